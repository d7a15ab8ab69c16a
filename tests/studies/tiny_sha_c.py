"""Another plan key than tiny_sha.py's (seed 8): a small study that runs side by side with the
others on one deployment and shares no step with them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree.hp import Constant, MultiStep  # noqa: E402
from stagetree.tuners import GridSearchSpace, SuccessiveHalving  # noqa: E402

name = "tiny-c"
seed = 8
trainer = DigitsTrainer()
space = GridSearchSpace(
    {
        "lr": [Constant(0.1), MultiStep(0.1, (20,), 0.1)],
        "batch_size": [Constant(32)],
        "momentum": [Constant(0.0), Constant(0.9)],
    }
)
tuner = SuccessiveHalving(space, metric="val_acc", mode="max", min_steps=10, max_steps=40, reduction=2)
