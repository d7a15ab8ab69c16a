"""The median stopping rule (Golovin et al., Google Vizier, KDD 2017)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from events.decisions import Continue, MedianRule, Stop
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
    With ``causal=True`` each evaluation step is a causal group. Decisions: a ``draw`` per
    configuration, then per result below ``max_steps`` a ``continue`` or a ``stop`` with its
    :class:`~events.decisions.MedianRule` (a failed trial: ``stop``, reason "failed"), and the
    ``answer``.

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
        for config in self.draw(study, self.configurations(study), points[0]):
            inbox.submit(config, points[0], 0, 0)
        reported: list[list[tuple[str, float]]] = [[] for _ in points]
        best_so_far: dict[str, float] = {}
        everything: dict[str, TrialResult] = {}
        final: list[TrialResult] = []
        async for i, result in inbox.results():
            everything[result.trial_id] = result
            if result.failed:  # stopped where it failed; the medians use results that exist
                self.decide(study, Stop(trial_id=result.trial_id, step=points[i], reason="failed"))
                continue
            score = self.score(result.metrics)
            best = best_so_far[result.trial_id] = max(best_so_far.get(result.trial_id, -math.inf), score)
            others = [v for t, v in reported[i] if t != result.trial_id]
            reported[i].append((result.trial_id, score))
            if i + 1 == len(points):
                final.append(result)
                continue
            median = statistics.median(others) if others else None
            evidence = MedianRule(metric=self.metric, mode=self.mode, best=self._raw(best),
                                  median=None if median is None else self._raw(median), others=len(others),
                                  min_trials=self.min_trials, grace_steps=self.grace_steps)
            if points[i] >= self.grace_steps and median is not None and len(others) >= self.min_trials \
                    and best < median:
                self.decide(study, Stop(trial_id=result.trial_id, step=points[i], reason="median", evidence=evidence))
                continue
            self.decide(study, Continue(trial_id=result.trial_id, step=points[i], to_step=points[i + 1],
                                        evidence=evidence))
            inbox.submit(result.hp, points[i + 1], i + 1, i + 1)
        return self._result(study, final, everything)

    def _raw(self, score: float) -> float | None:
        """A :meth:`score` back in the metric's own sign (None for a null metric)."""
        if not math.isfinite(score):
            return None
        return score if self.mode == "max" else -score
