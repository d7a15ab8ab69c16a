"""MLtuner's progress summarizer and stop rule (stagetree/summarizer.py) against hand-worked traces."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.summarizer import Summary, summarize, top_within


def steps(xs: list[float], every: int = 100) -> list[tuple[float, float]]:
    """``xs`` logged at steps every, 2*every, ..."""
    return [(every * (i + 1), x) for i, x in enumerate(xs)]


# --------------------------------------------------------------------------- hand-worked traces


def test_ten_points_ten_windows() -> None:
    # Windows of one point each. R = 3 - 10 = -7, T = 1000 - 100 = 900,
    # rises: 8.5 -> 8.75 (+0.25) and 6 -> 6.25 (+0.25), so noise = 0.25;
    # speed = (7 - 0.25) / 900 = 0.0075 loss per step; 0.25 < |R| / 10 = 0.7: converging.
    s = summarize(steps([10, 9, 8.5, 8.75, 7, 6, 6.25, 5, 4, 3]))
    assert (s.label, s.r, s.t, s.noise, s.k) == ("converging", -7.0, 900.0, 0.25, 10)
    assert s.speed == pytest.approx(6.75 / 900)


def test_ten_points_five_windows_of_two() -> None:
    # x windows: (10, 8) 9, (7, 7) 7, (6, 4) 5, (5, 6) 5.5, (3, 1) 2; t windows 15, 35, ..., 95.
    # R = 2 - 9 = -7, T = 80, noise = 5.5 - 5 = 0.5, speed = 6.5 / 80; 0.5 < 7 / 5: converging.
    s = summarize(steps([10, 8, 7, 7, 6, 4, 5, 6, 3, 1], every=10), k=5)
    assert (s.label, s.r, s.t, s.noise, s.k) == ("converging", -7.0, 80.0, 0.5, 5)
    assert s.speed == pytest.approx(6.5 / 80)


def test_uneven_windows_follow_array_split() -> None:
    # N = 7, k = 3: windows of 3, 2, 2 points (the first N % k windows get one more).
    # x: (9, 8, 7) 8, (6, 5) 5.5, (3, 1) 2; t = 0..6: (0, 1, 2) 1, (3, 4) 3.5, (5, 6) 5.5.
    s = summarize([(t, x) for t, x in enumerate([9, 8, 7, 6, 5, 3, 1])], k=3)
    assert (s.label, s.r, s.t, s.noise, s.k) == ("converging", -6.0, 4.5, 0.0, 3)
    assert s.speed == pytest.approx(6 / 4.5)


def test_fewer_points_than_windows_uses_one_window_per_point() -> None:
    s = summarize([(10, 3.0), (20, 2.0), (30, 1.5)])
    assert s == Summary("converging", pytest.approx(1.5 / 20), -1.5, 20.0, 0.0, 3)


def test_noisy_non_monotone_trace_is_unstable_with_zero_speed() -> None:
    # R = 4 - 5 = -1, noise = 3 (3 -> 6, 2 -> 5, 1 -> 4): (1 - 3) / 900 < 0, so speed 0.
    s = summarize(steps([5, 3, 6, 2, 5, 1, 4, 2, 3, 4]))
    assert s == Summary("unstable", 0.0, -1.0, 900.0, 3.0, 10)


def test_unstable_can_still_have_a_speed() -> None:
    # R = -7, noise = 1 (8 -> 9) >= 0.7 = |R| / 10: unstable, but speed (7 - 1) / 900 > 0.
    s = summarize(steps([10, 9, 8, 9, 7, 6, 5, 4, 3, 3]))
    assert (s.label, s.r, s.noise) == ("unstable", -7.0, 1.0)
    assert s.speed == pytest.approx(6 / 900)
    # a looser threshold accepts it: 1 < 0.2 * 7
    assert summarize(steps([10, 9, 8, 9, 7, 6, 5, 4, 3, 3]), eps=0.2).label == "converging"


def test_noise_equal_to_the_threshold_is_unstable() -> None:
    # k = 4, eps = 1/4: R = 1 - 5 = -4, noise = 3 - 2 = 1 = eps * |R|, not below it.
    s = summarize(steps([5, 2, 3, 1]), k=4)
    assert (s.label, s.r, s.noise) == ("unstable", -4.0, 1.0)
    assert s.speed == pytest.approx(3 / 300)


def test_rising_finite_loss_is_unstable_not_diverged() -> None:
    s = summarize(steps([1, 2, 3, 4]))
    assert s == Summary("unstable", 0.0, 3.0, 300.0, 1.0, 4)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_overflow_is_diverged_with_zero_speed(bad: float) -> None:
    s = summarize(steps([10, 9, 8, bad, 7]))
    assert s == Summary("diverged", 0.0, 0.0, 0.0, 0.0, 5)


def test_overflow_in_the_window_average_is_diverged() -> None:
    assert summarize(steps([1.7e308] * 4 + [1.0] * 4), k=4).label == "diverged"


def test_zero_elapsed_time_gives_zero_speed() -> None:
    s = summarize([(5, 3.0), (5, 2.0), (5, 1.0)])
    assert (s.label, s.speed, s.t) == ("converging", 0.0, 0.0)


def test_one_window_has_no_slope() -> None:
    assert summarize(steps([3.0, 2.0, 1.0]), k=1) == Summary("unstable", 0.0, 0.0, 0.0, 0.0, 1)


@pytest.mark.parametrize("trace", [[], [(0, 1.0)]])
def test_fewer_than_two_points_is_unstable(trace: list[tuple[float, float]]) -> None:
    assert summarize(trace) == Summary("unstable", 0.0, 0.0, 0.0, 0.0, len(trace))


# --------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(m=st.integers(2, 10), width=st.sampled_from([1, 2, 4]), data=st.data(),
       c=st.integers(-10**6, 10**6))
def test_adding_a_constant_to_the_loss_changes_nothing(m: int, width: int, data: st.DataObject, c: int) -> None:
    # Integer losses in windows of a power-of-two width keep every window mean exact.
    xs = data.draw(st.lists(st.integers(-1000, 1000), min_size=m * width, max_size=m * width))
    gaps = data.draw(st.lists(st.integers(0, 50), min_size=m * width, max_size=m * width))
    ts = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    base = summarize(list(zip(ts, map(float, xs))), k=m)
    shifted = summarize([(t, float(x + c)) for t, x in zip(ts, xs)], k=m)
    assert shifted == base


@settings(max_examples=200, deadline=None)
@given(xs=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=40), c=st.floats(-1e3, 1e3),
       k=st.integers(1, 12))
def test_adding_a_constant_to_real_losses_keeps_the_numbers(xs: list[float], c: float, k: int) -> None:
    base = summarize(steps(xs), k=k)
    shifted = summarize(steps([x + c for x in xs]), k=k)
    assert shifted.r == pytest.approx(base.r, abs=1e-6)
    assert shifted.noise == pytest.approx(base.noise, abs=1e-6)
    assert shifted.speed == pytest.approx(base.speed, abs=1e-6)


@settings(max_examples=300, deadline=None)
@given(xs=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=40),
       gaps=st.lists(st.integers(0, 1000), min_size=40, max_size=40), k=st.integers(1, 12))
def test_speed_is_finite_and_never_negative(xs: list[float], gaps: list[int], k: int) -> None:
    ts = [sum(gaps[: i + 1]) for i in range(len(xs))]
    s = summarize(list(zip(ts, xs)), k=k)
    assert math.isfinite(s.speed) and s.speed >= 0
    assert s.label in ("converging", "unstable", "diverged")
    if s.label == "converging":
        assert s.r < 0


@settings(max_examples=200, deadline=None)
@given(losses=st.sets(st.integers(-10**6, 10**6), min_size=2, max_size=60), k=st.integers(2, 20))
def test_strictly_decreasing_trace_is_converging(losses: set[int], k: int) -> None:
    xs = sorted(losses, reverse=True)
    s = summarize(steps(xs), k=k)
    assert s.label == "converging" and s.noise == 0.0 and s.speed > 0
    assert s.k == min(k, len(xs))


# --------------------------------------------------------------------------- top_within


def test_top_within() -> None:
    assert top_within([1.0, 0.95, 0.0, 0.92, 0.91, 0.905, 0.1])  # spread 0.095 < 0.1
    assert not top_within([1.0, 0.95, 0.92, 0.91, 0.89])  # spread 0.11
    assert not top_within([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # only 4 non-zero speeds
    assert not top_within([8.0, 8.0, 8.0, 8.0, 7.0], tolerance=0.125)  # 1 is not < 1
    assert top_within([8.0, 8.0, 8.0, 8.0, 7.5, 1.0], tolerance=0.125)  # slow ones do not count
    assert top_within([0.0, 3.0], n=1)
    assert not top_within([])


# --------------------------------------------------------------------------- errors

BAD: list[tuple[Callable[[], Any], str]] = [
    (lambda: summarize([], k=0), "`k` is 0, but must be a positive int"),
    (lambda: summarize([], k=True), "`k` is True, but must be a positive int"),
    (lambda: summarize([], k=2.0), "`k` is 2.0, but must be a positive int"),
    (lambda: summarize([], eps=0), "`eps` is 0, but must be a finite number > 0 (or None for 1/k)"),
    (lambda: summarize([], eps=math.nan), "`eps` is nan, but must be a finite number > 0"),
    (lambda: summarize([(0, 1.0), (1, 2.0, 3.0)]), "`trace[1]` is (1, 2.0, 3.0), but must be a (t, x) pair of numbers"),
    (lambda: summarize([(0, "1")]), "`trace[0]` is (0, '1'), but must be a (t, x) pair of numbers"),
    (lambda: summarize([5]), "`trace[0]` is 5, but must be a (t, x) pair of numbers"),
    (lambda: summarize([(math.nan, 1.0)]), "`trace[0]` has t = nan, but t must be finite (steps)"),
    (lambda: summarize([(5, 1.0), (3, 0.5)]),
     "`trace[1]` has t = 3, but t must be non-decreasing (trace[0] has t = 5.0)"),
    (lambda: top_within([1.0], n=0), "`n` is 0, but must be a positive int"),
    (lambda: top_within([1.0], tolerance=-0.1), "`tolerance` is -0.1, but must be a finite number >= 0"),
    (lambda: top_within([1.0, -2.0]), "`speeds[1]` is -2.0, but must be a finite number >= 0"),
    (lambda: top_within([math.inf]), "`speeds[0]` is inf, but must be a finite number >= 0"),
]


@pytest.mark.parametrize(("make", "message"), BAD, ids=[m[:50] for _, m in BAD])
def test_bad_input_names_the_field_and_the_value(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        make()
