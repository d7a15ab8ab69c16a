"""A tiny study (a linear model, 2 trials of 20 steps) whose trainer's ``version`` is
``$STAGETREE_TEST_TRAINER_VERSION`` as the process that loads it sees it (default "1"): a worker
started with another value has another version of the code than the study, whose plan key it
does not give. tests/test_kafka_cluster.py."""

import os

import torch

from stagetree import GridSearch, GridSearchSpace, Trainer
from stagetree.hp import Constant


class Versioned(Trainer):
    name = "versioned"
    version = os.environ.get("STAGETREE_TEST_TRAINER_VERSION", "1")
    hyperparameters = ("lr",)
    batch_size_hp = None

    def build(self, seed: int, device: torch.device) -> None:
        self.model = torch.nn.Linear(4, 1).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.truth = torch.tensor([[1.0], [-2.0], [0.5], [3.0]], device=device)
        self.val_x = torch.randn(64, 4).to(device)

    def train_size(self) -> int:
        return 64

    def setup(self, values: dict) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = values["lr"]

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        x = torch.randn(8, 4).to(self.truth.device)  # torch's RNG, seeded from (seed, step)
        loss = torch.nn.functional.mse_loss(self.model(x), x @ self.truth)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def evaluate(self) -> dict:
        loss = torch.nn.functional.mse_loss(self.model(self.val_x), self.val_x @ self.truth)
        return {"val_loss": float(loss)}


name = "versioned"
seed = 3
trainer = Versioned()
tuner = GridSearch(GridSearchSpace({"lr": [Constant(0.05), Constant(0.1)]}), steps=20, metric="val_loss",
                   mode="min")
