"""Random search over hyper-parameter sequences (Hippo §5.3: a search space yields configurations).

:class:`RandomSearchSpace` sits beside :class:`~stagetree.tuners.GridSearchSpace` and has the
same interface: an iterable of configurations (``dict[str, HPFunction]``) in a fixed order,
with ``len``. A hyper-parameter is either fixed, a list of candidates, or a *sampler*; the
sampler :class:`Sampled` builds a whole sequence from sampled parameters, so milestones,
decay factors or warm-up lengths are searched, not only numbers::

    RandomSearchSpace({
        "lr": Sampled(MultiStep, init=LogUniform(0.01, 0.3),
                      milestones=Milestones(2, 30, 110), gamma=Choice([0.1, 0.2])),
        "batch_size": [32, 64],
        "momentum": 0.9,
    }, n=16, seed=0)

Units: milestones, periods and every other length are steps (optimizer updates, as in
:mod:`events.hp`).

Determinism. Configuration ``i`` is a pure function of ``(hp_dict, seed, i)``: it draws from
``numpy.random.default_rng([seed, i])`` (PCG64 seeded through SeedSequence), visiting the
hyper-parameters in sorted-name order and the parameters of each :class:`Sampled` in
sorted-parameter order; fixed values draw nothing. Only ``Generator.random()`` (53-bit
uniform doubles) is used, with integer and subset draws built on it here, so the space depends
on no NumPy distribution algorithm that NEP 19 allows to change: it is the same across runs,
processes and platforms, and configuration ``i`` does not change when ``n`` grows. (Adding or
renaming a hyper-parameter may shift the draws of the names sorted after it.)
"""

from __future__ import annotations

import inspect
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, cast

import numpy as np
from pydantic import ValidationError

from events.hp import HPConfig, HPFunction, as_hp

__all__ = [
    "Choice",
    "IntUniform",
    "LogUniform",
    "Milestones",
    "RandomSearchSpace",
    "Sampled",
    "Sampler",
    "Uniform",
    "ask_config",
    "space_specs",
]


def _real(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"`{owner}.{name}` is {value!r}, but must be a finite int or float")
    return float(value)


def _int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"`{owner}.{name}` is {value!r}, but must be an int")
    return int(value)


def _uniform01(rng: np.random.Generator) -> float:
    """A uniform double in [0, 1): the one primitive every draw is built on (stable, NEP 19)."""
    return float(rng.random())


def _randint(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform int in [low, high] (inclusive) from one :func:`_uniform01` draw."""
    span = high - low + 1
    return low + min(int(_uniform01(rng) * span), span - 1)


class Sampler(ABC):
    """A distribution over values: ``sample(rng)`` draws one, ``validate()`` checks the fields.

    Samplers are frozen and compare by value. Their fields are checked by ``validate()``, which
    :class:`RandomSearchSpace` calls at construction (so the error names the hyper-parameter)
    and ``sample`` calls before drawing.
    """

    @abstractmethod
    def validate(self) -> None:
        """Raises ValueError naming the field and its value if a field is invalid."""

    @abstractmethod
    def _draw(self, rng: np.random.Generator) -> Any:
        """One value; the fields are valid."""

    def sample(self, rng: np.random.Generator) -> Any:
        """One value drawn with ``rng``. Raises ValueError if a field is invalid."""
        self.validate()
        return self._draw(rng)

    def ask(self, trial: Any, name: str) -> Any:
        """One value asked of an Optuna trial (``optuna.trial.Trial``: its ``suggest_*`` methods)
        under the parameter name ``name``; nested samplers ask under ``name.<part>``. The same
        distribution as :meth:`sample` (ask-and-tell: stagetree.integration.optuna).

        Raises:
            TypeError: the sampler has no Optuna form (a user's own Sampler subclass).
        """
        raise TypeError(f"{type(self).__name__} cannot be asked of an Optuna trial (it defines no `ask`)")


def _draw(spec: Any, rng: np.random.Generator) -> Any:
    """``spec`` drawn if it is a sampler, else ``spec`` itself."""
    return spec._draw(rng) if isinstance(spec, Sampler) else spec


def _ask(spec: Any, trial: Any, name: str) -> Any:
    """``spec`` asked of an Optuna trial if it is a sampler, else ``spec`` itself."""
    return spec.ask(trial, name) if isinstance(spec, Sampler) else spec


_CATEGORICAL = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Choice(Sampler):
    """One of ``values``, uniformly. A value may itself be a sampler; it is then drawn too
    (``Choice([Sampled(Constant, ...), Sampled(Cosine, ...)])`` searches over families).

    Raises ValueError (from ``validate``) if ``values`` is empty or not a list/tuple.
    """

    values: Sequence[Any]

    def __post_init__(self) -> None:
        if isinstance(self.values, Sequence) and not isinstance(self.values, (str, bytes)):
            object.__setattr__(self, "values", tuple(self.values))

    def validate(self) -> None:
        if not isinstance(self.values, tuple) or not self.values:
            raise ValueError(f"`Choice.values` is {self.values!r}, but must be a non-empty list")
        for j, value in enumerate(self.values):
            if isinstance(value, Sampler):
                try:
                    value.validate()
                except ValueError as exc:
                    raise ValueError(f"`Choice.values[{j}]`: {exc}") from None

    def _draw(self, rng: np.random.Generator) -> Any:
        return _draw(self.values[_randint(rng, 0, len(self.values) - 1)], rng)

    def ask(self, trial: Any, name: str) -> Any:
        """A categorical parameter: the values themselves when they are plain numbers or strings
        (as Optuna shows them), else their positions; a chosen sampler asks under ``name.<i>``."""
        if all(type(v) in _CATEGORICAL for v in self.values):
            return trial.suggest_categorical(name, list(self.values))
        i = trial.suggest_categorical(name, list(range(len(self.values))))
        return _ask(self.values[i], trial, f"{name}.{i}")


@dataclass(frozen=True)
class Uniform(Sampler):
    """A float uniform in [``low``, ``high``].

    Raises ValueError (from ``validate``) unless ``low`` and ``high`` are finite and ``low < high``.
    """

    low: float
    high: float

    def validate(self) -> None:
        low, high = _real("Uniform", "low", self.low), _real("Uniform", "high", self.high)
        if not low < high:
            raise ValueError(f"`Uniform.low` is {self.low!r}, but must be < `Uniform.high` {self.high!r}")

    def _draw(self, rng: np.random.Generator) -> float:
        low, high, u = float(self.low), float(self.high), _uniform01(rng)
        return min(max(low * (1.0 - u) + high * u, low), high)

    def ask(self, trial: Any, name: str) -> float:
        return float(trial.suggest_float(name, float(self.low), float(self.high)))


@dataclass(frozen=True)
class LogUniform(Sampler):
    """A float in [``low``, ``high``] whose logarithm is uniform (learning rates, weight decay).

    Raises ValueError (from ``validate``) unless ``0 < low < high`` and both are finite.
    """

    low: float
    high: float

    def validate(self) -> None:
        low, high = _real("LogUniform", "low", self.low), _real("LogUniform", "high", self.high)
        if not low > 0:
            raise ValueError(f"`LogUniform.low` is {self.low!r}, but must be > 0")
        if not low < high:
            raise ValueError(
                f"`LogUniform.low` is {self.low!r}, but must be < `LogUniform.high` {self.high!r}"
            )

    def _draw(self, rng: np.random.Generator) -> float:
        low, high = float(self.low), float(self.high)
        log_low, log_high = math.log(low), math.log(high)
        value = math.exp(log_low + (log_high - log_low) * _uniform01(rng))
        return min(max(value, low), high)

    def ask(self, trial: Any, name: str) -> float:
        return float(trial.suggest_float(name, float(self.low), float(self.high), log=True))


@dataclass(frozen=True)
class IntUniform(Sampler):
    """An int uniform in [``low``, ``high``], both inclusive (batch sizes, periods in steps).

    Raises ValueError (from ``validate``) unless both are ints and ``low <= high``.
    """

    low: int
    high: int

    def validate(self) -> None:
        low, high = _int("IntUniform", "low", self.low), _int("IntUniform", "high", self.high)
        if not low <= high:
            raise ValueError(
                f"`IntUniform.low` is {self.low!r}, but must be <= `IntUniform.high` {self.high!r}"
            )

    def _draw(self, rng: np.random.Generator) -> int:
        return _randint(rng, int(self.low), int(self.high))

    def ask(self, trial: Any, name: str) -> int:
        return int(trial.suggest_int(name, int(self.low), int(self.high)))


@dataclass(frozen=True)
class Milestones(Sampler):
    """A sorted tuple of ``count`` distinct int steps in [``low``, ``high``] (inclusive), every
    subset equally likely: ``milestones`` of MultiStep, ``boundaries`` of Piecewise.

    Raises ValueError (from ``validate``) unless ``count >= 1``, ``1 <= low <= high`` (a
    milestone is a step after step 0) and ``count <= high - low + 1``.
    """

    count: int
    low: int
    high: int

    def validate(self) -> None:
        count = _int("Milestones", "count", self.count)
        low, high = _int("Milestones", "low", self.low), _int("Milestones", "high", self.high)
        if count < 1:
            raise ValueError(f"`Milestones.count` is {self.count!r}, but must be >= 1")
        if low < 1:
            raise ValueError(f"`Milestones.low` is {self.low!r}, but must be >= 1 (a step after step 0)")
        if not low <= high:
            raise ValueError(
                f"`Milestones.low` is {self.low!r}, but must be <= `Milestones.high` {self.high!r}"
            )
        if count > high - low + 1:
            raise ValueError(
                f"`Milestones.count` is {self.count!r}, but must be <= high - low + 1 = {high - low + 1}"
            )

    def _draw(self, rng: np.random.Generator) -> tuple[int, ...]:
        # Floyd's algorithm: a uniform count-subset of range(span) with exactly count draws.
        span, chosen = int(self.high) - int(self.low) + 1, set[int]()
        for j in range(span - int(self.count), span):
            r = _randint(rng, 0, j)
            chosen.add(j if r in chosen else r)
        return tuple(int(self.low) + c for c in sorted(chosen))

    def ask(self, trial: Any, name: str) -> tuple[int, ...]:
        """``count`` int parameters ``name.0``, ``name.1``, ... over the same fixed range (so
        samplers that need a fixed space, CMA-ES and QMC, handle them), sorted and then made
        distinct: each is raised above the one before and kept below room for those after."""
        low, high, count = int(self.low), int(self.high), int(self.count)
        values = sorted(int(trial.suggest_int(f"{name}.{j}", low, high)) for j in range(count))
        for j in range(count):
            values[j] = min(max(values[j], values[j - 1] + 1 if j else low), high - (count - 1 - j))
        return tuple(values)


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _message(exc: Exception) -> str:
    """``exc`` on one line (a pydantic ValidationError lists its errors)."""
    if isinstance(exc, ValidationError):
        return "; ".join(
            (".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"] for e in exc.errors()
        )
    return str(exc)


@dataclass(frozen=True, init=False, repr=False)
class Sampled(Sampler):
    """``fn(**params)`` with every sampler among ``params`` drawn (in sorted-parameter order) and
    every other value passed as is (a list is a value here, not a set of candidates).

    ``Sampled(MultiStep, init=LogUniform(0.01, 0.3), milestones=Milestones(2, 30, 110),
    gamma=Choice([0.1, 0.2]))`` samples a step decay; samplers nest, as in
    ``Sampled(Warmup, init=0.0, period=IntUniform(1, 10), then=Sampled(Constant, value=...))``.

    Raises ValueError (from ``validate``) if ``fn`` is not callable, if a parameter is unknown
    to ``fn`` or a required one is missing, or if a nested sampler is invalid; ``sample`` lets
    ``fn``'s own errors through (RandomSearchSpace turns them into ValueErrors naming the
    hyper-parameter).
    """

    fn: Callable[..., Any]
    params: tuple[tuple[str, Any], ...]

    def __init__(self, fn: Callable[..., Any], /, **params: Any) -> None:
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "params", tuple(sorted(params.items())))

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.params)
        return f"Sampled({_fn_name(self.fn)}{args})"

    def validate(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"`Sampled.fn` is {self.fn!r}, but must be callable")
        fn_name = _fn_name(self.fn)
        where = f"`Sampled({fn_name})`"
        names = [k for k, _ in self.params]
        if isinstance(self.fn, type) and issubclass(self.fn, HPFunction):
            fields = {f.alias or n: f for n, f in self.fn.model_fields.items() if n != "kind"}
            unknown = [k for k in names if k not in fields]
            missing = [k for k, f in fields.items() if f.is_required() and k not in names]
            if unknown:
                raise ValueError(
                    f"{where} has no parameter {unknown[0]!r}; its parameters are {list(fields)}"
                )
            if missing:
                raise ValueError(f"{where} is missing the parameter {missing[0]!r}")
        else:
            try:
                inspect.signature(self.fn).bind(**dict(self.params))
            except TypeError as exc:
                raise ValueError(f"{where}: {exc}") from None
            except ValueError:  # no signature to check (some builtins)
                pass
        for key, value in self.params:
            if isinstance(value, Sampler):
                try:
                    value.validate()
                except ValueError as exc:
                    raise ValueError(f"`Sampled({fn_name}).{key}`: {exc}") from None

    def _draw(self, rng: np.random.Generator) -> Any:
        return self.fn(**{key: _draw(value, rng) for key, value in self.params})

    def ask(self, trial: Any, name: str) -> Any:
        """``fn`` with each sampled parameter asked under ``name.<parameter>`` (``lr.init``,
        ``lr.milestones.0``, ``lr.gamma``, ``lr.period``, ...)."""
        return self.fn(**{key: _ask(value, trial, f"{name}.{key}") for key, value in self.params})


class RandomSearchSpace:
    """``n`` random configurations (name -> sequence), a pure function of the arguments.

    Args:
        hp_dict: name -> one of
            * a fixed value (HPFunction, number or JSON dict), used in every configuration;
            * a list/tuple of candidates (fixed values or samplers), one chosen uniformly;
            * a :class:`Sampler`; :class:`Sampled` builds a sequence, and a sampled number
              becomes :class:`~events.hp.Constant` (through :func:`~events.hp.as_hp`).
        n: how many configurations to draw (positive int).
        seed: an int in [0, 2**63); see the module doc for what the draws depend on.
        filter: optional predicate on a configuration; False drops it (conditional spaces, as
            in GridSearchSpace). The space yields the configurations i = 0..n-1 that pass, in
            order of i, so ``len(space)`` may be less than ``n``.

    All ``n`` configurations are drawn at construction.

    Raises:
        ValueError: an empty ``hp_dict`` or a non-str name; ``n`` or ``seed`` out of range; a
            non-callable ``filter``; an invalid fixed value, candidate or sampler field (the
            message names the hyper-parameter, the field and the value, e.g. "`hp_dict['lr']`:
            `LogUniform.low` is -1, but must be > 0"); or a draw that is not a valid
            hyper-parameter sequence (e.g. MultiStep with a sampled ``gamma <= 0``), naming the
            hyper-parameter and the configuration index.
    """

    def __init__(
        self,
        hp_dict: Mapping[str, Any],
        n: int,
        seed: int,
        filter: Callable[[HPConfig], bool] | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, Integral) or n <= 0:
            raise ValueError(f"`n` is {n!r}, but must be a positive int")
        if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed < 2**63:
            raise ValueError(f"`seed` is {seed!r}, but must be an int in [0, 2**63)")
        check_filter(filter)
        self.hp_dict: dict[str, Any] = space_specs(hp_dict)
        self.n: int = int(n)
        self.seed: int = int(seed)
        self.filter: Callable[[HPConfig], bool] | None = filter
        self._configs: list[HPConfig] = [self.config(i) for i in range(self.n)]

    def config(self, i: int) -> HPConfig:
        """Configuration ``i`` (unfiltered), drawn from ``default_rng([seed, i])``; any ``i >= 0``.

        Raises ValueError if ``i`` is not an int >= 0, or if a draw is not a valid sequence
        (naming the hyper-parameter).
        """
        if isinstance(i, bool) or not isinstance(i, Integral) or i < 0:
            raise ValueError(f"`i` is {i!r}, but must be an int >= 0")
        rng = np.random.default_rng([self.seed, i])
        config: HPConfig = {}
        for name, spec in self.hp_dict.items():  # sorted by name
            try:
                config[name] = as_hp(_draw(spec, rng))
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"`hp_dict[{name!r}]`: configuration {i} (seed {self.seed}) is not a valid "
                    f"hyper-parameter sequence: {_message(exc)}"
                ) from exc
        return config

    def __iter__(self) -> Iterator[HPConfig]:
        for config in self._configs:
            if self.filter is None or self.filter(config):
                yield dict(config)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"RandomSearchSpace({self.hp_dict!r}, n={self.n}, seed={self.seed})"


def space_specs(hp_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``hp_dict`` checked and normalised, by sorted name: each value a sampler or a fixed
    HPFunction (a list of candidates becomes :class:`Choice`). The language of
    :class:`RandomSearchSpace` and of the Optuna searcher.

    Raises:
        ValueError: an empty ``hp_dict``, a non-str name, or an invalid value or sampler field,
            naming the hyper-parameter, the field and the value.
    """
    if not isinstance(hp_dict, Mapping) or not hp_dict:
        raise ValueError(f"`hp_dict` is {hp_dict!r}, but must name at least one hyper-parameter")
    for name in hp_dict:
        if not isinstance(name, str):
            raise ValueError(f"`hp_dict` has the name {name!r}, but names must be str")
    return {name: _spec(name, hp_dict[name]) for name in sorted(hp_dict)}


def ask_config(specs: Mapping[str, Any], trial: Any) -> HPConfig:
    """A configuration asked of an Optuna trial (``optuna.trial.Trial``): each spec of
    :func:`space_specs` by name, sampled parameters named ``<hp>.<parameter>`` (nested ones
    ``lr.then.value``, milestones ``lr.milestones.0``, ...).

    Raises:
        ValueError: a draw that is not a valid sequence, naming the hyper-parameter and the
            Optuna trial number.
    """
    config: HPConfig = {}
    for name, spec in specs.items():
        try:
            config[name] = as_hp(_ask(spec, trial, name))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`hp_dict[{name!r}]`: Optuna trial {getattr(trial, 'number', '?')} is not a valid "
                             f"hyper-parameter sequence: {_message(exc)}") from exc
    return config


def _spec(name: str, value: Any) -> Any:
    """``value`` checked and normalised: a sampler, or a fixed HPFunction (lists become Choice)."""
    where = f"`hp_dict[{name!r}]`"
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{where} is {value!r}, but a list of candidates must not be empty")
        value = Choice([
            v if isinstance(v, Sampler) else _fixed(f"`hp_dict[{name!r}][{j}]`", v)
            for j, v in enumerate(value)
        ])
    if isinstance(value, Sampler):
        try:
            value.validate()
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return value
    return _fixed(where, value)


def _fixed(where: str, value: Any) -> HPFunction:
    if not isinstance(value, (HPFunction, dict, Real)) or isinstance(value, bool):
        raise ValueError(
            f"{where} is {value!r}, but must be a number, an HPFunction, a JSON dict, "
            "a list of candidates or a sampler"
        )
    try:
        return as_hp(cast(Any, value))  # checked above: a number, an HPFunction or a dict
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{where} is {value!r}, which is not a valid hyper-parameter sequence: {_message(exc)}"
        ) from None


# ----------------------------------------------------------------------------- grid spaces


def check_filter(filter: Any) -> None:
    """A space's ``filter``: None or a predicate on a configuration. Raises ValueError naming it."""
    if filter is not None and not callable(filter):
        raise ValueError(f"`filter` is {filter!r}, but must be callable or None")


def candidates_of(field: str, hp_dict: Mapping[str, Any]) -> dict[str, list[HPFunction]]:
    """``hp_dict``'s candidate lists as hyper-parameter functions (numbers become Constant).

    Raises:
        ValueError: ``hp_dict`` not a mapping, a name that is not a str, a list that is empty
            or not a list, or an invalid candidate, naming ``field[name]`` and the value.
    """
    if not isinstance(hp_dict, Mapping):
        raise ValueError(f"`{field}` is {hp_dict!r}, but must be a mapping of names to lists of candidates")
    out: dict[str, list[HPFunction]] = {}
    for name, values in hp_dict.items():
        if not isinstance(name, str):
            raise ValueError(f"`{field}` has the name {name!r}, but names must be str")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"`{field}[{name!r}]` is {values!r}, but must be a non-empty list of candidates")
        try:
            out[name] = [as_hp(v) for v in values]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`{field}[{name!r}]`: {exc}") from None
    return out


class GridSearchSpace:
    """The Cartesian product of candidate sequences per hyper-parameter (Hippo §5.3).

    Args:
        hp_dict: name -> list of candidates (HPFunction, number, or JSON dict).
        filter: optional predicate on a configuration; False drops it (conditional spaces).

    Raises:
        ValueError: an empty or non-mapping ``hp_dict``, a name that is not a str, an empty
            candidate list, an invalid candidate (naming the name), or a non-callable ``filter``.
    """

    def __init__(self, hp_dict: Mapping[str, Sequence[Any]], filter: Callable[[HPConfig], bool] | None = None) -> None:
        if isinstance(hp_dict, Mapping) and not hp_dict:
            raise ValueError("`hp_dict` is {}, but must name at least one hyper-parameter")
        self.candidates: dict[str, list[Any]] = dict(candidates_of("hp_dict", hp_dict))
        check_filter(filter)
        self.filter = filter

    def __iter__(self) -> Iterator[HPConfig]:
        names = list(self.candidates)
        for combo in itertools.product(*(self.candidates[n] for n in names)):
            config = dict(zip(names, combo))
            if self.filter is None or self.filter(config):
                yield config

    def __len__(self) -> int:
        return sum(1 for _ in self)


def unshared_by_type(configs: Sequence[Mapping[str, HPFunction]]) -> dict[str, tuple[Any, Any]]:
    """Hyper-parameters whose configurations start (step 0) at the same number written as
    different types, e.g. ``Constant(384)`` (the int 384) and ``MultiStep(384, ..., 1.5)`` (the
    float 384.0): name -> the first two such values. Trials share a step only where every value
    is the same in type too (:func:`events.hp.same_value`: an int batch size and a float one are
    different trainings), so such configurations share nothing, which is rarely what was meant.
    """
    out: dict[str, tuple[Any, Any]] = {}
    first: dict[tuple[str, float], Any] = {}
    for config in configs:
        for name in sorted(config):
            if name in out:
                continue
            try:
                value = config[name].value(0)
            except ArithmeticError:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            seen = first.setdefault((name, float(value)), value)
            if type(seen) is not type(value):
                out[name] = (seen, value)
    return out
