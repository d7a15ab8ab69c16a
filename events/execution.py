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

Decisions about a running path reach it through a :class:`Control` and are acted on at step
boundaries (``scheduler.inflight``):

* CheckpointRequested (save at step ``s`` of a stage, evaluating when asked): on reaching ``s``
  inside the stage the weights are stored and ``[MetricsReported?, CheckpointSaved]`` goes out;
  a step already passed is ignored;
* PathPreempted: training goes on to its ``until`` point (if not passed), then the weights are
  stored (if not stored yet) and ``[CheckpointSaved?, StageStopped]`` ends the path.

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
    CheckpointRequested,
    CheckpointSaved,
    Event,
    MetricsReported,
    PathPreempted,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageSpec,
    StageStarted,
    StageStopped,
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

    def train(self, spec: StageSpec, until: int, interrupt: Callable[[], bool]) -> None:
        """Train the weights in hand from :meth:`step` up to ``until`` (``<= spec.to_step``) under
        ``spec.hp``, stopping early at a step boundary where ``interrupt()`` is true."""
        ...

    def evaluate(self, spec: StageSpec, step: int) -> dict[str, float]:
        """Metrics of the weights in hand (at ``step`` of ``spec``'s node)."""
        ...

    def save(self) -> tuple[str, int] | None:
        """Store the weights in hand if they are not stored yet: ``(sha256 ref, size in bytes)``
        of the verified object, or None when they are (an evaluation-only stage, say)."""
        ...

    def abandon(self) -> None:
        """Forget the weights in hand (after a failure they are not trusted)."""
        ...

    def now(self) -> float:
        """Seconds on the backend's clock."""
        ...


class Control(Protocol):
    """Decisions about the running path that arrive while it runs (PathPreempted,
    CheckpointRequested for its dispatch)."""

    def poll(self) -> list[Event]:
        """The control events that arrived since the last poll."""
        ...

    def waiting(self) -> bool:
        """Whether a control event has arrived that :meth:`poll` would return (cheap: asked
        before every step)."""
        ...


class NoControl:
    """A path nobody steers."""

    def poll(self) -> list[Event]:
        return []

    def waiting(self) -> bool:
        return False


class _Steering:
    """What the control events said so far: steps to save at, and where to stop."""

    def __init__(self, d: StageDispatched, control: Control) -> None:
        self.d, self.control = d, control
        self.saves: dict[tuple[str, int], bool] = {}
        self.until: tuple[int, int] | None = None  # (stage, step); (-1, -1): stop at once

    def update(self) -> None:
        for event in self.control.poll():
            if getattr(event, "dispatch_id", None) != self.d.dispatch_id:
                continue
            if isinstance(event, CheckpointRequested):
                key = (event.node_id, event.step)
                self.saves[key] = self.saves.get(key, False) or event.evaluate
            elif isinstance(event, PathPreempted) and self.until is None:
                self.until = (event.until_stage, event.until_step) \
                    if event.until_stage is not None and event.until_step is not None else (-1, -1)

    def stop_in(self, i: int, spec: StageSpec) -> int | None:
        """The step of stage ``i`` at which the path stops (None: it runs to the stage's end)."""
        if self.until is None or (self.until[0] > i):
            return None
        if self.until[0] == i and self.until[1] >= spec.to_step:
            return None
        return spec.from_step if self.until[0] < i else self.until[1]

    def next_save(self, spec: StageSpec, after: int) -> int | None:
        steps = [s for (n, s) in self.saves if n == spec.node_id and after < s < spec.to_step]
        return min(steps) if steps else None


def run_path(d: StageDispatched, backend: PathBackend, emit: Emit, worker_id: str,
             stamp: Callable[[Event], Event] = lambda e: e, control: Control | None = None,
             should_stop: Callable[[], bool] | None = None) -> bool:
    """Execute every stage of ``d`` in order on ``backend``, emitting the event batches described
    in the module docstring through ``emit`` (each event passed through ``stamp`` first: producer,
    timestamp, trace context), acting on what ``control`` says at step boundaries. Never raises
    for a failing stage. Records spans when tracing.

    ``should_stop`` is asked before every stage after the first (a worker draining on SIGTERM):
    when it answers True the path ends there, after the last finished stage's checkpoint, with
    no event, and ``run_path`` returns False (the rest is for the worker to hand back); True
    otherwise."""
    base = {"dispatch_id": d.dispatch_id, "plan_key": d.plan_key}
    first = d.stages[0]
    steering = _Steering(d, control if control is not None else NoControl())

    def failed(spec: StageSpec, kind: FaultKind, error: str, ref: str | None = None) -> None:
        emit([stamp(StageFailed(**base, worker_id=worker_id, node_id=spec.node_id, from_step=spec.from_step,
                                to_step=spec.to_step, kind=kind, error=error, ref=ref))])

    def saved(spec: StageSpec, step: int) -> list[Event]:
        with tracing.span("checkpoint.save", attributes={"stagetree.node_id": spec.node_id, "stagetree.step": step}):
            ref = backend.save()
        return [] if ref is None else [stamp(CheckpointSaved(**base, node_id=spec.node_id, step=step, ref=ref[0],
                                                             size=ref[1]))]

    started = backend.now()
    try:
        with tracing.span("checkpoint.load", attributes={"stagetree.ref": d.source.ref if d.source else "fresh"}):
            backend.begin(d)
    except StageFault as fault:
        failed(first, fault.kind, fault.error, fault.ref)
        return True
    for i, spec in enumerate(d.stages):
        if i and should_stop is not None and should_stop():
            return False
        stage = {"node_id": spec.node_id, "from_step": spec.from_step, "to_step": spec.to_step}
        attrs = {f"stagetree.{k}": v for k, v in stage.items()}
        with tracing.span("stage", attributes=attrs):
            emit([stamp(StageStarted(dispatch_id=d.dispatch_id, worker_id=worker_id, plan_key=d.plan_key, **stage))])
            end: list[Event] = []
            try:
                if backend.step() != spec.from_step:
                    raise RuntimeError(f"stage starts at step {spec.from_step}, "
                                       f"but the weights are at {backend.step()}")
                train_seconds = 0.0
                while True:
                    steering.update()
                    at = backend.step()
                    stop = steering.stop_in(i, spec)
                    if stop is not None and at >= stop:
                        now = backend.now()
                        emit([*saved(spec, at), stamp(StageStopped(**base, worker_id=worker_id, **stage, step=at,
                                                                   seconds=now - started,
                                                                   train_seconds=train_seconds))])
                        return True
                    if at >= spec.to_step:
                        break
                    target = min(x for x in (spec.to_step, stop, steering.next_save(spec, at)) if x is not None)
                    t0 = backend.now()
                    with tracing.span("train", attributes=attrs):
                        backend.train(spec, target, steering.control.waiting)
                    train_seconds += backend.now() - t0
                    at = backend.step()
                    if at < spec.to_step and (spec.node_id, at) in steering.saves:  # a split inside the stage
                        evaluate = steering.saves.pop((spec.node_id, at))
                        mid: list[Event] = []
                        if evaluate:
                            mid.append(stamp(MetricsReported(**base, node_id=spec.node_id, step=at,
                                                             metrics=dict(backend.evaluate(spec, at)))))
                        mid += saved(spec, at)
                        if mid:
                            emit(mid)
                if spec.evaluate:
                    with tracing.span("evaluate", attributes=attrs):
                        metrics = backend.evaluate(spec, spec.to_step)
                    end.append(stamp(MetricsReported(**base, node_id=spec.node_id, step=spec.to_step,
                                                     metrics=dict(metrics))))
                end += saved(spec, spec.to_step)
            except StageFault as fault:
                backend.abandon()
                failed(spec, fault.kind, fault.error, fault.ref)
                return True
            except Exception as exc:  # the trainer's own code failed: report, never crash the worker
                backend.abandon()
                failed(spec, "error", "".join(traceback.format_exception_only(exc)).strip())
                return True
            now = backend.now()
            end.append(stamp(StageFinished(**base, worker_id=worker_id, **stage, seconds=now - started,
                                           train_seconds=train_seconds)))
            emit(end)
            started = now
    return True
