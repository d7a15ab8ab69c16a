"""The models of simulated GPUs, without torch: the cost of a step and the learning curve a
simulated trial follows, and :class:`SimulatedWorker`, a :class:`~events.execution.PathBackend`
that executes a dispatch on a virtual clock with them (``stagetree simulate``) or, through
:mod:`gpu_worker.simulated_worker`, in real time on Kafka.

A simulated worker executes a StageDispatched exactly as a GPU worker would (same events, same
order: StageStarted, MetricsReported, CheckpointSaved, StageFinished per stage), but instead of
training it *computes* how long each stage takes with a :class:`CostModel` and what it reports
with a :class:`CurveModel`. Both are pure functions of the hyper-parameter values step by step,
so a simulated stage trained in one piece or in several, on any worker, gives the same metrics:
the same split invariance real training has (DESIGN.md "Determinism recipe").

Checkpoints are the curve model's state (a few floats), kept under a sha256 ``ref`` derived from
that state, so equal prefixes give equal refs.

This module imports no torch (nor anything that does): simulated worker processes stay light.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from events.execution import Saved, run_path
from events.hp import HPFunction
from events.models import Event, StageDispatched, StageSpec


@dataclass(frozen=True)
class CostModel:
    """Seconds a simulated GPU spends per step, per checkpoint load/save and per evaluation.

    ``seconds_per_step = base_seconds * prod((value / ref) ** exponent)`` over ``scale``, which
    maps a hyper-parameter name to ``(ref, exponent)``; e.g. ``{"batch_size": (128, -0.3)}`` makes
    an epoch at batch size 256 take 0.81x as long as at 128 (larger batches use the GPU better),
    ``{"seq_len": (384, 1.3)}`` makes longer BERT sequences cost more. A name missing from a
    configuration counts at its ``ref``.

    Units: seconds; a step is whatever the trainer counts (an epoch in the paper studies);
    ``checkpoint_bytes`` in bytes.
    """

    base_seconds: float = 1.0
    scale: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    eval_seconds: float = 0.0
    checkpoint_bytes: int = 64
    """Bytes of one checkpoint (model and optimizer state): what a checkpoint budget counts."""

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_bytes, bool) or not isinstance(self.checkpoint_bytes, int) \
                or self.checkpoint_bytes < 1:
            raise ValueError(f"`CostModel.checkpoint_bytes` is {self.checkpoint_bytes!r}, but must be an int >= 1")
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

    def train_seconds(self, hp: Mapping[str, HPFunction], from_step: int, to_step: int) -> float:
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

    def advance(self, loss: float, hp: Mapping[str, HPFunction], from_step: int, to_step: int) -> float:
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

    def metrics(self, loss: float, hp: Mapping[str, HPFunction], step: int, seed: int) -> dict[str, float]:
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

    def advance(self, loss: float, hp: Mapping[str, HPFunction], from_step: int, to_step: int) -> float:
        return loss + (to_step - from_step)

    def metrics(self, loss: float, hp: Mapping[str, HPFunction], step: int, seed: int) -> dict[str, float]:
        return self.formula({n: f.value(max(step - 1, 0)) for n, f in hp.items()}, step)


Curve = CurveModel | FormulaCurve


def models_to_json(cost: CostModel, curve: CurveModel) -> dict[str, Any]:
    """``cost`` and ``curve`` as JSON data (for a simulated worker process's command line)."""
    curve_json = dataclasses.asdict(curve)
    curve_json["bonus"] = {name: [[value, bonus] for value, bonus in table.items()]
                           for name, table in curve.bonus.items()}
    cost_json = dataclasses.asdict(cost)
    cost_json["scale"] = {name: list(pair) for name, pair in cost.scale.items()}
    return {"cost": cost_json, "curve": curve_json}


def models_from_json(data: Mapping[str, Any]) -> tuple[CostModel, CurveModel]:
    """The models :func:`models_to_json` wrote.

    Raises:
        ValueError, TypeError, KeyError: the data is not such a document (the field is named).
    """
    cost = dict(data["cost"])
    cost["scale"] = {name: (float(ref), float(exp)) for name, (ref, exp) in cost["scale"].items()}
    curve = dict(data["curve"])
    curve["bonus"] = {name: {float(v): float(b) for v, b in pairs} for name, pairs in curve["bonus"].items()}
    return CostModel(**cost), CurveModel(**curve)


def checkpoint_ref(plan_key: str, node_id: str, loss: float, step: int) -> str:
    """The sha256 standing in for a simulated checkpoint: plan, node, model state and step."""
    return hashlib.sha256(f"{plan_key}\0{node_id}\0{loss.hex()}\0{step}".encode()).hexdigest()


class _ScheduleControl:
    """Control events arriving at given virtual times (seconds after the dispatch)."""

    def __init__(self, controls: Sequence[tuple[float, Event]], clock: Callable[[], float]) -> None:
        self.pending = sorted(controls, key=lambda c: c[0])
        self.clock = clock

    def waiting(self) -> bool:
        return bool(self.pending) and self.pending[0][0] <= self.clock()

    def poll(self) -> list[Event]:
        now = self.clock()
        arrived = [event for at, event in self.pending if at <= now]
        self.pending = [(at, event) for at, event in self.pending if at > now]
        return arrived


@dataclass
class SimulatedWorker:
    """Turns a dispatch into timed events, keeping simulated checkpoints in ``checkpoints``
    (ref -> loss). Shared by all simulated workers of a cluster (the central checkpoint store).

    It is a :class:`~events.execution.PathBackend` on a virtual clock, so a simulated GPU emits
    exactly the events, in exactly the batches, of a real one (:func:`events.execution.run_path`).
    """

    cost: CostModel
    curve: Curve
    checkpoints: dict[str, float] = field(default_factory=dict)
    _clock: float = 0.0
    _loss: float = 0.0
    _step: int = 0
    _stored: bool = False
    _node: str = ""
    _dispatch: StageDispatched | None = None

    def execute(self, d: StageDispatched, controls: Sequence[tuple[float, Event]] = ()
                ) -> list[tuple[float, list[Event]]]:
        """The events of running ``d``, as ``(seconds after the dispatch, events)`` batches:
        the first StageStarted at 0, then at each stage end its MetricsReported (when it
        evaluates), CheckpointSaved and StageFinished, with the next stage's StageStarted.

        ``controls``: decisions about the path (PathPreempted, CheckpointRequested) and the
        seconds after the dispatch they reach the worker; it acts on each at its first step
        boundary from then on, as a GPU worker does.

        Raises:
            KeyError: the source checkpoint is unknown (never produced by this simulation).
        """
        self._clock = 0.0
        out: list[tuple[float, list[Event]]] = []

        def emit(events: list[Event]) -> None:
            if out and out[-1][0] == self._clock:  # a StageStarted goes out with the previous end
                out[-1][1].extend(events)
            else:
                out.append((self._clock, list(events)))

        run_path(d, self, emit, d.worker_id, control=_ScheduleControl(controls, lambda: self._clock))
        return out

    # ------------------------------------------------------------------ PathBackend, virtual

    def begin(self, d: StageDispatched) -> None:
        self._dispatch, self._node = d, d.stages[0].node_id
        if d.source is None:
            self._loss, self._step, self._stored = self.curve.initial(), 0, False
        else:
            self._loss, self._step, self._stored = self.checkpoints[d.source.ref], d.source.step, True
            self._spend(self.cost.load_seconds)

    def step(self) -> int:
        return self._step

    def train(self, spec: StageSpec, until: int, interrupt: Callable[[], bool]) -> None:
        self._node = spec.node_id
        while self._step < until:
            if interrupt():
                return
            self._spend(self.cost.train_seconds(spec.hp, self._step, self._step + 1))
            self._loss = self.curve.advance(self._loss, spec.hp, self._step, self._step + 1)
            self._step += 1
            self._stored = False

    def evaluate(self, spec: StageSpec, step: int) -> dict[str, float]:
        assert self._dispatch is not None
        self._spend(self.cost.eval_seconds)
        return self.curve.metrics(self._loss, spec.hp, step, self._dispatch.seed)

    def save(self, waited: bool = False) -> Saved | None:
        assert self._dispatch is not None
        if self._stored:
            return None
        self._spend(self.cost.save_seconds)
        ref = checkpoint_ref(self._dispatch.plan_key, self._node, self._loss, self._step)
        self.checkpoints[ref] = self._loss
        self._stored = True
        return Saved(ref, self.cost.checkpoint_bytes)

    def abandon(self) -> None:
        self._stored = False

    def now(self) -> float:
        return self._clock

    def _spend(self, seconds: float) -> None:
        """What the simulated GPU spends ``seconds`` on: the virtual clock moves on."""
        self._clock += seconds
