"""A small real study for end-to-end tests: the digits CNN, 16 sequence configs, SHA."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree import GridSearchSpace, SuccessiveHalving  # noqa: E402
from stagetree.hp import Constant, MultiStep, Warmup  # noqa: E402

name = "tiny"
seed = 7
trainer = DigitsTrainer()
space = GridSearchSpace(
    {
        "lr": [MultiStep(0.1, (20,), 0.1), Constant(0.1), Warmup(0.0, 10, Constant(0.1)), Constant(0.05)],
        "batch_size": [Constant(32), MultiStep(32, (20,), 2)],
        "momentum": [Constant(0.0), Constant(0.9)],
    }
)
tuner = SuccessiveHalving(space, metric="val_acc", mode="max", min_steps=10, max_steps=160, reduction=2)
