"""The one event sequence of executing a dispatched path (DESIGN.md "The event log").

Every executor of a :class:`~events.models.StageDispatched` (the GPU worker, the cluster
simulator's simulated GPUs, the scheduler's instant test simulation) emits the same events in the
same order and batches, produced here by :func:`run_path` over a :class:`PathBackend` that only
moves weights (real training, a cost model, or nothing at all):

1. the path's source is taken (a checkpoint loaded, or a fresh initialisation); if that fails,
   one StageFailed for the first stage ends the path;
2. for each stage, in order: ``[StageStarted]``; then the stage trains ``[from_step, to_step)``,
   evaluates when asked and stores a checkpoint when it trained a step (or when the weights in
   hand were never stored), and its end goes out as ONE batch ``[MetricsReported?,
   CheckpointSaved?, StageFinished]``, which the transport appends atomically: no crash can leave
   metrics recorded without the stage's checkpoint and accounting (a checkpoint is written and
   verified before the batch that names it, invariant 4);
3. a failure ends the path with one ``[StageFailed]`` for the stage: ``kind`` from the
   :class:`StageFault` a backend raised (a corrupt or missing source, a failing store), else
   "error" with the exception (the trainer's own code raised).

``StageFinished.seconds`` is the time the worker was held by the stage (loading the source counts
to the first stage), ``train_seconds`` the part spent training; both are read from the backend's
clock, at the edge (a simulated backend's clock is virtual).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Literal, Protocol

from events import tracing
from events.models import (
    CheckpointSaved,
    Event,
    MetricsReported,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageSpec,
    StageStarted,
)

FaultKind = Literal["error", "checkpoint_corrupt", "checkpoint_missing", "storage"]
Emit = Callable[[list[Event]], None]
"""Where the events go: each call is one batch, appended atomically by the transport."""


class StageFault(Exception):
    """A backend's failure with the StageFailed ``kind`` it stands for (a corrupt or missing
    source checkpoint ``ref``, a store that kept failing); ``error`` is the message recorded."""

    def __init__(self, kind: FaultKind, error: str, ref: str | None = None) -> None:
        super().__init__(error)
        self.kind: FaultKind = kind
        self.error = error
        self.ref = ref


class PathBackend(Protocol):
    """What :func:`run_path` needs from an executor: weights it can position, train, evaluate
    and store, and a clock (seconds; monotonic, or virtual in a simulation).

    Each method may raise :class:`StageFault`; any other exception from :meth:`train`,
    :meth:`evaluate` or :meth:`save` is the trainer's error.
    """

    def begin(self, d: StageDispatched) -> None:
        """Hold the weights ``d`` starts from: its source checkpoint, or a fresh initialisation."""
        ...

    def step(self) -> int:
        """The step the weights in hand are at (steps trained)."""
        ...

    def train(self, spec: StageSpec) -> None:
        """Train the weights in hand over ``[spec.from_step, spec.to_step)`` under ``spec.hp``."""
        ...

    def evaluate(self, spec: StageSpec) -> dict[str, float]:
        """Metrics of the weights in hand (at ``spec.to_step``)."""
        ...

    def save(self, spec: StageSpec) -> tuple[str, int] | None:
        """Store the weights in hand if they are not stored yet: ``(sha256 ref, size in bytes)``
        of the verified object, or None when nothing new needs storing."""
        ...

    def abandon(self) -> None:
        """Forget the weights in hand (after a failure they are not trusted)."""
        ...

    def now(self) -> float:
        """Seconds on the backend's clock."""
        ...


def run_path(d: StageDispatched, backend: PathBackend, emit: Emit, worker_id: str,
             stamp: Callable[[Event], Event] = lambda e: e) -> None:
    """Execute every stage of ``d`` in order on ``backend``, emitting the event batches described
    in the module docstring through ``emit`` (each event passed through ``stamp`` first: producer,
    timestamp, trace context). Never raises for a failing stage. Records spans when tracing."""
    base = {"dispatch_id": d.dispatch_id, "plan_key": d.plan_key}
    first = d.stages[0]

    def failed(spec: StageSpec, kind: FaultKind, error: str, ref: str | None = None) -> None:
        emit([stamp(StageFailed(**base, worker_id=worker_id, node_id=spec.node_id, from_step=spec.from_step,
                                to_step=spec.to_step, kind=kind, error=error, ref=ref))])

    started = backend.now()
    try:
        with tracing.span("checkpoint.load", attributes={"stagetree.ref": d.source.ref if d.source else "fresh"}):
            backend.begin(d)
    except StageFault as fault:
        failed(first, fault.kind, fault.error, fault.ref)
        return
    for spec in d.stages:
        stage = {"node_id": spec.node_id, "from_step": spec.from_step, "to_step": spec.to_step}
        attrs = {f"stagetree.{k}": v for k, v in stage.items()}
        with tracing.span("stage", attributes=attrs):
            emit([stamp(StageStarted(dispatch_id=d.dispatch_id, worker_id=worker_id, **stage))])
            end: list[Event] = []
            try:
                if backend.step() != spec.from_step:
                    raise RuntimeError(f"stage starts at step {spec.from_step}, "
                                       f"but the weights are at {backend.step()}")
                t0 = backend.now()
                with tracing.span("train", attributes=attrs):
                    backend.train(spec)
                train_seconds = backend.now() - t0
                if spec.evaluate:
                    with tracing.span("evaluate", attributes=attrs):
                        metrics = backend.evaluate(spec)
                    end.append(stamp(MetricsReported(**base, node_id=spec.node_id, step=spec.to_step,
                                                     metrics=dict(metrics))))
                with tracing.span("checkpoint.save", attributes=attrs):
                    saved = backend.save(spec)
                if saved is not None:
                    end.append(stamp(CheckpointSaved(**base, node_id=spec.node_id, step=spec.to_step, ref=saved[0],
                                                     size=saved[1])))
            except StageFault as fault:
                backend.abandon()
                failed(spec, fault.kind, fault.error, fault.ref)
                return
            except Exception as exc:  # the trainer's own code failed: report, never crash the worker
                backend.abandon()
                failed(spec, "error", "".join(traceback.format_exception_only(exc)).strip())
                return
            now = backend.now()
            end.append(stamp(StageFinished(**base, worker_id=worker_id, **stage, seconds=now - started,
                                           train_seconds=train_seconds)))
            emit(end)
            started = now
