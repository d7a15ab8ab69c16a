"""A grid whose trainer's evaluate() returns NaN for x = 0 and -inf for x = 1 (which a "min" tuner
would take for the best loss), and 0.5 + x / 10 otherwise. tests/test_worker_processes.py (a
non-finite metric is recorded as null, its trial is done, and it ranks last)."""

import torch

from stagetree import GridSearch, GridSearchSpace, Trainer
from stagetree.hp import Constant


class NonFinite(Trainer):
    hyperparameters = ("x",)
    batch_size_hp = None

    def build(self, seed: int, device: torch.device) -> None:
        self.model = torch.nn.Linear(1, 1, bias=False).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.x = 0.0

    def train_size(self) -> int:
        return 1

    def setup(self, values: dict) -> None:
        if "x" in values:
            self.x = float(values["x"])

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        pass

    def evaluate(self) -> dict:
        loss = {0.0: float("nan"), 1.0: float("-inf")}.get(self.x, 0.5 + self.x / 10)
        return {"val_loss": loss, "x": self.x}


name = "non-finite"
trainer = NonFinite()
tuner = GridSearch(GridSearchSpace({"x": [Constant(0.0), Constant(1.0), Constant(2.0), Constant(3.0)]}), steps=2,
                   metric="val_loss", mode="min")
