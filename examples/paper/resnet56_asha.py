"""ResNet56 / CIFAR-10, asynchronous successive halving: 448 trials, reduction 4, 15 to 120
epochs (Hippo Table 1). Set ``causal = True`` below for the causal-order mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paper import WORKERS, resnet56_space, resnet56_trainer  # noqa: E402

from stagetree import ASHA  # noqa: E402

name = "resnet56-asha"
seed = 0
workers = WORKERS
causal = False
trainer = resnet56_trainer()
tuner = ASHA(resnet56_space(), metric="val_acc", mode="max", min_steps=15, max_steps=120, reduction=4, causal=causal)
