"""Multi-study case S8 (Hippo Figs. 13/14): 8 studies of 144 trials on ResNet20 / CIFAR-10,
sharing one search plan (same trainer and seed), grid search to 100 epochs each, at once."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paper import WORKERS, resnet20_studies, resnet20_trainer  # noqa: E402

name = "resnet20-s8"
workers = WORKERS
trainer = resnet20_trainer()
studies = resnet20_studies(8)
