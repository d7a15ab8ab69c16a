"""The SDK's runtime on Kafka: submit trials as events, learn results by folding the plan topic.

The client keeps its own in-memory projection of every partition of ``stagetree.plan`` (the
same reducer as everywhere, :class:`projections.partitions.PartitionedFold`), following the
partitions as records arrive; futures resolve when the merged view shows a trial's metrics. It
writes nothing but its own submissions (to the partition of their plan key): the serve
instances project and schedule, workers train.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from events import topics
from events.kafka_log import Follower, KafkaLog, KafkaLogError, partition_for
from events.log import Record, append_events, event_key
from events.models import Event, LogSealed
from projections.partitions import PartitionedFold
from stagetree.runtime import RuntimeBase, RuntimeError_


class KafkaRuntime(RuntimeBase):
    """A Study's runtime over ``log`` (a KafkaLog). Start :meth:`run` as a task."""

    def __init__(self, log: KafkaLog, poll_s: float = 0.02) -> None:
        log.ensure_topic(topics.PLAN)
        self.partitions = log.partition_count(topics.PLAN)
        fold = PartitionedFold(log, self.partitions)
        super().__init__(fold)  # type: ignore[arg-type]
        self.fold_all = fold
        self.log = log
        self.poll_s = poll_s
        self.follower = Follower(log, {(topics.PLAN, p): 0 for p in range(self.partitions)}, wait_ms=100)
        self.last_record: dict[int, int] = {}
        """Partition -> offset of the last record folded that is not a seal."""
        self.sealed_to: dict[int, int] = {}
        """Partition -> the last offset a seal folded so far covers."""
        ends = self.follower.end_offsets()
        while not self.follower.reached(ends):
            self._fold(self.follower.poll(0.1))

    def _fold(self, records: list[Record]) -> None:
        for partition, offset, event in self.fold_all.fold(records):
            if isinstance(event, LogSealed):
                self.sealed_to[partition] = max(self.sealed_to.get(partition, -1), event.offset)
            else:
                self.last_record[partition] = offset

    def append(self, events: list[Event]) -> None:
        """Append events to their plans' partitions, then fold up to them."""
        if self.failure is not None:
            raise RuntimeError_(f"the runtime failed: {self.failure}")
        stamped = self.stamp(events)
        offsets = append_events(self.log, topics.PLAN, [(event_key(e), e) for e in stamped])
        mine = {}
        for event, offset in zip(stamped, offsets):
            p = partition_for(event_key(event), self.partitions)
            mine[p] = max(mine.get(p, -1), offset)
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
