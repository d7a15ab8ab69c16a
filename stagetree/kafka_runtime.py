"""The SDK's runtime on Kafka: submit trials as events, learn results by folding the plan topic.

The client keeps its own in-memory projection of ``stagetree.plan`` (the same reducer as
everywhere), polled every ``poll_s`` seconds; futures resolve when it shows a trial's metrics.
It writes nothing but its own submissions: the serve process projects and schedules, workers
train.
"""

from __future__ import annotations

import asyncio
import time

from events import topics
from events.kafka_log import KafkaLog
from events.log import append_events, event_key
from events.models import Event
from projections.store import Projector
from stagetree.runtime import RuntimeBase, RuntimeError_


class KafkaRuntime(RuntimeBase):
    """A Study's runtime over ``log`` (a KafkaLog). Start :meth:`run` as a task."""

    def __init__(self, log: KafkaLog, poll_s: float = 0.02) -> None:
        super().__init__(Projector(log, dead_letters=False))
        self.log = log
        self.poll_s = poll_s
        self.projector.catch_up()

    def append(self, events: list[Event]) -> None:
        """Append events to the plan topic, then fold."""
        if self.failure is not None:
            raise RuntimeError_(f"the runtime failed: {self.failure}")
        append_events(self.log, topics.PLAN, [(event_key(e), e) for e in self.stamp(events)])
        self.fold()

    def fold(self) -> None:
        self.projector.catch_up()
        self._notify()

    async def run(self) -> None:
        """Fold new records every ``poll_s`` seconds until cancelled."""
        while True:
            try:
                self.fold()
            except Exception as exc:  # a broken transport fails every waiting trial
                self._fail(exc)
                return
            await asyncio.sleep(self.poll_s)

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
