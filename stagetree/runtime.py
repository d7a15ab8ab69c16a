"""What every deployment gives the SDK: a folded projection, futures for trial results, drain.

:class:`RuntimeBase` holds the part shared by the embedded coordinator and the Kafka runtime:
futures per ``(trial, steps)`` resolved from the projection after every fold, failure
propagation to every waiting future, and waiting for in-flight dispatches to end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from events.models import Event, MetricsReported, StageFailed, TrialCancelled, TrialSubmitted
from projections.queries import running_dispatches
from projections.state import State
from projections.store import Projector
from stagetree.errors import RuntimeError_, StudyTakenOver, TrialFailed

_ANSWERING = (TrialSubmitted, StageFailed, TrialCancelled)
"""The events besides MetricsReported whose fold can answer a trial, fail it or cancel it."""


async def settle() -> None:
    """Let every runnable coroutine of the running loop run until all of them wait (on results
    or on nothing): what the simulator does before advancing its clock and a replay of the log
    before folding the next records."""
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)  # CPython's queue of runnable callbacks
    for _ in range(100 if ready is None else 1_000_000):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return


class RuntimeBase:
    """Futures and draining over ``projector``'s state (subclasses append and fold)."""

    failure_type: type[Exception] = RuntimeError_

    def __init__(self, projector: Projector) -> None:
        self.projector = projector
        self.failure: BaseException | None = None
        self.on_fold: list[Callable[[], None]] = []
        self._waiters: dict[tuple[str, int], list[asyncio.Future[dict[str, float]]]] = {}
        self._idle: asyncio.Event | None = None
        self._scan_all = True  # a fold may have answered, failed or cancelled any waiting trial
        self._reported: list[tuple[str, str, int]] = []  # (plan key, node, step) of metrics folded since
        self._at: dict[tuple[str, str, int], set[tuple[str, int]]] = {}  # where a waiting request is answered
        projector.listeners.append(self._saw)

    def _saw(self, offset: int, event: Event) -> None:
        """Note what a folded event can change for the futures (see :meth:`_resolve`): metrics at
        a place answer the requests there; a submission (answered at once from stored metrics),
        a failure or a cancellation can concern any waiting trial."""
        if isinstance(event, MetricsReported):
            self._reported.append((event.plan_key, event.node_id, event.step))
        elif isinstance(event, _ANSWERING):
            self._scan_all = True

    @property
    def state(self) -> State:
        return self.projector.state

    def prefix(self, plan_key: str) -> dict[str, Any]:
        """The prefix of the plan stream a decision about plan ``plan_key`` is taken from now,
        as the fields of a :class:`~events.models.DecisionEvent`: ``decided_at``, the offset
        of the last event folded (a partitioned runtime adds ``decided_at_partitions``)."""
        return {"decided_at": self.state.offset}

    @staticmethod
    def stamp(events: list[Event]) -> list[Event]:
        """Give events without a timestamp the current wall-clock time (at the edge)."""
        now = time.time()
        return [e if e.ts else e.model_copy(update={"ts": now}) for e in events]

    def watch(self, trial_id: str, steps: int) -> asyncio.Future[dict[str, float]]:
        """A future resolved with the trial's metrics at ``steps`` (at once if already known)."""
        future: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            future.set_exception(self.failed())
            return future
        self._waiters.setdefault((trial_id, steps), []).append(future)
        self._resolve([(trial_id, steps)])
        return future

    def failed(self) -> BaseException:
        """The error a call meets after the runtime failed (:attr:`failure` is set): a
        :class:`StudyTakenOver` itself (its message says all), else :attr:`failure_type` naming
        the failure."""
        if isinstance(self.failure, StudyTakenOver):
            return self.failure
        return self.failure_type(f"the runtime failed: {self.failure}")

    def _index(self, key: tuple[str, int]) -> None:
        """Note where the waiting ``(trial, steps)`` is answered (its request's node), once the
        trial's request is in the plan (else a later full scan does it)."""
        trial = self.state.trials.get(key[0])
        if trial is not None and key[1] in trial.requests:
            self._at.setdefault((trial.plan_key, trial.requests[key[1]], key[1]), set()).add(key)

    def busy(self) -> bool:
        """True while a dispatched path has not finished, failed or been lost."""
        return bool(running_dispatches(self.state))

    async def drain(self) -> None:
        """Wait until every dispatched path has reported its end (so totals are complete)."""
        while self.busy() and self.failure is None:
            self._idle = asyncio.Event()
            await self._idle.wait()
        self._idle = None

    def _notify(self) -> None:
        """After a fold: resolve futures, tell listeners, wake drain()."""
        self._resolve()
        for listener in self.on_fold:
            listener()
        if self._idle is not None and not self.busy():
            self._idle.set()

    def fail(self, exc: BaseException) -> None:
        """Stop answering: every waiting future (and every later one) gets ``exc``; :meth:`drain`
        returns. For an error found by the SDK (:class:`~stagetree.errors.MetricNotReported`)."""
        if self.failure is None:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        if self._idle is not None:
            self._idle.set()
        for futures in self._waiters.values():
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
        self._waiters.clear()

    def _resolve(self, keys: list[tuple[str, int]] | None = None) -> None:
        """Resolve the futures of ``keys`` whose trial has its answer (metrics at the steps, or a
        failure, or a cancellation). Default: after folds, every waiting key when a submission,
        failure or cancellation was folded, else those whose request (where :meth:`watch` found
        it in the plan) got metrics; nothing when neither was folded."""
        if keys is None:
            if self._scan_all:
                keys = list(self._waiters)
            else:
                keys = [key for place in self._reported for key in self._at.pop(place, ())]
            self._scan_all = False
            self._reported.clear()
        for key in keys:
            trial_id, steps = key
            trial = self.state.trials.get(trial_id)
            if key not in self._waiters:
                continue
            futures = self._waiters[key]
            if trial is None:
                continue
            if steps in trial.results:
                for f in futures:
                    if not f.done():
                        f.set_result(dict(trial.results[steps]))
            elif trial.status == "failed":
                for f in futures:
                    if not f.done():
                        f.set_exception(TrialFailed(trial_id, trial.error))
            elif trial.status == "cancelled":
                for f in futures:
                    f.cancel()
            else:
                self._index(key)  # still waiting: answered where its request is
                continue
            del self._waiters[key]
