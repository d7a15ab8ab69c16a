"""Counts in words for what the commands print: ``1 worker``, ``2 workers``."""

from __future__ import annotations


def counted(n: object, noun: str, plural: str | None = None) -> str:
    """``"<n> <noun>"``, the noun plural (``plural``, else ``noun + "s"``) unless ``n`` is 1; an
    ``n`` that is not a number (a summary's missing field: ``?``) takes the plural."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
