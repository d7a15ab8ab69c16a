"""Executing a dispatched path: load the source checkpoint, train its stages, report results.

The executor only does what the dispatch says (DESIGN.md: decisions live in the scheduler).
For each stage it trains ``[from_step, to_step)`` with the stage's hyper-parameter functions,
keeping the weights in memory from one stage to the next (Hippo §4.3 batching), evaluates at
``to_step`` when asked, writes the central checkpoint (verified by sha256 *before* the
CheckpointSaved event is emitted: invariant 4), and emits the stage's end (its metrics, the
checkpoint and StageFinished with the measured seconds) as one atomic batch. Clocks are read here, at the edge, and the measurements travel in the events.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import TypeVar

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
    StageSpec,
    StageStarted,
)
from gpu_worker.checkpoint import CheckpointCorrupt, CheckpointMissing, CheckpointStore, StorageError
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer

T = TypeVar("T")

Emit = Callable[[list[Event]], None]
"""Where a worker's events go: each call is one batch, appended atomically by the transport."""


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
        storage_attempts: tries of a checkpoint read or write that fails with StorageError (a
            full disk, an unreachable object store) before the path is handed back.
        storage_backoff_s: seconds before the second try, doubled for each further one.
        sleep: how to wait between tries (seconds).

    The session survives between dispatches: when a path starts from the checkpoint this
    worker just saved, the weights in memory are used without reloading (same bytes, same
    result, as invariant 1 guarantees).

    Events go out through ``emit`` in batches that the transport appends atomically: a stage's
    StageStarted alone, and its end (MetricsReported when it evaluates, CheckpointSaved,
    StageFinished) as one batch after the checkpoint is written and verified, so no crash can
    leave metrics recorded without the stage's checkpoint and accounting (issue 11 item 12).
    """

    def __init__(self, trainer: Trainer, worker_id: str, store: CheckpointStore, device: torch.device,
                 *, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time,
                 storage_attempts: int = 3, storage_backoff_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(storage_attempts, bool) or not isinstance(storage_attempts, int) or storage_attempts < 1:
            raise ValueError(f"`storage_attempts` is {storage_attempts!r}, but must be an int >= 1")
        self.trainer = trainer
        self.worker_id = worker_id
        self.store = store
        self.device = device
        self.clock = clock
        self.wall = wall
        self.storage_attempts = storage_attempts
        self.storage_backoff_s = storage_backoff_s
        self.sleep = sleep
        self._session: TrainingSession | None = None
        self._holding: tuple[int, str] | None = None  # (seed, ref) of the weights in memory

    def stamp(self, event: Event) -> Event:
        """Set producer, timestamp and (when tracing) the current span's context on ``event``."""
        return event.model_copy(update={"producer": f"worker:{self.worker_id}", "ts": self.wall(),
                                        "trace": tracing.carrier()})

    def _stored(self, operation: Callable[[], T]) -> T:
        """``operation()`` (a store read or write), tried ``storage_attempts`` times while it
        raises StorageError, waiting ``storage_backoff_s`` and then twice as long each time."""
        for attempt in range(self.storage_attempts):
            try:
                return operation()
            except StorageError:
                if attempt + 1 == self.storage_attempts:
                    raise
                self.sleep(self.storage_backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _session_for(self, d: StageDispatched) -> TrainingSession:
        """A session positioned at the path's source. Raises CheckpointError when it cannot load."""
        if d.source is not None and self._session is not None and self._holding == (d.seed, d.source.ref):
            return self._session
        self._session, self._holding = None, None
        session = TrainingSession(self.trainer, d.seed, self.device)
        if d.source is None:
            session.start_fresh()
        else:
            ref = d.source.ref
            session.load(self._stored(lambda: self.store.get(ref)))
            self._holding = (d.seed, d.source.ref)
        self._session = session
        return session

    def run(self, d: StageDispatched, emit: Emit) -> None:
        """Execute every stage of ``d`` in order, emitting event batches through ``emit``.

        Never raises for a failing stage: a corrupt or missing source checkpoint, an exception
        from the trainer, or a store that keeps failing becomes a StageFailed event and ends the
        path. With tracing on, the work is recorded as spans in the trace the dispatch carries.
        """
        with tracing.span("dispatch.process", parent=d.trace, kind=SpanKind.CONSUMER,
                          attributes=tracing.messaging("process", topics.DISPATCH, d.event_id,
                                                       dispatch_id=d.dispatch_id, worker_id=self.worker_id)):
            self._run(d, emit)

    def _failed(self, d: StageDispatched, spec: StageSpec, kind: str, error: str, ref: str | None = None) -> Event:
        return self.stamp(StageFailed(dispatch_id=d.dispatch_id, plan_key=d.plan_key, worker_id=self.worker_id,
                                      node_id=spec.node_id, from_step=spec.from_step, to_step=spec.to_step,
                                      kind=kind, error=error, ref=ref))

    def _run(self, d: StageDispatched, emit: Emit) -> None:
        started = self.clock()
        first = d.stages[0]
        base = {"dispatch_id": d.dispatch_id, "plan_key": d.plan_key}
        try:
            with tracing.span("checkpoint.load", attributes={"stagetree.ref": d.source.ref if d.source else "fresh"}):
                session = self._session_for(d)
        except (CheckpointCorrupt, CheckpointMissing) as exc:
            kind = "checkpoint_corrupt" if isinstance(exc, CheckpointCorrupt) else "checkpoint_missing"
            emit([self._failed(d, first, kind, str(exc), d.source.ref if d.source else None)])
            return
        except StorageError as exc:
            emit([self._failed(d, first, "storage", str(exc))])
            return
        for spec in d.stages:
            stage = {"node_id": spec.node_id, "from_step": spec.from_step, "to_step": spec.to_step}
            attrs = {f"stagetree.{k}": v for k, v in stage.items()}
            with tracing.span("stage", attributes=attrs):
                emit([self.stamp(StageStarted(dispatch_id=d.dispatch_id, worker_id=self.worker_id, **stage))])
                end: list[Event] = []
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
                        end.append(self.stamp(MetricsReported(**base, node_id=spec.node_id, step=spec.to_step,
                                                              metrics=metrics)))
                    if spec.to_step > spec.from_step or self._holding is None:  # eval-only: source kept
                        with tracing.span("checkpoint.save", attributes=attrs):
                            data = session.save()
                            try:
                                ref = self._stored(lambda: self.store.put(data))
                            except (StorageError, CheckpointCorrupt) as exc:  # the store's fault
                                self._session, self._holding = None, None
                                emit([self._failed(d, spec, "storage", f"{type(exc).__name__}: {exc}")])
                                return
                        self._holding = (d.seed, ref.ref)
                        end.append(self.stamp(CheckpointSaved(**base, node_id=spec.node_id, step=spec.to_step,
                                                              ref=ref.ref, size=ref.size)))
                except Exception as exc:  # the trainer's own code failed: report, never crash the worker
                    self._session, self._holding = None, None
                    error = "".join(traceback.format_exception_only(exc)).strip()
                    emit([self._failed(d, spec, "error", error)])
                    return
                now = self.clock()
                end.append(self.stamp(StageFinished(**base, worker_id=self.worker_id, **stage,
                                                    seconds=now - started, train_seconds=train_seconds)))
                emit(end)
                started = now
