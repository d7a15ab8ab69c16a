"""``stagetree serve``: the stream processors of Kafka mode, as one faust-streaming app.

Any number of ``stagetree serve`` processes with the same ``--app-id`` form one faust app (one
consumer group). faust assigns each instance some partitions of the topics below, moves them
when an instance joins or dies, and tells the instance (``on_partitions_assigned`` /
``on_partitions_revoked``):

* ``project`` consumes ``stagetree.plan`` (``--plan-partitions``, default 8; keyed by plan key,
  so a partition holds the whole history of its plans). For every assigned partition the
  instance opens a RocksDB projection store (``STATE_DIR/plan-<p>``: the same pure reducer as
  embedded mode, state and offset committed in one batch), folds what the partition holds after
  the store's offset, then folds every record the agent receives; revoked, the store is closed
  (:class:`projections.partitions.PartitionStores`). Undecodable or rejected records are
  dead-lettered with the reason.
* ``beats`` consumes ``stagetree.heartbeat`` (one partition). The instance that owns it holds
  the **scheduler role** (:mod:`scheduler.role`): it decides, for all plans at once, each idle
  worker's critical path, declares silent workers lost, and seals every partition's hash chain,
  all through one transactional producer (``<prefix>stagetree.scheduler``) that fences the
  previous holder. Every instance keeps a hot standby of the role's input (an in-memory fold of
  every plan partition, read ``read_committed``), so a take-over only fences and catches up.

faust's consumer is made ``read_committed`` (:class:`ServeApp`): records of an aborted
transaction, e.g. a fenced zombie's decision, are never folded. Offsets then have gaps; every
fold tracks the last offset it applied.

One instance per state directory: ``stagetree serve`` holds an exclusive lock on
``STATE_DIR/serve.lock`` for its lifetime (:mod:`stagetree.state_lock`), so a second serve on it
is refused (exit 2) before it starts, rather than crashing in faust on a store's RocksDB lock
once the group assigns it a partition; a killed holder's lock is gone with it.

Restart: the stores in ``--state-dir`` are reloaded and each folds the log from its own offset
(DESIGN.md: state is a fold over the log), so the projections are byte-identical after a
restart; faust's committed group offsets only say where its consumer resumes, and a record
delivered twice is skipped by the store's offset.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
from pathlib import Path

import faust
import orjson
from faust.transport.drivers import aiokafka as faust_aiokafka

from events import topics
from events.deadletter import dead_letter
from events.kafka_log import KafkaLog
from events.log import Record
from gpu_worker.checkpoint import CheckpointStore
from projections.partitions import PartitionStores
from scheduler.role import SchedulerRole

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- read_committed faust


class _ReadCommittedThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport):  # type: ignore[no-untyped-def]
        consumer = super()._create_worker_consumer(transport)
        # faust reads read_committed only with processing_guarantee="exactly_once", whose own
        # per-partition transactions stagetree does not use (its decisions have their own).
        consumer._isolation_level = "read_committed"
        return consumer


class _ReadCommittedConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> _ReadCommittedThread:
        return _ReadCommittedThread(self, loop=self.loop, beacon=self.beacon)


class _ReadCommittedTransport(faust_aiokafka.Transport):
    Consumer = _ReadCommittedConsumer


class ServeApp(faust.App):
    """A faust app whose consumer reads ``read_committed``."""

    def _new_transport(self):  # type: ignore[no-untyped-def]
        return _ReadCommittedTransport(self.conf.broker_consumer, self)


# ----------------------------------------------------------------------------- the app


def default_instance() -> str:
    """This process's instance name: host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def heartbeat_worker(value: bytes) -> str:
    """The worker id of a beat ``{"worker_id": ..., "ts": ...}``.

    Raises:
        ValueError: the beat is not such an object (the reason names what is wrong).
    """
    try:
        beat = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(beat, dict):
        raise ValueError(f"a beat must be a JSON object, got {type(beat).__name__}")
    worker_id = beat.get("worker_id")
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"`worker_id` is {worker_id!r}, but must be a non-empty string")
    return worker_id


class Serve:
    """One serve instance: its partition stores, its scheduler role, and the faust app."""

    def __init__(self, log: KafkaLog, role_log: KafkaLog, state_dir: Path, *, app_id: str, instance: str,
                 heartbeat_timeout_s: float = 10.0, secret: bytes | None = None, policy: str = "critical-path",
                 session_timeout_s: float = 8.0, checkpoint_budget: int | None = None,
                 store: CheckpointStore | None = None) -> None:
        if isinstance(session_timeout_s, bool) or not isinstance(session_timeout_s, (int, float)) \
                or not math.isfinite(session_timeout_s) or session_timeout_s <= 0:
            raise ValueError(f"`session_timeout_s` is {session_timeout_s!r}, but must be seconds > 0")
        self.log = log
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.instance = instance
        self.partitions = log.partition_count(topics.PLAN)
        self.stores = PartitionStores(log, self.state_dir, secret=secret)
        self.role = SchedulerRole(role_log, instance=instance, heartbeat_timeout_s=heartbeat_timeout_s,
                                  secret=secret, policy=policy, checkpoint_budget=checkpoint_budget, store=store,
                                  regrant_after_s=2 * session_timeout_s)
        self._opening: dict[int, list[Record]] = {}
        self.app = ServeApp(
            app_id,
            broker=f"kafka://{log.bootstrap_servers.split(',')[0]}",
            store="memory://",
            datadir=str(self.state_dir / "faust"),  # not the current directory
            web_enabled=False,
            topic_replication_factor=log.replication_factor,
            topic_partitions=1,
            producer_acks=-1,
            consumer_auto_offset_reset="earliest",
            # a dead instance's partitions (and role) move once its session expires
            broker_session_timeout=session_timeout_s,
            broker_heartbeat_interval=max(0.5, session_timeout_s / 4),
            broker_rebalance_timeout=max(10.0, 2 * session_timeout_s),
        )
        self.plan_topic = log.topic(topics.PLAN)
        self.heartbeat_topic = log.topic(topics.HEARTBEAT)
        plan = self.app.topic(self.plan_topic, value_serializer="raw", key_serializer="raw",
                              partitions=self.partitions)
        heartbeat = self.app.topic(self.heartbeat_topic, value_serializer="raw", key_serializer="raw", partitions=1)
        self.app.agent(plan, name="project")(self._project)
        self.app.agent(heartbeat, name="beats")(self._beats)
        self.app.on_partitions_assigned.connect(self._assigned)
        self.app.on_partitions_revoked.connect(self._revoked)
        self._role_thread = threading.Thread(target=self.role.run, name="scheduler-role", daemon=True)

    async def _project(self, stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            message = event.message
            record = Record(topics.PLAN, message.offset, (message.key or b"").decode("utf-8", "replace"),
                            message.value or b"", b"", message.partition)
            if message.partition in self._opening:
                self._opening[message.partition].append(record)
            else:
                self.stores.fold(record)

    async def _beats(self, stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            message = event.message
            try:
                worker_id = heartbeat_worker(message.value or b"")
            except ValueError as exc:  # dead-lettered by the role, never skipped silently
                reason = f"not a heartbeat ({exc}); a heartbeat is {{\"worker_id\": ..., \"ts\": ...}}"
                self.role.bad_beat(dead_letter(topics.HEARTBEAT, message.offset, bytes(message.value or b""), reason,
                                               producer=f"serve:{self.instance}"), message.offset)
                continue
            self.role.beat(worker_id, message.offset)

    async def _assigned(self, app, assigned, **kwargs) -> None:  # type: ignore[no-untyped-def]
        plan = sorted(tp.partition for tp in assigned if tp.topic == self.plan_topic)
        loop = asyncio.get_running_loop()
        for partition in plan:
            if partition in self.stores.owned:
                continue
            self._opening[partition] = []
            try:
                await loop.run_in_executor(None, self.stores.open, partition)
            finally:
                pending = self._opening.pop(partition)
            for record in pending:
                self.stores.fold(record)
        if any(tp.topic == self.heartbeat_topic for tp in assigned):
            self.role.grant()
        log.info("serve %s: assigned plan partitions %s", self.instance, plan)

    async def _revoked(self, app, revoked, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if any(tp.topic == self.heartbeat_topic for tp in revoked):
            self.role.revoke()
        for tp in revoked:
            if tp.topic == self.plan_topic:
                self.stores.close(tp.partition)

    def run(self) -> None:
        """Run until SIGTERM / SIGINT."""
        from faust.worker import Worker

        self._role_thread.start()
        try:
            Worker(self.app, loglevel="warning", quiet=True).execute_from_commandline()
        finally:
            self.role.stop.set()
            self._role_thread.join(timeout=30)
            self.stores.close_all()


def ensure_topics(log: KafkaLog) -> None:
    """Create the deployment's topics if missing (the plan stream with its partitions)."""
    for stream in topics.ALL:
        log.ensure_topic(stream)


def serve(log: KafkaLog, role_log: KafkaLog, state_dir: Path, *, app_id: str, instance: str | None = None,
          heartbeat_timeout_s: float = 10.0, secret: bytes | None = None, session_timeout_s: float = 8.0,
          checkpoint_budget: int | None = None, store: CheckpointStore | None = None) -> None:
    """Run a serve instance until it is stopped (SIGTERM / SIGINT). ``role_log`` is a second
    transport, used by the scheduler role's thread alone; ``store`` is the checkpoint store the
    role deletes evicted checkpoints from (under ``checkpoint_budget`` bytes)."""
    ensure_topics(log)
    Serve(log, role_log, state_dir, app_id=app_id, instance=instance or default_instance(),
          heartbeat_timeout_s=heartbeat_timeout_s, secret=secret, session_timeout_s=session_timeout_s,
          checkpoint_budget=checkpoint_budget, store=store).run()
