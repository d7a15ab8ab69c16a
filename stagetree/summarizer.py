"""MLtuner's progress summarizer and stopping rule (Cui et al., "MLtuner", SoCC'18, §4.1, §4.3).

:func:`summarize` turns a loss trace into a label and a convergence speed, exactly as the
pseudo-code of RELATED_SPEC.md §3.2; :func:`top_within` is the paper's rule of thumb for
stopping a search. Both are pure functions.

Units: ``t`` is logical time in steps (optimizer updates), never wall-clock seconds (MLtuner
measured per second, which made its decisions depend on timing; RELATED_SPEC.md §2.4). ``x``
is the loss (lower is better), so a speed is loss units per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Literal

import numpy as np

__all__ = ["CONVERGING", "DIVERGED", "UNSTABLE", "Label", "Summary", "summarize", "top_within"]

Label = Literal["converging", "unstable", "diverged"]
CONVERGING: Label = "converging"
UNSTABLE: Label = "unstable"
DIVERGED: Label = "diverged"


@dataclass(frozen=True)
class Summary:
    """What :func:`summarize` found.

    Attributes:
        label: "converging", "unstable" (needs a longer trial) or "diverged" (overflow).
        speed: ``max((-r - noise) / t, 0)``, loss units per step; 0 unless ``t > 0``.
        r: last window mean minus first window mean of the loss (< 0 when it fell).
        t: last window mean minus first window mean of the time, in steps.
        noise: the largest rise between consecutive window means, at least 0 (loss units).
        k: the number of windows used: ``min(k, N)``.

    ``r``, ``t`` and ``noise`` are 0.0 when the label is decided without windows: a diverged
    trace, or one with fewer than 2 points.
    """

    label: Label
    speed: float
    r: float
    t: float
    noise: float
    k: int


def summarize(trace: Sequence[tuple[float, float]], k: int = 10, eps: float | None = None) -> Summary:
    """MLtuner's progress summarizer (SoCC'18 §4.1; RELATED_SPEC.md §3.2).

    1. Any non-finite loss (NaN/Inf: numerical overflow) -> "diverged", speed 0. So is a trace
       whose window averages overflow. A finite loss that rises is "unstable", not diverged.
    2. The indices 0..N-1 are split into ``min(k, N)`` contiguous windows of near-equal size
       (``numpy.array_split``: the first ``N % k`` windows hold one point more); with N < k
       each point is its own window. Each window is averaged, in ``t`` and in ``x``.
    3. ``R = x~_last - x~_first``, ``T = t~_last - t~_first`` (steps),
       ``noise = max(0, max_j (x~_{j+1} - x~_j))``, ``speed = max((-R - noise) / T, 0)``
       (0 when ``T <= 0``).
    4. "converging" iff ``R < 0`` and ``noise < eps * |R|``; otherwise "unstable".

    A trace of fewer than 2 points has no slope: it is "unstable" with speed 0 (a longer trial
    is needed); so is every trace with ``k = 1`` (one window: ``R = T = 0``). The paper fixes
    ``k = 10`` (white noise looks monotone with probability < 0.1%) and ``eps = 1 / k`` (no
    window may rise by more than a straight line would fall per window).

    Args:
        trace: points ``(t_i, x_i)``: ``t`` in steps (finite, non-decreasing), ``x`` the loss.
        k: the number of windows (positive int).
        eps: the stability threshold (finite, > 0); ``None`` means ``1 / k``.

    Raises:
        ValueError: ``k`` or ``eps`` out of range, a point that is not a pair of numbers, or a
            non-finite or decreasing ``t`` (naming the point and the value).
    """
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 1:
        raise ValueError(f"`k` is {k!r}, but must be a positive int")
    k = int(k)
    if eps is None:
        eps = 1.0 / k
    elif isinstance(eps, bool) or not isinstance(eps, Real) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"`eps` is {eps!r}, but must be a finite number > 0 (or None for 1/k)")
    ts, xs = _points(trace)
    n = len(ts)
    windows = min(k, n)
    if any(not math.isfinite(x) for x in xs):
        return Summary(DIVERGED, 0.0, 0.0, 0.0, 0.0, windows)
    if n < 2:
        return Summary(UNSTABLE, 0.0, 0.0, 0.0, 0.0, windows)
    with np.errstate(over="ignore", invalid="ignore"):
        t_mean = np.array([w.mean() for w in np.array_split(np.asarray(ts), windows)])
        x_mean = np.array([w.mean() for w in np.array_split(np.asarray(xs), windows)])
        r = float(x_mean[-1] - x_mean[0])
        t = float(t_mean[-1] - t_mean[0])
        noise = max([0.0, *map(float, np.diff(x_mean))])  # 0 with one window (k = 1)
    if not (np.all(np.isfinite(x_mean)) and math.isfinite(r) and math.isfinite(noise)):
        return Summary(DIVERGED, 0.0, 0.0, 0.0, 0.0, windows)
    speed = 0.0
    if t > 0 and math.isfinite(t):
        speed = max((-r - noise) / t, 0.0)
        speed = speed if math.isfinite(speed) else 0.0
    label = CONVERGING if r < 0 and noise < eps * abs(r) else UNSTABLE
    return Summary(label, float(speed), r, t, noise, windows)


def _points(trace: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """``trace`` checked and split into times and losses (floats)."""
    ts: list[float] = []
    xs: list[float] = []
    for i, point in enumerate(trace):
        try:
            t, x = point
        except (TypeError, ValueError):
            raise ValueError(
                f"`trace[{i}]` is {point!r}, but must be a (t, x) pair of numbers"
            ) from None
        if any(isinstance(v, bool) or not isinstance(v, Real) for v in (t, x)):
            raise ValueError(f"`trace[{i}]` is {point!r}, but must be a (t, x) pair of numbers")
        if not math.isfinite(t):
            raise ValueError(f"`trace[{i}]` has t = {t!r}, but t must be finite (steps)")
        if ts and t < ts[-1]:
            raise ValueError(
                f"`trace[{i}]` has t = {t!r}, but t must be non-decreasing "
                f"(trace[{i - 1}] has t = {ts[-1]!r})"
            )
        ts.append(float(t))
        xs.append(float(x))
    return ts, xs


def top_within(speeds: Sequence[float], n: int = 5, tolerance: float = 0.10) -> bool:
    """MLtuner's stopping rule (SoCC'18 §4.3): stop when the top ``n`` non-zero convergence
    speeds differ by less than ``tolerance``.

    The paper does not say relative to what (RELATED_SPEC.md §2.4); here the spread of the top
    ``n`` is relative to the best: ``best - nth_best < tolerance * best``, which bounds every
    pairwise difference among them by the same fraction of the best. False when fewer than
    ``n`` speeds are non-zero. Speeds are loss units per step, as :func:`summarize` returns.

    Raises:
        ValueError: ``n`` not a positive int, ``tolerance`` not finite and >= 0, or a speed
            that is negative or not finite (naming its index and value).
    """
    if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
        raise ValueError(f"`n` is {n!r}, but must be a positive int")
    if isinstance(tolerance, bool) or not isinstance(tolerance, Real) or not (
        math.isfinite(tolerance) and tolerance >= 0
    ):
        raise ValueError(f"`tolerance` is {tolerance!r}, but must be a finite number >= 0")
    for i, s in enumerate(speeds):
        if isinstance(s, bool) or not isinstance(s, Real) or not (math.isfinite(s) and s >= 0):
            raise ValueError(f"`speeds[{i}]` is {s!r}, but must be a finite number >= 0")
    top = sorted((float(s) for s in speeds if s > 0), reverse=True)[: int(n)]
    return len(top) == n and top[0] - top[-1] < tolerance * top[0]
