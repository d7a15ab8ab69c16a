"""RandomSearchSpace and its samplers (stagetree/spaces.py): draws, determinism, bounds, errors."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hp import Constant, Cosine, HPFunction, MultiStep, Warmup
from stagetree.spaces import (
    Choice,
    GridSearchSpace,
    IntUniform,
    LogUniform,
    Milestones,
    RandomSearchSpace,
    Sampled,
    Uniform,
)
from stagetree.tuners import GridSearch, SuccessiveHalving


def values(space: RandomSearchSpace, name: str) -> list[int | float]:
    """The step-0 value of ``name`` in every configuration."""
    return [config[name].value(0) for config in space]


# --------------------------------------------------------------------------- the draws


def test_first_draw_is_the_pinned_pcg64_double() -> None:
    # default_rng([seed, i]).random() is PCG64 + SeedSequence: the same on every platform.
    space = RandomSearchSpace({"u": Uniform(0, 1)}, n=1, seed=0)
    assert list(space) == [{"u": Constant(0.6369616873214543)}]
    assert 0.6369616873214543 == float(np.random.default_rng([0, 0]).random())


def test_names_are_drawn_in_sorted_order_from_rng_seed_i() -> None:
    # Configuration 3 of seed 7: rng = default_rng([7, 3]); "a" (sorted first) takes the first
    # double u1 = 0.97503..., so IntUniform(0, 9) = floor(10 * u1) = 9; "b" takes the second.
    rng = np.random.default_rng([7, 3])
    u1, u2 = rng.random(), rng.random()
    assert math.floor(10 * u1) == 9
    space = RandomSearchSpace({"b": Uniform(0.0, 1.0), "a": IntUniform(0, 9), "c": 5}, n=4, seed=7)
    assert space.config(3) == {"a": Constant(9), "b": Constant(float(u2)), "c": Constant(5)}
    assert list(space)[3] == space.config(3)
    assert list(list(space)[3]) == ["a", "b", "c"]


def test_fixed_values_and_numbers_become_sequences() -> None:
    fixed = MultiStep(0.1, [10], 0.5)
    space = RandomSearchSpace(
        {"lr": fixed, "m": 0.9, "wd": {"kind": "Constant", "value": 1e-4}, "bs": IntUniform(8, 8)},
        n=3, seed=1,
    )
    assert len(space) == 3
    for config in space:
        assert config == {"lr": fixed, "m": Constant(0.9), "wd": Constant(1e-4), "bs": Constant(8)}
        assert isinstance(config["bs"].value(0), int)  # ints stay ints (batch sizes)


def test_list_candidates_are_chosen_uniformly() -> None:
    space = RandomSearchSpace({"bs": [32, 64, 128]}, n=3000, seed=5)
    counts = Counter(values(space, "bs"))
    assert set(counts) == {32, 64, 128}
    assert all(abs(c - 1000) < 150 for c in counts.values())  # ~5 standard deviations


def test_a_candidate_list_may_hold_samplers() -> None:
    space = RandomSearchSpace({"lr": [0.5, Uniform(0.0, 0.25)]}, n=200, seed=2)
    drawn = values(space, "lr")
    assert 0.5 in drawn
    assert any(0.0 <= v <= 0.25 for v in drawn)
    assert all(v == 0.5 or 0.0 <= v <= 0.25 for v in drawn)


def test_sampled_multistep() -> None:
    lr = Sampled(MultiStep, init=LogUniform(0.01, 0.3), milestones=Milestones(2, 30, 110),
                 gamma=Choice([0.1, 0.2]))
    for config in RandomSearchSpace({"lr": lr}, n=50, seed=3):
        fn = config["lr"]
        assert isinstance(fn, MultiStep)
        assert 0.01 <= fn.init <= 0.3
        assert len(fn.milestones) == 2 and 30 <= fn.milestones[0] < fn.milestones[1] <= 110
        assert fn.gamma in (0.1, 0.2)


def test_sampled_nests_and_chooses_families() -> None:
    warmup = Sampled(Warmup, init=0.0, period=IntUniform(1, 10),
                     then=Sampled(Constant, value=LogUniform(1e-3, 1e-1)))
    family = Choice([Sampled(Constant, value=Uniform(0.0, 1.0)),
                     Sampled(Cosine, init=1.0, min_value=0.0, period=IntUniform(5, 20))])
    space = RandomSearchSpace({"lr": warmup, "mom": family}, n=100, seed=4)
    kinds = set()
    for config in space:
        lr = config["lr"]
        assert isinstance(lr, Warmup) and lr.init == 0.0 and 1 <= lr.period <= 10
        assert isinstance(lr.then, Constant) and 1e-3 <= lr.then.value(0) <= 1e-1
        kinds.add(type(config["mom"]))
    assert kinds == {Constant, Cosine}


def test_milestones_cover_every_step_when_count_fills_the_range() -> None:
    rng = np.random.default_rng(0)
    assert Milestones(5, 3, 7).sample(rng) == (3, 4, 5, 6, 7)
    assert Milestones(1, 4, 4).sample(rng) == (4,)


def test_milestone_subsets_are_uniform() -> None:
    rng = np.random.default_rng(11)
    counts = Counter(Milestones(2, 1, 4).sample(rng) for _ in range(6000))  # 6 subsets
    assert len(counts) == 6 and all(abs(c - 1000) < 150 for c in counts.values())


def test_loguniform_is_uniform_in_log() -> None:
    rng = np.random.default_rng(12)
    logs = [math.log10(LogUniform(1e-4, 1.0).sample(rng)) for _ in range(4000)]
    assert abs(np.mean(logs) - (-2.0)) < 0.1
    assert sum(v < -3 for v in logs) == pytest.approx(1000, abs=150)


def test_filter_keeps_indices_in_order_and_len_may_be_below_n() -> None:
    hp = {"x": IntUniform(0, 9)}
    full = RandomSearchSpace(hp, n=40, seed=9)
    even = RandomSearchSpace(hp, n=40, seed=9, filter=lambda c: c["x"].value(0) % 2 == 0)
    assert list(even) == [c for c in full if c["x"].value(0) % 2 == 0]
    assert 0 < len(even) < 40


def test_iteration_hands_out_copies() -> None:
    space = RandomSearchSpace({"x": Uniform(0, 1)}, n=2, seed=0)
    first = next(iter(space))
    first["x"] = Constant(7)
    assert next(iter(space))["x"] != Constant(7)


def test_reprs_are_readable() -> None:
    lr = Sampled(MultiStep, init=LogUniform(0.01, 0.3), milestones=Milestones(2, 30, 110),
                 gamma=Choice([0.1, 0.2]))
    assert repr(lr) == (
        "Sampled(MultiStep, gamma=Choice(values=(0.1, 0.2)), init=LogUniform(low=0.01, high=0.3), "
        "milestones=Milestones(count=2, low=30, high=110))"
    )
    assert repr(RandomSearchSpace({"u": Uniform(0, 1)}, n=2, seed=3)) == (
        "RandomSearchSpace({'u': Uniform(low=0, high=1)}, n=2, seed=3)"
    )
    assert lr == Sampled(MultiStep, gamma=Choice((0.1, 0.2)), milestones=Milestones(2, 30, 110),
                         init=LogUniform(0.01, 0.3))


# --------------------------------------------------------------------------- properties

SPACE: dict[str, Any] = {
    "lr": Sampled(MultiStep, init=LogUniform(1e-3, 1.0), milestones=Milestones(3, 1, 50),
                  gamma=Choice([0.1, 0.5])),
    "bs": [16, 32, 64],
    "wd": Uniform(0.0, 0.01),
}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), n=st.integers(1, 12), more=st.integers(0, 12))
def test_space_is_a_pure_function_and_prefix_stable(seed: int, n: int, more: int) -> None:
    space = list(RandomSearchSpace(SPACE, n=n, seed=seed))
    assert space == list(RandomSearchSpace(dict(SPACE), n=n, seed=seed))
    assert list(RandomSearchSpace(SPACE, n=n + more, seed=seed))[:n] == space


def ordered_pair(lo: float, hi: float) -> st.SearchStrategy[tuple[float, float]]:
    return st.tuples(st.floats(lo, hi), st.floats(lo, hi)).filter(lambda p: p[0] != p[1]).map(sorted)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), uni=ordered_pair(-1e9, 1e9), log=ordered_pair(1e-12, 1e9),
       ints=st.tuples(st.integers(-10**12, 10**12), st.integers(0, 10**12)),
       ms=st.tuples(st.integers(1, 10**6), st.integers(0, 200), st.integers(1, 8)))
def test_sampled_values_lie_within_bounds(seed: int, uni: list[float], log: list[float],
                                          ints: tuple[int, int], ms: tuple[int, int, int]) -> None:
    int_low, int_high = ints[0], ints[0] + ints[1]
    ms_low, ms_high, count = ms[0], ms[0] + ms[1], min(ms[2], ms[1] + 1)
    space = RandomSearchSpace({
        "u": Uniform(*uni), "l": LogUniform(*log), "i": IntUniform(int_low, int_high),
        "m": Sampled(MultiStep, init=1.0, milestones=Milestones(count, ms_low, ms_high), gamma=0.5),
    }, n=8, seed=seed)
    for config in space:
        assert uni[0] <= config["u"].value(0) <= uni[1]
        assert log[0] <= config["l"].value(0) <= log[1]
        i = config["i"].value(0)
        assert isinstance(i, int) and int_low <= i <= int_high
        milestones = config["m"].milestones
        assert len(milestones) == count and all(ms_low <= s <= ms_high for s in milestones)


# --------------------------------------------------------------------------- errors

BAD: list[tuple[Callable[[], Any], str]] = [
    (lambda: RandomSearchSpace({}, 1, 0), "`hp_dict` is {}, but must name at least one hyper-parameter"),
    (lambda: RandomSearchSpace({1: 0.1}, 1, 0), "`hp_dict` has the name 1, but names must be str"),
    (lambda: RandomSearchSpace({"x": 1}, 0, 0), "`n` is 0, but must be a positive int"),
    (lambda: RandomSearchSpace({"x": 1}, True, 0), "`n` is True, but must be a positive int"),
    (lambda: RandomSearchSpace({"x": 1}, 2.0, 0), "`n` is 2.0, but must be a positive int"),
    (lambda: RandomSearchSpace({"x": 1}, 1, -1), "`seed` is -1, but must be an int in [0, 2**63)"),
    (lambda: RandomSearchSpace({"x": 1}, 1, 2**63), f"`seed` is {2**63}, but must be an int in [0, 2**63)"),
    (lambda: RandomSearchSpace({"x": 1}, 1, 0).config(-1), "`i` is -1, but must be an int >= 0"),
    (lambda: RandomSearchSpace({"x": 1}, 1, 0, filter=3), "`filter` is 3, but must be callable or None"),
    (lambda: RandomSearchSpace({"x": "a"}, 1, 0),
     "`hp_dict['x']` is 'a', but must be a number, an HPFunction, a JSON dict, a list of candidates or a sampler"),
    (lambda: RandomSearchSpace({"x": []}, 1, 0),
     "`hp_dict['x']` is [], but a list of candidates must not be empty"),
    (lambda: RandomSearchSpace({"x": [1, True]}, 1, 0), "`hp_dict['x'][1]` is True, but must be a number"),
    (lambda: RandomSearchSpace({"x": {"kind": "Constant", "value": math.inf}}, 1, 0),
     "`hp_dict['x']` is {'kind': 'Constant', 'value': inf}, which is not a valid hyper-parameter sequence"),
    (lambda: RandomSearchSpace({"lr": LogUniform(-1, 1)}, 1, 0),
     "`hp_dict['lr']`: `LogUniform.low` is -1, but must be > 0"),
    (lambda: RandomSearchSpace({"lr": LogUniform(0.1, 0.1)}, 1, 0),
     "`hp_dict['lr']`: `LogUniform.low` is 0.1, but must be < `LogUniform.high` 0.1"),
    (lambda: RandomSearchSpace({"lr": Uniform(2.0, 1.0)}, 1, 0),
     "`hp_dict['lr']`: `Uniform.low` is 2.0, but must be < `Uniform.high` 1.0"),
    (lambda: RandomSearchSpace({"lr": Uniform(0.0, math.nan)}, 1, 0),
     "`hp_dict['lr']`: `Uniform.high` is nan, but must be a finite int or float"),
    (lambda: RandomSearchSpace({"bs": IntUniform(1.5, 4)}, 1, 0),
     "`hp_dict['bs']`: `IntUniform.low` is 1.5, but must be an int"),
    (lambda: RandomSearchSpace({"bs": IntUniform(5, 4)}, 1, 0),
     "`hp_dict['bs']`: `IntUniform.low` is 5, but must be <= `IntUniform.high` 4"),
    (lambda: RandomSearchSpace({"bs": Choice([])}, 1, 0),
     "`hp_dict['bs']`: `Choice.values` is (), but must be a non-empty list"),
    (lambda: RandomSearchSpace({"bs": Choice("ab")}, 1, 0),
     "`hp_dict['bs']`: `Choice.values` is 'ab', but must be a non-empty list"),
    (lambda: RandomSearchSpace({"bs": Choice([1, Uniform(1, 0)])}, 1, 0),
     "`hp_dict['bs']`: `Choice.values[1]`: `Uniform.low` is 1, but must be < `Uniform.high` 0"),
    (lambda: RandomSearchSpace(
        {"m": Sampled(MultiStep, init=1.0, milestones=Milestones(4, 10, 12), gamma=0.1)}, 1, 0),
     "`hp_dict['m']`: `Sampled(MultiStep).milestones`: `Milestones.count` is 4, but must be <= high - low + 1 = 3"),
    (lambda: RandomSearchSpace({"m": Milestones(0, 1, 5)}, 1, 0),
     "`hp_dict['m']`: `Milestones.count` is 0, but must be >= 1"),
    (lambda: RandomSearchSpace({"m": Milestones(1, 0, 5)}, 1, 0),
     "`hp_dict['m']`: `Milestones.low` is 0, but must be >= 1 (a step after step 0)"),
    (lambda: RandomSearchSpace({"m": Milestones(1, 6, 5)}, 1, 0),
     "`hp_dict['m']`: `Milestones.low` is 6, but must be <= `Milestones.high` 5"),
    (lambda: RandomSearchSpace({"lr": Sampled(Warmup, start=0.0, period=3, then=Constant(1.0))}, 1, 0),
     "`hp_dict['lr']`: `Sampled(Warmup)` has no parameter 'start'; "
     "its parameters are ['init', 'period', 'then']"),
    (lambda: RandomSearchSpace({"lr": Sampled(Warmup, init=0.0, period=3)}, 1, 0),
     "`hp_dict['lr']`: `Sampled(Warmup)` is missing the parameter 'then'"),
    (lambda: RandomSearchSpace({"lr": Sampled(3, a=1)}, 1, 0),
     "`hp_dict['lr']`: `Sampled.fn` is 3, but must be callable"),
    (lambda: RandomSearchSpace({"lr": Sampled(lambda value: value, rate=1.0)}, 1, 0),
     "`hp_dict['lr']`: `Sampled(<lambda>)`: missing a required argument: 'value'"),
    # a draw that is not a valid sequence names the hyper-parameter (gamma must be > 0)
    (lambda: RandomSearchSpace(
        {"lr": Sampled(MultiStep, init=1.0, milestones=[5], gamma=Uniform(-1.0, 0.0))}, 2, 0),
     "`hp_dict['lr']`: configuration 0 (seed 0) is not a valid hyper-parameter sequence: MultiStep: "
     "`gamma` is "),
    # a draw of the wrong type: Milestones on its own samples a tuple, not a sequence
    (lambda: RandomSearchSpace({"m": Milestones(2, 1, 5)}, 1, 0),
     "`hp_dict['m']`: configuration 0 (seed 0) is not a valid hyper-parameter sequence: `x` is ("),
]


@pytest.mark.parametrize(("make", "message"), BAD, ids=[m[:60] for _, m in BAD])
def test_bad_input_names_the_field_and_the_value(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        make()


def test_a_sampler_used_alone_checks_its_fields() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=re.escape("`Uniform.low` is 2, but must be < `Uniform.high` 1")):
        Uniform(2, 1).sample(rng)
    with pytest.raises(ValueError, match=re.escape("`Sampled(Constant).value`: `LogUniform.low` is 0")):
        Sampled(Constant, value=LogUniform(0, 1)).sample(rng)
    assert isinstance(Sampled(Constant, value=Uniform(0, 1)).sample(rng), HPFunction)


@pytest.mark.parametrize(("make", "needles"), [
    (lambda: GridSearchSpace({1: [0.1]}), ["`hp_dict` has the name 1", "must be str"]),
    (lambda: GridSearchSpace([("lr", [0.1])]), ["`hp_dict` is [('lr', [0.1])]", "must be a mapping"]),
    (lambda: GridSearchSpace({"lr": [0.1]}, filter="lr > 0"), ["`filter` is 'lr > 0'", "callable"]),
    (lambda: GridSearch(GridSearchSpace({"lr": [0.1, 0.2]}, filter=lambda c: False), 5, "acc"),
     ["`space` holds no configuration", "its filter drops every configuration"]),
    (lambda: GridSearch([], 5, "acc"), ["`space` holds no configuration,"]),
    (lambda: SuccessiveHalving(RandomSearchSpace({"lr": LogUniform(0.01, 0.1)}, n=3, seed=0,
                                                                 filter=lambda c: False), "acc",
                               min_steps=1, max_steps=4), ["`space` holds no configuration"]),
])
def test_a_grid_is_checked_as_a_random_space_is_and_an_empty_space_is_refused(make: Any, needles: list[str]) -> None:
    """A name that is not a str, a list of pairs for the dict, a filter that is not callable,
    and a space that holds nothing (every configuration filtered out: before, the study ran
    zero trials and exited 0 with best None) are refused when built, naming the field."""
    with pytest.raises(ValueError) as caught:
        make()
    assert all(n in str(caught.value) for n in needles), caught.value
