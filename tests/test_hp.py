"""Hyper-parameter sequences (events.hp): values, JSON, validation, canonical pieces, merging."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hp import (
    Constant,
    Cosine,
    CyclicLR,
    Exponential,
    HPConfig,
    HPFunction,
    Linear,
    MultiStep,
    Piecewise,
    PowerRamp,
    Warmup,
    _eval_piece,
    as_hp,
    breakpoints,
    canonical_json,
    check_computable,
    config_from_json,
    config_to_json,
    config_values,
    first_divergence,
    hp_from_json,
    hp_to_json,
    same_piece,
    same_value,
    value_key,
)

# --------------------------------------------------------------------------- strategies

numbers = st.integers(-1000, 1000) | st.floats(-1e3, 1e3, allow_nan=False)
gammas = st.integers(1, 4) | st.floats(0.01, 4.0)
periods = st.integers(1, 50)
milestones = st.lists(st.integers(1, 500), unique=True, max_size=4).map(sorted)

leaves: st.SearchStrategy[HPFunction] = st.one_of(
    st.builds(Constant, numbers),
    st.builds(MultiStep, numbers, milestones, gammas),
    st.builds(Exponential, numbers, gammas),
    st.builds(Linear, numbers, numbers),
    st.builds(Cosine, numbers, numbers, periods, st.integers(1, 3) | st.floats(1.0, 3.0)),
    st.builds(CyclicLR, numbers, numbers, periods, periods),
    st.builds(PowerRamp, numbers, numbers, periods, st.sampled_from([0.5, 1, 1.0, 2]) | st.floats(0.05, 4.0)),
)


def _piecewise(
    children: st.SearchStrategy[HPFunction],
) -> st.SearchStrategy[HPFunction]:
    return st.lists(children, min_size=1, max_size=3).flatmap(
        lambda fns: st.lists(
            st.integers(1, 300), min_size=len(fns) - 1, max_size=len(fns) - 1, unique=True
        ).map(lambda bounds: Piecewise(fns, sorted(bounds)))
    )


functions: st.SearchStrategy[HPFunction] = st.recursive(
    leaves,
    lambda children: st.builds(Warmup, numbers, periods, children) | _piecewise(children),
    max_leaves=5,
)
configs: st.SearchStrategy[HPConfig] = st.dictionaries(
    st.sampled_from(["bs", "lr", "momentum", "wd"]), functions, min_size=1
)

# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (Constant(0.1), [0.1, 0.1, 0.1]),
        (MultiStep(0.1, [2, 4], 0.1), [0.1, 0.1, 0.01, 0.01, 0.001, 0.001]),
        (Exponential(0.1, 0.9), [0.1, 0.09, 0.081, 0.0729]),
        (Linear(1, -0.02), [1, 0.98, 0.96, 0.94]),
        # SGDR, gamma 2: cycles [0, 2), [2, 6), [6, 14), each restarting at init.
        (
            Cosine(1.0, 0.0, 2, gamma=2),
            [1.0, 0.5, 1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 1.0],
        ),
        (
            Cosine(1.0, 0.2, 4),
            [1.0, 0.2 + 0.4 * (1 + math.sqrt(0.5)), 0.6, 0.2 + 0.4 * (1 - math.sqrt(0.5)), 1.0],
        ),
        # Ramp 0.0 -> then.value(0) = 0.1 over 4 steps, then the exponential from its step 0.
        (Warmup(0.0, 4, Exponential(0.1, 0.5)), [0.0, 0.025, 0.05, 0.075, 0.1, 0.05, 0.025]),
        (CyclicLR(0.0, 1.0, 2, 4), [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.5, 1.0]),
        # Each function runs in its own frame, starting at 0 at its boundary.
        (
            Piecewise([Constant(1), Linear(10, -1), Exponential(8, 0.5)], [3, 5]),
            [1, 1, 1, 10, 9, 8.0, 4.0, 2.0],
        ),
        # 1-sqrt cooldown: 1 - sqrt(step / 4), then 0 for good.
        (PowerRamp(1.0, 0.0, 4, 0.5), [1.0, 0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0, 0.0]),
        (PowerRamp(1.0, 0.0, 4, 2), [1.0, 0.9375, 0.75, 0.4375, 0.0, 0.0]),
        (PowerRamp(0.0, 2.0, 4, 1), [0.0, 0.5, 1.0, 1.5, 2.0, 2.0]),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, HPFunction) else "",
)
def test_values_match_hand_computed_numbers(fn: HPFunction, expected: list[float]) -> None:
    assert [fn.value(s) for s in range(len(expected))] == pytest.approx(expected)


def _reference(fn: HPFunction, step: int) -> float:
    """The value by the family's formula, written out independently of canonical pieces."""
    match fn:
        case Constant():
            return fn.value_
        case MultiStep():
            return fn.init * fn.gamma ** sum(m <= step for m in fn.milestones)
        case Exponential():
            return fn.init * fn.gamma**step
        case Linear():
            return fn.init + fn.slope * step
        case Cosine():
            start, cycle = 0, 0
            while step >= start + round(fn.period * fn.gamma**cycle):
                start, cycle = start + round(fn.period * fn.gamma**cycle), cycle + 1
            length = round(fn.period * fn.gamma**cycle)
            cosine = math.cos(math.pi * (step - start) / length)
            return fn.min_value + (fn.init - fn.min_value) * (1 + cosine) / 2
        case Warmup():
            if step >= fn.period:
                return _reference(fn.then, step - fn.period)
            target = _reference(fn.then, 0)
            return fn.init + (target - fn.init) * step / fn.period
        case CyclicLR():
            rest = step % (fn.period_up + fn.period_down)
            if rest < fn.period_up:
                return fn.init + (fn.max_value - fn.init) * rest / fn.period_up
            return fn.max_value + (fn.init - fn.max_value) * (rest - fn.period_up) / fn.period_down
        case PowerRamp():
            if step >= fn.period:
                return fn.end_value
            return fn.init + (fn.end_value - fn.init) * (step / fn.period) ** fn.power
        case Piecewise():
            i = sum(b <= step for b in fn.boundaries)
            return _reference(fn.functions[i], step - (fn.boundaries[i - 1] if i else 0))
    raise AssertionError(fn)


@given(functions, st.integers(0, 300))
@settings(deadline=None)
def test_values_follow_the_family_formulas(fn: HPFunction, step: int) -> None:
    assert fn.value(step) == pytest.approx(_reference(fn, step), rel=1e-12, abs=1e-12)


def test_multistep_int_doubling_keeps_ints() -> None:
    bs = MultiStep(32, [40], 2)
    assert (bs.value(0), bs.value(39), bs.value(40), bs.value(1000)) == (32, 32, 64, 64)
    assert all(type(bs.value(s)) is int for s in (0, 40))
    assert type(MultiStep(32, [40], 2.0).value(40)) is float


def test_value_rejects_negative_step() -> None:
    with pytest.raises(ValueError, match="`step` is -1"):
        Constant(0.1).value(-1)


def test_str_is_readable() -> None:
    fn = MultiStep(0.1, [90, 135], 0.1)
    assert str(fn) == repr(fn) == "MultiStep(init=0.1, milestones=[90, 135], gamma=0.1)"
    assert str(Constant(0.1)) == "Constant(value=0.1)"
    assert (
        str(Piecewise([Warmup(0.0, 5, Exponential(0.1, 0.9)), Constant(1e-6)], [30]))
        == "Piecewise(functions=[Warmup(init=0.0, period=5, then=Exponential(init=0.1, "
        "gamma=0.9)), Constant(value=1e-06)], boundaries=[30])"
    )


# --------------------------------------------------------------------------- JSON


@given(functions)
def test_json_round_trip(fn: HPFunction) -> None:
    data = hp_to_json(fn)
    assert hp_from_json(data) == fn
    assert hp_from_json(orjson.loads(orjson.dumps(data))) == fn
    assert as_hp(data) == fn
    assert hp_from_json(data).pieces(50) == fn.pieces(50)


@given(configs)
def test_config_json_round_trip_and_canonical_bytes(config: HPConfig) -> None:
    data = config_to_json(config)
    assert list(data) == sorted(config)
    restored = config_from_json(orjson.loads(orjson.dumps(data)))
    assert restored == config
    reordered = dict(reversed(list(config.items())))
    assert canonical_json(restored) == canonical_json(reordered) == canonical_json(config)


def test_json_shape() -> None:
    assert hp_to_json(Constant(0.1)) == {"kind": "Constant", "value": 0.1}
    assert hp_to_json(Warmup(0, 3, MultiStep(32, [40], 2))) == {
        "kind": "Warmup",
        "init": 0,
        "period": 3,
        "then": {"kind": "MultiStep", "init": 32, "milestones": [40], "gamma": 2},
    }


def test_equality_is_strict_about_int_and_float() -> None:
    assert Constant(128) != Constant(128.0)
    assert canonical_json({"bs": Constant(128)}) != canonical_json({"bs": Constant(128.0)})
    assert Constant(128) == Constant(128) and hash(Constant(128)) == hash(Constant(128))
    # An int batch size and a float one are different trainings (setup is called on the change),
    # so the two configs share no step although 128 == 128.0 (issue 11 item 2).
    assert first_divergence({"bs": Constant(128)}, {"bs": Constant(128.0)}, 0, 1000) == 0
    assert first_divergence({"bs": MultiStep(32, [10], 2)}, {"bs": Piecewise([Constant(32), Constant(64.0)], [10])},
                            0, 20) == 10
    assert first_divergence({"m": Constant(0.0)}, {"m": Constant(-0.0)}, 0, 5) == 0


def test_same_value_is_the_one_rule_for_values() -> None:
    assert same_value(3, 3) and same_value(0.5, 0.5)
    assert not same_value(3, 3.0) and not same_value(0.0, -0.0) and not same_value(True, 1)
    keys = {value_key(v) for v in (3, 3.0, 0.0, -0.0, 1.5)}
    assert len(keys) == 5
    assert value_key(1.5) == value_key(3 / 2)
    assert not same_piece(("const", 32), ("const", 32.0))
    assert not same_piece(("exp", 1.0, 0.5, 0), ("exp", 1, 0.5, 0))


def test_a_value_that_cannot_be_computed_differs_from_any_other() -> None:
    # Both trials are valid (every value they train with is a float), and they agree on steps
    # 0..1023; at 1024 the first one's exponential would overflow, which must not crash the
    # scan (issue 11 item 3): the configs diverge there.
    a = {"lr": Exponential(1.0, 2.0)}
    b = {"lr": Piecewise([Exponential(1.0, 2.0), Constant(1.0)], [1024])}
    assert a["lr"].first_uncomputable(1000) is None and b["lr"].first_uncomputable(1200) is None
    assert first_divergence(a, b, 0, 1200) == 1024


@pytest.mark.parametrize(("fn", "steps", "first_bad"), [
    (Exponential(1.0, 2.0), 1000, None),
    (Exponential(1.0, 2.0), 1100, 1024),
    (Piecewise([Exponential(1.0, 2.0), Constant(5.0)], [1100]), 1200, 1024),
    (Exponential(2, 2), 2**62, 62),  # an int leaving 64 bits, judged without computing 2**(2**62)
    (Exponential(0.1, 2), 10**18, 1024),
    (Exponential(1.0, 0.5), 10**18, None),  # underflow to 0.0 is a value
    (Warmup(0.0, 10, Exponential(1.0, 2.0)), 2000, 1034),
    (Warmup(0.0, 10, Exponential(2.0**1023, 2.0)), 12, 2),  # the ramp to 2**1023: 2**1023 x 2 steps overflows
    (MultiStep(1.0, [5, 10], 1e300), 20, 10),
    (Linear(1e300, 1e300), 10**18, 179_769_313),  # 1e300 * 179769313 leaves the float range
    (Cosine(0.1, 0.0, 1), 10**18, None),  # periodic: no scan of 10**18 pieces
    (CyclicLR(0.01, 0.1, 1, 1), 10**18, None),
    (PowerRamp(1.0, 0.0, 10, 0.5), 10**18, None),  # bounded by its ends
    (PowerRamp(-1e308, 1e308, 10, 0.5), 5, 0),  # the ends' difference leaves the float range
])
def test_first_uncomputable(fn: HPFunction, steps: int, first_bad: int | None) -> None:
    assert fn.first_uncomputable(steps) == first_bad
    if first_bad is not None:
        with pytest.raises(ArithmeticError):
            value = fn.value(first_bad)
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                raise OverflowError("int beyond 64 bits")
            if isinstance(value, float) and not math.isfinite(value):
                raise OverflowError("not finite")
        if first_bad:
            fn.value(first_bad - 1)  # the step before is fine


def test_first_uncomputable_remembers_only_what_it_scanned() -> None:
    """A trial extended with more steps is checked again: the steps found fine are remembered
    per sequence, a longer range is still scanned, and a copy with other parameters forgets."""
    fn = Exponential(1.0, 2.0)
    assert fn.first_uncomputable(1000) is None
    assert fn.first_uncomputable(500) is None
    assert fn.first_uncomputable(1100) == 1024  # past what was found fine: scanned
    assert fn.first_uncomputable(1000) is None
    faster = fn.model_copy(update={"gamma": 4.0})
    assert faster.first_uncomputable(1000) == 512
    assert fn.model_copy().first_uncomputable(1000) is None
    assert fn.model_dump() == {"kind": "Exponential", "init": 1.0, "gamma": 2.0}  # nothing else dumped


def test_check_computable_names_the_hyper_parameter() -> None:
    check_computable({"lr": Exponential(1.0, 2.0)}, 1000)
    with pytest.raises(ValueError, match=r"`hp\['lr'\]` is Exponential\(init=1.0, gamma=2.0\), whose value at "
                                         r"step 1024 leaves the float range.*1100 steps"):
        check_computable({"lr": Exponential(1.0, 2.0), "bs": Constant(32)}, 1100)


def test_as_hp() -> None:
    fn = Cosine(0.1, 0.0, 20)
    assert as_hp(fn) is fn
    assert as_hp(128) == Constant(128)
    assert as_hp(0.1) == Constant(0.1)
    assert as_hp({"kind": "Linear", "init": 1, "slope": -0.02}) == Linear(1, -0.02)
    assert type(as_hp(np.float64(0.1)).value(0)) is float
    numpy_bs = MultiStep.model_validate({"init": np.int64(32), "milestones": [40], "gamma": 2})
    assert numpy_bs == MultiStep(32, [40], 2) and type(numpy_bs.value(40)) is int
    for bad in ("0.1", None, True, [0.1]):
        with pytest.raises(TypeError, match=repr(bad).replace("[", r"\[")):
            as_hp(bad)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_as_the_ints_they_are_and_floats_still_refused() -> None:
    """Milestones built with numpy (``np.array([5, 8])``, ``[np.int64(5)]``) were refused
    ("Input should be a valid integer"), and so were numpy step counts and boundaries. Any
    integral number but a bool is taken and stored as a plain int: the same function, the same
    canonical JSON (so the same trial id), the same JSON types; 5.0 and True are refused as
    before."""
    pairs = [
        (MultiStep(0.1, np.array([5, 8]), 0.1), MultiStep(0.1, [5, 8], 0.1)),
        (MultiStep(32, [np.int64(5), np.uint16(9)], 2), MultiStep(32, [5, 9], 2)),
        (Warmup(0.0, np.int32(10), Constant(0.1)), Warmup(0.0, 10, Constant(0.1))),
        (Cosine(0.1, 0.0, np.int64(20), 2), Cosine(0.1, 0.0, 20, 2)),
        (CyclicLR(0.01, 0.1, np.int8(5), np.uint8(7)), CyclicLR(0.01, 0.1, 5, 7)),
        (PowerRamp(0.1, 0.0, np.int64(10), 0.5), PowerRamp(0.1, 0.0, 10, 0.5)),
        (Piecewise([Constant(0.1), Constant(0.01)], np.array([50])), Piecewise([Constant(0.1), Constant(0.01)], [50])),
        (hp_from_json({"kind": "MultiStep", "init": 0.1, "milestones": [np.int64(5)], "gamma": 0.1}),
         MultiStep(0.1, [5], 0.1)),
    ]
    for numpy_built, plain in pairs:
        assert numpy_built == plain and canonical_json({"lr": numpy_built}) == canonical_json({"lr": plain})
        assert hp_to_json(numpy_built) == hp_to_json(plain)
        assert all(type(v) is type(w) for v, w in zip(numpy_built.model_dump().values(), plain.model_dump().values()))
        assert numpy_built.pieces(200) == plain.pieces(200)
    assert type(MultiStep(0.1, np.array([5, 8]), 0.1).milestones[0]) is int
    for bad, field in [(lambda: MultiStep(0.1, [5.0], 0.1), "milestones.0"),
                       (lambda: MultiStep(0.1, [np.float64(5.0)], 0.1), "milestones.0"),
                       (lambda: MultiStep(0.1, [True, 8], 0.1), "milestones.0"),
                       (lambda: MultiStep(0.1, [np.bool_(True)], 0.1), "milestones.0"),
                       (lambda: Warmup(0.0, 10.0, Constant(0.1)), "period"),
                       (lambda: Piecewise([Constant(0.1), Constant(0.01)], [50.0]), "boundaries.0")]:
        with pytest.raises(ValueError, match=f"`{field}`: Input should be a valid integer"):
            bad()
    with pytest.raises(ValueError, match=r"`milestones` is \[8, 5\], but must be strictly increasing"):
        MultiStep(0.1, np.array([8, 5]), 0.1)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "field", "value"),
    [
        (lambda: Constant(math.nan), "value", "nan"),
        (lambda: Constant(math.inf), "value", "inf"),
        (lambda: Constant(True), "value", "True"),
        (lambda: Constant("0.1"), "value", "'0.1'"),  # type: ignore[arg-type]
        (lambda: MultiStep(2**63, [10], 2), "init", str(2**63)),
        (lambda: Linear(0.1, -math.inf), "slope", "-inf"),
        (lambda: MultiStep(0.1, [90, 90], 0.1), "milestones", "[90, 90]"),
        (lambda: MultiStep(0.1, [0, 10], 0.1), "milestones", "[0, 10]"),
        (lambda: MultiStep(0.1, [10], 0), "gamma", "0"),
        (lambda: Exponential(0.1, -0.5), "gamma", "-0.5"),
        (lambda: Cosine(0.1, 0.0, 10, 0.5), "gamma", "0.5"),
        (lambda: Cosine(0.1, 0.0, 0), "period", "0"),
        (lambda: Warmup(0.0, -3, Constant(0.1)), "period", "-3"),
        (lambda: CyclicLR(0.01, 0.1, 5, 0), "period_down", "0"),
        (lambda: PowerRamp(0.1, 0.0, 0, 0.5), "period", "0"),
        (lambda: PowerRamp(0.1, 0.0, 10, 0), "power", "0"),
        (lambda: PowerRamp(0.1, 0.0, 10, -0.5), "power", "-0.5"),
        (lambda: PowerRamp(0.1, math.nan, 10, 0.5), "end_value", "nan"),
        (lambda: Piecewise([Constant(0.1), Constant(0.01)], [50, 60]), "boundaries", "[50, 60]"),
        (lambda: Piecewise([Constant(0.1), Constant(0.01)], [0]), "boundaries", "[0]"),
        (
            lambda: hp_from_json(
                {"kind": "Warmup", "init": 0, "period": 0, "then": hp_to_json(Constant(1))}
            ),
            "period",
            "0",
        ),
    ],
)
def test_invalid_parameters_name_field_and_value(
    make: Callable[[], object], field: str, value: str
) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert f"`{field}` is {value}" in str(info.value)


# --------------------------------------------------------------------------- canonical pieces


def test_pieces_of_multistep_and_constant_share_a_key() -> None:
    assert Constant(0.1).pieces(200) == [(0, ("const", 0.1))]
    assert MultiStep(0.1, [90, 135], 0.1).pieces(200) == [
        (0, ("const", 0.1)),
        (90, ("const", 0.1 * 0.1)),
        (135, ("const", 0.1 * 0.1**2)),
    ]
    assert MultiStep(0.1, [90, 135], 0.1).pieces(100) == [
        (0, ("const", 0.1)),
        (90, ("const", 0.1 * 0.1)),
    ]
    assert Constant(0.1).pieces(0) == []


def test_pieces_shift_inner_frames() -> None:
    assert Warmup(0.0, 4, Exponential(0.1, 0.5)).pieces(100) == [
        (0, ("ramp", 0.0, 0.1, 4, 0)),
        (4, ("exp", 0.1, 0.5, 4)),
    ]
    assert Piecewise([Constant(1), Cosine(1.0, 0.0, 10)], [5]).pieces(30) == [
        (0, ("const", 1)),
        (5, ("cos", 1.0, 0.0, 10, 5)),
        (15, ("cos", 1.0, 0.0, 10, 15)),
        (25, ("cos", 1.0, 0.0, 10, 25)),
    ]


@pytest.mark.parametrize(
    ("fn", "key"),
    [
        (Exponential(0.1, 1), ("const", 0.1)),
        (Exponential(0, 0.5), ("const", 0.0)),
        (Linear(2, 0), ("const", 2)),
        (Cosine(0.1, 0.1, 10), ("const", 0.1)),
        (CyclicLR(0.1, 0.1, 2, 2), ("const", 0.1)),
        (Warmup(0.1, 10, Constant(0.1)), ("const", 0.1)),
        (Piecewise([Constant(0.1), Constant(0.1)], [50]), ("const", 0.1)),
        (MultiStep(0.1, [10, 20], 1), ("const", 0.1)),
        (PowerRamp(0.1, 0.1, 10, 0.5), ("const", 0.1)),
    ],
    ids=str,
)
def test_degenerate_pieces_are_constants(fn: HPFunction, key: tuple[object, ...]) -> None:
    assert fn.pieces(100) == [(0, key)]


@given(functions, st.integers(0, 300))
@settings(deadline=None)
def test_pieces_cover_the_range_and_compute_the_values(fn: HPFunction, stop: int) -> None:
    pieces = fn.pieces(stop)
    starts = [start for start, _ in pieces]
    assert starts == sorted(set(starts))
    assert (starts[:1] == [0]) == (stop > 0) and all(s < stop for s in starts)
    assert not any(same_piece(a, b) for (_, a), (_, b) in zip(pieces, pieces[1:]))
    bounds = [*starts[1:], stop]
    for (start, key), end in zip(pieces, bounds):
        for s in range(start, end):
            assert fn.value(s) == _eval_piece(key, s)


def test_power_ramp_pieces_and_the_linear_one_is_a_warmup_ramp() -> None:
    """A cooldown is one ``pow`` piece, then the end value; power 1 is the same canonical piece
    as a Warmup ramp, so the two merge (equal keys give bitwise-equal values)."""
    wsd = Piecewise([Warmup(0.0, 10, Constant(1.0)), PowerRamp(1.0, 0.0, 20, 0.5)], [60])
    assert wsd.pieces(100) == [
        (0, ("ramp", 0.0, 1.0, 10, 0)),
        (10, ("const", 1.0)),
        (60, ("pow", 1.0, 0.0, 20, 0.5, 60)),
        (80, ("const", 0.0)),
    ]
    linear = PowerRamp(1.0, 0.0, 20, 1)
    ramp = Warmup(1.0, 20, Constant(0.0))
    assert linear.pieces(100) == ramp.pieces(100) == [(0, ("ramp", 1.0, 0.0, 20, 0)), (20, ("const", 0.0))]
    assert [linear.value(s) for s in range(30)] == [ramp.value(s) for s in range(30)]
    assert PowerRamp(1.0, 0.0, 20, 1.0).pieces(30) == linear.pieces(30)
    assert PowerRamp(1.0, 0.0, 20, 1.0) != linear  # the parameters differ; the function does not
    assert hp_to_json(linear) == {"kind": "PowerRamp", "init": 1.0, "end_value": 0.0, "period": 20, "power": 1}


def test_breakpoints_are_the_union_of_piece_starts() -> None:
    config = {"lr": MultiStep(0.1, [90, 135], 0.1), "bs": MultiStep(128, [40], 2)}
    assert breakpoints(config, 200) == [0, 40, 90, 135]
    assert breakpoints(config, 100) == [0, 40, 90]
    assert config_values(config, 95) == {"bs": 256, "lr": pytest.approx(0.01)}
    assert list(config_values(config, 0)) == ["bs", "lr"]


# --------------------------------------------------------------------------- first divergence

LR_FAMILY = [
    Constant(0.1),
    Constant(0.01),
    Constant(1),
    Constant(1.0),
    MultiStep(0.1, [100], 0.1),
    MultiStep(0.1, [100, 150], 0.1),
    MultiStep(0.1, [120], 0.1),
    MultiStep(0.1, [100], 1),
    Exponential(0.1, 0.99),
    Exponential(3, 3),  # exact ints ...
    Exponential(3.0, 3),  # ... differ from floats once 3**step passes 2**53
    Linear(0.1, -0.0001),
    Linear(0.1, 0),
    Cosine(0.1, 0.0, 50),
    Cosine(0.1, 0.0, 50, 2),
    Cosine(0.1, 0.0, 25),
    Warmup(0.0, 10, Constant(0.1)),
    Warmup(0.0, 10, Exponential(0.1, 0.99)),
    Warmup(0.1, 10, Constant(0.1)),
    CyclicLR(0.01, 0.1, 20, 30),
    CyclicLR(0.01, 0.1, 20, 20),
    Piecewise([Constant(0.1), Exponential(0.1, 0.99)], [100]),
    Piecewise([Constant(0.1), Constant(0.01)], [100]),
    Piecewise([Cosine(0.1, 0.0, 50), Constant(0.1)], [100]),
    Piecewise([Warmup(0.0, 10, Constant(0.1)), Cosine(0.1, 0.0, 50, 2)], [60]),
    Piecewise([Warmup(0.0, 10, Constant(0.1)), PowerRamp(0.1, 0.0, 40, 0.5)], [60]),
    Piecewise([Warmup(0.0, 10, Constant(0.1)), PowerRamp(0.1, 0.0, 40, 1)], [60]),
    Piecewise([Warmup(0.0, 10, Constant(0.1)), Warmup(0.1, 40, Constant(0.0))], [60]),
    Piecewise([Warmup(0.0, 10, Constant(0.1)), PowerRamp(0.1, 0.0, 20, 2)], [80]),
]
BS_FAMILY = [
    Constant(128),
    Constant(128.0),
    MultiStep(128, [40], 2),
    MultiStep(128, [40, 80], 2),
    Warmup(32, 20, Constant(128)),
]
family_configs = st.fixed_dictionaries(
    {"lr": st.sampled_from(LR_FAMILY), "bs": st.sampled_from(BS_FAMILY)}
)


def _brute_force(a: HPConfig, b: HPConfig, start: int, stop: int) -> int:
    diverged = (s for s in range(start, stop) if any(not same_value(a[k].value(s), b[k].value(s)) for k in a))
    return next(diverged, stop)


@given(family_configs, family_configs, st.integers(0, 300), st.integers(0, 300))
@settings(max_examples=500, deadline=None)
def test_first_divergence_equals_a_step_by_step_scan(
    a: HPConfig, b: HPConfig, start: int, stop: int
) -> None:
    assert first_divergence(a, b, start, stop) == _brute_force(a, b, start, stop)


def test_constant_and_multistep_diverge_at_the_milestone() -> None:
    a = {"lr": Constant(0.1)}
    b = {"lr": MultiStep(0.1, [100], 0.1)}
    assert first_divergence(a, b, 0, 200) == 100
    assert first_divergence(a, b, 0, 100) == 100
    assert first_divergence(a, b, 150, 200) == 150


def test_long_ranges_are_skipped_piece_by_piece() -> None:
    assert first_divergence({"lr": Constant(0.1)}, {"lr": Constant(0.1)}, 0, 30_000) == 30_000
    late = {"lr": MultiStep(0.1, [29_000], 0.1)}
    assert first_divergence({"lr": Constant(0.1)}, late, 0, 30_000) == 29_000
    cosine = {"lr": Cosine(0.1, 0.0, 1)}
    assert first_divergence(cosine, dict(cosine), 0, 30_000) == 30_000


def test_first_divergence_rejects_different_names() -> None:
    with pytest.raises(ValueError, match=r"only `a` has \['lr'\] and only `b` has \['bs'\]"):
        first_divergence({"lr": Constant(0.1)}, {"bs": Constant(0.1)}, 0, 10)


def _first_bad_by_brute_force(fn: Any, stop: int) -> int | None:
    for step in range(stop):
        try:
            value = fn.value(step)
        except ArithmeticError:
            return step
        if isinstance(value, float) and not math.isfinite(value):
            return step
    return None


@pytest.mark.parametrize("fn, stop", [
    (Exponential(0.01, 2), 1030),  # a float times the exact int 2**1024: OverflowError, though 0.01 * 2**1024 is finite
    (Warmup(-1e308, 10, Constant(1e308)), 20),  # the ramp's span overflows: inf and nan
    (CyclicLR(-1e308, 1e308, 4, 4), 20),
    (Cosine(1e308, -1e308, 4), 20),
    (Cosine(0.1, 0.0, 2, 1e308), 20),  # its second cycle's length leaves the float range
    (Warmup(0.0, 10, Exponential(0.1, 2.0)), 1100),
    (Cosine(0.1, 0.0, 4, 2), 300),
    (CyclicLR(0.1, 1.0, 4, 4), 50),
    # a span x steps (a ramp) or a span x 2 (a cosine at its cycle's start) past the float range,
    # between finite ends (the bug bash of 2026-11-28; hypothesis shrank the first)
    (Cosine(0.0, 8.98846567431158e307, 1), 5),
    (Cosine(1e308, 0.0, 4), 5),
    (Warmup(0.0, 3, Constant(8.98846567431158e307)), 5),
    (Warmup(0.0, 1000, Constant(1e306)), 1010),
    (CyclicLR(0.0, 1e306, 1000, 10), 1010),
    (CyclicLR(1e306, 0.0, 10, 1000), 1010),
    (PowerRamp(0.0, 1e308, 10, 1), 20),
    (PowerRamp(0.0, 1e308, 10, 2), 20),
    # a zero init times an int gamma: 0 at every step (its logarithm raised a math domain error)
    (MultiStep(0.0, [5], 2), 10),
    (MultiStep(0, [5], 2), 10),
    (Piecewise([Constant(0), Constant(0), MultiStep(0, [1], 1)], [1, 2]), 3),
    (MultiStep(0.0, list(range(1, 1100)), 2), 1100),  # 0.0 x 2**1024: the float conversion overflows
], ids=["exp-int-gamma", "warmup-span", "cyclic-span", "cosine-span", "cosine-period", "warmup-exp", "cosine-ok",
        "cyclic-ok", "cosine-double-span", "cosine-double-span-2", "warmup-ramp-product", "warmup-ramp-late",
        "cyclic-up-product", "cyclic-down-product", "powerramp-1-product", "powerramp-2-ok", "multistep-zero-float",
        "multistep-zero-int", "piecewise-zero", "multistep-zero-many"])
def test_the_first_uncomputable_step_is_the_first_that_fails(fn: Any, stop: int) -> None:
    """These passed the submit-time check, then failed in the worker or handed inf and nan to the
    trainer's ``setup`` (README: such a trial is refused when submitted, naming the step)."""
    assert fn.first_uncomputable(stop) == _first_bad_by_brute_force(fn, stop)


@given(st.lists(st.integers(1, 60), min_size=1, max_size=4, unique=True), st.integers(1, 80))
def test_continue_with_keeps_the_values_before_the_step_and_takes_then_after(cuts: list[int], at: int) -> None:
    """PBT explores from a donor's configuration at a generation's step; a donor whose sequence is
    a Piecewise with boundaries at or after that step (a paper space's schedule) made an invalid
    Piecewise (boundaries not increasing), which ended the study."""
    from events.hp import continue_with

    boundaries = sorted(cuts)
    fn = Piecewise([Constant(float(i)) for i in range(len(boundaries) + 1)], boundaries)
    then = MultiStep(9.0, [3], 0.5)
    out = continue_with(fn, then, at)
    assert [out.value(s) for s in range(at)] == [fn.value(s) for s in range(at)]
    assert [out.value(at + s) for s in range(10)] == [then.value(s) for s in range(10)]
