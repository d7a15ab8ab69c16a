"""Grid search: every configuration of the space to a fixed number of steps (Hippo §5.3)."""

from __future__ import annotations

from collections.abc import Iterable

from events.decisions import Stop
from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import Mode, Tuner, TunerResult, positive_int


class GridSearch(Tuner):
    """Train every configuration of the space to ``steps`` steps and pick the best. Decisions: a
    ``draw`` per configuration, a ``stop`` (reason "failed") per trial whose training failed,
    and the ``answer``."""

    def __init__(self, space: Iterable[HPConfig], steps: int, metric: str, mode: Mode = "max") -> None:
        super().__init__(space, metric, mode)
        self.steps = positive_int("steps", steps)

    async def run(self, study: Study) -> TunerResult:
        configs = self.draw(study, self.configurations(study), self.steps)
        results = await self._train(study, configs, self.steps)
        for r in results:
            if r.failed:  # a loss: it ends where it failed
                self.decide(study, Stop(trial_id=r.trial_id, step=r.steps, reason="failed"))
        return self._result(study, results, {r.trial_id: r for r in results})
