"""Hyper-parameter sequences: the value of a hyper-parameter as a pure function of the step.

A sequence maps the GLOBAL step (an int >= 0; step ``s`` is the ``s``-th optimizer update,
counted from 0) to a number. Every family is a frozen pydantic model with a ``kind``
discriminator, so sequences travel inside events as JSON (:data:`HP`, :data:`HP_ADAPTER`).
The families follow Hippo thesis Appendix A.1 and the paper's Tables 2-4 (HIPPO_SPEC.md §5.2).

Canonical pieces. Merging trials needs to know where two sequences agree, so every sequence is
decomposed into elementary pieces: ``pieces(stop)`` lists ``(start_step, key)`` covering
``[0, stop)``. A key ``(formula, *params)`` names one elementary function of the global step:

* ``("const", v)``: ``v``
* ``("exp", init, gamma, origin)``: ``init * gamma ** (step - origin)``
* ``("lin", init, slope, origin)``: ``init + slope * (step - origin)``
* ``("ramp", start_value, end_value, period, origin)``:
  ``start_value + (end_value - start_value) * (step - origin) / period``
* ``("cos", init, min_value, length, origin)``:
  ``min_value + (init - min_value) * (1 + cos(pi * (step - origin) / length)) / 2``
* ``("pow", start_value, end_value, period, power, origin)``:
  ``start_value + (end_value - start_value) * ((step - origin) / period) ** power``

``value(step)`` is computed by evaluating the key of the piece holding ``step``, so two pieces
with the same key give bitwise-equal values. Keys are compared by value *and* type
(:func:`same_piece`): ``3 == 3.0``, but ``3 * 3 ** 40 != 3.0 * 3 ** 40``. Degenerate pieces
(``exp`` with init 0 or gamma 1, ``lin`` with slope 0, ``ramp`` or ``pow`` with equal ends, ``cos``
with ``init == min_value``) are written as ``("const", v)``, ``v`` being their value at the origin;
a ``pow`` piece of power 1 is the ``ramp`` piece of the same ends and period (the same function,
so a :class:`PowerRamp` of power 1 merges with a :class:`Warmup` ramp).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from functools import cached_property
from numbers import Integral, Real
from operator import index
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

__all__ = [
    "HP",
    "HP_ADAPTER",
    "Constant",
    "Cosine",
    "CyclicLR",
    "Exponential",
    "HPConfig",
    "HPFunction",
    "Linear",
    "MultiStep",
    "Number",
    "Piece",
    "PieceKey",
    "Piecewise",
    "PowerRamp",
    "Warmup",
    "as_hp",
    "breakpoints",
    "canonical_json",
    "check_computable",
    "config_from_json",
    "config_to_json",
    "config_values",
    "continue_with",
    "first_divergence",
    "hp_from_json",
    "hp_to_json",
    "same_piece",
    "same_value",
    "value_key",
]


def _name(info: ValidationInfo) -> str:
    """The field's public name (``Constant.value_`` is ``value`` in JSON and in __init__)."""
    return (info.field_name or "").removesuffix("_")


def _problems(exc: ValidationError) -> str:
    """A pydantic error as one line: our validators' messages as they are, others with the
    parameter's name (``value error, ...`` prefixes and documentation links left out)."""
    out = []
    for e in exc.errors():
        message = str(e["msg"]).removeprefix("Value error, ")
        where = ".".join(str(p) for p in e["loc"])
        out.append(message if message.startswith("`") or not where else f"`{where}`: {message}")
    return "; ".join(out)


def _number(value: Any, info: ValidationInfo) -> int | float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"`{_name(info)}` is {value!r}, but must be an int or a float")
    number = int(value) if isinstance(value, Integral) else float(value)
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"`{_name(info)}` is {value!r}, but must be finite")
    if isinstance(number, int) and not -(2**63) <= number < 2**63:
        raise ValueError(f"`{_name(info)}` is {value!r}, but must fit in 64 bits (JSON)")
    return number


def _positive(value: int | float, info: ValidationInfo) -> int | float:
    if value <= 0:
        raise ValueError(f"`{_name(info)}` is {value!r}, but must be > 0")
    return value


def _at_least_one(value: int, info: ValidationInfo) -> int:
    if not 1 <= value < 2**63:
        raise ValueError(f"`{_name(info)}` is {value!r}, but must be >= 1 and fit in 64 bits (JSON)")
    return value


def _increasing_positive(steps: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
    if any(not 1 <= s < 2**63 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
        raise ValueError(
            f"`{_name(info)}` is {list(steps)}, but must be strictly increasing ints >= 1 that fit in 64 bits (JSON)"
        )
    return steps


Number = Annotated[int | float, BeforeValidator(_number)]
PositiveNumber = Annotated[int | float, BeforeValidator(_number), AfterValidator(_positive)]
"""A finite float or a 64-bit int; ints stay ints (batch sizes); bools and strings are rejected."""

def _plain_int(value: Any) -> Any:
    """An integral number other than a bool (numpy's integers too) as the plain ``int`` it is,
    so that it is stored and written to JSON exactly as that int (same canonical JSON, same
    trial ids); anything else as it is, for the strict int check to refuse (a float, even
    ``5.0``; a bool; a string)."""
    if isinstance(value, Integral) and not isinstance(value, bool):
        return index(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_plain_int)]
"""An int (any :class:`numbers.Integral` but a bool, stored as ``int``)."""

Period = Annotated[Int, AfterValidator(_at_least_one)]
"""A length in steps, >= 1."""

Steps = Annotated[tuple[Int, ...], AfterValidator(_increasing_positive)]
"""Strictly increasing steps, each >= 1 (milestones, boundaries)."""

PieceKey = tuple[Any, ...]
"""``(formula, *params)``: one elementary function of the global step (see the module doc)."""

Piece = tuple[int, PieceKey]
"""``(start_step, key)``: ``key`` applies from ``start_step`` up to the next piece's start."""


def _eval_piece(key: PieceKey, step: int) -> int | float:
    """Evaluates the elementary function ``key`` at global ``step``."""
    value: int | float
    match key:
        case ("const", constant):
            value = constant
        case ("exp", init, gamma, origin):
            value = init * gamma ** (step - origin)
        case ("lin", init, slope, origin):
            value = init + slope * (step - origin)
        case ("ramp", start_value, end_value, period, origin):
            value = start_value + (end_value - start_value) * (step - origin) / period
        case ("cos", init, min_value, length, origin):
            cosine = math.cos(math.pi * (step - origin) / length)
            value = min_value + (init - min_value) * (1 + cosine) / 2
        case ("pow", start_value, end_value, period, power, origin):
            value = start_value + (end_value - start_value) * ((step - origin) / period) ** power
        case _:
            raise ValueError(f"`key` is {key!r}, which is not a known piece")
    return value


def _piece(*key: Any) -> PieceKey:
    """The canonical key: a degenerate (constant) function becomes ``("const", v)``."""
    formula, *params = key
    constant = (
        (formula == "exp" and (params[0] == 0 or params[1] == 1))
        or (formula == "lin" and params[1] == 0)
        or (formula in ("ramp", "cos", "pow") and params[0] == params[1])
    )
    if constant:
        return ("const", _eval_piece(key, key[-1]))
    if formula == "pow" and params[3] == 1:
        start_value, end_value, period, _, origin = params
        return ("ramp", start_value, end_value, period, origin)
    return key


def _shift(key: PieceKey, offset: int) -> PieceKey:
    """``key`` moved ``offset`` steps later: the origin (last parameter) grows by ``offset``."""
    return key if key[0] == "const" else (*key[:-1], key[-1] + offset)


def same_value(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are the same number: equal, of the same type, and for
    floats of the same sign (``3 != 3.0``, ``0.0 != -0.0``).

    This is the one equality of values stagetree uses: two trials share a step only if every
    value there is the same by this rule (the sharing rule), the training session calls
    ``Trainer.setup`` when a value is not the same as at the step before, and an int batch size
    and a float one are different trainings even though ``32 == 32.0``.
    """
    if type(a) is not type(b) or a != b:
        return False
    return type(a) is not float or math.copysign(1.0, a) == math.copysign(1.0, b)


def value_key(value: Any) -> tuple[Any, ...]:
    """A hashable key of ``value`` such that ``value_key(a) == value_key(b)`` exactly when
    :func:`same_value` says ``a`` and ``b`` are the same (for dictionary indexes of values)."""
    if type(value) is float:
        return ("float", value, math.copysign(1.0, value))
    return (type(value).__name__, value)


def same_piece(a: PieceKey, b: PieceKey) -> bool:
    """Whether two keys are the same in every parameter (:func:`same_value`), which guarantees
    bitwise-equal values."""
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))


_INT_LIMIT = 2**63


def _bad_value(key: PieceKey, step: int) -> bool:
    """Whether the value of piece ``key`` at ``step`` cannot be used: it raises (a float leaving
    the float range), is not finite, or is an int outside 64 bits. Integer powers are judged by
    their logarithm first, so a huge exponent is never computed."""
    if key[0] == "exp":
        init, gamma, origin = key[1:]
        n = step - origin
        if isinstance(gamma, int) and init != 0:  # a zero init: 0 * gamma ** n, evaluated below
            bits = n * math.log2(gamma)  # of the int gamma ** n, computed exactly before the product
            magnitude = math.log2(abs(init)) + bits
            if isinstance(init, int):
                if n > 64:
                    return True
            elif magnitude > 1030 or bits >= 1025:  # a float init times an int past 2**1024: OverflowError
                return True
            elif magnitude < 1020 and bits < 1023:
                return False
    try:
        value = _eval_piece(key, step)
    except ArithmeticError:
        return True
    if isinstance(value, float):
        return not math.isfinite(value)
    return not -_INT_LIMIT <= value < _INT_LIMIT


def _first_bad(key: PieceKey, start: int, stop: int) -> int | None:
    """The first step in ``[start, stop)`` where piece ``key`` has a bad value (see
    :func:`_bad_value`), or None. ``exp`` and ``lin`` pieces can grow out of range; their
    magnitude is convex in the step, so past a good ``start`` the bad steps form a suffix and a
    bisection finds the first one in O(log(stop - start)) evaluations. A ramp multiplies its
    span by the steps since its origin before dividing by its period, so that product, too,
    grows with the step and can overflow between finite ends: the same bisection. A ramp, cosine
    or power piece whose span overflows is inf or nan from its first step; a cosine piece
    doubles its span at the start of its cycle, its largest factor (``start`` must lie in one
    cycle); a power piece multiplies its span by at most 1."""
    if start >= stop:
        return None
    if key[0] in ("ramp", "cos", "pow") and not math.isfinite(key[2] - key[1]):
        return start
    if key[0] == "cos":
        return start if _bad_value(key, start) else None
    if key[0] not in ("exp", "lin", "ramp"):
        return None
    if _bad_value(key, start):
        return start
    if not _bad_value(key, stop - 1):
        return None
    lo, hi = start, stop - 1  # good at lo, bad at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _bad_value(key, mid) else (mid, hi)
    return hi


def _check_step(name: str, step: int) -> int:
    step = index(step)
    if step < 0:
        raise ValueError(f"`{name}` is {step}, but must be >= 0")
    return step


def _format(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return str(value) if isinstance(value, HPFunction) else repr(value)


_COMPUTABLE_BELOW = "_computable_below"
"""Key, in a sequence's ``__dict__``, of the largest ``stop`` for which
:meth:`HPFunction.first_uncomputable` found every value fine (a trial extended by successive
requests is checked again with more steps: only a larger ``stop`` is scanned again)."""


class HPFunction(BaseModel):
    """Base of every hyper-parameter sequence: a frozen function of the global step.

    Equality is strict: ``Constant(128) != Constant(128.0)``, because an int batch size and a
    float one are different trainings. Equal sequences have equal :func:`hp_to_json` bytes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        """Validates ``data``; each family also takes its parameters positionally.

        Raises:
            ValueError: a parameter is invalid; one line per problem, naming the family, the
                parameter and the value (``MultiStep: `init` is nan, but must be finite``).
        """
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ValueError(f"{type(self).__name__}: {_problems(exc)}") from None

    def value(self, step: int) -> int | float:
        """The value at global ``step`` (int >= 0); raises ValueError for a negative step."""
        step = _check_step("step", step)
        return _eval_piece(self._piece_at(step)[0], step)

    def pieces(self, stop: int) -> list[Piece]:
        """Canonical pieces ``(start_step, key)`` covering steps ``[0, stop)``.

        Sorted by start, the first at step 0 (empty when ``stop`` is 0), consecutive equal keys
        merged. Raises ValueError for a negative ``stop``.
        """
        stop = _check_step("stop", stop)
        pieces: list[Piece] = []
        step: int | None = 0
        while step is not None and step < stop:
            key, end = self._piece_at(step)
            if not pieces or not same_piece(pieces[-1][1], key):
                pieces.append((step, key))
            step = end
        return pieces

    def first_uncomputable(self, stop: int) -> int | None:
        """The first step in ``[0, stop)`` whose value cannot be computed or used (a float
        leaving the float range, a non-finite value, an int outside 64 bits), or None when every
        value there is fine. A trial asking for ``stop`` steps needs all of them.

        Cost: independent of ``stop`` for periodic families; a bisection for exponential and
        linear pieces. Raises ValueError for a negative ``stop``.
        """
        stop = _check_step("stop", stop)
        if stop <= self.__dict__.get(_COMPUTABLE_BELOW, 0):
            return None
        bad = self._first_uncomputable(stop)
        if bad is None:  # every step below ``stop`` is fine: remembered (the object is frozen)
            self.__dict__[_COMPUTABLE_BELOW] = stop
        return bad

    def _first_uncomputable(self, stop: int) -> int | None:
        """Per family: see :meth:`first_uncomputable` (default: bounded families, never)."""
        return None

    @abstractmethod
    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        """The key of the piece holding ``step`` and the step where it ends (None: never)."""

    @cached_property
    def canonical(self) -> bytes:
        """:func:`hp_to_json` as orjson bytes with sorted keys (equal sequences, equal bytes);
        computed once per object (it is frozen)."""
        return orjson.dumps(hp_to_json(self), option=orjson.OPT_SORT_KEYS)

    def _canonical_bytes(self) -> bytes:
        return self.canonical

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any:
        """A copy; with ``update``, its :attr:`canonical` bytes are computed again (not copied)."""
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("canonical", None)
        copy.__dict__.pop(_COMPUTABLE_BELOW, None)
        return copy

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HPFunction):
            return NotImplemented
        return self._canonical_bytes() == other._canonical_bytes()

    def __hash__(self) -> int:
        return hash(self._canonical_bytes())

    def __str__(self) -> str:
        args = ", ".join(
            f"{field.alias or name}={_format(getattr(self, name))}"
            for name, field in type(self).model_fields.items()
            if name != "kind"
        )
        return f"{type(self).__name__}({args})"

    __repr__ = __str__


class Constant(HPFunction):
    """``value`` at every step (Hippo thesis A.1 ``Constant(init)``; ``CONSTANT(x; a) = a``).

    Raises ValueError if ``value`` is not a finite number.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", serialize_by_alias=True)

    kind: Literal["Constant"] = "Constant"
    value_: Number = Field(alias="value")  # ``value`` is the method; JSON and __init__ say "value"

    def __init__(self, value: float, **data: Any) -> None:
        super().__init__(value=value, **data)

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        return ("const", self.value_), None


class MultiStep(HPFunction):
    """``init * gamma ** k`` where ``k`` is the number of milestones <= step.

    Hippo thesis A.1 ``MultiStep(init, milestones, gamma)``; the paper's Tables 2-4 call it
    ``StepLR(gamma, milestones)`` (PyTorch MultiStepLR). ``milestones`` are steps. ``gamma``
    may exceed 1: ``MultiStep(32, [40], 2)`` doubles a batch size at step 40 (32, then 64; the
    value stays an int when ``init`` and ``gamma`` are ints).

    Raises ValueError if ``milestones`` are not strictly increasing ints >= 1, if
    ``gamma <= 0`` or if a number is not finite.
    """

    kind: Literal["MultiStep"] = "MultiStep"
    init: Number
    milestones: Steps
    gamma: PositiveNumber

    def __init__(self, init: float, milestones: Sequence[int], gamma: float, **data: Any) -> None:
        super().__init__(init=init, milestones=milestones, gamma=gamma, **data)

    def _first_uncomputable(self, stop: int) -> int | None:
        for k, start in enumerate((0, *self.milestones)):
            if start >= stop:
                break
            if _bad_value(("exp", self.init, self.gamma, 0), k):
                return start
        return None

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        k = bisect_right(self.milestones, step)
        end = self.milestones[k] if k < len(self.milestones) else None
        return ("const", self.init * self.gamma**k), end


class Exponential(HPFunction):
    """``init * gamma ** step``: multiplied by ``gamma`` at every step.

    Hippo thesis A.1 ``Exponential(init, gamma)``; ``EXPONENTIAL(x; a0, gamma)`` of the paper's
    node fields and ``Exponential(gamma)`` of Tables 2-4 (PyTorch ExponentialLR).

    Raises ValueError if ``gamma <= 0`` or if a number is not finite. ``value`` raises
    OverflowError once a float value leaves the float range.
    """

    kind: Literal["Exponential"] = "Exponential"
    init: Number
    gamma: PositiveNumber

    def __init__(self, init: float, gamma: float, **data: Any) -> None:
        super().__init__(init=init, gamma=gamma, **data)

    def _first_uncomputable(self, stop: int) -> int | None:
        return _first_bad(self._piece_at(0)[0], 0, stop)

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        return _piece("exp", self.init, self.gamma, 0), None


class Linear(HPFunction):
    """``init + slope * step``.

    ``LINEAR(x; a, b) = a + b * x`` of the paper's node fields (Fig. 6 ``LINEAR(1, -0.02)``);
    Tables 2-4 write ``Linear(total_t)``. ``slope`` is per step.

    Raises ValueError if a number is not finite.
    """

    kind: Literal["Linear"] = "Linear"
    init: Number
    slope: Number

    def __init__(self, init: float, slope: float, **data: Any) -> None:
        super().__init__(init=init, slope=slope, **data)

    def _first_uncomputable(self, stop: int) -> int | None:
        return _first_bad(self._piece_at(0)[0], 0, stop)

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        return _piece("lin", self.init, self.slope, 0), None


class Cosine(HPFunction):
    """Cosine annealing with warm restarts (SGDR) from ``init`` down to ``min_value``.

    Cycle ``i`` lasts ``T_i = round(period * gamma ** i)`` steps (``T_0 = period``) and starts at
    ``c_i = T_0 + ... + T_{i-1}``; within it the value is
    ``min_value + (init - min_value) * (1 + cos(pi * (step - c_i) / T_i)) / 2``, so each cycle
    restarts at ``init``.

    Hippo thesis A.1 ``Cosine(init, min_y, period, gamma)``; Tables 2-4 write
    ``CosineAnnealingWarmRestarts(t0=20)`` (PyTorch, ``T_mult`` = ``gamma``).

    Raises ValueError if ``period < 1``, ``gamma < 1`` or a number is not finite.
    """

    kind: Literal["Cosine"] = "Cosine"
    init: Number
    min_value: Number
    period: Period
    gamma: Number = 1.0

    def __init__(
        self,
        init: float,
        min_value: float,
        period: int,
        gamma: float = 1.0,
        **data: Any,
    ) -> None:
        super().__init__(init=init, min_value=min_value, period=period, gamma=gamma, **data)

    @field_validator("gamma")
    @classmethod
    def _gamma_at_least_one(cls, gamma: int | float) -> int | float:
        if gamma < 1:
            raise ValueError(f"`gamma` is {gamma!r}, but must be >= 1")
        return gamma

    def _first_uncomputable(self, stop: int) -> int | None:
        if stop == 0:
            return None
        if _first_bad(self._piece_at(0)[0], 0, 1) is not None:
            return 0  # its span, or that span doubled at each cycle's start, leaves the float range

        def breaks(step: int) -> bool:  # a cycle length leaving the float range (period x gamma**i)
            try:
                self._piece_at(step)
            except (ArithmeticError, ValueError):
                return True
            return False

        if not breaks(stop - 1):
            return None
        lo, hi = -1, stop - 1  # the lengths only grow: the steps that break form a suffix
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if breaks(mid) else (mid, hi)
        return hi

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        if self.gamma == 1:
            length = self.period
            origin = step - step % length
        else:
            origin, i, length = 0, 0, self.period
            while origin + length <= step:
                origin, i = origin + length, i + 1
                length = round(self.period * self.gamma**i)
        return _piece("cos", self.init, self.min_value, length, origin), origin + length


class Warmup(HPFunction):
    """Linear warm-up from ``init`` for ``period`` steps, then ``then`` in its own frame.

    For ``step < period``: ``init + (then.value(0) - init) * step / period``; for
    ``step >= period``: ``then.value(step - period)`` (``then`` starts at 0 when the warm-up
    ends, like PyTorch SequentialLR).

    Hippo thesis A.1 ``Warmup(init, period, func)``; the paper's Tables 2-4 write
    ``Warmup(duration, target)`` (a different argument order).

    Raises ValueError if ``period < 1`` or ``init`` is not finite.
    """

    kind: Literal["Warmup"] = "Warmup"
    init: Number
    period: Period
    then: HP

    def __init__(self, init: float, period: int, then: HPFunction, **data: Any) -> None:
        super().__init__(init=init, period=period, then=then, **data)

    def _first_uncomputable(self, stop: int) -> int | None:
        if stop == 0:
            return None
        bad = self.then._first_uncomputable(max(stop - self.period, 1))  # the ramp needs then(0)
        if bad == 0:
            return 0
        ramp = _first_bad(self._piece_at(0)[0], 0, min(stop, self.period))  # its span x steps can overflow
        if ramp is not None:
            return ramp
        return None if bad is None else bad + self.period

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        if step < self.period:
            return _piece("ramp", self.init, self.then.value(0), self.period, 0), self.period
        key, end = self.then._piece_at(step - self.period)
        return _shift(key, self.period), None if end is None else end + self.period


class PowerRamp(HPFunction):
    """From ``init`` to ``end_value`` over ``period`` steps along a power curve, then ``end_value``.

    For ``step < period``: ``init + (end_value - init) * (step / period) ** power``; for
    ``step >= period``: ``end_value``. Power 1 is a linear ramp, the same canonical piece as a
    :class:`Warmup` ramp and computed as one (``init + (end_value - init) * step / period``,
    which may differ from the power formula in the last bit), power 0.5 the "1-sqrt" cooldown
    of warmup-stable-decay schedules (``init * (1 - sqrt(step / period))`` down to 0; Hägele et al., "Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations", NeurIPS 2024, §3), power 2 the
    "1-square" one. Inside :class:`Piecewise` it runs in its own frame, so a cooldown that starts
    at step ``c`` is ``Piecewise([stable, PowerRamp(peak, 0.0, length, 0.5)], [c])``.

    Raises ValueError if ``period < 1``, ``power <= 0`` or a number is not finite.
    """

    kind: Literal["PowerRamp"] = "PowerRamp"
    init: Number
    end_value: Number
    period: Period
    power: PositiveNumber

    def __init__(self, init: float, end_value: float, period: int, power: float, **data: Any) -> None:
        super().__init__(init=init, end_value=end_value, period=period, power=power, **data)

    def _first_uncomputable(self, stop: int) -> int | None:
        # values lie between init and end_value, unless their difference leaves the float range (or,
        # at power 1, a ramp: its span times the steps does)
        return _first_bad(self._piece_at(0)[0], 0, min(stop, self.period))

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        if step < self.period:
            return _piece("pow", self.init, self.end_value, self.period, self.power, 0), self.period
        return ("const", self.end_value), None


class CyclicLR(HPFunction):
    """Triangular cycles between ``init`` and ``max_value``.

    Each cycle of ``period_up + period_down`` steps rises linearly from ``init`` to
    ``max_value`` over ``period_up`` steps, then falls linearly back to ``init`` over
    ``period_down`` steps; the first cycle starts at step 0.

    Hippo thesis A.1 ``CyclicLR(init, max_y, period1, period2)``; Tables 2-4 write
    ``CyclicLR(base_lr, max_lr, step_size_up)`` (PyTorch, mode "triangular").

    Raises ValueError if a period is < 1 or a number is not finite.
    """

    kind: Literal["CyclicLR"] = "CyclicLR"
    init: Number
    max_value: Number
    period_up: Period
    period_down: Period

    def __init__(
        self,
        init: float,
        max_value: float,
        period_up: int,
        period_down: int,
        **data: Any,
    ) -> None:
        super().__init__(
            init=init, max_value=max_value, period_up=period_up, period_down=period_down, **data
        )

    def _first_uncomputable(self, stop: int) -> int | None:
        up = _first_bad(self._piece_at(0)[0], 0, min(stop, self.period_up))  # a span, or span x steps, can
        if up is not None:  # overflow; later cycles repeat the first
            return up
        return _first_bad(self._piece_at(self.period_up)[0], self.period_up,
                          min(stop, self.period_up + self.period_down))

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        cycle = self.period_up + self.period_down
        origin = step - step % cycle
        if step - origin < self.period_up:
            key = _piece("ramp", self.init, self.max_value, self.period_up, origin)
            return key, origin + self.period_up
        key = _piece("ramp", self.max_value, self.init, self.period_down, origin + self.period_up)
        return key, origin + cycle


class Piecewise(HPFunction):
    """A chain of sequences: ``functions[i]`` on ``[boundaries[i-1], boundaries[i])``.

    Function ``i`` runs in its own frame: it is evaluated at ``step - boundaries[i-1]``
    (function 0 at ``step``), like ``Warmup.then``. ``boundaries`` are steps. Piecewise
    constants (the paper's ``values=(...), milestones=[...]``) are chains of ``Constant``.

    DESIGN.md "hyper-parameter sequence" (chains); HIPPO_SPEC.md §5.2.

    Raises ValueError if ``boundaries`` are not strictly increasing ints >= 1 or their number is
    not ``len(functions) - 1``.
    """

    kind: Literal["Piecewise"] = "Piecewise"
    functions: tuple[HP, ...] = Field(min_length=1)
    boundaries: Steps

    def __init__(
        self, functions: Sequence[HPFunction], boundaries: Sequence[int], **data: Any
    ) -> None:
        super().__init__(functions=functions, boundaries=boundaries, **data)

    @model_validator(mode="after")
    def _one_boundary_between_functions(self) -> Piecewise:
        if len(self.boundaries) != len(self.functions) - 1:
            raise ValueError(
                f"`boundaries` is {list(self.boundaries)}, but must have "
                f"len(functions) - 1 = {len(self.functions) - 1} entries"
            )
        return self

    def _first_uncomputable(self, stop: int) -> int | None:
        for i, fn in enumerate(self.functions):
            start = self.boundaries[i - 1] if i else 0
            if start >= stop:
                break
            end = min(self.boundaries[i], stop) if i < len(self.boundaries) else stop
            bad = fn._first_uncomputable(end - start)
            if bad is not None:
                return start + bad
        return None

    def _piece_at(self, step: int) -> tuple[PieceKey, int | None]:
        i = bisect_right(self.boundaries, step)
        offset = self.boundaries[i - 1] if i else 0
        key, end = self.functions[i]._piece_at(step - offset)
        stop = self.boundaries[i] if i < len(self.boundaries) else None
        if end is not None:
            end += offset
            stop = end if stop is None else min(end, stop)
        return _shift(key, offset), stop


_PARSED: dict[bytes, HPFunction] = {}
_PARSED_LIMIT = 4096
"""Sequences kept by :func:`_parse_once` (the whole memo is dropped when it is full)."""


def _parse_once(data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate ``data`` into a sequence, returning the very object parsed before from the same
    JSON: a log names the same few sequences in thousands of events (every request and dispatch
    of a trial), and a sequence is frozen, so equal JSON can share one object.

    Only a JSON object (dict) whose canonical bytes (orjson, sorted keys) are exactly those of the
    sequence it validated into is kept, so a hit returns what validation would; anything else
    (invalid data, non-canonical input such as a tuple, NaN written as null) is validated as
    usual, with the same errors.
    """
    if type(data) is not dict:
        return handler(data)
    try:
        key = orjson.dumps(data, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON data (an int beyond 64 bits, an object): no key
        return handler(data)
    fn = _PARSED.get(key)
    if fn is None:
        fn = handler(data)
        if isinstance(fn, HPFunction) and fn.canonical == key:
            if len(_PARSED) >= _PARSED_LIMIT:
                _PARSED.clear()
            _PARSED[key] = fn
    return fn


HP = Annotated[
    Constant | MultiStep | Exponential | Linear | Cosine | Warmup | CyclicLR | Piecewise | PowerRamp,
    Field(discriminator="kind"),
    WrapValidator(_parse_once),
]
"""Any hyper-parameter sequence; JSON objects are told apart by their ``kind`` (parsed once per
distinct JSON: :func:`_parse_once`)."""

Warmup.model_rebuild()
Piecewise.model_rebuild()

HP_ADAPTER = TypeAdapter(HP)
"""Validates and dumps :data:`HP` values (JSON-ready dicts, see :func:`hp_from_json`)."""

HPConfig = dict[str, HPFunction]
"""A trial's hyper-parameters: name -> sequence."""

_CONFIG_ADAPTER = TypeAdapter(dict[str, HP])


def as_hp(x: HPFunction | float | dict[str, Any]) -> HPFunction:
    """``x`` as a sequence: sequences pass through, numbers become :class:`Constant`, dicts are
    parsed as :data:`HP` JSON.

    Raises TypeError for anything else (bools included), ValueError for an invalid dict.
    """
    if isinstance(x, HPFunction):
        return x
    if isinstance(x, dict):
        return HP_ADAPTER.validate_python(x)
    if isinstance(x, Real) and not isinstance(x, bool):
        return Constant(x)
    raise TypeError(
        f"`x` is {x!r} ({type(x).__name__}), but must be a hyper-parameter sequence, "
        "an int, a float or a dict"
    )


def hp_to_json(fn: HPFunction) -> dict[str, Any]:
    """``fn`` as JSON-ready data: ``{"kind": ..., <parameters>}``."""
    data: dict[str, Any] = fn.model_dump(mode="json")
    return data


def hp_from_json(obj: Any) -> HPFunction:
    """The sequence that :func:`hp_to_json` wrote. Raises ValueError if ``obj`` is invalid."""
    return HP_ADAPTER.validate_python(obj)


def config_to_json(config: Mapping[str, HPFunction]) -> dict[str, Any]:
    """``config`` as JSON-ready data, sorted by hyper-parameter name."""
    return {name: hp_to_json(config[name]) for name in sorted(config)}


def config_from_json(obj: Any) -> HPConfig:
    """The config that :func:`config_to_json` wrote. Raises ValueError if ``obj`` is invalid."""
    config = _CONFIG_ADAPTER.validate_python(obj)
    return {name: config[name] for name in sorted(config)}


def canonical_json(config: Mapping[str, HPFunction]) -> bytes:
    """``config`` as orjson bytes with sorted keys: equal configs give equal bytes."""
    return orjson.dumps(config_to_json(config), option=orjson.OPT_SORT_KEYS)


def config_values(config: Mapping[str, HPFunction], step: int) -> dict[str, int | float]:
    """The value of every hyper-parameter at global ``step``, sorted by name."""
    return {name: config[name].value(step) for name in sorted(config)}


def continue_with(fn: HPFunction, then: HPFunction, at: int) -> HPFunction:
    """``fn`` up to step ``at``, then ``then`` in its own frame (starting at 0 at ``at``): a
    Piecewise, flattened when ``fn`` is one already (its boundaries at or after ``at`` and the
    pieces they start are left out: ``then`` replaces them). Raises ValueError unless ``at`` >= 1."""
    if isinstance(fn, Piecewise):
        kept = [b for b in fn.boundaries if b < at]
        return Piecewise([*fn.functions[:len(kept) + 1], then], [*kept, at])
    return Piecewise([fn, then], [at])


def check_computable(config: Mapping[str, HPFunction], steps: int, field: str = "hp") -> None:
    """Raise ValueError naming ``field[name]`` when some hyper-parameter of ``config`` has a value
    that cannot be computed or used at a step below ``steps`` (see
    :meth:`HPFunction.first_uncomputable`): a trial asking for ``steps`` steps could not train.
    """
    for name in sorted(config):
        bad = config[name].first_uncomputable(steps)
        if bad is not None:
            raise ValueError(
                f"`{field}[{name!r}]` is {config[name]}, whose value at step {bad} leaves the float range "
                f"(or 64-bit ints), but the trial asks for {steps} steps"
            )


def breakpoints(config: Mapping[str, HPFunction], stop: int) -> list[int]:
    """Sorted steps in ``[0, stop)`` where some hyper-parameter starts a new canonical piece.

    Consecutive breakpoints delimit the segments of DESIGN.md: over each, every
    hyper-parameter follows one canonical function. Raises ValueError for a negative ``stop``.
    """
    return sorted({start for fn in config.values() for start, _ in fn.pieces(stop)})


def first_divergence(
    a: Mapping[str, HPFunction], b: Mapping[str, HPFunction], start: int, stop: int
) -> int:
    """The smallest step in ``[start, stop)`` where some hyper-parameter of ``a`` and ``b``
    differs (``not same_value(a[k].value(s), b[k].value(s))``: an int and a float, or a value
    that cannot be computed, differ from anything), or ``stop`` if there is none.

    Two trials share exactly the steps before their first divergence: subsequences are
    identical iff they have the same function over the same steps (Hippo thesis ch. 3,
    HIPPO_SPEC.md §1.1). Intervals where both sequences follow the same canonical piece are
    skipped at once; steps are scanned one by one only where the pieces differ (usually they
    differ at once).

    Raises ValueError if ``a`` and ``b`` name different hyper-parameters or a step is negative.
    """
    if a.keys() != b.keys():
        raise ValueError(
            f"`a` and `b` must name the same hyper-parameters, but only `a` has "
            f"{sorted(a.keys() - b.keys())} and only `b` has {sorted(b.keys() - a.keys())}"
        )
    start, stop = _check_step("start", start), _check_step("stop", stop)
    for name in sorted(a):
        stop = _first_divergence(a[name], b[name], start, stop)
    return stop


def _first_divergence(fa: HPFunction, fb: HPFunction, start: int, stop: int) -> int:
    step = start
    while step < stop:
        key_a, end_a = fa._piece_at(step)
        key_b, end_b = fb._piece_at(step)
        end = min(e for e in (end_a, end_b, stop) if e is not None)
        if key_a[0] == key_b[0] == "const":
            if not same_value(key_a[1], key_b[1]):
                return step
        elif not same_piece(key_a, key_b):
            for s in range(step, end):
                try:
                    if not same_value(_eval_piece(key_a, s), _eval_piece(key_b, s)):
                        return s
                except ArithmeticError:  # a value that cannot be computed is the same as nothing
                    return s
        step = end
    return stop
