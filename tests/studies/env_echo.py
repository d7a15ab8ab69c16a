"""A one-trial study whose metric is ``$STAGETREE_TEST_ECHO`` as the worker sees it (read when the
worker evaluates; a worker without the variable cannot warm up). tests/test_worker_processes.py."""

import os

import torch

from stagetree import GridSearch, GridSearchSpace, Trainer
from stagetree.hp import Constant


class Echo(Trainer):
    hyperparameters = ("x",)
    batch_size_hp = None

    def build(self, seed: int, device: torch.device) -> None:
        self.model = torch.nn.Linear(1, 1, bias=False).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_size(self) -> int:
        return 1

    def setup(self, values: dict) -> None:
        pass

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        pass

    def evaluate(self) -> dict:
        return {"echo": float(os.environ["STAGETREE_TEST_ECHO"])}


name = "env-echo"
trainer = Echo()
tuner = GridSearch(GridSearchSpace({"x": [Constant(0.0)]}), steps=1, metric="echo", mode="min")
