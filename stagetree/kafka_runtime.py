"""The SDK's runtime on Kafka: submit trials as events, learn results by folding the plan topic.

The client keeps its own in-memory projection of every partition of ``stagetree.plan`` (the
same reducer as everywhere, :class:`projections.partitions.PartitionedFold`), following the
partitions as records arrive; futures resolve when the merged view shows a trial's metrics. It
writes nothing but its own submissions (to the partition of their plan key): the serve
instances project and schedule, workers train.

An append rides out a broker that is away (restarting, unreachable) for up to ``retry_s``
seconds, as a worker does: the records a failed attempt did not get into the log (found by
reading the plan partitions to their end, record by record) are appended again, so none is
written twice and none is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from events import topics
from events.codec import encode
from events.kafka_log import AppendAbandoned, DeliveryFailed, Follower, KafkaLog, KafkaLogError, partition_for
from events.log import Record, event_key
from events.models import Event, LogSealed
from projections.partitions import PartitionedFold
from stagetree.runtime import RuntimeBase, RuntimeError_

log = logging.getLogger(__name__)

RETRY_S = 300.0
"""Seconds an append of the SDK keeps trying through a broker outage (a worker's ``retry_s``)."""


class KafkaRuntime(RuntimeBase):
    """A Study's runtime over ``log`` (a KafkaLog). Start :meth:`run` as a task.

    Args:
        log: the transport (its ``timeout_s`` bounds one attempt of an append).
        poll_s: seconds between folds of new records.
        retry_s: seconds an append keeps trying while the broker is away, before it raises.
    """

    def __init__(self, log: KafkaLog, poll_s: float = 0.02, retry_s: float = RETRY_S) -> None:
        log.ensure_topic(topics.PLAN)
        self.partitions = log.partition_count(topics.PLAN)
        fold = PartitionedFold(log, self.partitions)
        super().__init__(fold)  # type: ignore[arg-type]
        self.fold_all = fold
        self.log = log
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.retries = 0
        """Appends attempted again after a failed attempt (a broker away), since the start."""
        self._unconfirmed: Counter[bytes] | None = None  # values of a failed attempt, looked for while folding
        self.follower = Follower(log, {(topics.PLAN, p): 0 for p in range(self.partitions)}, wait_ms=100)
        self.last_record: dict[int, int] = {}
        """Partition -> offset of the last record folded that is not a seal."""
        self.sealed_to: dict[int, int] = {}
        """Partition -> the last offset a seal folded so far covers."""
        ends = self.follower.end_offsets()
        while not self.follower.reached(ends):
            self._fold(self.follower.poll(0.1))

    def _fold(self, records: list[Record]) -> None:
        if self._unconfirmed is not None:
            for record in records:
                if self._unconfirmed[record.value] > 0:
                    self._unconfirmed[record.value] -= 1
        for partition, offset, event in self.fold_all.fold(records):
            if isinstance(event, LogSealed):
                self.sealed_to[partition] = max(self.sealed_to.get(partition, -1), event.offset)
            else:
                self.last_record[partition] = offset

    def append(self, events: list[Event]) -> None:
        """Append events to their plans' partitions, then fold up to them.

        While the broker is away, a failed attempt is retried every second for up to
        :attr:`retry_s` seconds: what it got into the log is found by folding to the end of the
        plan partitions, and only the rest is appended again (an idempotent producer keeps a
        partition's records in order and without gaps, so that rest is a suffix per partition).

        The retries give up when the log's ``stop_requested`` is set (a run being stopped: its
        signal handler sets it), within a second.

        Raises:
            RuntimeError_: the runtime failed earlier.
            AppendAbandoned: the process is stopping (``log.stop_requested``).
            DeliveryFailed: the broker did not take the records within :attr:`retry_s` seconds.
            KafkaLogError: the records were not readable back within that time, or a record
                is too large (nothing is appended then).
        """
        if self.failure is not None:
            raise RuntimeError_(f"the runtime failed: {self.failure}")
        items = [(event_key(e), encode(e)) for e in self.stamp(events)]
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                offsets = self.log.append_many(topics.PLAN, items)
                break
            except DeliveryFailed as exc:
                if time.monotonic() > deadline or self.log.stop_requested:
                    raise
                log.warning("kafka: the SDK's append failed (retrying for up to %g s more): %s",
                            max(0.0, deadline - time.monotonic()), exc)
                self.retries += 1
                items = self._not_in_log(items, deadline)
                if not items:
                    offsets = []
                    break
        mine: dict[int, int] = {}
        for (key, _), offset in zip(items, offsets):
            p = partition_for(key, self.partitions)
            mine[p] = max(mine.get(p, -1), offset)
        deadline = max(deadline, time.monotonic() + self.log.timeout_s)
        projectors = self.fold_all.projectors
        while any(projectors[p].state.offset < o for p, o in mine.items()):
            if time.monotonic() > deadline:
                raise KafkaLogError(f"kafka: the SDK's own records {mine} were not readable within "
                                    f"{self.log.timeout_s:g} s")
            self._fold(self.follower.poll(0.05))
        self._notify()

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` (0: none) in steps of 0.1 s.

        Raises:
            AppendAbandoned: the log's ``stop_requested`` is (or becomes) set.
        """
        end = time.monotonic() + seconds
        while True:
            if self.log.stop_requested:
                raise AppendAbandoned("kafka: the SDK's append was abandoned: the process is stopping")
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def _not_in_log(self, items: list[tuple[str, bytes]], deadline: float) -> list[tuple[str, bytes]]:
        """The ``(key, value)`` items of a failed attempt that are not in the log: fold every plan
        partition to its end now (asked of the broker once it answers, a second apart, until
        ``deadline``) and strike each record met whose value is one of the items'.

        Raises:
            KafkaLogError: the broker did not answer before ``deadline``.
            AppendAbandoned: the log's ``stop_requested`` was set meanwhile.
        """
        self._unconfirmed = Counter(value for _, value in items)
        try:
            while True:
                self._pause(1.0)
                try:
                    ends = self.follower.end_offsets(timeout_s=5)
                    while not self.follower.reached(ends):
                        self._pause(0)
                        if time.monotonic() > deadline:
                            raise KafkaLogError("kafka: the plan partitions were not readable to their end "
                                                f"within {self.retry_s:g} s of the SDK's append")
                        self._fold(self.follower.poll(0.1))
                    break
                except AppendAbandoned:
                    raise
                except KafkaLogError:
                    if time.monotonic() > deadline:
                        raise
            left = self._unconfirmed
            out = []
            for key, value in items:
                if left[value] > 0:
                    left[value] -= 1
                    out.append((key, value))
            return out
        finally:
            self._unconfirmed = None

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
        """Close the follower (the log is the caller's)."""
        self.follower.close()

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
