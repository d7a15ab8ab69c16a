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
import hashlib
import inspect
import math
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel

from events.hp import HPFunction, as_hp, canonical_json, hp_to_json

if TYPE_CHECKING:
    from stagetree.tuners._base import Tuner


def jsonable(value: Any) -> Any:
    """``value`` as JSON data that is equal for equal settings across processes: numbers,
    strings, None and bools as they are (a non-finite float as ``"nan"``, ``"inf"`` or
    ``"-inf"``, a numpy scalar as its Python number); a hyper-parameter sequence as its JSON
    (:func:`events.hp.hp_to_json`); mappings, sequences and sets element by element (a set
    sorted); a dataclass or pydantic model field by field, with its class name; an object with a
    ``settings()`` method as what it returns; a function or class by its qualified name (without its module); any
    other object by its class's qualified name only (never its ``repr``, which may hold an
    address)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, HPFunction):
        return hp_to_json(value)
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item):  # a numpy scalar
        return jsonable(item())
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
    its class, the number of its configurations and the sha256 (hex) of their canonical JSON in
    order (:func:`events.hp.canonical_json`, numbers read as :class:`~events.hp.Constant`), so
    a filter or a seed counts by what it yields; else (an iterator, read once) its class only."""
    settings = getattr(space, "settings", None)
    if callable(settings):
        return dict(jsonable(settings()))
    out: dict[str, Any] = {"space": _qualified(type(space))}
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
