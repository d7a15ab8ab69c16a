"""A model with a 100 MB checkpoint in stage trees, for a worker's load and build costs (issue
15, goal 2) as the workers meet them in a run: ``benchmarks/worker_overhead.py`` trains its
trainer stage by stage, and ``stagetree run benchmarks/studies/tree_100mb.py --workers 2``
runs the study (then read each StageFinished's ``seconds - train_seconds`` from the log).

Model: ``torch.nn.Linear(WIDTH, WIDTH)`` without bias (WIDTH = 5,000: 100,000,000 bytes of
weights), plain SGD, a fresh random batch of 64 inputs per step from the step-seeded generator
(no data set), about 0.16 s per step on one CPU thread here.

Space (9 trials, 20 steps each): the learning rate starts at 0.01, 0.02 or 0.03 (three stage
trees, each a fresh start) and is multiplied by 0.1, 0.3 or 0.5 at step 10 (three branches of
each tree, each loaded from the checkpoint at step 10 or continued in memory): p = 180 / 120.
"""

import torch

from stagetree import GridSearch, GridSearchSpace, Trainer
from stagetree.hp import MultiStep

WIDTH = 5000


class Big(Trainer):
    """Linear(WIDTH, WIDTH) without bias, plain SGD: a 100 MB checkpoint; random data per step."""

    hyperparameters = ("lr",)
    batch_size_hp = None

    def build(self, seed: int, device: torch.device) -> None:
        self.model = torch.nn.Linear(WIDTH, WIDTH, bias=False).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def train_size(self) -> int:
        return 1

    def setup(self, values: dict) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = float(values.get("lr", group["lr"]))

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        x = torch.randn(64, WIDTH, device=self.model.weight.device)
        loss = self.model(x).square().mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def evaluate(self) -> dict:
        return {"norm": float(self.model.weight.norm())}


name = "tree-100mb"
seed = 0
trainer = Big()
space = GridSearchSpace({"lr": [MultiStep(start, (10,), gamma) for start in (0.01, 0.02, 0.03)
                                for gamma in (0.1, 0.3, 0.5)]})
tuner = GridSearch(space, steps=20, metric="norm", mode="min")
