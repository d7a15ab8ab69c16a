"""A study's recorded tuner settings (StudyStarted's ``tuner_settings``, written by
:meth:`stagetree.tuners.Tuner.settings`): where two differ, and a line for people.

Plain JSON in, text out: readers of a log (``report``, ``export``, ``replay verify``, the
``--resume`` check) use these without importing the tuners.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


def difference(recorded: Any, current: Any, path: str = "") -> str | None:
    """Where two settings (:meth:`stagetree.tuners.Tuner.settings`) first differ, in sorted key order, as
    "`path`: A in the log, B now" (values quoted up to 80 characters); None when equal."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        for key in sorted(set(recorded) | set(current)):
            where = f"{path}.{key}" if path else key
            if key not in recorded or key not in current:
                return (f"`{where}`: absent in the log, {_short(current[key])} now" if key not in recorded else
                        f"`{where}`: {_short(recorded[key])} in the log, absent now")
            found = difference(recorded[key], current[key], where)
            if found is not None:
                return found
        return None
    if isinstance(recorded, list) and isinstance(current, list) and len(recorded) == len(current):
        for i, (a, b) in enumerate(zip(recorded, current, strict=True)):
            found = difference(a, b, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if type(recorded) is type(current) and recorded == current:
        return None
    return f"`{path}`: {_short(recorded)} in the log, {_short(current)} now"


def _short(value: Any) -> str:
    text = orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    return text if len(text) <= 80 else f"{text[:77]}..."


def describe(settings: Mapping[str, Any]) -> str:
    """Settings (:meth:`stagetree.tuners.Tuner.settings`) in one line for people, e.g.
    ``SuccessiveHalving(max_steps=160, metric="val_acc", ...) on GridSearchSpace(configurations=16),
    rules 1`` (each value as JSON, cut to 80 characters; a space's sha256 left out)."""
    def args(items: Mapping[str, Any], leave: set[str]) -> str:
        return ", ".join(f"{k}={_short(v)}" for k, v in sorted(items.items()) if k not in leave)

    space = settings.get("space")
    space = space if isinstance(space, Mapping) else {}
    return (f"{settings.get('tuner', '?')}({args(settings, {'tuner', 'rules', 'space'})}) on "
            f"{space.get('space', '?')}({args(space, {'space', 'sha256'})}), rules {settings.get('rules', '?')}")
