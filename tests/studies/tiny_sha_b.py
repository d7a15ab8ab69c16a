"""A later study on tiny_sha.py's search plan: same trainer and seed, another name, and a space
that overlaps tiny_sha's (4 of its configurations plus 2 new ones, max_steps 40 <= 160), so run
after it in the same --out directory it is answered from the steps "tiny" trained (Hippo §7)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree import GridSearchSpace, SuccessiveHalving  # noqa: E402
from stagetree.hp import Constant, MultiStep  # noqa: E402

name = "tiny-b"
seed = 7
trainer = DigitsTrainer()
space = GridSearchSpace(
    {
        "lr": [Constant(0.1), Constant(0.05), Constant(0.02)],  # 0.02 is new
        "batch_size": [Constant(32), MultiStep(32, (20,), 2)],
        "momentum": [Constant(0.9)],
    }
)
tuner = SuccessiveHalving(space, metric="val_acc", mode="max", min_steps=10, max_steps=40, reduction=2)
