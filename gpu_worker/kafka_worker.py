"""A worker on Kafka (``stagetree worker``): consume its dispatches, train, publish results.

The worker shares the path executor with embedded mode; only the transport differs. It joins by
publishing WorkerJoined (which voids any dispatch an earlier process of the same id left
unfinished), then reads ``stagetree.dispatch`` from the offset it noted *before* joining,
executing the records keyed by its id. Results go to ``stagetree.plan``; checkpoints to the
checkpoint store (local directory or MinIO), written and verified before CheckpointSaved is
published. A thread sends a beat to ``stagetree.heartbeat`` every ``heartbeat_s`` seconds; the
serve process declares a silent worker lost, and its unfinished stages are dispatched again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import torch

from events import topics
from events.codec import InvalidEvent, decode, encode
from events.deadletter import dead_letter
from events.log import EventLog, event_key
from events.models import CheckpointRequested, Event, PathPreempted, StageDispatched, StudyStarted, WorkerJoined
from gpu_worker.checkpoint import CheckpointStore
from gpu_worker.executor import PathExecutor, resolve_device
from gpu_worker.loader import load_trainer
from gpu_worker.process import warm_up


def base_plan_key(plan_key: str) -> str:
    """The study's plan key of a trial-mode plan (``<key>/trial/<id>``), else the key itself."""
    return plan_key.split("/trial/", 1)[0]


class TopicControl:
    """The :class:`~events.execution.Control` of a path on a Kafka worker: decisions about it
    arrive on the worker's dispatch records; they are read at most every ``every_s`` seconds
    (a read costs a fetch), from the offset after the dispatch."""

    def __init__(self, log: EventLog, worker_id: str, start: int, every_s: float = 0.5) -> None:
        self.log, self.worker_id, self.position, self.every_s = log, worker_id, start, every_s
        self.checked = time.monotonic()
        self.arrived: list[Event] = []

    def _read(self) -> None:
        self.checked = time.monotonic()
        for record in self.log.read(topics.DISPATCH, self.position):
            self.position = record.offset + 1
            if record.key != self.worker_id or (b'"PathPreempted"' not in record.value
                                                and b'"CheckpointRequested"' not in record.value):
                continue
            try:
                self.arrived.append(decode(record.value))
            except InvalidEvent:
                continue  # the worker's loop dead-letters it when it reads the record

    def waiting(self) -> bool:
        if not self.arrived and time.monotonic() - self.checked >= self.every_s:
            self._read()
        return bool(self.arrived)

    def poll(self) -> list[Event]:
        out, self.arrived = self.arrived, []
        return out


class KafkaWorker:
    """One worker process on Kafka.

    Args:
        log_factory: makes a transport (a KafkaLog); called twice, for the main loop and the
            heartbeat thread, since a transport is used from one thread at a time.
        worker_id: this worker's id (dispatch records are keyed by it).
        store: the checkpoint store.
        device: torch device spec (``auto``, ``cpu``, ``cuda:N``).
        study_file: the study file to build trainers from; None: the file recorded by the
            StudyStarted event of each dispatch's plan.
        heartbeat_s: seconds between beats.
        poll_s: seconds between reads of the dispatch stream when idle.
    """

    def __init__(self, log_factory: Callable[[], EventLog], worker_id: str, store: CheckpointStore,
                 device: str = "auto", *, study_file: str | None = None, heartbeat_s: float = 1.0,
                 poll_s: float = 0.02, threads: int = 1) -> None:
        self.log_factory = log_factory
        self.log = log_factory()
        self.worker_id = worker_id
        self.store = store
        torch.set_num_threads(threads)
        self.device = resolve_device(device)
        self.study_file = study_file
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.stop = threading.Event()
        self._executors: dict[str, PathExecutor] = {}
        self._studies: dict[str, str] = {}  # plan key -> study file, from StudyStarted
        self._plan_read = 0
        self._lost_read = 0

    def _study_file_for(self, plan_key: str) -> str:
        if self.study_file is not None:
            return self.study_file
        key = base_plan_key(plan_key)
        if key not in self._studies:
            for record in self.log.read(topics.PLAN, self._plan_read):
                self._plan_read = record.offset + 1
                if b'"StudyStarted"' not in record.value:
                    continue
                try:
                    event = decode(record.value)
                except InvalidEvent:
                    continue
                if isinstance(event, StudyStarted) and event.study_file:
                    self._studies[event.plan_key] = event.study_file
        if key not in self._studies:
            raise LookupError(f"no StudyStarted with a study file for plan {key!r}: pass --study")
        return self._studies[key]

    def _executor_for(self, d: StageDispatched) -> PathExecutor:
        path = self._study_file_for(d.plan_key)
        if path not in self._executors:
            self._executors[path] = PathExecutor(load_trainer(Path(path)), self.worker_id, self.store, self.device)
        return self._executors[path]

    def _emit(self, events: list[Event]) -> None:
        self.log.append_many(topics.PLAN, [(event_key(e), encode(e)) for e in events])

    def _beat(self) -> None:
        log = self.log_factory()
        try:
            while not self.stop.is_set():
                log.append(topics.HEARTBEAT, self.worker_id,
                           orjson.dumps({"worker_id": self.worker_id, "ts": time.time()}))
                self.stop.wait(self.heartbeat_s)
        finally:
            log.close()

    def _join(self) -> int:
        """Publish WorkerJoined; returns the dispatch offset to read from (earlier ones are void)."""
        start = self.log.end_offset(topics.DISPATCH)
        self._emit([WorkerJoined(producer=f"worker:{self.worker_id}", ts=time.time(), worker_id=self.worker_id,
                                 device=str(self.device))])
        self._lost_read = self.log.end_offset(topics.PLAN)
        return start

    def _declared_lost(self) -> bool:
        """Whether the plan stream says this worker was declared lost since it joined (it was
        silent too long, e.g. paused or cut off): then it joins again."""
        lost = False
        for record in self.log.read(topics.PLAN, self._lost_read):
            self._lost_read = record.offset + 1
            if record.key == self.worker_id and b'"WorkerLost"' in record.value:
                lost = True
        return lost

    def run(self) -> None:
        """Join, then serve dispatches until :attr:`stop` is set (after the current path)."""
        if self.study_file is not None:  # start-up costs before joining, not in worker-seconds
            executor = self._executors[self.study_file] = PathExecutor(
                load_trainer(Path(self.study_file)), self.worker_id, self.store, self.device)
            warm_up(executor.trainer, self.device)
        start = self._join()
        beat = threading.Thread(target=self._beat, name=f"heartbeat-{self.worker_id}", daemon=True)
        beat.start()
        checked = time.monotonic()
        try:
            while not self.stop.is_set():
                if time.monotonic() - checked > 1.0:
                    checked = time.monotonic()
                    if self._declared_lost():
                        start = self._join()
                got = False
                for record in self.log.read(topics.DISPATCH, start):
                    start, got = record.offset + 1, True
                    if record.key != self.worker_id:
                        continue
                    try:
                        dispatch = decode(record.value)
                        if isinstance(dispatch, (PathPreempted, CheckpointRequested)):
                            continue  # about a path that has ended (it finished first): nothing to do
                        if not isinstance(dispatch, StageDispatched):
                            raise InvalidEvent(f"the dispatch stream holds StageDispatched, PathPreempted and "
                                               f"CheckpointRequested events, not {dispatch.type}")
                    except InvalidEvent as exc:  # one rule: dead-letter with the reason, never skip silently
                        letter = dead_letter(topics.DISPATCH, record.offset, record.value, exc.reason,
                                             producer=f"worker:{self.worker_id}")
                        self.log.append(topics.DEADLETTER, record.key, encode(letter))
                        continue
                    control = TopicControl(self.log, self.worker_id, start)
                    self._executor_for(dispatch).run(dispatch, self._emit, control)
                    if self.stop.is_set():
                        break
                if not got:
                    self.stop.wait(self.poll_s)
        finally:
            self.stop.set()
            beat.join(timeout=5)
            self.log.close()
