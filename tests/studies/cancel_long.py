"""A study that cancels a long trial while it trains (preemption on cancel): LONG to 400 steps and
SHORT to 10 at once on two workers; when SHORT is answered, LONG is cancelled."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree import Tuner, TunerResult  # noqa: E402

LONG = {"lr": 0.05, "batch_size": 32, "momentum": 0.0}
SHORT = {"lr": 0.1, "batch_size": 32, "momentum": 0.0}


class CancelLong(Tuner):
    async def run(self, study):
        study.submit(LONG, 400)
        await study.submit(SHORT, 10)
        study.cancel(LONG)
        return TunerResult(None, self.metric, self.mode)


name = "cancel"
seed = 5
trainer = DigitsTrainer()
tuner = CancelLong([LONG, SHORT], "val_acc")
