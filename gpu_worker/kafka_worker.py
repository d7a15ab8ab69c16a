"""A worker on Kafka (``stagetree worker``): read its own dispatches, run them, publish results.

The worker shares the path executor with embedded mode; only the transport differs:

* **Its own stream.** Dispatches reach a worker on ``stagetree.dispatch.<worker id>``
  (:func:`events.topics.dispatch_stream`), which it creates at start; it reads nothing else
  (``read_committed``, long-polling: an idle worker costs the broker one open fetch). When
  ``stagetree serve`` declares it lost (it was silent too long: paused, cut off), a copy of the
  WorkerLost arrives there too: the path it is running ends at its next step boundary (its
  dispatch went to another worker; :func:`events.execution.run_path`), a dispatch sent before
  the notice is not run, and the worker joins again.
* **Atomic, fenced appends.** Every batch the path executor emits (``events.execution``: a
  stage's end is ONE batch, MetricsReported, CheckpointSaved and StageFinished) is one Kafka
  transaction of a :class:`~events.kafka_log.TransactionalAppender` with ``transactional.id``
  ``<prefix>stagetree.worker.<worker id>``, visible at once or not at all; a WorkerJoined is
  written to every plan partition at once. Starting a worker fences an older process with the
  same id (a zombie's next append fails, and it exits).
* **Steering.** Decisions about the running path (PathPreempted, CheckpointRequested) arrive on
  the same stream while it runs; the executor asks for them between steps
  (:class:`StreamControl`).
* **Joining** publishes WorkerJoined (voiding any dispatch an earlier process of the same id
  left unfinished); dispatches on its stream from before that are ignored.
* **Draining.** On SIGTERM (:meth:`KafkaWorker.drain`) the worker finishes the stage it is
  training, hands the rest of its path back (WorkerLost with reason "drained", written by the
  worker itself: the scheduler dispatches the rest again from the checkpoint just saved), and
  exits. A second SIGTERM is not needed; SIGKILL loses only the stage in flight.
* **Refusing.** A dispatch its runner cannot run as the plan was made (no trainer the worker can
  build gives the dispatch's plan key: another version of the code is deployed here) is not
  trained: the runner raises :class:`DispatchRefused` before anything of it is emitted, the
  worker hands it back (WorkerLost, as a drain does; the scheduler dispatches it to another
  worker), and :meth:`KafkaWorker.run` raises that error (``stagetree worker`` exits 2 with it).
  Staying would only be dispatched the same path again.
* **Liveness.** A thread sends a beat to ``stagetree.heartbeat`` every ``heartbeat_s`` seconds.

This module does not import torch: what runs a dispatch is a :class:`Runner` (training:
:class:`TrainingRunner`, which imports torch when made; the cluster benchmark's simulated
workers: :mod:`gpu_worker.simulated_worker`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from events import topics
from events.codec import InvalidEvent, decode, encode
from events.deadletter import dead_letter
from events.execution import END_POLL_S, Control, EndBatches
from events.kafka_log import (
    Fenced,
    Follower,
    KafkaLog,
    KafkaLogError,
    TransactionalAppender,
    Write,
    event_writes,
    partition_for,
)
from events.log import Record
from events.models import (
    CheckpointRequested,
    Event,
    PathPreempted,
    StageDispatched,
    StageStarted,
    StudyStarted,
    WorkerJoined,
    WorkerLost,
    base_plan_key,
)

log = logging.getLogger(__name__)

Emit = Callable[[list[Event]], None]

SIGTERM_HOOK_ENV = "STAGETREE_TEST_SIGTERM_IN_A_PATH"
"""Fault injection for tests: when set, the worker sends itself SIGTERM (once) as it starts the
first stage of a dispatch that has more stages after it, so the drain hands a path back."""

CATCH_UP_AFTER_S = 1.0
"""Seconds without a look at its stream after which a worker reads the stream to its end (one
query of the broker) rather than take what happened to arrive (:meth:`KafkaWorker.poll`)."""

HOLD_HOOK_ENV = "STAGETREE_TEST_HOLD_IN_PATH"
"""Fault injection for tests: ``N:DIR``. When the worker has started the first stage of its N-th
dispatch (counting from 1; its StageStarted is on the log), it creates ``DIR/<worker id>.held``
and waits there, still beating, until the test deletes that file (or a SIGTERM). A test thus
holds a study at a known point, mid-path, while it kills or stops a serve, a broker or the
worker itself, however fast the stages train."""


class DispatchRefused(ValueError):  # noqa: N818  a refusal, as UsageError: exit 2
    """A runner cannot run a dispatch as its plan was made (no trainer this worker can build gives
    its plan key); raised before anything of the dispatch is emitted. The message names the
    worker, the dispatch, the plan key and what the worker has instead (``stagetree worker``
    prints it and exits 2)."""


class Runner(Protocol):
    """Runs dispatched paths for one worker (a training executor, or a simulated GPU)."""

    device: str
    """The device name written into WorkerJoined."""

    def prepare(self) -> None:
        """Start-up work before joining (not counted in worker-seconds)."""

    def run(self, dispatch: StageDispatched, emit: Emit, control: Control, should_stop: Callable[[], bool],
            ends: EndBatches | None = None) -> bool:
        """Run ``dispatch``, emitting its event batches in order (``events.execution.run_path``),
        steered by ``control``; stop before a stage when ``should_stop()``, returning False (the
        rest handed back); True otherwise. ``ends``: the worker's end batches, kept between
        paths (a path's end does not wait for its writes: PathTrained).

        Raises:
            DispatchRefused: the dispatch cannot be run here; nothing of it was emitted."""


def worker_transactional_id(log: KafkaLog, worker_id: str) -> str:
    """The ``transactional.id`` of worker ``worker_id`` in the deployment of ``log``."""
    return log.topic(f"stagetree.worker.{worker_id}")


class StreamControl:
    """The :class:`~events.execution.Control` of a path on a Kafka worker: decisions about it
    (PathPreempted, CheckpointRequested) arrive on the worker's own stream while it runs; the
    stream is polled at most every ``every_s`` seconds, without waiting. A notice that the worker
    was declared lost (WorkerLost) ends the path and is kept for the worker's loop (which joins
    again), as are records not about the path."""

    def __init__(self, worker: KafkaWorker, every_s: float = 0.2) -> None:
        self.worker, self.every_s = worker, every_s
        self.checked = time.monotonic()
        self.arrived: list[Event] = []

    def _read(self) -> None:
        self.checked = time.monotonic()
        for record in self.worker.poll(0):
            event = self.worker.decoded(record)
            if event is None:
                continue
            if isinstance(event, (PathPreempted, CheckpointRequested, WorkerLost)):
                self.arrived.append(event)  # a WorkerLost ends the path (its dispatch is void) ...
            if not isinstance(event, (PathPreempted, CheckpointRequested)):
                self.worker.pending.append((record, event))  # ... and the worker's loop joins again

    def waiting(self) -> bool:
        if not self.arrived and time.monotonic() - self.checked >= self.every_s:
            self._read()
        return bool(self.arrived)

    def poll(self) -> list[Event]:
        if time.monotonic() - self.checked >= self.every_s:
            self._read()
        out, self.arrived = self.arrived, []
        return out


class KafkaWorker:
    """One worker process on Kafka.

    Args:
        log_factory: makes a transport (a KafkaLog); called twice, for the main loop and the
            heartbeat thread, since a transport is used from one thread at a time.
        worker_id: this worker's id (its dispatch stream is named after it: A-Z a-z 0-9 . _ -).
        runner: runs the dispatches.
        heartbeat_s: seconds between beats.
        retry_s: how long an append that fails (a broker away) is retried before the worker
            gives up and exits (its stage is then dispatched again).

    Raises:
        ValueError: ``worker_id`` cannot name a Kafka topic; ``heartbeat_s`` is not a finite
            number > 0 (0 sent thousands of beats a second).
    """

    def __init__(self, log_factory: Callable[[], KafkaLog], worker_id: str, runner: Runner, *,
                 heartbeat_s: float = 1.0, retry_s: float = 300.0) -> None:
        if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, (int, float)) \
                or not math.isfinite(heartbeat_s) or heartbeat_s <= 0:
            raise ValueError(f"`heartbeat_s` is {heartbeat_s!r}, but must be seconds > 0")
        self.stream = topics.dispatch_stream(worker_id)
        self.log_factory = log_factory
        self.log = log_factory()
        self.worker_id = worker_id
        self.runner = runner
        self.heartbeat_s = heartbeat_s
        self.retry_s = retry_s
        self.stop = threading.Event()
        """Set to leave after the current stage (a drain) or, when idle, at once."""
        self.producer = f"worker:{worker_id}"
        self.partitions = 1
        self.appender = TransactionalAppender(self.log, worker_transactional_id(self.log, worker_id))
        self.pending: list[tuple[Record, Event]] = []  # read from the stream, not handled yet
        self.follower: Follower
        self._hooked = False
        self._sigterm_hook: StageDispatched | None = None
        self._dispatches = 0  # dispatches run so far (the hold hook counts them)
        self._hold: Path | None = None
        self._looked = time.monotonic()  # when the stream was last read (:meth:`poll`)

    def drain(self) -> None:
        """Finish the stage in flight, hand back the rest of the path, and leave (SIGTERM)."""
        self.stop.set()

    # ------------------------------------------------------------------ publishing

    def _append(self, writes: Sequence[Write]) -> None:
        """Append in one transaction, retrying a broker that is away for up to ``retry_s``.

        Raises:
            Fenced: another process took this worker id over.
            KafkaLogError: still failing after ``retry_s``.
        """
        self.appender.append_retrying(writes, self.retry_s, who=f"worker {self.worker_id}")

    def publish(self, events: Sequence[Event]) -> None:
        """Append ``events`` to the plan stream in one transaction (WorkerJoined/WorkerLost to
        every partition)."""
        self._append(event_writes(topics.PLAN, events, self.partitions))

    def emit(self, events: list[Event]) -> None:
        """The executor's emit: each batch (a stage's end is one) is one transaction."""
        self.publish(events)
        if self._sigterm_hook is not None and any(isinstance(e, StageStarted) for e in events):
            d, self._sigterm_hook = self._sigterm_hook, None
            first = d.stages[0]
            if any(isinstance(e, StageStarted) and (e.node_id, e.from_step) == (first.node_id, first.from_step)
                   for e in events):
                os.kill(os.getpid(), signal.SIGTERM)
        if self._hold is not None and any(isinstance(e, StageStarted) for e in events):
            held, self._hold = self._hold, None
            held.touch()
            while held.exists() and not self.stop.is_set():
                self.stop.wait(0.05)

    def _hold_hook(self) -> Path | None:
        """The file :data:`HOLD_HOOK_ENV` holds this worker's current dispatch with, or None."""
        spec = os.environ.get(HOLD_HOOK_ENV)
        if not spec:
            return None
        count, _, folder = spec.partition(":")
        return Path(folder) / f"{self.worker_id}.held" if int(count) == self._dispatches else None

    def _dead_letter(self, offset: int, raw: bytes, reason: str) -> None:
        letter = dead_letter(self.stream, offset, raw, reason, producer=self.producer)
        log.warning("worker %s: dispatch record at offset %d dead-lettered: %s", self.worker_id, offset, reason)
        self._append([Write(topics.DEADLETTER, self.worker_id, encode(letter))])

    def decoded(self, record: Record) -> Event | None:
        """The event of a record of this worker's stream, or None when it is dead-lettered
        (undecodable, or not for this worker)."""
        try:
            event = decode(record.value)
        except InvalidEvent as exc:
            self._dead_letter(record.offset, record.value, exc.reason)
            return None
        if getattr(event, "worker_id", None) != self.worker_id:
            self._dead_letter(record.offset, record.value, f"a {event.type} for worker "
                              f"{getattr(event, 'worker_id', None)!r} on the dispatch stream of {self.worker_id!r}")
            return None
        return event

    def poll(self, wait: float) -> list[Record]:
        """The records of the worker's stream that arrived, waiting up to ``wait`` seconds for
        one. When the stream was not looked at for :data:`CATCH_UP_AFTER_S` seconds (the process
        was paused, or a step took that long), the stream is read to its end as the broker has it
        now (at most 5 s more): a notice written meanwhile, that the worker was declared lost, is
        among the records, not left for a later look while a void path trains on."""
        since = time.monotonic() - self._looked
        records = self.follower.poll(wait)
        if since > CATCH_UP_AFTER_S:
            deadline = time.monotonic() + 5
            try:
                ends = self.follower.end_offsets(timeout_s=5)
                while not self.follower.reached(ends) and time.monotonic() < deadline:
                    records += self.follower.poll(0.05)
            except KafkaLogError as exc:  # the broker away: what arrived is seen at a later look
                log.debug("worker %s: stream end not read: %s", self.worker_id, exc)
        self._looked = time.monotonic()
        return records

    def _void(self, dispatch: StageDispatched) -> bool:
        """Whether ``dispatch`` is void: a WorkerLost follows it on the stream (the worker was
        declared lost after it was sent, e.g. while paused: it went to another worker). The
        stream is read first, without waiting, so a notice already there is seen."""
        self.pending += [(r, e) for r in self.poll(0) if (e := self.decoded(r)) is not None]
        if any(isinstance(e, WorkerLost) for _, e in self.pending):
            log.warning("worker %s: dispatch %s is void (the worker was declared lost after it was sent): "
                        "not run", self.worker_id, dispatch.dispatch_id)
            return True
        return False

    def _beat(self) -> None:
        beats = self.log_factory()
        try:
            while not self.stop.is_set():
                try:
                    beats.append(topics.HEARTBEAT, self.worker_id,
                                 orjson.dumps({"worker_id": self.worker_id, "ts": time.time()}))
                except KafkaLogError as exc:  # a broker away: the next beat tries again
                    log.warning("worker %s: heartbeat not sent: %s", self.worker_id, exc)
                self.stop.wait(self.heartbeat_s)
        finally:
            beats.close()

    def _join(self) -> None:
        self.publish([WorkerJoined(producer=self.producer, ts=time.time(), worker_id=self.worker_id,
                                   device=self.runner.device)])

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Join, then run dispatches until :attr:`stop` is set (a path in flight is cut after
        its current stage and handed back).

        Raises:
            DispatchRefused: the runner refused a dispatch: it was handed back untrained (this
                worker's WorkerLost says so) and the worker left.
        """
        self.runner.prepare()  # start-up costs before joining, not in worker-seconds
        self.log.ensure_topic(self.stream)
        self.partitions = self.log.partition_count(topics.PLAN)
        start = self.log.end_offset(self.stream)
        self.appender.start()  # fences an older process of this worker id
        self._join()
        # A fetch the broker holds open returns when records arrive, but a transaction's records
        # become readable only at its commit marker: keep the wait short so that a dispatch is
        # seen within ~0.1 s of its commit.
        self.follower = Follower(self.log, {(self.stream, 0): start}, wait_ms=100)
        beat = threading.Thread(target=self._beat, name=f"heartbeat-{self.worker_id}", daemon=True)
        beat.start()
        handed_back = False
        refused: DispatchRefused | None = None
        ends = EndBatches(self.emit)  # a path's end does not wait for its writes (PathTrained)
        try:
            while not self.stop.is_set():
                if not self.pending:
                    # while end batches wait for their writes, look at them every END_POLL_S
                    wait = END_POLL_S if ends else 0.2
                    self.pending += [(r, e) for r in self.poll(wait) if (e := self.decoded(r)) is not None]
                    ends.release(False)
                while self.pending and not self.stop.is_set():
                    record, event = self.pending.pop(0)
                    if isinstance(event, StageDispatched):
                        if self._void(event):
                            continue
                        self._dispatches += 1
                        self._hold = self._hold_hook()
                        if os.environ.get(SIGTERM_HOOK_ENV) and len(event.stages) > 1 and not self._hooked:
                            self._hooked, self._sigterm_hook = True, event
                        try:
                            if not self.runner.run(event, self.emit, StreamControl(self), self.stop.is_set, ends):
                                handed_back = True
                        except DispatchRefused as exc:  # nothing of it trained: hand it back and leave
                            refused = exc
                            self.stop.set()
                    elif isinstance(event, (PathPreempted, CheckpointRequested)):
                        continue  # about a path that has ended (it finished first): nothing to do
                    elif isinstance(event, WorkerLost):
                        log.warning("worker %s was declared lost (%s): joining again", self.worker_id, event.reason)
                        self._join()
                    else:
                        self._dead_letter(record.offset, record.value, f"a {event.type} event does not belong on "
                                                                       "a dispatch stream")
            ends.release(True)  # the paths it trained end before it leaves
            reason = "drained (SIGTERM) with its path handed back" if handed_back else "drained (SIGTERM)"
            if refused is not None:
                reason = f"refused a dispatch, which it handed back untrained, and left: {refused}"
            self.publish([WorkerLost(producer=self.producer, ts=time.time(), worker_id=self.worker_id,
                                     reason=reason)])
        except Fenced as exc:
            log.error("worker %s: another process took this worker id over; leaving: %s", self.worker_id, exc)
        finally:
            self.stop.set()
            beat.join(timeout=5)
            self.follower.close()
            self.appender.close()
            self.log.close()
        if refused is not None:
            raise refused


class TrainingRunner:
    """Runs dispatches by training (the :class:`~gpu_worker.executor.PathExecutor`), building a
    trainer per study file. Imports torch when made.

    A dispatch is trained only with a trainer that has its plan key:
    ``plan_key_of(trainer, dispatch.seed)`` must be the dispatch's (its study's key for a
    ``--no-merge`` trial's ``<key>/trial/<id>``), since a plan is shared only by trainers of one
    fingerprint (name, version, constants, data order) and seed. The trainer is that of
    ``study_file`` when it has the key, else that of a study file the plan's StudyStarted events
    record, when that file is on this host and its trainer has the key (a worker started with
    another study's file runs another study's plan with that study's trainer). When none has it
    (another version of the code is deployed on this host, or no study file is there) the
    dispatch is refused: :class:`DispatchRefused`, nothing trained. Each verdict is kept per
    study file and plan key.

    Args:
        log: a transport (reads a plan's StudyStarted for its study file).
        worker_id: the worker's id.
        store: the checkpoint store.
        device: torch device spec (``auto``, ``cpu``, ``cuda:N``).
        study_file: the study file to build trainers from first (``--study``); None: only the
            files recorded by the StudyStarted events of each dispatch's plan.
        threads: torch intra-op threads.
    """

    def __init__(self, log: KafkaLog, worker_id: str, store: Any, device: str = "auto", *,
                 study_file: str | None = None, threads: int = 1) -> None:
        import torch

        from gpu_worker.executor import resolve_device

        torch.set_num_threads(threads)
        self.log = log
        self.worker_id = worker_id
        self.store = store
        self.torch_device = resolve_device(device)
        self.device = str(self.torch_device)
        self.study_file = study_file
        self._executors: dict[str, Any] = {}
        self._studies: dict[str, list[str]] = {}  # plan key -> study files, from StudyStarted
        # (study file, plan key) -> None when its trainer has the key; else why not, in words
        self._verdicts: dict[tuple[str, str], str | None] = {}
        self._chosen: dict[str, str] = {}  # plan key -> the study file whose trainer has it

    def prepare(self) -> None:
        if self.study_file is not None:
            from gpu_worker.process import warm_up

            warm_up(self._executor(self.study_file).trainer, self.torch_device)

    def _executor(self, path: str) -> Any:
        """The executor of the trainer of study file ``path`` (made once).

        Raises:
            StudyFileError: the file is not there, does not import or has no trainer.
        """
        if path not in self._executors:
            from gpu_worker.executor import PathExecutor
            from gpu_worker.loader import load_trainer

            self._executors[path] = PathExecutor(load_trainer(Path(path)), self.worker_id, self.store,
                                                 self.torch_device)
        return self._executors[path]

    def _recorded_study_files(self, key: str) -> list[str]:
        """The study files the StudyStarted events of plan ``key`` record (the latest first), read
        from the plan's partition when none is known yet."""
        if key not in self._studies:
            partition = partition_for(key, self.log.partition_count(topics.PLAN))
            for record in self.log.read(topics.PLAN, partition=partition):
                if b'"StudyStarted"' not in record.value:
                    continue
                try:
                    event = decode(record.value)
                except InvalidEvent:
                    continue
                if isinstance(event, StudyStarted) and event.study_file:
                    files = self._studies.setdefault(event.plan_key, [])
                    if event.study_file in files:
                        files.remove(event.study_file)
                    files.insert(0, event.study_file)
        return self._studies.get(key, [])

    def _verdict(self, path: str, key: str, seed: int) -> str | None:
        """None when the trainer of study file ``path`` gives plan key ``key`` with ``seed``; else
        what it has instead, in words (kept per file and key)."""
        if (path, key) not in self._verdicts:
            from gpu_worker.loader import StudyFileError
            from stagetree.study import plan_key_of

            try:
                trainer = self._executor(path).trainer
            except StudyFileError as exc:
                self._verdicts[path, key] = f"{exc}"
            else:
                own = plan_key_of(trainer, seed)
                self._verdicts[path, key] = None if own == key else (
                    f"this worker's trainer {trainer.name}@{trainer.version} (study file {path!r}) gives plan key "
                    f"{own!r} with seed {seed}, not {key!r}")
        return self._verdicts[path, key]

    def study_file_for(self, dispatch: StageDispatched) -> str:
        """The study file whose trainer runs ``dispatch``: one whose trainer has its plan key
        (``study_file`` first, then those its plan's StudyStarted events record).

        Raises:
            DispatchRefused: no study file this worker can load has a trainer with that key
                (the message names the plan key and what each file gives instead).
        """
        key = base_plan_key(dispatch.plan_key)
        if key in self._chosen:
            return self._chosen[key]
        candidates = [] if self.study_file is None else [self.study_file]
        for path in self._recorded_study_files(key):
            if all(os.path.realpath(path) != os.path.realpath(c) for c in candidates):
                candidates.append(path)
        why = []
        for path in candidates:
            verdict = self._verdict(path, key, dispatch.seed)
            if verdict is None:
                if path != self.study_file and self.study_file is not None:
                    log.warning("worker %s: plan %s is not the plan of --study %r (%s); its stages are trained "
                                "with the trainer of the study file its StudyStarted records, %r", self.worker_id,
                                key, self.study_file, self._verdicts[self.study_file, key], path)
                self._chosen[key] = path
                return path
            why.append(verdict)
        if not candidates:
            why.append("no StudyStarted of that plan records a study file")
        hint = ("another version of the code is deployed here (bump or align the trainer's `version`)"
                if {os.path.realpath(f) for f in self._recorded_study_files(key)}
                & {os.path.realpath(f) for f in self._executors} else
                "start this worker with --study naming that study's file on this host")
        raise DispatchRefused(f"worker {self.worker_id}: dispatch {dispatch.dispatch_id} of plan {key!r}: "
                              f"{'; '.join(why)}: {hint}; not trained, handed back")

    def run(self, dispatch: StageDispatched, emit: Emit, control: Control, should_stop: Callable[[], bool],
            ends: EndBatches | None = None) -> bool:
        return self._executor(self.study_file_for(dispatch)).run(dispatch, emit, control, should_stop, ends)
