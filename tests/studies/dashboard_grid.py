"""A grid study for the dashboard's browser tests: the digits CNN, 8 configurations sharing
prefixes (three learning-rate sequences agree for 40 steps), 120 steps each, with the metrics of
every trial asked at steps 30, 60, 90 and 120 at once (so the learning curves have points and a
trial is finished only when all four are answered). Each step also sleeps 10 ms (800 steps on 2
workers: about 4 s more), so that its trials finish one after another over roughly fifteen
seconds, however fast the workers start and train: a page can watch the count grow."""

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree import GridSearch, GridSearchSpace  # noqa: E402
from stagetree.hp import Constant, MultiStep  # noqa: E402
from stagetree.tuners import TunerResult  # noqa: E402


class PacedDigits(DigitsTrainer):
    """The example's trainer, 10 ms slower per step (sleeping changes no result)."""

    def train_step(self, indices, step):
        time.sleep(0.01)
        super().train_step(indices, step)


class GridWithCurves(GridSearch):
    """Grid search that also asks for every trial's metrics every ``every`` steps, in the same
    batch as its final request."""

    def __init__(self, space, steps, metric, mode="max", *, every):
        super().__init__(space, steps, metric, mode)
        self.every = every

    async def run(self, study) -> TunerResult:
        configs = self.draw(study, self.configurations(study), self.steps)
        earlier = [study.submit(c, s) for c in configs for s in range(self.every, self.steps, self.every)]
        results = await self._train(study, configs, self.steps)
        await asyncio.gather(*earlier, return_exceptions=True)
        return self._result(study, results, {r.trial_id: r for r in results})


name = "dash"
seed = 3
trainer = PacedDigits()
space = GridSearchSpace(
    {
        "lr": [MultiStep(0.1, (40,), 0.1), Constant(0.1), MultiStep(0.1, (40,), 0.5), Constant(0.05)],
        "batch_size": [Constant(32)],
        "momentum": [Constant(0.0), Constant(0.9)],
    }
)
tuner = GridWithCurves(space, 120, "val_acc", every=30)
