"""A study file as a user writes it: everything of stagetree comes from ``import stagetree``.

The tuner family is chosen by ``STAGETREE_TEST_TUNER`` (one of :data:`FAMILIES`), so one file
covers every family; the model is a linear classifier on scikit-learn's bundled digits.
"""

import os

import torch
from sklearn.datasets import load_digits

from stagetree import (
    ASHA,
    PBT,
    EarlyStopTuner,
    GridSearch,
    GridSearchSpace,
    Hyperband,
    LogUniform,
    MedianStopping,
    MLtunerTuner,
    RandomSearchSpace,
    Sampled,
    Schedule,
    SuccessiveHalving,
    Trainer,
    hp,
)


class Linear(Trainer):
    """Softmax regression on the 8x8 digits: ``(batch, 64)`` pixels -> 10 classes."""

    hyperparameters = ("lr", "batch_size")

    def build(self, seed: int, device: torch.device) -> None:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.int64)
        self.x, self.y = x[:1400].to(device), y[:1400].to(device)
        self.vx, self.vy = x[1400:].to(device), y[1400:].to(device)
        self.model = torch.nn.Linear(64, 10).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_size(self) -> int:
        return len(self.y)

    def setup(self, values: dict) -> None:
        if "lr" in values:
            for group in self.optimizer.param_groups:
                group["lr"] = float(values["lr"])

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        indices = indices.to(self.x.device)
        loss = torch.nn.functional.cross_entropy(self.model(self.x[indices]), self.y[indices])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def evaluate(self) -> dict:
        logits = self.model(self.vx)
        loss = torch.nn.functional.cross_entropy(logits, self.vy)
        return {"val_acc": (logits.argmax(1) == self.vy).float().mean().item(), "loss": loss.item()}


grid = GridSearchSpace({"lr": [hp.Constant(0.1), hp.MultiStep(0.3, [4], 0.1), hp.Constant(0.01)],
                        "batch_size": [hp.Constant(32)]})
random = RandomSearchSpace({"lr": Sampled(hp.MultiStep, init=LogUniform(0.01, 0.5), milestones=[4], gamma=0.1),
                            "batch_size": 32}, n=4, seed=0)
FAMILIES = {
    "GridSearch": lambda: GridSearch(grid, steps=6, metric="val_acc"),
    "SuccessiveHalving": lambda: SuccessiveHalving(random, "val_acc", min_steps=2, max_steps=8, reduction=2),
    "EarlyStopTuner": lambda: EarlyStopTuner(Schedule.from_milestones((2, 3), (6, 1)), grid, "val_acc"),
    "ASHA": lambda: ASHA(random, "val_acc", min_steps=2, max_steps=8, reduction=2),
    "Hyperband": lambda: Hyperband(random, "val_acc", min_steps=2, max_steps=6, reduction=3),
    "MedianStopping": lambda: MedianStopping(random, "val_acc", max_steps=6, interval=2, min_trials=2),
    "PBT": lambda: PBT(random, "val_acc", population=4, interval=3, max_steps=6,
                       mutations={"lr": [0.01, 0.05, 0.1]}),
    "MLtunerTuner": lambda: MLtunerTuner([{"lr": 0.1, "batch_size": 32}], "val_acc",
                                         tunables={"lr": [0.01, 0.1, 0.3]}, max_steps=6, epoch_steps=2,
                                         trial_steps=2, points=2, patience=2),
}

family = os.environ.get("STAGETREE_TEST_TUNER", "GridSearch")
name = f"public-{family}"
seed = 1
trainer = Linear()
tuner = FAMILIES[family]()
