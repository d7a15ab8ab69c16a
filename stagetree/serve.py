"""``stagetree serve``: the stream processors of Kafka mode, as a faust-streaming app.

Agents:

* ``project`` consumes ``stagetree.plan``. The projection is the same pure reducer as embedded
  mode, folded by :class:`projections.store.Projector` into a RocksDB store (rocksdict) that
  commits state and offset in one batch. Faust delivers the records and wakes the agent; the
  projector reads on from its *own* stored offset, so a record faust redelivers is skipped and
  one faust skipped (its offsets are committed separately) is still folded: exactly once, in
  order, whatever faust's consumer group did. After each fold the scheduler service appends
  its decisions (StageDispatched to ``stagetree.plan`` and ``stagetree.dispatch``).
* ``beats`` consumes ``stagetree.heartbeat``; a timer declares a worker lost (a WorkerLost
  event, decided by this process's clock and recorded, so a replay never reads a clock) when
  it has been silent for ``heartbeat_timeout_s``.

Sealing: this process is the one folder of the plan stream, so it keeps the stream's hash chain
and appends LogSealed events (the chain after an offset, sha256 or HMAC with ``--log-key``),
which ``replay verify kafka://...`` checks.

Restart: the store in ``state_dir`` is loaded and the projector folds the log from its offset
(DESIGN.md: state is a fold over the log), so the search plan is byte-identical after a
restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import faust
import orjson

from events import topics
from events.codec import encode
from events.deadletter import dead_letter
from events.kafka_log import KafkaLog
from events.log import chain_algorithm
from events.models import LogSealed, WorkerLost
from gpu_worker.checkpoint import CheckpointStore
from projections.state import State
from projections.store import ProjectionStore, Projector
from scheduler.service import SchedulerService

log = logging.getLogger(__name__)


class HeartbeatMonitor:
    """Last beat per worker (monotonic seconds, this process's clock)."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"`heartbeat_timeout_s` is {timeout_s!r}, but must be > 0")
        self.timeout_s = timeout_s
        self.last: dict[str, float] = {}

    def beat(self, worker_id: str, now: float) -> None:
        self.last[worker_id] = now

    def silent(self, state: State, now: float) -> list[str]:
        """Alive workers (in ``state``) silent for longer than the timeout; a worker never heard
        from gets the timeout as grace from the first check."""
        out = []
        for worker_id, worker in sorted(state.workers.items()):
            if not worker.alive:
                self.last.pop(worker_id, None)
                continue
            seen = self.last.setdefault(worker_id, now)
            if now - seen > self.timeout_s:
                out.append(worker_id)
                self.last.pop(worker_id)
        return out


class Service:
    """The projector, scheduler service and heartbeat monitor of one serve process."""

    def __init__(self, log: KafkaLog, state_dir: Path, heartbeat_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, startup_grace_s: float = 20.0,
                 secret: bytes | None = None, checkpoint_budget: int | None = None,
                 store: CheckpointStore | None = None) -> None:
        self.log = log
        self.projection_store = ProjectionStore(state_dir)
        self.secret = secret
        self.projector = Projector(log, store=self.projection_store, secret=secret)
        self.sealed_through = -1  # the last record the last seal covers
        self.last_seal = -1  # the offset of that seal itself
        self.store = store
        self.scheduler = SchedulerService(log, self.projector, checkpoint_budget=checkpoint_budget,
                                          delete=self._delete if store is not None else None)
        self.monitor = HeartbeatMonitor(heartbeat_timeout_s)
        self.clock = clock
        # No worker is judged before the heartbeat consumer had time to join its group and
        # catch up: a restarted app must not declare every worker lost at once.
        self.judging_from = clock() + startup_grace_s

    def _delete(self, refs: list[str]) -> None:
        assert self.store is not None
        for ref in refs:
            self.store.delete(ref)

    def step(self) -> None:
        """Fold what is new, schedule, and seal."""
        self.projector.catch_up()
        self.scheduler.run_pass()
        self.seal()

    def seal(self) -> None:
        """Append a LogSealed with the plan stream's hash chain after the last folded record, if
        anything was folded since the last seal (this process is the stream's one folder)."""
        state = self.projector.state
        if state.offset <= self.sealed_through or state.offset == self.last_seal == self.sealed_through + 1:
            return  # nothing new, or nothing but the last seal itself (records between it and what
            # it covers, appended while it was written, are sealed by the next one)
        seal = LogSealed(producer="serve", ts=time.time(), stream=topics.PLAN, offset=state.offset, chain=state.chain,
                         algorithm=chain_algorithm(self.secret))
        # Not folded here: records appended meanwhile must reach a scheduling pass, which the
        # agent runs when it sees the seal (or anything after it).
        self.sealed_through = state.offset
        self.last_seal = self.log.append(topics.PLAN, "seal", encode(seal))

    def check_liveness(self) -> None:
        self.seal()  # records folded by a pass that nobody triggered since
        if self.clock() < self.judging_from:
            return
        lost = self.monitor.silent(self.projector.state, self.clock())
        if lost:
            self.log.append_many(topics.PLAN, [
                (w, encode(WorkerLost(producer="serve", ts=time.time(), worker_id=w,
                                      reason=f"no heartbeat for {self.monitor.timeout_s:g} s")))
                for w in lost
            ])
            self.step()

    def close(self) -> None:
        self.projection_store.close()


def build_app(log: KafkaLog, state_dir: Path, *, app_id: str, heartbeat_timeout_s: float = 10.0,
              liveness_interval_s: float = 0.5, secret: bytes | None = None, checkpoint_budget: int | None = None,
              store: CheckpointStore | None = None) -> tuple[faust.App, Service]:
    """The faust app of ``stagetree serve`` over ``log``'s broker and topics.

    Topics must exist before the app starts (the KafkaLog creates them on first append).
    """
    service = Service(log, state_dir, heartbeat_timeout_s, secret=secret, checkpoint_budget=checkpoint_budget,
                      store=store)
    app = faust.App(
        app_id,
        broker=f"kafka://{log.bootstrap_servers.split(',')[0]}",
        store="memory://",
        datadir=str(state_dir / "faust"),  # not the current directory
        web_enabled=False,
        topic_replication_factor=log.replication_factor,
        topic_partitions=1,
        producer_acks=-1,
        consumer_auto_offset_reset="earliest",
        # a restarted app takes over its partitions once the dead member's session expires
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
    )
    plan = app.topic(log.topic(topics.PLAN), value_serializer="raw", key_serializer="raw", partitions=1)
    heartbeat = app.topic(log.topic(topics.HEARTBEAT), value_serializer="raw", key_serializer="raw", partitions=1)

    @app.agent(plan)
    async def project(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            if event.message.offset > service.projector.state.offset:
                service.step()

    @app.agent(heartbeat)
    async def beats(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            value = event.value
            try:
                worker_id = orjson.loads(value)["worker_id"]
                if not isinstance(worker_id, str) or not worker_id:
                    raise TypeError(f"`worker_id` is {worker_id!r}, but must be a non-empty string")
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:  # dead-lettered, never skipped silently
                reason = (f"not a heartbeat ({type(exc).__name__}: {exc}); "
                          'a heartbeat is {"worker_id": ..., "ts": ...}')
                letter = dead_letter(topics.HEARTBEAT, event.message.offset, bytes(value), reason, producer="serve")
                service.log.append(topics.DEADLETTER, "heartbeat", encode(letter))
                continue
            service.monitor.beat(worker_id, service.clock())

    @app.timer(interval=liveness_interval_s)
    async def liveness() -> None:
        service.check_liveness()

    @app.task
    async def start() -> None:
        service.step()  # fold whatever the store has not seen yet, and schedule

    return app, service


def ensure_topics(log: KafkaLog) -> None:
    """Create the stream topics (one partition each) if missing."""
    for stream in topics.ALL:
        log.ensure_topic(stream)


def serve(log: KafkaLog, state_dir: Path, *, app_id: str, heartbeat_timeout_s: float = 10.0,
          secret: bytes | None = None, checkpoint_budget: int | None = None,
          store: CheckpointStore | None = None) -> None:
    """Run the serve app until it is stopped (SIGTERM / SIGINT)."""
    from faust.worker import Worker

    ensure_topics(log)
    app, service = build_app(log, state_dir, app_id=app_id, heartbeat_timeout_s=heartbeat_timeout_s, secret=secret,
                             checkpoint_budget=checkpoint_budget, store=store)
    try:
        Worker(app, loglevel="warning", quiet=True).execute_from_commandline()
    finally:
        service.close()
