"""The lowest versions pyproject.toml allows, as pip constraints (``make test-floors``).

Usage: ``python tests/floors.py [NAME=VERSION ...] > constraints.txt``

Every entry of ``[project].dependencies`` must name its floor (``name>=X``, further bounds
allowed after a comma); each becomes ``name==X``, unless an override names it
(``torch=2.5.1``: the compose image's torch, a patch release of pyproject's ``torch>=2.5``). The
test extras and every transitive dependency are left to pip, which resolves them against these
pins. Exits naming the entry when one has no floor, and naming the override when it names no
dependency.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
_FLOOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9A-Za-z.+!-]*)\s*(,[^;]*)?$")


def floors(pyproject: str, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{name: version}`` for every dependency of ``pyproject`` (the file's text) at its floor,
    ``overrides`` replacing some. Raises ValueError naming an entry without a ``>=`` floor (or
    with an environment marker), or an override that names no dependency."""
    overrides = dict(overrides or {})
    pins: dict[str, str] = {}
    for entry in tomllib.loads(pyproject)["project"]["dependencies"]:
        match = _FLOOR.match(entry)
        if match is None:
            raise ValueError(f"dependency {entry!r} names no floor: write it as NAME>=VERSION")
        name = match.group(1)
        pins[name] = overrides.pop(name, match.group(2))
    if overrides:
        raise ValueError(f"override {sorted(overrides)[0]!r} names no dependency of pyproject.toml")
    return pins


def main(argv: list[str]) -> int:
    overrides = {}
    for arg in argv:
        name, sep, version = arg.partition("=")
        if not sep or not name or not version:
            print(f"floors.py: an override is NAME=VERSION, got {arg!r}", file=sys.stderr)
            return 2
        overrides[name] = version
    try:
        pins = floors(PYPROJECT.read_text(), overrides)
    except ValueError as exc:
        print(f"floors.py: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in pins.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
