"""A small grid whose learning rates decay at different steps, so the stage tree has paths of
several stages (a shared prefix, then each decay's own stages): what a draining worker cuts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree.hp import Constant, MultiStep  # noqa: E402
from stagetree.tuners import GridSearch, GridSearchSpace  # noqa: E402

name = "tiny-grid"
seed = 7
trainer = DigitsTrainer()
space = GridSearchSpace(
    {
        "lr": [MultiStep(0.1, (30,), 0.1), MultiStep(0.1, (30, 60), 0.1), MultiStep(0.1, (45,), 0.1)],
        "batch_size": [Constant(32)],
        "momentum": [Constant(0.9)],
    }
)
tuner = GridSearch(space, steps=90, metric="val_acc", mode="max")
