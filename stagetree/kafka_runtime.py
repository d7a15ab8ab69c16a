"""The SDK's runtime on Kafka: submit trials as events, learn results by folding the plan topic.

The client keeps its own in-memory projection of every partition of ``stagetree.plan`` (the
same reducer as everywhere, :class:`projections.partitions.PartitionedFold`), following the
partitions as records arrive; futures resolve when the merged view shows a trial's metrics. It
writes nothing but its own submissions (to the partition of their plan key): the serve
instances project and schedule, workers train.

Every append is one Kafka transaction of a producer whose ``transactional.id`` names the study
the client drives (``<prefix>stagetree.study.<name>``), as a worker's names the worker: a second
client of the same study registers that id (:meth:`KafkaRuntime.claim`), which fences the first,
then reads the plan to its end; the first then appends nothing more. The second continues the
study from the log (its tuner decides again from the start, as after a kill); the first stops
with :class:`~stagetree.errors.StudyTakenOver` when it folds the second's StudyStarted, or at
its next append. Two clients never both record a study's decisions.

An append rides out a broker that is away (restarting, unreachable) for up to ``retry_s``
seconds, as a worker does (:meth:`~events.kafka_log.TransactionalAppender.append_retrying`, on
the same producer: an aborted attempt is appended again, a commit in doubt is resumed); none is
written twice and none is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from events import topics
from events.codec import encode
from events.kafka_log import Fenced, Follower, KafkaLog, KafkaLogError, TransactionalAppender, Write, partition_for
from events.log import Record, event_key
from events.models import Event, LogSealed, StudyStarted
from projections.partitions import PartitionedFold
from stagetree.errors import StudyTakenOver
from stagetree.runtime import RuntimeBase, RuntimeError_

log = logging.getLogger(__name__)

RETRY_S = 300.0
"""Seconds an append of the SDK keeps trying through a broker outage (a worker's ``retry_s``)."""


def study_transactional_id(log: KafkaLog, study: str) -> str:
    """The ``transactional.id`` of the client driving study ``study`` on the deployment of ``log``:
    one live writer per study."""
    return f"{log.topic('stagetree.study')}.{study}"


class KafkaRuntime(RuntimeBase):
    """A Study's runtime over ``log`` (a KafkaLog). Start :meth:`run` as a task.

    Args:
        log: the transport (its ``timeout_s`` bounds one attempt of an append).
        poll_s: seconds between folds of new records.
        retry_s: seconds an append keeps trying while the broker is away, before it raises.
        study: the name of the study this client drives: its appends are fenced by a later
            client of the same study (:func:`study_transactional_id`), and a StudyStarted of it
            that is not this client's, folded after this client's :meth:`claim`, stops it. None
            (a client of no study): a writer of its own (``<prefix>stagetree.client.<uuid>``).
    """

    def __init__(self, log: KafkaLog, poll_s: float = 0.02, retry_s: float = RETRY_S,
                 study: str | None = None) -> None:
        log.ensure_topic(topics.PLAN)
        self.partitions = log.partition_count(topics.PLAN)
        fold = PartitionedFold(log, self.partitions)
        super().__init__(fold)  # type: ignore[arg-type]
        self.fold_all = fold
        self.log = log
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.study = study
        self.appender = TransactionalAppender(log, study_transactional_id(log, study) if study is not None
                                              else log.topic(f"stagetree.client.{uuid.uuid4().hex}"))
        self._claimed = False  # the study's transactional.id registered, and the plan read to its end after
        self._own: set[str] = set()  # the event ids of this client's own StudyStarted
        self.follower = Follower(log, {(topics.PLAN, p): 0 for p in range(self.partitions)}, wait_ms=100)
        self.last_record: dict[int, int] = {}
        """Partition -> offset of the last record folded that is not a seal."""
        self.sealed_to: dict[int, int] = {}
        """Partition -> the last offset a seal folded so far covers."""
        self._catch_up()

    def _catch_up(self) -> None:
        """Fold every plan partition up to its end as the broker has it now."""
        ends = self.follower.end_offsets()
        while not self.follower.reached(ends):
            self._fold(self.follower.poll(0.1))

    def claim(self) -> None:
        """Take the study over: register its ``transactional.id`` (every earlier client of it is
        fenced: what it committed stays, it commits nothing more), then fold the plan to its end,
        so the state shows everything the earlier client recorded. From then on a StudyStarted of
        the study that is not this client's is a later client's: this one stops
        (:class:`StudyTakenOver`). Done by the first :meth:`append` when not called before; a
        client without a study claims nothing.

        Raises:
            KafkaLogError: the cluster did not answer within the log's ``timeout_s``.
            AppendAbandoned: the process is stopping (``log.stop_requested``).
        """
        if self.study is None or self._claimed:
            return
        self.appender.start(lambda: self.log.stop_requested)
        self._catch_up()
        self._claimed = True

    def _still_mine(self) -> None:
        """Before the study's producer is started afresh after a fatal error (its registration
        would fence a client that took the study over meanwhile): fold to the end, and stop if
        another client's StudyStarted is there.

        Raises:
            StudyTakenOver: another client drives the study now.
            KafkaLogError: the plan is not readable (the caller retries).
        """
        self._catch_up()
        if isinstance(self.failure, StudyTakenOver):
            raise self.failure

    @property
    def retries(self) -> int:
        """Appends attempted again after a failed attempt (a broker away), since the start."""
        return self.appender.retries

    def _fold(self, records: list[Record]) -> None:
        for partition, offset, event in self.fold_all.fold(records):
            if isinstance(event, LogSealed):
                self.sealed_to[partition] = max(self.sealed_to.get(partition, -1), event.offset)
            else:
                self.last_record[partition] = offset
            if isinstance(event, StudyStarted) and self._claimed and event.name == self.study \
                    and event.event_id not in self._own and self.failure is None:
                self._taken_over(f", at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(event.ts))}")

    def _taken_over(self, detail: str = "", why: str = "") -> None:
        """Fail the runtime with :class:`StudyTakenOver`: ``detail`` follows "a second `stagetree
        run` of it", ``why`` (the broker's refusal) ends the message."""
        self._fail(StudyTakenOver(
            f"another client started driving study {self.study!r} on this deployment (a second `stagetree run` of "
            f"it{detail}): it continues the study from the log; this one appends nothing more{why}"))

    def append(self, events: list[Event]) -> None:
        """Append events to their plans' partitions in one transaction, then fold up to them.

        While the broker is away, a failed attempt is retried every second for up to
        :attr:`retry_s` seconds (an aborted attempt is appended again, a commit in doubt is
        resumed: none is written twice). The retries give up when the log's ``stop_requested``
        is set (a run being stopped: its signal handler sets it), within a second.

        Raises:
            RuntimeError_: the runtime failed earlier (:class:`StudyTakenOver`: another client
                drives the study now).
            StudyTakenOver: another client of the study fenced this one's appends; nothing of
                ``events`` was appended.
            AppendAbandoned: the process is stopping (``log.stop_requested``); nothing appended.
            KafkaLogError: the broker did not take the records within :attr:`retry_s` seconds,
                or they were not readable back within the log's ``timeout_s`` after that, or a
                record is too large (nothing is appended then); CommitUnknown: the producer
                failed while a commit was in doubt (the records are in the log once, or not).
        """
        if self.failure is not None:
            raise self.failed()
        self.claim()
        events = self.stamp(events)  # after the claim: a later start is stamped later
        writes = [Write(topics.PLAN, event_key(e), encode(e)) for e in events]
        self._own.update(e.event_id for e in events if isinstance(e, StudyStarted) and e.name == self.study)
        try:
            positions = self.appender.append_retrying(writes, self.retry_s, who="the SDK",
                                                      stopping=lambda: self.log.stop_requested,
                                                      before_restart=self._still_mine)
        except Fenced as exc:
            self._taken_over(why=f" ({exc})")
            raise self.failed() from None
        mine: dict[int, int] = {}
        for partition, offset in positions:
            mine[partition] = max(mine.get(partition, -1), offset)
        deadline = time.monotonic() + self.log.timeout_s
        projectors = self.fold_all.projectors
        while any(projectors[p].state.offset < o for p, o in mine.items()):
            if time.monotonic() > deadline:
                raise KafkaLogError(f"kafka: the SDK's own records {mine} were not readable within "
                                    f"{self.log.timeout_s:g} s")
            self._fold(self.follower.poll(0.05))
        self._notify()

    def fold(self) -> None:
        self._fold(self.follower.poll(0))
        self._notify()

    def unsealed(self, upto: dict[int, int]) -> dict[int, int]:
        """The partitions whose records up to ``upto[partition]`` are not all covered by a seal
        folded so far, with the offset a seal must cover."""
        return {p: o for p, o in upto.items() if self.sealed_to.get(p, -1) < o}

    def prefix(self, plan_key: str) -> dict[str, Any]:
        """``decided_at``: the last folded offset of ``plan_key``'s partition; with several
        partitions also ``decided_at_partitions``, every partition's (the merged view decided
        from)."""
        return self.fold_all.prefix(partition_for(plan_key, self.partitions))

    async def run(self) -> None:
        """Fold new records every ``poll_s`` seconds until cancelled."""
        while True:
            try:
                self.fold()
            except Exception as exc:  # a broken transport fails every waiting trial
                self._fail(exc)
                return
            await asyncio.sleep(self.poll_s)

    def close(self) -> None:
        """Close the follower and the producer (the log is the caller's)."""
        self.follower.close()
        self.appender.close()

    async def ready(self, workers: list[str], timeout: float = 300.0) -> None:
        """Wait until each named worker has joined (start-up is not study time).

        Raises:
            RuntimeError_: a worker did not join within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not all(w in self.state.workers and self.state.workers[w].alive for w in workers):
            if time.monotonic() > deadline:
                missing = [w for w in workers if not (w in self.state.workers and self.state.workers[w].alive)]
                raise RuntimeError_(f"workers {missing} did not join within {timeout} s")
            await asyncio.sleep(self.poll_s)
