"""Embedded mode: one coordinator process, an embedded RocksDB log, N worker subprocesses.

The coordinator is the only writer of the log and the projection (DESIGN.md "Processes").
It appends what the SDK submits and what workers report, folds the plan stream with the
projector, and after every fold asks the scheduler for decisions, appending each
StageDispatched (to ``stagetree.plan`` and ``stagetree.dispatch``) before sending it to the
worker's pipe. Everything runs on one asyncio loop; worker pipes are read by one thread each,
which only hands raw bytes to the loop.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path


from events import topics, tracing
from events.codec import InvalidEvent, decode, encode
from events.log import EmbeddedLog, append_events, event_key
from events.models import DeadLettered, Event, StageDispatched, WorkerLost
from gpu_worker.process import STOP, embedded_worker_main
from projections.store import ProjectionStore, Projector
from scheduler.service import SchedulerService
from stagetree.runtime import RuntimeBase, RuntimeError_


class CoordinatorError(RuntimeError_):
    """The coordinator cannot continue (e.g. its own decision was rejected by the reducer)."""


class EmbeddedCoordinator(RuntimeBase):
    """Owns ``run_dir`` (``log/``, ``state/``, ``checkpoints/``) and the worker processes.

    Args:
        run_dir: the run directory; reopening it continues from the log (``--resume``).
        study_file: the study file the workers import to build the trainer.
        workers: number of worker processes (one per device).
        device: ``auto`` (``cuda:i`` when present, else cpu), ``cpu`` or ``cuda:N``.
        threads: torch threads per worker.
        secret: HMAC key of the log's hash chain (None: plain sha256).

    Use as an async context manager inside a running loop.
    """

    failure_type = CoordinatorError

    def __init__(self, run_dir: str | Path, study_file: str | Path, workers: int, *, device: str = "auto",
                 threads: int = 1, secret: bytes | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"`workers` is {workers!r}, but must be an int >= 1 in embedded mode")
        self.run_dir = Path(run_dir)
        self.study_file = Path(study_file)
        self.workers = workers
        self.device = device
        self.threads = threads
        self.log = EmbeddedLog(self.run_dir / "log", secret=secret)
        self.store = ProjectionStore(self.run_dir / "state")
        super().__init__(Projector(self.log, store=self.store, secret=secret))
        self.projector.catch_up()
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self._conns: dict[str, Connection] = {}
        self._procs: dict[str, mp.process.BaseProcess] = {}
        self._stopping = False
        self._inbox: asyncio.Queue[tuple[str, bytes | None]] | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self.scheduler = SchedulerService(self.log, self.projector, deliver=self._send)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> EmbeddedCoordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Declare workers of an earlier incarnation lost, then start this run's workers."""
        loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        stale = [w for w in sorted(self.state.workers) if self.state.workers[w].alive]
        if stale:
            self.append([WorkerLost(producer="coordinator", worker_id=w, reason="coordinator restarted")
                         for w in stale])
        ctx = mp.get_context("spawn")
        for i in range(self.workers):
            worker_id = f"w{i}"
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=embedded_worker_main,
                args=(child, worker_id, i, str(self.study_file), str(self.checkpoint_dir), self.device, self.threads,
                      tracing.spec()),
                name=f"stagetree-worker-{worker_id}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns[worker_id], self._procs[worker_id] = parent, proc
            threading.Thread(target=self._read_pipe, args=(loop, worker_id, parent), daemon=True).start()
        self._pump_task = asyncio.create_task(self._pump())

    async def stop(self) -> None:
        """Stop workers and close the log and the store."""
        self._stopping = True
        for conn in self._conns.values():
            try:
                conn.send_bytes(STOP)
            except OSError:
                pass
        for proc in self._procs.values():
            await asyncio.get_running_loop().run_in_executor(None, proc.join, 10)
            if proc.is_alive():
                proc.kill()
        if self._pump_task is not None:
            self._pump_task.cancel()
        self.log.close()
        self.store.close()

    def _read_pipe(self, loop: asyncio.AbstractEventLoop, worker_id: str, conn: Connection) -> None:
        assert self._inbox is not None
        while True:
            try:
                data: bytes | None = conn.recv_bytes()
            except (EOFError, OSError):
                data = None
            try:
                loop.call_soon_threadsafe(self._inbox.put_nowait, (worker_id, data))
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
            dead: list[tuple[str, bytes]] = []
            for worker_id, data in items:
                if data is None:
                    if not self._stopping and self.state.workers.get(worker_id, None) is not None:
                        events.append(WorkerLost(producer="coordinator", worker_id=worker_id, reason="process exited"))
                    continue
                try:
                    events.append(decode(data))
                except InvalidEvent as exc:
                    letter = DeadLettered(producer="coordinator", stream=f"pipe:{worker_id}", offset=-1,
                                          reason=exc.reason, raw=data.decode("utf-8", "replace"))
                    dead.append((worker_id, encode(letter)))
            if dead:
                self.log.append_many(topics.DEADLETTER, dead)
            if events:
                try:
                    self.append(events)
                except Exception:  # append() handed the failure to every waiting future
                    return

    # ------------------------------------------------------------------ the Runtime protocol

    def append(self, events: list[Event]) -> None:
        """Stamp and append events to the plan stream, fold, schedule, and resolve futures."""
        if self.failure is not None:
            raise CoordinatorError(f"the coordinator failed: {self.failure}")
        try:
            append_events(self.log, topics.PLAN, [(event_key(e), e) for e in self.stamp(events)])
            self._fold()
            if not self._stopping and self._procs and not any(w.alive for w in self.state.workers.values()) \
                    and not any(p.is_alive() for p in self._procs.values()):
                raise CoordinatorError("every worker process has exited; see the WorkerLost events")
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
        """Wait until every worker of this run has joined (start-up is not study time).

        Raises:
            CoordinatorError: a worker did not join within ``timeout`` seconds (or exited).
        """
        deadline = time.monotonic() + timeout
        while not all(w in self.state.workers and self.state.workers[w].alive for w in self._procs):
            if self.failure is not None or time.monotonic() > deadline or \
                    any(not p.is_alive() for p in self._procs.values()):
                raise CoordinatorError(f"workers did not start within {timeout} s: see their output above")
            await asyncio.sleep(0.02)

    def _send(self, decision: StageDispatched) -> None:
        try:
            self._conns[decision.worker_id].send_bytes(encode(decision))
        except (OSError, KeyError):
            self.append([WorkerLost(producer="coordinator", worker_id=decision.worker_id, reason="pipe closed")])
