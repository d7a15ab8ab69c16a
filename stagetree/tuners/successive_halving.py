"""Synchronous successive halving (Jamieson & Talwalkar 2016), as used in Hippo §6."""

from __future__ import annotations

from collections.abc import Iterable

from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, check_range, check_reduction


def rungs(min_steps: int, max_steps: int, reduction: int) -> list[int]:
    """Rung budgets of successive halving: min_steps * reduction**k, capped by max_steps (last).

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2`` (with
            ``reduction <= 1`` the rungs would never reach ``max_steps``).
    """
    check_range(min_steps, max_steps)
    check_reduction(reduction)
    out = [min_steps]
    while out[-1] * reduction < max_steps:
        out.append(out[-1] * reduction)
    if out[-1] != max_steps:
        out.append(max_steps)
    return out


class SuccessiveHalving(Tuner):
    """Synchronous successive halving (SHA; Jamieson & Talwalkar 2016, as used in Hippo §6).

    Every configuration trains to ``min_steps``; at each rung the best 1/``reduction`` (at least
    one) continue to ``reduction`` times more steps, up to ``max_steps``. A promotion is a new
    request on the same trial, so it resumes from the trial's own checkpoint. Decisions: a
    ``draw`` per configuration, then at each rung but the last a ``promote`` or ``stop`` per
    trial with its :class:`~events.decisions.Ranking`, and the ``answer``.

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, min_steps: int,
                 max_steps: int, reduction: int = 4) -> None:
        super().__init__(space, metric, mode)
        self.min_steps, self.max_steps = check_range(min_steps, max_steps)
        self.reduction = check_reduction(reduction)

    def rungs(self) -> list[int]:
        return rungs(self.min_steps, self.max_steps, self.reduction)

    async def run(self, study: Study) -> TunerResult:
        budgets = self.rungs()
        alive = self.draw(study, self.configurations(study), budgets[0])
        everything: dict[str, TrialResult] = {}
        results: list[TrialResult] = []
        for k, steps in enumerate(budgets):
            results = await self._train(study, alive, steps)
            everything.update({r.trial_id: r for r in results})
            if k + 1 < len(budgets):
                kept = self.cut(study, results, max(1, len(alive) // self.reduction), k, budgets[k + 1])
                alive = [r.hp for r in kept]
        return self._result(study, results, everything)
