"""The one event sequence of executing a dispatched path (DESIGN.md "The event log").

Every executor of a :class:`~events.models.StageDispatched` (the GPU worker, the cluster
simulator's simulated GPUs, the scheduler's instant test simulation) emits the same events in the
same order and batches, produced here by :func:`run_path` over a :class:`PathBackend` that only
moves weights (real training, a cost model, or nothing at all):

1. the path's source is taken (a checkpoint loaded, or a fresh initialisation); if that fails,
   one StageFailed for the first stage ends the path. A backend may hand back the source's
   weights before its bytes are verified (:class:`SourceCheck`): the first stage trains
   meanwhile, and the check is waited for before anything made from the weights is stored or
   goes out (the first checkpoint written, which every end batch follows) and before any
   failure is reported; when it fails, ``[StageFailed]`` of kind "checkpoint_corrupt" ends the
   path after the first stage's StageStarted;
2. for each stage, in order: ``[StageStarted]``; then the stage trains ``[from_step, to_step)``,
   evaluates when asked and stores a checkpoint when it trained a step (or when the weights in
   hand were never stored), and its end goes out as ONE batch ``[MetricsReported?,
   CheckpointSaved?, StageFinished]``, which the transport appends atomically: no crash can leave
   metrics recorded without the stage's checkpoint and accounting (a checkpoint is written and
   verified before the batch that names it, invariant 4); a worker that can emit between paths
   (:class:`EndBatches`) does not wait for its last writes: ``[PathTrained]`` frees it for the
   next path, and the end batches still waiting follow once their writes are verified;
3. a failure ends the path with one ``[StageFailed]`` for the stage: ``kind`` from the
   :class:`StageFault` a backend raised (a corrupt or missing source, a failing store), else
   "error" with the exception (the trainer's own code raised, in its build too).

Decisions about a running path reach it through a :class:`Control` and are acted on at step
boundaries (``scheduler.inflight``):

* CheckpointRequested (save at step ``s`` of a stage, evaluating when asked): on reaching ``s``
  inside the stage the weights are stored and ``[MetricsReported?, CheckpointSaved]`` goes out;
  a step already passed is ignored;
* PathPreempted: training goes on to its ``until`` point (if not passed), then the weights are
  stored (if not stored yet) and ``[CheckpointSaved?, StageStopped]`` ends the path;
* WorkerLost about the worker running the path (it was declared lost while it ran: paused, cut
  off): the dispatch is void, its stages are dispatched again elsewhere, so the path ends at the
  next step boundary and nothing more about it goes out but the end batches of the stages it
  finished before (what those record is true); the stage in training is dropped, as a kill -9
  drops it.

``StageFinished.seconds`` is the time the worker was held by the stage (loading the source counts
to the first stage), ``train_seconds`` the part spent training; both are read from the backend's
clock, at the edge (a simulated backend's clock is virtual).
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable
from typing import Literal, Protocol

from events import tracing
from events.models import (
    CheckpointRequested,
    CheckpointSaved,
    Event,
    MetricsReported,
    PathPreempted,
    PathTrained,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageSpec,
    StageStarted,
    StageStopped,
    WorkerLost,
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

    def __reduce__(self) -> tuple[type, tuple[FaultKind, str, str | None]]:  # pickled whole
        return type(self), (self.kind, self.error, self.ref)


class PathBackend(Protocol):
    """What :func:`run_path` needs from an executor: weights it can position, train, evaluate
    and store, and a clock (seconds; monotonic, or virtual in a simulation).

    Each method may raise :class:`StageFault`; any other exception from :meth:`train`,
    :meth:`evaluate` or :meth:`save` is the trainer's error.
    """

    def begin(self, d: StageDispatched) -> SourceCheck | None:
        """Hold the weights ``d`` starts from: its source checkpoint, or a fresh initialisation.
        Returns the check of a source whose bytes are still being verified (the weights in hand
        may be trained meanwhile; nothing made from them is published until it passes), or None
        when there is nothing left to check."""
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

    def save(self, waited: bool = False) -> SaveHandle | None:
        """Store the weights in hand if they are not stored yet, or None when they are (an
        evaluation-only stage, say). The handle gives ``(sha256 ref, size in bytes)`` of the
        verified object once written; a backend may write in the background while the next
        stage trains (the weights are snapshotted before this returns). ``waited``: the caller
        waits for the handle before the weights change again (a path's end), so a backend need
        not copy them first."""
        ...

    def abandon(self) -> None:
        """Forget the weights in hand (after a failure they are not trusted)."""
        ...

    def now(self) -> float:
        """Seconds on the backend's clock."""
        ...


class SourceCheck(Protocol):
    """A source checkpoint loaded before its bytes were verified (:meth:`PathBackend.begin`)."""

    def result(self) -> None:
        """Block until the bytes are verified; raise :class:`StageFault` (kind
        "checkpoint_corrupt") when they do not hash to the source's ref."""
        ...


class SaveHandle(Protocol):
    """A checkpoint being stored: :meth:`result` blocks until it is written and verified and
    returns ``(ref, size)``, or raises :class:`StageFault` (kind "storage")."""

    def done(self) -> bool:
        ...

    def result(self) -> tuple[str, int]:
        ...


class Saved:
    """A :class:`SaveHandle` already written (backends that store synchronously)."""

    def __init__(self, ref: str, size: int) -> None:
        self.value = (ref, size)

    def done(self) -> bool:
        return True

    def result(self) -> tuple[str, int]:
        return self.value


class Control(Protocol):
    """Decisions about the running path that arrive while it runs (PathPreempted,
    CheckpointRequested for its dispatch; WorkerLost about its worker)."""

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
        self.lost = False  # the worker was declared lost: the dispatch is void

    def update(self) -> None:
        for event in self.control.poll():
            if isinstance(event, WorkerLost) and event.worker_id == self.d.worker_id:
                self.lost = True
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


class _Pending:
    """An end batch of dispatch ``dispatch_id`` waiting for its checkpoint's write (``handle``;
    None: nothing written): ``batch(saved)`` makes its events once the write is verified
    (``saved``: its ``(ref, size)``, None without a write), ``failed(fault)`` the StageFailed that
    ends the path when the write failed."""

    def __init__(self, dispatch_id: str, handle: SaveHandle | None,
                 batch: Callable[[tuple[str, int] | None], list[Event]],
                 failed: Callable[[StageFault], list[Event]]) -> None:
        self.dispatch_id, self.handle, self.batch, self.failed = dispatch_id, handle, batch, failed


def describe_error(exc: Exception) -> str:
    """The StageFailed ``error`` of an exception the trainer's code raised: its type and message."""
    return "".join(traceback.format_exception_only(exc)).strip()


END_POLL_S = 0.001
"""Seconds an idle worker waits for its next message before it looks at its checkpoint writes
again, while end batches wait for them: how late an end batch may go out after its write."""


class EndBatches:
    """A worker's end batches waiting for their checkpoints' writes, in the order they were made,
    across the paths it runs: a path handed off with PathTrained leaves its ends here while the
    worker's next path trains (:func:`run_path` with ``ends``). Each goes out through ``emit``
    once its write is verified, in order (a worker's writes complete in order)."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self._queue: deque[_Pending] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, entry: _Pending) -> None:
        self._queue.append(entry)

    def holds(self, dispatch_id: str) -> bool:
        """Whether an end batch of ``dispatch_id`` is still waiting."""
        return any(e.dispatch_id == dispatch_id for e in self._queue)

    def ready(self) -> bool:
        """Whether the first waiting batch can go out now (its write is done)."""
        return bool(self._queue) and (self._queue[0].handle is None or self._queue[0].handle.done())

    def release(self, block: bool) -> str | None:
        """Emit the end batches whose writes are done (every one, waiting for the writes, with
        ``block``), in order. When a write failed: its path's StageFailed is emitted instead, its
        other waiting batches are dropped, and its dispatch id is returned (the batches after it
        are left waiting); else None."""
        while self._queue and (block or self.ready()):
            entry = self._queue.popleft()
            saved = None
            if entry.handle is not None:
                try:
                    saved = entry.handle.result()
                except StageFault as fault:
                    self._queue = deque(e for e in self._queue if e.dispatch_id != entry.dispatch_id)
                    self.emit(entry.failed(fault))
                    return entry.dispatch_id
            batch = entry.batch(saved)
            if batch:
                self.emit(batch)
        return None


def run_path(d: StageDispatched, backend: PathBackend, emit: Emit, worker_id: str,
             stamp: Callable[[Event], Event] = lambda e: e, control: Control | None = None,
             should_stop: Callable[[], bool] | None = None, ends: EndBatches | None = None) -> bool:
    """Execute every stage of ``d`` in order on ``backend``, emitting the event batches described
    in the module docstring through ``emit`` (each event passed through ``stamp`` first: producer,
    timestamp, trace context), acting on what ``control`` says at step boundaries. Never raises
    for a failing stage. Records spans when tracing.

    Checkpoint writes may finish after the next stage has started training: a stage's end batch
    goes out, in stage order, once its write is verified (checked at step boundaries, and waited
    for before the path ends); its ``seconds`` end when the checkpoint was handed to the writer,
    so the time a write overlaps the next stage counts once.

    ``should_stop`` is asked before every stage after the first (a worker draining on SIGTERM):
    when it answers True the path ends there, once the finished stages' writes are verified and
    their end batches emitted, and ``run_path`` returns False (the rest is for the worker to hand
    back); True otherwise.

    ``ends``: the worker's :class:`EndBatches` (emitting through ``emit`` too), kept between its
    paths. With it the path's end does not wait for its writes: when some are still going after
    the last stage has trained, ``[PathTrained]`` goes out and ``run_path`` returns; their end
    batches follow from ``ends`` (released at the next path's step boundaries, or by the worker
    while it waits for work), and the last stage's ``seconds`` end at the hand-off. Without it (a
    transport that cannot emit between paths) the last stage holds the worker until every write
    is verified, and its ``seconds`` count that wait.
    """
    base = {"dispatch_id": d.dispatch_id, "plan_key": d.plan_key}
    first = d.stages[0]
    steering = _Steering(d, control if control is not None else NoControl())
    hand_off = ends is not None
    pending = ends if ends is not None else EndBatches(emit)

    def stage_failed(spec: StageSpec, kind: FaultKind, error: str, ref: str | None = None) -> list[Event]:
        return [stamp(StageFailed(**base, worker_id=worker_id, node_id=spec.node_id, from_step=spec.from_step,
                                  to_step=spec.to_step, kind=kind, error=error, ref=ref))]

    def failed(spec: StageSpec, kind: FaultKind, error: str, ref: str | None = None) -> None:
        emit(stage_failed(spec, kind, error, ref))

    def ending(spec: StageSpec, step: int, handle: SaveHandle | None, before: list[Event],
               after: Callable[[], list[Event]]) -> _Pending:
        """The end batch ``[*before, CheckpointSaved?, *after()]`` of ``spec`` at ``step``."""
        def batch(saved: tuple[str, int] | None) -> list[Event]:
            checkpoint = [] if saved is None else [stamp(CheckpointSaved(**base, node_id=spec.node_id, step=step,
                                                                         ref=saved[0], size=saved[1]))]
            return [*before, *checkpoint, *after()]
        return _Pending(d.dispatch_id, handle, batch,
                        lambda fault: stage_failed(spec, fault.kind, fault.error, fault.ref))

    source: SourceCheck | None = None

    def verified() -> None:
        """Wait for the source's check, if one is pending; raises StageFault when it fails."""
        nonlocal source
        if source is not None:
            check, source = source, None
            with tracing.span("checkpoint.verify"):
                check.result()

    def settled(fault: StageFault) -> StageFault:
        """The fault to report: the source's, when it did not verify (``fault`` may be its effect)."""
        try:
            verified()
        except StageFault as corrupt:
            return corrupt
        return fault

    def save(spec: StageSpec, step: int, waited: bool = False) -> SaveHandle | None:
        verified()
        with tracing.span("checkpoint.save", attributes={"stagetree.node_id": spec.node_id, "stagetree.step": step}):
            return backend.save(waited)

    def release(block: bool) -> bool:
        """Emit the end batches whose writes are done (all of them with ``block``), in order;
        False when a write of this path failed (its StageFailed is emitted; the path ends). A
        failed write of an earlier path ended that path only."""
        while (failed_id := pending.release(block)) is not None:
            if failed_id == d.dispatch_id:
                backend.abandon()
                return False
        return True

    def interrupt() -> bool:
        return steering.control.waiting() or pending.ready()

    def void() -> bool:
        """Whether the worker was declared lost (asked at stage starts and step boundaries): if
        so, the end batches of the stages it finished go out, and the path ends there."""
        steering.update()
        if steering.lost:
            release(True)
            backend.abandon()
        return steering.lost

    started = backend.now()
    try:
        with tracing.span("checkpoint.load", attributes={"stagetree.ref": d.source.ref if d.source else "fresh"}):
            source = backend.begin(d)
    except StageFault as fault:
        failed(first, fault.kind, fault.error, fault.ref)
        return True
    except Exception as exc:  # the trainer's build or load_state_dict raised: its error, not the worker's
        backend.abandon()
        failed(first, "error", describe_error(exc))
        return True
    for i, spec in enumerate(d.stages):
        if i and should_stop is not None and should_stop():
            return not release(True)  # a write that failed ended the path with its StageFailed
        if void():
            return True
        stage = {"node_id": spec.node_id, "from_step": spec.from_step, "to_step": spec.to_step}
        attrs = {f"stagetree.{k}": v for k, v in stage.items()}
        with tracing.span("stage", attributes=attrs):
            emit([stamp(StageStarted(dispatch_id=d.dispatch_id, worker_id=worker_id, plan_key=d.plan_key, **stage))])
            try:
                if backend.step() != spec.from_step:
                    raise RuntimeError(f"stage starts at step {spec.from_step}, "
                                       f"but the weights are at {backend.step()}")
                train_seconds = 0.0
                while True:
                    if not release(False) or void():
                        return True
                    at = backend.step()
                    stop = steering.stop_in(i, spec)
                    if stop is not None and at >= stop:
                        handle = save(spec, at, waited=True)
                        now = backend.now()
                        stopped = stamp(StageStopped(**base, worker_id=worker_id, **stage, step=at,
                                                     seconds=now - started, train_seconds=train_seconds))
                        pending.add(ending(spec, at, handle, [], lambda e=stopped: [e]))
                        release(True)
                        return True
                    if at >= spec.to_step:
                        break
                    target = min(x for x in (spec.to_step, stop, steering.next_save(spec, at)) if x is not None)
                    t0 = backend.now()
                    with tracing.span("train", attributes=attrs):
                        backend.train(spec, target, interrupt)
                    train_seconds += backend.now() - t0
                    at = backend.step()
                    if at < spec.to_step and (spec.node_id, at) in steering.saves:  # a split inside the stage
                        evaluate = steering.saves.pop((spec.node_id, at))
                        before: list[Event] = []
                        if evaluate:
                            before.append(stamp(MetricsReported(**base, node_id=spec.node_id, step=at,
                                                                metrics=dict(backend.evaluate(spec, at)))))
                        pending.add(ending(spec, at, save(spec, at), before, list))
                end: list[Event] = []
                if spec.evaluate:
                    with tracing.span("evaluate", attributes=attrs):
                        metrics = backend.evaluate(spec, spec.to_step)
                    end.append(stamp(MetricsReported(**base, node_id=spec.node_id, step=spec.to_step,
                                                     metrics=dict(metrics))))
                handle = save(spec, spec.to_step, waited=i + 1 == len(d.stages))
            except Exception as exc:  # a StageFault, or the trainer's own code failed: report, never crash the worker
                fault = settled(exc if isinstance(exc, StageFault) else StageFault("error", describe_error(exc)))
                if release(True):
                    backend.abandon()
                    failed(spec, fault.kind, fault.error, fault.ref)
                return True
            now = backend.now()
            finish = StageFinished(**base, worker_id=worker_id, **stage, seconds=now - started,
                                   train_seconds=train_seconds)
            if i + 1 < len(d.stages) or hand_off:
                stamped = stamp(finish)
                pending.add(ending(spec, spec.to_step, handle, end, lambda e=stamped: [e]))
                started = now
            else:  # the last stage holds the worker until every write of the path is verified
                t0 = started
                pending.add(ending(spec, spec.to_step, handle, end, lambda f=finish, t0=t0: [
                    stamp(f.model_copy(update={"seconds": backend.now() - t0}))]))
                release(True)
    if hand_off:
        if release(False) and pending.holds(d.dispatch_id):  # writes still going: the worker is free
            emit([stamp(PathTrained(**base, worker_id=worker_id))])
    return True
