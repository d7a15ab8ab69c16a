"""1,000 trivial trials for the overhead benchmark (issue 15, goal 1): one step each, no data.

The model is one scalar weight; a step moves it towards the trial's ``target``, so every trial
is its own one-step stage (no two trials share a step) and what is measured is the control
plane and the worker's per-stage cost, not training. ``STAGETREE_TRIVIAL_TRIALS`` changes the
number of trials (default 1,000).
"""

import os

import torch

from stagetree import GridSearch, GridSearchSpace, Trainer
from stagetree.hp import Constant

TRIALS = int(os.environ.get("STAGETREE_TRIVIAL_TRIALS", "1000"))


class Scalar(Trainer):
    """One weight ``w`` (shape ``(1,)``); a step sets ``w += target - w`` scaled by 0.5."""

    hyperparameters = ("target",)
    batch_size_hp = None

    def build(self, seed: int, device: torch.device) -> None:
        self.model = torch.nn.Linear(1, 1, bias=False).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.target = 0.0

    def train_size(self) -> int:
        return 1

    def setup(self, values: dict) -> None:
        if "target" in values:
            self.target = float(values["target"])

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        with torch.no_grad():
            self.model.weight += 0.5 * (self.target - self.model.weight)

    def evaluate(self) -> dict:
        return {"loss": float((self.model.weight - self.target).abs().item())}


name = "trivial"
seed = 0
trainer = Scalar()
space = GridSearchSpace({"target": [Constant(i / TRIALS) for i in range(TRIALS)]})
tuner = GridSearch(space, steps=1, metric="loss", mode="min")
