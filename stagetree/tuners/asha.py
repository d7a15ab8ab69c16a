"""Asynchronous successive halving (Li et al., MLSys 2020)."""

from __future__ import annotations

from collections.abc import Iterable

from events.decisions import Promote, Stop
from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, check_causal, check_range, check_reduction
from stagetree.tuners._inbox import ResultInbox
from stagetree.tuners.successive_halving import rungs


class ASHA(Tuner):
    """Asynchronous successive halving (Li et al., "A System for Massively Parallel
    Hyperparameter Tuning", MLSys 2020, Algorithm 2; the ASHA of Hippo §6.1).

    Every configuration of the space is requested at the first rung at once (the stage-tree
    scheduler decides what trains first, Hippo §4.3). Each time a result at rung ``k`` is handed
    over (:class:`ResultInbox`), the trials in the top ``floor(n_k / reduction)`` of the ``n_k``
    results of rung ``k`` so far that are not promoted yet are promoted: the same trial is
    requested at rung ``k + 1`` and resumes from its own checkpoint. Rungs are
    ``min_steps * reduction**k`` steps, capped by ``max_steps`` (:func:`rungs`). The answer is
    the best result at the highest rung reached.

    Assumes results at one rung are comparable across trials. With ``causal=True`` each rung is
    a causal group: decisions and the answer do not depend on the number of workers.
    Decisions: a ``draw`` per configuration, a ``promote`` when a trial enters the top of its
    rung (its :class:`~events.decisions.Ranking` then), and, once nothing is waiting, a ``stop``
    for each trial at the highest rung it reached below the last (ranked in the final rung),
    then the ``answer``.

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, min_steps: int,
                 max_steps: int, reduction: int = 4, causal: bool = False) -> None:
        super().__init__(space, metric, mode)
        self.min_steps, self.max_steps = check_range(min_steps, max_steps)
        self.reduction = check_reduction(reduction)
        self.causal = check_causal(causal)

    def rungs(self) -> list[int]:
        return rungs(self.min_steps, self.max_steps, self.reduction)

    async def run(self, study: Study) -> TunerResult:
        budgets = self.rungs()
        inbox: ResultInbox[int] = ResultInbox(study, self.causal)  # payload: the rung
        for config in self.draw(study, self.configurations(study), budgets[0]):
            inbox.submit(config, budgets[0], 0, 0)
        at_rung: list[list[TrialResult]] = [[] for _ in budgets]
        promoted: list[set[str]] = [set() for _ in budgets]
        everything: dict[str, TrialResult] = {}
        async for k, result in inbox.results():
            at_rung[k].append(result)  # a failed trial counts at its rung, ranked last
            everything[result.trial_id] = result
            if k + 1 == len(budgets):
                continue
            count = len(at_rung[k]) // self.reduction
            for r in self.keep(at_rung[k], count):
                if r.trial_id not in promoted[k]:
                    promoted[k].add(r.trial_id)
                    self.decide(study, Promote(trial_id=r.trial_id, step=budgets[k], to_step=budgets[k + 1], rung=k,
                                               evidence=self.ranking(at_rung[k], r.trial_id, count)))
                    inbox.submit(r.hp, budgets[k + 1], k + 1, k + 1)
        # Nothing is waiting: a trial not promoted from its highest rung stops there.
        for k in range(len(budgets) - 1):
            evidence = self.rankings(at_rung[k], len(at_rung[k]) // self.reduction)
            for r in self.rank(at_rung[k]):
                if r.trial_id not in promoted[k]:
                    self.decide(study, Stop(trial_id=r.trial_id, step=budgets[k], rung=k,
                                            reason="failed" if r.failed else "rank", evidence=evidence[r.trial_id]))
        top = next((results for results in reversed(at_rung) if results), [])
        return self._result(study, top, everything)
