"""A softmax regression on the digits data whose MLtunerTuner answers with an evaluation before
its main line's last step (its val_acc falls after the step it picked), and the same trainer in
a grid when ``$STAGETREE_TEST_TUNER`` is ``grid``. tests/test_mltuner.py (the summary's
``best_step``)."""

import os

import torch
from sklearn.datasets import load_digits

from stagetree import GridSearch, GridSearchSpace, MLtunerTuner, Trainer
from stagetree.hp import Constant


class Softmax(Trainer):
    hyperparameters = ("lr", "batch_size")

    def build(self, seed: int, device: torch.device) -> None:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.int64)
        self.x, self.y = x[:1400].to(device), y[:1400].to(device)
        self.val_x, self.val_y = x[1400:].to(device), y[1400:].to(device)
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
        with torch.no_grad():
            logits = self.model(self.val_x)
            loss = torch.nn.functional.cross_entropy(logits, self.val_y)
        return {"val_acc": (logits.argmax(1) == self.val_y).float().mean().item(), "val_loss": loss.item()}


name = "mltuner-answer"
seed = 5
trainer = Softmax()
if os.environ.get("STAGETREE_TEST_TUNER") == "grid":
    name = "grid-answer"
    tuner = GridSearch(GridSearchSpace({"lr": [Constant(0.1), Constant(0.5)], "batch_size": [Constant(16)]}),
                       steps=20, metric="val_acc", mode="max")
else:
    tuner = MLtunerTuner([{"lr": 0.1, "batch_size": 16}], "val_acc", "max", tunables={"lr": [0.01, 0.1, 0.5]},
                         max_steps=40, epoch_steps=5, trial_steps=5, points=2, patience=2,
                         progress_metric="val_loss")
