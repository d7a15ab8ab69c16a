"""Example study: a small CNN on scikit-learn's bundled handwritten digits.

Data: ``sklearn.datasets.load_digits`` (1797 grayscale 8x8 images of the
digits 0-9, shipped with scikit-learn, no download), pixel values scaled from
[0, 16] to [0, 1]. The seed fixes an 80/20 train/validation split (1438 / 359
examples). Run it with ``stagetree run examples/digits.py``.

Tuned hyper-parameters: ``lr`` (SGD learning rate), ``batch_size`` (examples
per step) and ``momentum`` (SGD momentum). Metrics: ``val_acc`` (fraction of
validation images classified correctly, in [0, 1]) and ``val_loss`` (mean
cross-entropy in nats).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional

from stagetree import GridSearchSpace, SuccessiveHalving, Trainer
from stagetree.hp import Constant, Cosine, CyclicLR, Exponential, MultiStep, Warmup

VALIDATION_FRACTION = 0.2
DROPOUT = 0.25
DEFAULT_LR = 0.05
DEFAULT_MOMENTUM = 0.0


@lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All digits: images float32 ``(1797, 1, 8, 8)`` in [0, 1], labels int64 ``(1797,)``."""
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    return images, labels


class DigitsCNN(nn.Module):
    """``(batch, 1, 8, 8)`` images -> ``(batch, 10)`` logits.

    conv 1->16 3x3 (padding 1), ReLU, conv 16->32 3x3 (padding 1), ReLU,
    2x2 max-pool to ``(batch, 32, 4, 4)``, dropout, linear 512->10.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.dropout = nn.Dropout(DROPOUT)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = functional.relu(self.conv1(x))
        x = functional.max_pool2d(functional.relu(self.conv2(x)), 2)
        return self.fc(self.dropout(torch.flatten(x, 1)))


class DigitsTrainer(Trainer):
    """SGD on ``DigitsCNN``. A trial's configuration gives ``lr``, ``batch_size`` and ``momentum``
    (a study refuses one that lacks any); ``build`` starts the optimizer at lr 0.05 and momentum
    0.0, which ``setup`` then replaces with the trial's values."""

    hyperparameters = ("lr", "batch_size", "momentum")

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor

    def constants(self) -> dict[str, Any]:
        return {
            "dataset": "sklearn.datasets.load_digits",
            "validation_fraction": VALIDATION_FRACTION,
            "model": "conv16-conv32-maxpool-dropout-fc10",
            "dropout": DROPOUT,
            "optimizer": "SGD",
            "default_lr": DEFAULT_LR,
            "default_momentum": DEFAULT_MOMENTUM,
        }

    def build(self, seed: int, device: torch.device) -> None:
        images, labels = _digits()
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(labels), generator=generator)
        n_val = round(VALIDATION_FRACTION * len(labels))
        val, train = order[:n_val], order[n_val:]
        self.train_images, self.train_labels = images[train].to(device), labels[train].to(device)
        self.val_images, self.val_labels = images[val].to(device), labels[val].to(device)
        self.model = DigitsCNN().to(device)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=DEFAULT_LR, momentum=DEFAULT_MOMENTUM
        )

    def train_size(self) -> int:
        return len(self.train_labels)

    def setup(self, hp: dict[str, float | int]) -> None:
        for group in self.optimizer.param_groups:
            if "lr" in hp:
                group["lr"] = float(hp["lr"])
            if "momentum" in hp:
                group["momentum"] = float(hp["momentum"])

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        indices = indices.to(self.train_images.device)
        self.model.train()
        loss = functional.cross_entropy(
            self.model(self.train_images[indices]), self.train_labels[indices]
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        logits = self.model(self.val_images)
        self.model.train()
        loss = functional.cross_entropy(logits, self.val_labels)
        accuracy = (logits.argmax(dim=1) == self.val_labels).float().mean()
        return {"val_acc": accuracy.item(), "val_loss": loss.item()}


# ----------------------------------------------------------------------------- the study

name = "digits"
seed = 0
trainer = DigitsTrainer()

space = GridSearchSpace(
    {
        # learning-rate sequences (8): step decays, warm-ups, cosine restarts, cyclic
        "lr": [
            MultiStep(0.1, (100, 200), 0.1),
            MultiStep(0.1, (200,), 0.1),
            MultiStep(0.05, (150, 300), 0.2),
            Constant(0.05),
            Warmup(0.0, 25, Exponential(0.1, 0.995)),
            Warmup(0.0, 25, MultiStep(0.1, (175,), 0.1)),
            Cosine(0.1, 0.001, 100, gamma=2.0),
            CyclicLR(0.01, 0.1, 50, 50),
        ],
        # batch-size sequences (2): constant, or doubled at step 100
        "batch_size": [Constant(32), MultiStep(32, (100,), 2)],
        # momentum (4): constants, and 0.5 raised to 0.9 at step 100
        "momentum": [Constant(0.0), Constant(0.5), Constant(0.9), MultiStep(0.5, (100,), 1.8)],
    }
)  # 8 x 2 x 4 = 64 trials

tuner = SuccessiveHalving(space, metric="val_acc", mode="max", min_steps=30, max_steps=480, reduction=4)
