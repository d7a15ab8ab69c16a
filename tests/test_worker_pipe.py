"""An embedded worker's pipe to its coordinator (gpu_worker/process.py), on a real OS pipe, and
its warm-up before joining."""

from __future__ import annotations

import multiprocessing
from collections import deque

import pytest
import torch

from events.hp import Constant
from events.models import Event
from gpu_worker.process import PipeControl, warm_up
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer


class Regression(Trainer):
    """A linear model on 64 fixed random examples, SGD with momentum; counts its steps."""

    hyperparameters = ("lr",)
    batch_size_hp = None
    steps_trained = 0

    def build(self, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def train_size(self) -> int:
        return 64

    def setup(self, hp: dict[str, float | int]) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = float(hp.get("lr", group["lr"]))

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        Regression.steps_trained += 1
        loss = torch.nn.functional.mse_loss(self.model(self.x + 0.01 * torch.randn(64, 8)), self.y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def evaluate(self) -> dict[str, float]:
        return {"loss": float(torch.nn.functional.mse_loss(self.model(self.x), self.y))}


class NeedsSetup(Regression):
    """Trains only once ``setup`` gave it a learning rate (its own attribute)."""

    def setup(self, hp: dict[str, float | int]) -> None:
        self.lr = float(hp["lr"])

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        with torch.no_grad():
            self.model.weight -= self.lr * self.model.weight


def _trained(trainer: Trainer) -> bytes:
    session = TrainingSession(trainer, 3, "cpu")
    session.start_fresh()
    session.train({"lr": Constant(0.05)}, 5)
    return session.save()


def test_the_warm_up_trains_one_throwaway_step_that_changes_no_stage_after_it() -> None:
    """torch's first-call costs of a backward pass and an optimizer step belong to start-up, not
    to the first stage: the warm-up trains one step, and a stage after it trains what a worker
    that never warmed up trains, bit for bit (noise drawn in the step, momentum, the lr)."""
    cold = _trained(Regression())
    trainer = Regression()
    before = Regression.steps_trained
    warm_up(trainer, torch.device("cpu"))
    assert Regression.steps_trained == before + 1
    assert _trained(trainer) == cold


def test_the_warm_up_leaves_a_trainer_that_needs_its_hyper_parameters_to_its_first_stage() -> None:
    """The warm-up step sets no hyper-parameters; a trainer that cannot train without them still
    joins, and its first stage trains normally (the warm-up's error is not the worker's)."""
    trainer = NeedsSetup()
    warm_up(trainer, torch.device("cpu"))  # NeedsSetup.train_step raised AttributeError inside
    assert isinstance(_trained(trainer), bytes)


class EvaluatesOnlyAfterSetup(NeedsSetup):
    """Evaluates only once ``setup`` gave it a learning rate, as its steps."""

    def evaluate(self) -> dict[str, float]:
        return {"loss": self.lr * float(self.model.weight.sum())}


def test_the_warm_up_leaves_an_evaluation_that_raises_to_the_stages() -> None:
    """The warm-up evaluates before any ``setup``: a trainer whose evaluation reads what
    ``setup`` set still joins (the stage that meets the error reports it as the trainer's, a
    failed trial), and trains and evaluates normally with its hyper-parameters."""
    trainer = EvaluatesOnlyAfterSetup()
    warm_up(trainer, torch.device("cpu"))
    session = TrainingSession(trainer, 3, "cpu")
    session.start_fresh()
    session.train({"lr": Constant(0.05)}, 5)
    assert set(session.evaluate()) == {"loss"}


@pytest.mark.parametrize("unread", [False, True], ids=["closed", "reset"])
def test_a_worker_leaves_its_path_when_the_coordinator_closes_the_pipe(unread: bool) -> None:
    """A coordinator killed with kill -9 closes the pipe: the worker must not train the rest of
    its path for nobody (an orphan keeps a GPU busy); it leaves at the next step boundary. When
    the coordinator had not read what the worker sent last, the pipe is reset (ECONNRESET), not
    closed: the same, not a traceback."""
    coordinator, worker = multiprocessing.Pipe()
    emitted: list[list[Event]] = []
    control = PipeControl(worker, deque(), "w0", emitted.append)
    assert control.poll() == []  # nothing yet: the path trains on
    if unread:
        worker.send_bytes(b"an end batch the coordinator never read")
    coordinator.close()
    assert control.waiting()  # the end of the pipe is news: the step boundary looks at it
    with pytest.raises(SystemExit, match="coordinator closed the pipe"):
        control.poll()
    assert emitted == []
