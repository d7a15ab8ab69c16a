"""The median stopping rule (Golovin et al., Google Vizier, KDD 2017)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, check_causal, positive_int
from stagetree.tuners._inbox import ResultInbox


class MedianStopping(Tuner):
    """The median stopping rule (Golovin et al., "Google Vizier: A Service for Black-Box
    Optimization", KDD 2017, §3.2.2).

    Every configuration is requested at ``interval`` steps, then every ``interval`` steps up to
    ``max_steps``. When trial ``t``'s result at step ``s`` is handed over, ``t`` is stopped if
    ``s >= grace_steps``, at least ``min_trials`` other trials have reported at ``s``, and ``t``'s
    best result so far is worse than the median of the others' results at ``s``; otherwise it is
    requested at the next step. The answer is the best result at ``max_steps``.

    Units: steps. Assumes the metric improves with training, so results at equal steps compare.
    With ``causal=True`` each evaluation step is a causal group.

    Raises:
        ValueError: non-positive ``interval``/``max_steps``/``min_trials``, negative ``grace_steps``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, max_steps: int,
                 interval: int, grace_steps: int = 0, min_trials: int = 3, causal: bool = False) -> None:
        super().__init__(space, metric, mode)
        self.max_steps = positive_int("max_steps", max_steps)
        self.interval = positive_int("interval", interval)
        self.min_trials = positive_int("min_trials", min_trials)
        if isinstance(grace_steps, bool) or not isinstance(grace_steps, int) or grace_steps < 0:
            raise ValueError(f"`grace_steps` is {grace_steps!r}, but must be an int >= 0")
        self.grace_steps = grace_steps
        self.causal = check_causal(causal)

    def points(self) -> list[int]:
        """The evaluation steps: every ``interval`` steps, and ``max_steps``."""
        return [*range(self.interval, self.max_steps, self.interval), self.max_steps]

    async def run(self, study: Study) -> TunerResult:
        points = self.points()
        inbox: ResultInbox[int] = ResultInbox(study, self.causal)  # payload: the evaluation point
        for config in self.space:
            inbox.submit(config, points[0], 0, 0)
        reported: list[list[tuple[str, float]]] = [[] for _ in points]
        best_so_far: dict[str, float] = {}
        everything: dict[str, TrialResult] = {}
        final: list[TrialResult] = []
        decisions: list[tuple[Any, ...]] = []
        async for i, result in inbox.results():
            everything[result.trial_id] = result
            if result.failed:
                continue  # stopped where it failed; the medians use results that exist
            score = self.score(result.metrics)
            best = best_so_far[result.trial_id] = max(best_so_far.get(result.trial_id, -math.inf), score)
            others = [v for t, v in reported[i] if t != result.trial_id]
            reported[i].append((result.trial_id, score))
            if i + 1 == len(points):
                final.append(result)
                continue
            if points[i] >= self.grace_steps and len(others) >= self.min_trials and best < statistics.median(others):
                decisions.append(("stop", result.trial_id, points[i]))
                continue
            inbox.submit(result.hp, points[i + 1], i + 1, i + 1)
        out = self._result(final, everything)
        out.decisions = decisions
        return out
