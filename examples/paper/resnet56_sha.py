"""ResNet56 / CIFAR-10, successive halving: 448 trials, reduction 4, 15 to 120 epochs (Hippo
Table 1). ``stagetree simulate examples/paper/resnet56_sha.py --workers 40``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paper import WORKERS, resnet56_space, resnet56_trainer  # noqa: E402

from stagetree import SuccessiveHalving  # noqa: E402

name = "resnet56-sha"
seed = 0
workers = WORKERS
trainer = resnet56_trainer()
tuner = SuccessiveHalving(resnet56_space(), metric="val_acc", mode="max", min_steps=15, max_steps=120, reduction=4)
