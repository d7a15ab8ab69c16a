"""A grid whose batch size doubles mid-run, for merged vs trial-based worker-seconds (issue 15,
goal 3): the cost of a step changes along a trial, so the fair bound of the saving is the
cost-weighted merge rate p_w, not p (``benchmarks/merge_savings.py``).

Data: scikit-learn's bundled digits, the split of ``examples/digits.py``. Model: the example's
CNN made ``STAGETREE_RAMP_WIDTH`` channels wide (conv 1->W, conv W->2W, max-pool, dropout,
linear 2W*16->10; default W = 112, about 20 ms per step of 32 examples on one CPU thread; W = 16
is the example's tiny model, about 1.5 ms).

Space (16 trials, 200 steps each, SGD with momentum 0.9): the learning rate is 0.05 for the first
100 steps and then one of 8 values (``MultiStep(0.05, (100,), gamma)``); the batch size is 32
throughout or doubles to 64 at step 100. Every trial shares steps [0, 100), so p = 3,200 / 1,700
= 1.88, and the shared steps are the cheap ones (batch 32), so p_w is lower.
"""

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch  # noqa: E402
from digits import DEFAULT_LR, DEFAULT_MOMENTUM, DROPOUT, DigitsTrainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional  # noqa: E402

from stagetree import GridSearch, GridSearchSpace  # noqa: E402
from stagetree.hp import Constant, MultiStep  # noqa: E402

WIDTH = int(os.environ.get("STAGETREE_RAMP_WIDTH", "112"))
"""Channels of the first convolution (the second has twice as many)."""


class WideCNN(nn.Module):
    """``(batch, 1, 8, 8)`` images -> ``(batch, 10)`` logits, ``width`` channels wide."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1)
        self.dropout = nn.Dropout(DROPOUT)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = functional.relu(self.conv1(x))
        x = functional.max_pool2d(functional.relu(self.conv2(x)), 2)
        return self.fc(self.dropout(torch.flatten(x, 1)))


class WideDigitsTrainer(DigitsTrainer):
    """The example's trainer on :class:`WideCNN` (width in the fingerprint)."""

    def constants(self) -> dict[str, Any]:
        return {**super().constants(), "model": f"conv{WIDTH}-conv{2 * WIDTH}-maxpool-dropout-fc10"}

    def build(self, seed: int, device: torch.device) -> None:
        super().build(seed, device)
        torch.manual_seed(seed)
        self.model = WideCNN(WIDTH).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=DEFAULT_LR, momentum=DEFAULT_MOMENTUM)


name = "batch-ramp"
seed = 0
trainer = WideDigitsTrainer()
space = GridSearchSpace({
    "lr": [MultiStep(0.05, (100,), gamma) for gamma in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.5, 2.0)],
    "batch_size": [Constant(32), MultiStep(32, (100,), 2)],
    "momentum": [Constant(0.9)],
})
tuner = GridSearch(space, steps=200, metric="val_acc", mode="max")
