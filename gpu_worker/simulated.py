"""Simulated trainers for the cluster simulator (``stagetree simulate``): a
:class:`SimulatedTrainer` names the models (:mod:`gpu_worker.simulation_models`, without torch,
re-exported here) that time and score its stages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gpu_worker.simulation_models import (  # noqa: F401  (re-exported: the simulator's names)
    CostModel,
    Curve,
    CurveModel,
    FormulaCurve,
    SimulatedWorker,
    checkpoint_ref,
    models_from_json,
    models_to_json,
)
from gpu_worker.trainer import Trainer


class SimulatedTrainer(Trainer):
    """A trainer that only exists in simulation: its hyper-parameter names, a cost model and a
    curve model. Its fingerprint covers both models, so simulated plans never mix with real ones.

    Args:
        name: the trainer's name (e.g. ``"resnet56-cifar10"``).
        hyperparameters: names a configuration must give (e.g. ``("lr", "batch_size")``).
        cost: seconds per step, per checkpoint and per evaluation.
        curve: the synthetic learning curve.
        constants: extra fixed settings that are part of the plan key (JSON values).

    The torch methods raise: ``stagetree run`` cannot train a simulated trainer; use
    ``stagetree simulate``.
    """

    batch_size_hp = None

    def __init__(self, name: str, hyperparameters: tuple[str, ...], *, cost: CostModel | None = None,
                 curve: Curve | None = None, constants: Mapping[str, Any] | None = None) -> None:
        if not name:
            raise ValueError(f"`name` is {name!r}, but must be a non-empty string")
        if not hyperparameters or not all(isinstance(h, str) and h for h in hyperparameters):
            raise ValueError(f"`hyperparameters` is {hyperparameters!r}, but must be a non-empty tuple of names")
        self.name = name  # type: ignore[misc]
        self.hyperparameters = tuple(hyperparameters)  # type: ignore[misc]
        self.cost = cost or CostModel()
        self.curve = curve or CurveModel()
        self._constants = dict(constants or {})

    def constants(self) -> dict[str, Any]:
        return {"simulated": True, "cost": repr(self.cost), "curve": repr(self.curve), **self._constants}

    def _not_here(self) -> Any:
        raise RuntimeError(f"trainer {self.name!r} is simulated: run it with `stagetree simulate`, not `stagetree run`")

    def build(self, seed: int, device: torch.device) -> None:
        self._not_here()

    def train_size(self) -> int:
        return self._not_here()

    def setup(self, hp: dict[str, float | int]) -> None:
        self._not_here()

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        self._not_here()

    def evaluate(self) -> dict[str, float]:
        return self._not_here()


def models_of(trainer: Trainer) -> tuple[CostModel, Curve]:
    """The cost and curve models to simulate ``trainer`` with: its own for a SimulatedTrainer,
    else the defaults (1 s per step; any real study file can be simulated)."""
    if isinstance(trainer, SimulatedTrainer):
        return trainer.cost, trainer.curve
    return CostModel(), CurveModel()


