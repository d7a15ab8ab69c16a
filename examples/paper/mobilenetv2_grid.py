"""MobileNetV2 / CIFAR-10, grid search: 240 trials to 120 epochs (Hippo Table 1)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paper import WORKERS, mobilenetv2_space, mobilenetv2_trainer  # noqa: E402

from stagetree import GridSearch  # noqa: E402

name = "mobilenetv2-grid"
seed = 0
workers = WORKERS
trainer = mobilenetv2_trainer()
tuner = GridSearch(mobilenetv2_space(), 120, metric="val_acc", mode="max")
