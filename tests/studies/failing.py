"""A study whose trainer raises at step 12 when the learning rate is 0.5: that trial fails. Its
evaluation, like its steps, reads what ``setup`` set (a worker's warm-up, which runs no
``setup``, must not end the run on it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree import GridSearch, GridSearchSpace  # noqa: E402


class ExplodingTrainer(DigitsTrainer):
    name = "ExplodingTrainer"

    def setup(self, hp):
        super().setup(hp)
        if "lr" in hp:
            self.lr = hp["lr"]

    def train_step(self, indices, step):
        if self.lr == 0.5 and step == 12:
            raise FloatingPointError("loss diverged at step 12")
        super().train_step(indices, step)

    def evaluate(self):
        if self.lr <= 0:  # AttributeError before any setup
            raise ValueError(f"lr {self.lr} must be > 0")
        return super().evaluate()


trainer = ExplodingTrainer()
tuner = GridSearch(GridSearchSpace({"lr": [0.05, 0.5], "batch_size": [32], "momentum": [0.0]}), steps=20,
                   metric="val_acc")
