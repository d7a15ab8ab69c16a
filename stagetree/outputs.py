"""Checks of the paths a command will write, made before it does any work (exit 2 naming the flag
and the value, rather than a traceback once the work is done). Imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

from stagetree.errors import UsageError


def check_output_dir(flag: str, value: str | Path) -> Path:
    """``value`` as a directory to create or write into: refused when empty, or when it or one of
    its parents is a file.

    Raises:
        UsageError: naming ``flag`` and the value.
    """
    if not str(value).strip():
        raise UsageError(f"{flag} is {str(value)!r}, but must name a directory")
    path = Path(value)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            where = "is a file" if part == path else f"is under {str(part)!r}, which is a file"
            raise UsageError(f"{flag} {str(path)!r} {where}, but must be a directory")
    return path


def check_output_file(flag: str, value: str | Path) -> Path:
    """``value`` as a file to write: refused when empty, a directory, or in a directory that does
    not exist.

    Raises:
        UsageError: naming ``flag`` and the value.
    """
    path = Path(value)
    if not str(value).strip() or path.is_dir():
        raise UsageError(f"{flag} is {str(value)!r}, but must name a file")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {str(value)!r}: its directory {str(path.parent)!r} does not exist")
    return path
