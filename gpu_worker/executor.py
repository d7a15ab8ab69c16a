"""Executing a dispatched path: load the source checkpoint, train its stages, report results.

The executor only does what the dispatch says (DESIGN.md: decisions live in the scheduler).
For each stage it trains ``[from_step, to_step)`` with the stage's hyper-parameter functions,
keeping the weights in memory from one stage to the next (Hippo §4.3 batching), evaluates at
``to_step`` when asked, writes the central checkpoint (verified by sha256 *before* the
CheckpointSaved event is emitted: invariant 4), and emits StageFinished with the measured
seconds. Clocks are read here, at the edge, and the measurements travel in the events.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

import torch
from opentelemetry.trace import SpanKind

from events import topics, tracing
from events.models import (
    CheckpointSaved,
    Event,
    MetricsReported,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageStarted,
)
from gpu_worker.checkpoint import CheckpointCorrupt, CheckpointMissing, CheckpointStore
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer

Emit = Callable[[Event], None]


def resolve_device(spec: str = "auto", index: int = 0) -> torch.device:
    """``"auto"``: ``cuda:<index mod device count>`` when CUDA is present, else ``cpu``;
    otherwise the torch device named by ``spec`` (``cpu``, ``cuda:1``, ...).

    Raises:
        ValueError: ``spec`` is not a torch device name, or names a CUDA device that is absent.
    """
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device(f"cuda:{index % torch.cuda.device_count()}")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"`device` is {spec!r}, but must be auto, cpu or cuda:N ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` is {spec!r}, but CUDA is not available here")
    return device


class PathExecutor:
    """Runs dispatched paths for one worker on one device.

    Args:
        trainer: the study's trainer instance (rebuilt from the seed for every source).
        worker_id: the id written into the events.
        store: where checkpoints are read and written.
        device: the torch device to train on.
        clock: monotonic seconds (measured durations), wall: epoch seconds (event ``ts``).

    The session survives between dispatches: when a path starts from the checkpoint this
    worker just saved, the weights in memory are used without reloading (same bytes, same
    result, as invariant 1 guarantees).
    """

    def __init__(self, trainer: Trainer, worker_id: str, store: CheckpointStore, device: torch.device,
                 *, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time) -> None:
        self.trainer = trainer
        self.worker_id = worker_id
        self.store = store
        self.device = device
        self.clock = clock
        self.wall = wall
        self._session: TrainingSession | None = None
        self._holding: tuple[int, str] | None = None  # (seed, ref) of the weights in memory

    def stamp(self, event: Event) -> Event:
        """Set producer, timestamp and (when tracing) the current span's context on ``event``."""
        return event.model_copy(update={"producer": f"worker:{self.worker_id}", "ts": self.wall(),
                                        "trace": tracing.carrier()})

    def _session_for(self, d: StageDispatched) -> TrainingSession:
        """A session positioned at the path's source. Raises CheckpointError when it cannot load."""
        if d.source is not None and self._session is not None and self._holding == (d.seed, d.source.ref):
            return self._session
        self._session, self._holding = None, None
        session = TrainingSession(self.trainer, d.seed, self.device)
        if d.source is None:
            session.start_fresh()
        else:
            session.load(self.store.get(d.source.ref))
            self._holding = (d.seed, d.source.ref)
        self._session = session
        return session

    def run(self, d: StageDispatched, emit: Emit, should_stop: Callable[[], bool] | None = None) -> bool:
        """Execute every stage of ``d`` in order, emitting events through ``emit``.

        Never raises for a failing stage: a corrupt or missing source checkpoint, or an
        exception from the trainer, becomes a StageFailed event and ends the path. With tracing
        on, the work is recorded as spans in the trace the dispatch carries.

        ``should_stop`` is asked before every stage after the first (a worker draining on
        SIGTERM): when it answers True the path ends there, after the last finished stage's
        checkpoint, and ``run`` returns False (the rest is handed back); True otherwise.
        """
        with tracing.span("dispatch.process", parent=d.trace, kind=SpanKind.CONSUMER,
                          attributes=tracing.messaging("process", topics.DISPATCH, d.event_id,
                                                       dispatch_id=d.dispatch_id, worker_id=self.worker_id)):
            return self._run(d, emit, should_stop)

    def _run(self, d: StageDispatched, emit: Emit, should_stop: Callable[[], bool] | None = None) -> bool:
        started = self.clock()
        first = d.stages[0]
        base = {"dispatch_id": d.dispatch_id, "plan_key": d.plan_key}
        try:
            with tracing.span("checkpoint.load", attributes={"stagetree.ref": d.source.ref if d.source else "fresh"}):
                session = self._session_for(d)
        except (CheckpointCorrupt, CheckpointMissing) as exc:
            kind = "checkpoint_corrupt" if isinstance(exc, CheckpointCorrupt) else "checkpoint_missing"
            emit(self.stamp(StageFailed(**base, worker_id=self.worker_id, node_id=first.node_id,
                                        from_step=first.from_step, to_step=first.to_step, kind=kind,
                                        error=str(exc), ref=d.source.ref if d.source else None)))
            return True
        for i, spec in enumerate(d.stages):
            if i and should_stop is not None and should_stop():
                return False
            stage = {"node_id": spec.node_id, "from_step": spec.from_step, "to_step": spec.to_step}
            attrs = {f"stagetree.{k}": v for k, v in stage.items()}
            with tracing.span("stage", attributes=attrs):
                emit(self.stamp(StageStarted(dispatch_id=d.dispatch_id, worker_id=self.worker_id, plan_key=d.plan_key,
                                             **stage)))
                try:
                    if session.step != spec.from_step:
                        raise RuntimeError(f"stage starts at step {spec.from_step}, but the weights are at {session.step}")
                    t0 = self.clock()
                    with tracing.span("train", attributes=attrs):
                        session.train(spec.hp, spec.to_step)
                    train_seconds = self.clock() - t0
                    if spec.evaluate:
                        with tracing.span("evaluate", attributes=attrs):
                            metrics = session.evaluate()
                        emit(self.stamp(MetricsReported(**base, node_id=spec.node_id, step=spec.to_step,
                                                        metrics=metrics)))
                    if spec.to_step > spec.from_step or self._holding is None:  # eval-only: source kept
                        with tracing.span("checkpoint.save", attributes=attrs):
                            ref = self.store.put(session.save())
                        self._holding = (d.seed, ref.ref)
                        emit(self.stamp(CheckpointSaved(**base, node_id=spec.node_id, step=spec.to_step,
                                                        ref=ref.ref, size=ref.size)))
                except Exception as exc:  # the trainer's own code failed: report, never crash the worker
                    self._session, self._holding = None, None
                    error = "".join(traceback.format_exception_only(exc)).strip()
                    emit(self.stamp(StageFailed(**base, worker_id=self.worker_id, **stage, kind="error", error=error)))
                    return True
                now = self.clock()
                emit(self.stamp(StageFinished(**base, worker_id=self.worker_id, **stage,
                                              seconds=now - started, train_seconds=train_seconds)))
                started = now
        return True
