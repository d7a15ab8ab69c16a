"""A tuner's settings as JSON data, recorded in its study's StudyStarted (``tuner_settings``).

A tuner's decisions are a function of the results it is given and of its settings: its class
and the version of its decision rules (:attr:`Tuner.rules`), its arguments (reduction factor,
rungs, population, ...) and its search space. The settings are recorded when a run starts so
that a ``--resume`` with another tuner or space in the study file is refused instead of mixing
two studies in one, and ``replay verify --study`` names a study file that differs from the one
the run used instead of reporting the first decision that then differs. Reading them back
(comparing, describing) is :mod:`events.settings`.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import functools
import hashlib
import inspect
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel

from events.hp import HPFunction, as_hp, canonical_json, hp_to_json

if TYPE_CHECKING:
    from stagetree.tuners._base import Tuner


def jsonable(value: Any) -> Any:
    """``value`` as JSON data that is equal for equal settings across processes: numbers,
    strings, None and bools as they are (a subclass, such as numpy's, as the plain type; a
    non-finite float as ``"nan"``, ``"inf"`` or ``"-inf"``; an int beyond 64 bits as its
    digits; a numpy scalar as its Python number, an array as nested lists); an enum member as
    ``Class.NAME``; a path, a Fraction or a Decimal as its text; a ``functools.partial`` as its
    function and arguments; a hyper-parameter sequence as its JSON
    (:func:`events.hp.hp_to_json`); mappings, sequences and sets element by element (a set
    sorted); a dataclass or pydantic model field by field, with its class name; an object with a
    ``settings()`` method as what it returns; a function or class by its qualified name (without its module); any
    other object by its class's qualified name only (never its ``repr``, which may hold an
    address)."""
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, enum.Enum):  # an IntEnum or a str Enum too: by its name, not as the number it is
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, int):  # a subclass as the int it is; beyond 64 bits (JSON's limit here) as digits
        return int(value) if -2**63 <= value < 2**64 else str(int(value))
    if isinstance(value, str):  # a subclass (numpy.str_) as the str it is
        return str(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, HPFunction):
        return hp_to_json(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (fractions.Fraction, decimal.Decimal)):
        return str(value)
    if isinstance(value, functools.partial):
        return {"partial": jsonable(value.func), "args": jsonable(value.args), "keywords": jsonable(value.keywords)}
    if type(value).__module__ == "numpy":
        to_list = getattr(value, "tolist", None)  # a scalar as its Python number, an array as nested lists
        if callable(to_list):
            return jsonable(to_list())
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=lambda v: orjson.dumps(v, option=orjson.OPT_SORT_KEYS))
    settings = getattr(value, "settings", None)
    if callable(settings) and not isinstance(value, type):
        return jsonable(settings())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"class": _qualified(type(value)),
                **{f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, BaseModel):
        return {"class": _qualified(type(value)), **jsonable(value.model_dump(mode="json"))}
    if callable(value):
        return _qualified(value)
    return f"<{_qualified(type(value))}>"


def _qualified(obj: Any) -> str:
    """The qualified name of a class or function, without its module: a study file is imported
    under a module name of the loader's making, and a class may move between modules."""
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)


def space_settings(space: Iterable[Any]) -> dict[str, Any]:
    """A search space as JSON data: what its ``settings()`` method returns (an adaptive space,
    such as an Optuna one, whose configurations do not exist before a study asks); else, for a
    space that can be read more than once and has a length (a grid, a random space, a list),
    its class (a tuple as a list), the number of its configurations and the sha256 (hex) of their canonical JSON in
    order (:func:`events.hp.canonical_json`, numbers read as :class:`~events.hp.Constant`), so
    a filter or a seed counts by what it yields; else (an iterator, read once) its class only."""
    settings = getattr(space, "settings", None)
    if callable(settings):
        return dict(jsonable(settings()))
    out: dict[str, Any] = {"space": "list" if isinstance(space, (list, tuple)) else _qualified(type(space))}
    if isinstance(space, Sized) and not isinstance(space, Iterator):
        digest = hashlib.sha256()
        count = 0
        for config in space:
            digest.update(_config_bytes(config) + b"\n")
            count += 1
        out |= {"configurations": count, "sha256": digest.hexdigest()}
    return out


def _config_bytes(config: Any) -> bytes:
    try:
        return canonical_json({name: as_hp(config[name]) for name in config})
    except (TypeError, ValueError, KeyError):  # not a configuration of sequences: as it is
        return orjson.dumps(jsonable(config), option=orjson.OPT_SORT_KEYS)


def recorded_settings(tuner: Tuner) -> dict[str, Any]:
    """``tuner.settings()`` as StudyStarted records it and as it reads back: :func:`jsonable`,
    then through JSON (so what a user's ``settings()`` override returns, a tuple say, compares
    equal with what the log holds). Every recording and every comparison goes through here.

    Raises:
        ValueError: the settings are not JSON data (naming the tuner and why).
    """
    data = jsonable(tuner.settings())
    try:
        out = orjson.loads(orjson.dumps(data))
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ValueError(f"the settings of tuner {tuner.name} cannot be recorded as JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ValueError(f"the settings of tuner {tuner.name} are {out!r}, but must be a dict")
    return out


def tuner_settings(tuner: Tuner) -> dict[str, Any]:
    """:meth:`Tuner.settings`: ``tuner`` (the class name), ``rules`` (:attr:`Tuner.rules`),
    ``space`` (:func:`space_settings`), and every other argument of the class's ``__init__``
    (:func:`jsonable`) but those in :attr:`Tuner.recorded_elsewhere`: the attribute of the same
    name where the tuner keeps one (its value as the tuner uses it), else the value it was built
    with (as passed, or the default), so a tuner that keeps an argument under another name (a
    user's ``self._lr = lr``) still records it."""
    out: dict[str, Any] = {"tuner": tuner.name, "rules": tuner.rules}
    passed = getattr(tuner, "_arguments", {})
    for name, param in inspect.signature(type(tuner).__init__).parameters.items():
        if name in ("self", "space") or name in tuner.recorded_elsewhere or \
                param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if hasattr(tuner, name):
            out[name] = jsonable(getattr(tuner, name))
        elif name in passed:
            out[name] = jsonable(passed[name])
        elif param.default is not param.empty:
            out[name] = jsonable(param.default)
    out["space"] = space_settings(tuner.space)
    return out
