"""Simulated workers for the cluster simulator (``stagetree simulate``).

A simulated worker executes a StageDispatched exactly as a GPU worker would (same events, same
order: StageStarted, MetricsReported, CheckpointSaved, StageFinished per stage), but instead of
training it *computes* how long each stage takes with a :class:`CostModel` and what it reports
with a :class:`CurveModel`. Both are pure functions of the hyper-parameter values step by step,
so a simulated stage trained in one piece or in several, on any worker, gives the same metrics:
the same split invariance real training has (DESIGN.md "Determinism recipe").

Checkpoints are the curve model's state (a few floats), kept by the simulator in memory under
a sha256 ``ref`` derived from that state, so equal prefixes give equal refs.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from events.hp import HPConfig
from events.models import (
    CheckpointSaved,
    Event,
    MetricsReported,
    StageDispatched,
    StageFinished,
    StageStarted,
)
from gpu_worker.trainer import Trainer


@dataclass(frozen=True)
class CostModel:
    """Seconds a simulated GPU spends per step, per checkpoint load/save and per evaluation.

    ``seconds_per_step = base_seconds * prod((value / ref) ** exponent)`` over ``scale``, which
    maps a hyper-parameter name to ``(ref, exponent)``; e.g. ``{"batch_size": (128, -0.3)}`` makes
    an epoch at batch size 256 take 0.81x as long as at 128 (larger batches use the GPU better),
    ``{"seq_len": (384, 1.3)}`` makes longer BERT sequences cost more. A name missing from a
    configuration counts at its ``ref``.

    Units: seconds; a step is whatever the trainer counts (an epoch in the paper studies).
    """

    base_seconds: float = 1.0
    scale: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    eval_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_seconds", "load_seconds", "save_seconds", "eval_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"`CostModel.{name}` is {value!r}, but must be a finite number >= 0")
        for name, pair in self.scale.items():
            if len(pair) != 2 or not pair[0] > 0:
                raise ValueError(f"`CostModel.scale[{name!r}]` is {pair!r}, but must be (ref > 0, exponent)")

    def step_seconds(self, values: Mapping[str, float]) -> float:
        """Seconds for one step with hyper-parameter ``values`` at that step."""
        seconds = float(self.base_seconds)
        for name, (ref, exponent) in self.scale.items():
            value = values.get(name, ref)
            seconds *= (max(value, 1e-12) / ref) ** exponent
        return seconds

    def train_seconds(self, hp: HPConfig, from_step: int, to_step: int) -> float:
        """Seconds to train steps ``[from_step, to_step)`` of configuration ``hp``."""
        return sum(self.step_seconds({n: f.value(s) for n, f in hp.items()}) for s in range(from_step, to_step))


@dataclass(frozen=True)
class CurveModel:
    """A synthetic learning curve: documented, deterministic, and path dependent.

    The model keeps one number per trial, the loss ``L`` (``initial_loss`` at step 0), and
    updates it every step from the hyper-parameter values of that step:

    * effective learning rate ``e = lr / (1 - momentum) * (ref_batch / batch_size)`` (SGD's
      noise scale; names missing from the configuration take ``momentum = 0.9`` and
      ``batch_size = ref_batch``), relative to the best one at momentum 0.9 and the reference
      batch: ``u = e / (best_lr / 0.1)``;
    * if ``u > diverge_at`` the step diverges: ``L <- L * 1.5`` (a loss above 1e6 is reported as
      NaN: the trial has diverged);
    * otherwise ``L <- L - rate * min(u, 1) ** rate_exponent * (L - floor(u))`` with a floor
      ``floor(u) = min_loss + floor_slope * u``: a large learning rate learns fast but stalls
      high, and a decay (MultiStep, Cosine) lowers the floor, as in Hippo Fig. 2.

    Reported metrics at step ``s``: ``loss = L``; ``val_acc = chance + (max_acc - chance) *
    exp(-acc_scale * (L - min_loss)) + bonus + jitter``, where ``bonus`` sums
    ``bonus[name][value at s - 1]`` (e.g. an optimizer or weight-decay effect) and ``jitter`` is
    a deterministic pseudo-noise of amplitude ``noise`` drawn from a hash of ``(seed, L, s)``.
    Everything is a pure function of the configuration's prefix, so merged and per-trial runs
    report identical numbers. Units: steps of the trainer; accuracy in [0, 1].
    """

    best_lr: float = 0.1
    diverge_at: float = 8.0
    rate: float = 0.08
    initial_loss: float = 2.3
    min_loss: float = 0.05
    floor_slope: float = 0.25
    chance: float = 0.1
    max_acc: float = 0.95
    acc_scale: float = 0.5
    rate_exponent: float = 0.25
    noise: float = 0.002
    ref_batch: float = 128.0
    lr_hp: str = "lr"
    momentum_hp: str = "momentum"
    batch_size_hp: str = "batch_size"
    bonus: Mapping[str, Mapping[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("best_lr", "rate", "initial_loss", "ref_batch", "diverge_at"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`CurveModel.{name}` is {value!r}, but must be a number > 0")

    def initial(self) -> float:
        """The loss of a freshly initialised model."""
        return float(self.initial_loss)

    def advance(self, loss: float, hp: HPConfig, from_step: int, to_step: int) -> float:
        """The loss after training steps ``[from_step, to_step)`` from ``loss``."""
        for s in range(from_step, to_step):
            if not math.isfinite(loss) or loss > 1e6:
                return math.inf
            lr = hp[self.lr_hp].value(s) if self.lr_hp in hp else self.best_lr
            momentum = hp[self.momentum_hp].value(s) if self.momentum_hp in hp else 0.9
            batch = hp[self.batch_size_hp].value(s) if self.batch_size_hp in hp else self.ref_batch
            u = lr / max(1.0 - momentum, 1e-3) * (self.ref_batch / max(batch, 1e-12)) / (self.best_lr / 0.1)
            if u > self.diverge_at:
                loss *= 1.5
                continue
            floor = self.min_loss + self.floor_slope * u
            loss -= self.rate * min(u, 1.0) ** self.rate_exponent * (loss - floor)
        return loss

    def metrics(self, loss: float, hp: HPConfig, step: int, seed: int) -> dict[str, float]:
        """The metrics reported at ``step`` for a model whose loss is ``loss``."""
        if not math.isfinite(loss) or loss > 1e6:
            return {"loss": math.nan, "val_acc": self.chance}
        acc = self.chance + (self.max_acc - self.chance) * math.exp(-self.acc_scale * max(loss - self.min_loss, 0.0))
        at = max(step - 1, 0)
        for name, table in self.bonus.items():
            if name in hp:
                acc += table.get(float(hp[name].value(at)), 0.0)
        digest = hashlib.sha256(struct.pack("<qdq", seed, loss, step)).digest()
        jitter = (int.from_bytes(digest[:8], "little") / 2**64 * 2.0 - 1.0) * self.noise
        return {"loss": loss, "val_acc": min(max(acc + jitter, 0.0), 1.0)}


@dataclass(frozen=True)
class FormulaCurve:
    """Metrics given by a formula of the hyper-parameter values at the last trained step and
    the step: ``formula({name: value at step - 1}, step) -> metrics``. For worked examples and
    tests whose expectations are computed by hand. The model state it carries is the number of
    steps trained (so checkpoints of different steps differ)."""

    formula: Callable[[dict[str, float], int], dict[str, float]]

    def initial(self) -> float:
        return 0.0

    def advance(self, loss: float, hp: HPConfig, from_step: int, to_step: int) -> float:
        return loss + (to_step - from_step)

    def metrics(self, loss: float, hp: HPConfig, step: int, seed: int) -> dict[str, float]:
        return self.formula({n: f.value(max(step - 1, 0)) for n, f in hp.items()}, step)


Curve = CurveModel | FormulaCurve


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


def checkpoint_ref(plan_key: str, node_id: str, loss: float, step: int) -> str:
    """The sha256 standing in for a simulated checkpoint: plan, node, model state and step."""
    return hashlib.sha256(f"{plan_key}\0{node_id}\0{loss.hex()}\0{step}".encode()).hexdigest()


@dataclass
class SimulatedWorker:
    """Turns a dispatch into timed events, keeping simulated checkpoints in ``checkpoints``
    (ref -> loss). Shared by all simulated workers of a cluster (the central checkpoint store).
    """

    cost: CostModel
    curve: Curve
    checkpoints: dict[str, float] = field(default_factory=dict)

    def execute(self, d: StageDispatched) -> list[tuple[float, list[Event]]]:
        """The events of running ``d``, as ``(seconds after the dispatch, events)`` batches:
        the first StageStarted at 0, then at each stage end its MetricsReported (when it
        evaluates), CheckpointSaved and StageFinished, with the next stage's StageStarted.

        Raises:
            KeyError: the source checkpoint is unknown (never produced by this simulation).
        """
        base = {"dispatch_id": d.dispatch_id, "plan_key": d.plan_key}
        if d.source is None:
            loss, elapsed = self.curve.initial(), 0.0
        else:
            loss, elapsed = self.checkpoints[d.source.ref], self.cost.load_seconds
        out: list[tuple[float, list[Event]]] = []
        started = 0.0
        pending: list[Event] = []
        for spec in d.stages:
            stage = {"node_id": spec.node_id, "from_step": spec.from_step, "to_step": spec.to_step}
            pending.append(StageStarted(dispatch_id=d.dispatch_id, worker_id=d.worker_id, plan_key=d.plan_key, **stage))
            out.append((started, pending))
            pending = []
            train = self.cost.train_seconds(spec.hp, spec.from_step, spec.to_step)
            loss = self.curve.advance(loss, spec.hp, spec.from_step, spec.to_step)
            elapsed += train
            batch: list[Event] = []
            if spec.evaluate:
                elapsed += self.cost.eval_seconds
                batch.append(MetricsReported(**base, node_id=spec.node_id, step=spec.to_step,
                                             metrics=self.curve.metrics(loss, spec.hp, spec.to_step, d.seed)))
            if spec.to_step > spec.from_step or d.source is None:
                elapsed += self.cost.save_seconds
                ref = checkpoint_ref(d.plan_key, spec.node_id, loss, spec.to_step)
                self.checkpoints[ref] = loss
                batch.append(CheckpointSaved(**base, node_id=spec.node_id, step=spec.to_step, ref=ref, size=64))
            batch.append(StageFinished(**base, worker_id=d.worker_id, **stage, seconds=elapsed - started,
                                       train_seconds=train))
            started = elapsed
            out.append((elapsed, batch))
        # Each StageStarted goes out with the previous stage's end, as a real worker emits them.
        merged: list[tuple[float, list[Event]]] = []
        for at, events in out:
            if merged and merged[-1][0] == at:
                merged[-1][1].extend(events)
            else:
                merged.append((at, list(events)))
        return merged
