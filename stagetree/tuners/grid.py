"""Grid search: every configuration of the space to a fixed number of steps (Hippo §5.3)."""

from __future__ import annotations

from collections.abc import Iterable

from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import Mode, Tuner, TunerResult, positive_int


class GridSearch(Tuner):
    """Train every configuration of the space to ``steps`` steps and pick the best."""

    def __init__(self, space: Iterable[HPConfig], steps: int, metric: str, mode: Mode = "max") -> None:
        super().__init__(space, metric, mode)
        self.steps = positive_int("steps", steps)

    async def run(self, study: Study) -> TunerResult:
        results = await self._train(study, list(self.space), self.steps)
        return self._result(results, {r.trial_id: r for r in results})
