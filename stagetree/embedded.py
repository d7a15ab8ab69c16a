"""Embedded mode: one coordinator process, an embedded RocksDB log, N worker subprocesses.

The coordinator is the only writer of the log and the projection (DESIGN.md "Processes").
It appends what the SDK submits and what workers report, folds the plan stream with the
projector, and after every fold asks the scheduler for decisions, appending each
StageDispatched (to ``stagetree.plan`` and ``stagetree.dispatch``) before sending it to the
worker's pipe. Everything runs on one asyncio loop; worker pipes are read by one thread each,
which only hands raw bytes to the loop. A worker's batch of events is appended atomically; a
message that cannot be decoded is dead-lettered.

Durability: a kill -9 of the coordinator loses no append (every write is in the operating
system's hands when it returns). Against a power loss: what the SDK submits is appended with
an fsync before its answer; the scheduler's decisions and the workers' reports are made durable
by the log's group commit (:meth:`events.log.EmbeddedLog.sync_soon`: a background fsync, a few
milliseconds, shared by every write made meanwhile), and explicitly before anything that
outlives this machine's processes depends on them: the deletion of evicted objects and the end
of the run (:meth:`EmbeddedCoordinator.stop`). A power loss ends the workers too, so it can lose
only a tail of the log that nothing still running acted on (a checkpoint object written for a
lost decision is named by nothing; the stage is dispatched again on resume).

A worker process that exits unexpectedly (at start-up or later) is declared lost, its path is
dispatched again, and its slot gets a new process, up to ``max_restarts`` times.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from events import topics, tracing
from events.codec import InvalidEvent, decode_batch, encode
from events.deadletter import dead_letter
from events.log import EmbeddedLog, append_event_streams, event_key
from events.models import COORDINATOR_RESTARTED, DeadLettered, Event, StageDispatched, WorkerJoined, WorkerLost
from gpu_worker.boot import STOP, embedded_worker_main
from gpu_worker.checkpoint import LocalCheckpointStore
from projections.store import ProjectionStore, Projector
from scheduler.service import SchedulerService
from stagetree.runtime import RuntimeBase, RuntimeError_
from stagetree.worker_processes import (
    MAX_RESTARTS,
    PrestartedWorkers,
    describe_exit,
    start_process,
    worker_start_method,
)


class CoordinatorError(RuntimeError_):
    """The coordinator cannot continue (e.g. its own decision was rejected by the reducer)."""


@dataclass
class _Slot:
    """One worker slot: its current process (``generation`` counts the processes started)."""

    worker_id: str
    index: int
    process: mp.process.BaseProcess | None = None
    conn: Connection | None = None
    generation: int = 0
    restarts: int = 0
    joined: bool = False
    gave_up: str | None = None  # why the slot was given up (restart budget spent)


class EmbeddedCoordinator(RuntimeBase):
    """Owns ``run_dir`` (``log/``, ``state/``, ``checkpoints/``) and the worker processes.

    Args:
        run_dir: the run directory; reopening it continues from the log (``--resume``).
        study_file: the study file the workers import to build the trainer.
        workers: number of worker processes (one per device).
        device: ``auto`` (``cuda:i`` when present, else cpu), ``cpu`` or ``cuda:N``.
        threads: torch threads per worker.
        secret: HMAC key of the log's hash chain (None: plain sha256).
        max_restarts: times a worker slot is started again after its process exited
            unexpectedly (at start-up or later); its path is dispatched again meanwhile.
        say: where notices go (a worker exited, is started again); default: standard error.
        checkpoint_budget: bytes of checkpoints the run may keep (None: unbounded); see
            ``scheduler.eviction``.
        prestarted: processes started earlier (:class:`PrestartedWorkers`), used for the
            workers' first start instead of starting new ones.
        start_method: how worker processes start (``auto``, ``spawn``, ``forkserver``; default
            ``$STAGETREE_WORKER_START``, else ``auto``): see :func:`worker_start_method`.

    Use as an async context manager inside a running loop.
    """

    failure_type = CoordinatorError

    def __init__(self, run_dir: str | Path, study_file: str | Path, workers: int, *, device: str = "auto",
                 threads: int = 1, secret: bytes | None = None, max_restarts: int = MAX_RESTARTS,
                 say: Callable[[str], None] | None = None, checkpoint_budget: int | None = None,
                 prestarted: PrestartedWorkers | None = None, start_method: str | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"`workers` is {workers!r}, but must be an int >= 1 in embedded mode")
        self.start_method = worker_start_method(device, start_method)
        self.run_dir = Path(run_dir)
        self.study_file = Path(study_file)
        self.workers = workers
        self.device = device
        self.threads = threads
        self.max_restarts = max_restarts
        self.prestarted = prestarted
        self.say = say if say is not None else (lambda text: print(text, file=sys.stderr, flush=True))
        self.log = EmbeddedLog(self.run_dir / "log", secret=secret)
        self.store = ProjectionStore(self.run_dir / "state")
        super().__init__(Projector(self.log, store=self.store, secret=secret))
        self.projector.catch_up()
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self._slots: dict[str, _Slot] = {f"w{i}": _Slot(f"w{i}", i) for i in range(workers)}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: asyncio.Queue[tuple[str, int, bytes | None]] | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self.checkpoints = LocalCheckpointStore(self.checkpoint_dir)
        self.scheduler = SchedulerService(self.log, self.projector, deliver=self._send,
                                          checkpoint_budget=checkpoint_budget, delete=self._delete)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> EmbeddedCoordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Declare workers of an earlier incarnation lost, then start this run's workers."""
        self._loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        stale = [w for w in sorted(self.state.workers) if self.state.workers[w].alive]
        if stale:
            self.append([WorkerLost(producer="coordinator", worker_id=w, reason=COORDINATOR_RESTARTED)
                         for w in stale])
        self.scheduler.collect_garbage()  # objects of evictions a crash left undeleted; no worker writes yet
        for slot in self._slots.values():
            self._spawn(slot)
        self._pump_task = asyncio.create_task(self._pump())

    def _spawn(self, slot: _Slot) -> None:
        """Start a worker process for ``slot`` and a thread reading its pipe."""
        assert self._loop is not None
        args = (slot.worker_id, slot.index, str(self.study_file), str(self.checkpoint_dir), self.device,
                self.threads, tracing.spec(), dict(os.environ))
        taken = self.prestarted.take() if self.prestarted is not None and slot.generation == 0 else None
        if taken is not None:
            proc, parent = taken
            parent.send(args)
        else:
            proc, parent = start_process(embedded_worker_main, args, f"stagetree-worker-{slot.worker_id}",
                                         self.start_method)
        slot.generation += 1
        slot.process, slot.conn, slot.joined = proc, parent, False
        threading.Thread(target=self._read_pipe, args=(self._loop, slot.worker_id, slot.generation, parent),
                         daemon=True).start()

    async def stop(self) -> None:
        """Stop workers and close the log and the store."""
        self._stopping = True
        for slot in self._slots.values():
            try:
                if slot.conn is not None:
                    slot.conn.send_bytes(STOP)
            except OSError:
                pass
        for slot in self._slots.values():
            if slot.process is not None:
                await asyncio.get_running_loop().run_in_executor(None, slot.process.join, 10)
                if slot.process.is_alive():
                    slot.process.kill()
        if self._pump_task is not None:
            self._pump_task.cancel()
        self.log.sync()
        self.log.close()
        self.store.close()

    def _read_pipe(self, loop: asyncio.AbstractEventLoop, worker_id: str, generation: int, conn: Connection) -> None:
        assert self._inbox is not None
        while True:
            try:
                data: bytes | None = conn.recv_bytes()
            except (EOFError, OSError):
                data = None
            try:
                loop.call_soon_threadsafe(self._inbox.put_nowait, (worker_id, generation, data))
            except RuntimeError:  # loop closed
                return
            if data is None:
                return

    async def _pump(self) -> None:
        assert self._inbox is not None
        while True:
            items = [await self._inbox.get()]
            while not self._inbox.empty():
                items.append(self._inbox.get_nowait())
            events: list[Event] = []
            dead: list[DeadLettered] = []
            for worker_id, generation, data in items:
                slot = self._slots[worker_id]
                if generation != slot.generation:
                    continue  # an earlier process of the slot, already replaced
                if data is None:
                    events += self._exited(slot)
                    continue
                try:
                    batch = decode_batch(data)
                except InvalidEvent as exc:
                    dead.append(dead_letter(f"pipe:{worker_id}", -1, data, exc.reason, producer="coordinator"))
                    continue
                for event in batch:
                    if isinstance(event, DeadLettered):
                        dead.append(event)  # the worker's own dead letter (a bad dispatch message)
                    else:
                        events.append(event)
                        if isinstance(event, WorkerJoined):
                            slot.joined = True
            if dead:
                self.log.append_many(topics.DEADLETTER, [(letter.stream, encode(letter)) for letter in dead])
            if events:
                try:
                    self.append(events, durable=False)  # see "Durability" in the module docstring
                except Exception:  # append() handed the failure to every waiting future
                    return

    def _exited(self, slot: _Slot) -> list[Event]:
        """The events of ``slot``'s process having exited (while not stopping): WorkerLost when it
        had a record in the log, and a new process unless the restart budget is spent."""
        if self._stopping:
            return []
        proc = slot.process
        if proc is not None:
            proc.join(timeout=5)
        how = describe_exit(proc.exitcode if proc is not None else None)
        when = "while running" if slot.joined else "during start-up"
        pid = proc.pid if proc is not None else "?"
        events: list[Event] = []
        known = self.state.workers.get(slot.worker_id)
        if known is not None and known.alive:
            events.append(WorkerLost(producer="coordinator", worker_id=slot.worker_id,
                                     reason=f"process {pid} {how} {when}"))
        if slot.restarts < self.max_restarts:
            slot.restarts += 1
            self.say(f"worker {slot.worker_id} (pid {pid}) {how} {when}; starting it again "
                     f"(restart {slot.restarts} of {self.max_restarts})")
            self._spawn(slot)
        else:
            slot.gave_up = f"worker {slot.worker_id} (pid {pid}) {how} {when}, after {slot.restarts} restarts"
            slot.process, slot.conn = None, None
            self.say(f"{slot.gave_up}; not starting it again")
        return events

    # ------------------------------------------------------------------ the Runtime protocol

    def append(self, events: list[Event], durable: bool = True) -> None:
        """Stamp and append events to the plan stream (atomically), fold, schedule, and resolve
        futures. ``durable=False`` (the workers' reports) leaves the fsync to the log's group
        commit (see "Durability" in the module docstring)."""
        if self.failure is not None:
            raise CoordinatorError(f"the coordinator failed: {self.failure}")
        try:
            append_event_streams(self.log, [(topics.PLAN, [(event_key(e), e) for e in self.stamp(events)])],
                                 durable=durable)
            if not durable:
                self.log.sync_soon()
            self._fold()
            if not self._stopping and all(slot.gave_up for slot in self._slots.values()):
                raise CoordinatorError("every worker process has exited and was given up: "
                                       + "; ".join(str(slot.gave_up) for slot in self._slots.values()))
        except Exception as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------------ internals

    def _fold(self) -> None:
        """Fold new records, run the scheduler service, resolve futures, tell listeners."""
        self.projector.catch_up()
        self.scheduler.run_pass()
        self._notify()

    async def ready(self, timeout: float = 300.0) -> None:
        """Wait until every worker slot has joined (start-up is not study time); a worker that
        dies while starting is started again (up to ``max_restarts`` times).

        Raises:
            CoordinatorError: a slot spent its restart budget, or not every worker joined within
                ``timeout`` seconds (the message says which and what happened).
        """
        deadline = time.monotonic() + timeout
        while not all(self._joined(w) for w in self._slots):
            given_up = [slot.gave_up for slot in self._slots.values() if slot.gave_up]
            if given_up:
                raise CoordinatorError("; ".join(given_up) + ": see its output above")
            if self.failure is not None:
                raise CoordinatorError(f"the coordinator failed while workers started: {self.failure}")
            if time.monotonic() > deadline:
                waiting = [w for w in sorted(self._slots) if not self._joined(w)]
                raise CoordinatorError(f"workers {waiting} were still starting after {timeout:g} s (their processes "
                                       "are alive but have not joined): see their output above")
            await asyncio.sleep(0.02)

    def _joined(self, worker_id: str) -> bool:
        worker = self.state.workers.get(worker_id)
        return self._slots[worker_id].joined and worker is not None and worker.alive

    def _delete(self, refs: list[str]) -> None:
        for ref in refs:
            self.checkpoints.delete(ref)

    def _send(self, decision: Event) -> None:
        slot = self._slots.get(decision.worker_id)  # type: ignore[attr-defined]
        try:
            if slot is None or slot.conn is None:
                raise OSError("no process")
            slot.conn.send_bytes(encode(decision))
        except OSError:
            if not isinstance(decision, StageDispatched):
                return  # a decision about a path of a worker that is gone: its loss is handled
            # The process is gone; its pipe's end is handled by the pump (lost, started again).
            # Until then the dispatch waits on a worker that cannot run it: declare it lost now.
            self.append([WorkerLost(producer="coordinator", worker_id=decision.worker_id,
                                    reason="its pipe closed before a dispatch could be sent")])
