"""Handing an asynchronous tuner its results in an order a replay of the log reproduces."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from events.hp import HPConfig
from stagetree.study import Study, TrialFailed
from stagetree.tuners._base import TrialResult

P = TypeVar("P")


class CausalOrderBroken(RuntimeError):
    """A replayed log hands a causal-order tuner a result before an earlier one of its group."""


@dataclass
class _Entry(Generic[P]):
    future: asyncio.Future[dict[str, float]]
    trial_id: str
    config: HPConfig
    steps: int
    group: int
    index: int
    payload: P


class ResultInbox(Generic[P]):
    """Hands an asynchronous tuner the results of its requests one at a time, in an order that a
    replay of the log reproduces.

    * Arrival order (``causal=False``): of the results already answered, the one answered
      first in the log (``Trial.answered``, the ordinal the reducer gives each answer), ties by
      submission order.
      Decisions follow the order stages happened to finish, so they depend on the number of
      workers and their timing, but replaying the log feeds the tuner the same order.
    * Causal order (``causal=True``, after NASPipe's causal synchronous parallelism, OSDI'22
      §4): requests belong to *groups* (the results a decision compares, e.g. one rung of ASHA)
      and within a group results are handed over in submission order. A result waits only for
      the earlier results of its own group that are still running. Submission order within a
      group is itself decided in causal order, so every decision, and the study's answer, is
      the same whatever the number of workers and their timing. The price is idle workers while
      a finished result waits for an earlier one (see ``idle_worker_seconds`` in the summary).

    Every result handed over is noted with :meth:`Study.release`, so the tuner's next decision
    records the order it was given its results in. A replay of the log (``replay verify
    --study``) sets :attr:`Study.release_script` to that recorded order and the inbox follows it:
    a result is handed over when it is the next one the live tuner was given and the log prefix
    holds it. The order is an input of the decisions, decided by timing: in arrival order all
    of it, in causal order the interleaving of the groups (within a group the rule fixes it, and
    a replay refuses a record that breaks it, :class:`CausalOrderBroken`).
    """

    def __init__(self, study: Study, causal: bool = False) -> None:
        self.study = study
        self.causal = causal
        self._entries: list[_Entry[P]] = []
        self._count = 0

    def __len__(self) -> int:
        return len(self._entries)

    def waiting(self, group: int) -> int:
        """How many registered requests of ``group`` are not handed over yet."""
        return sum(1 for e in self._entries if e.group == group)

    def add(self, future: asyncio.Future[dict[str, float]], config: HPConfig, steps: int, group: int,
            payload: P) -> None:
        """Register a submitted request of ``config`` at ``steps``; ``group`` orders it in causal mode."""
        trial_id = self.study.trial_id(self.study.config(config))
        self._entries.append(_Entry(future, trial_id, config, steps, group, self._count, payload))
        self._count += 1

    def submit(self, config: HPConfig, steps: int, group: int, payload: P) -> None:
        """Submit ``config`` for ``steps`` to the study and register the request."""
        self.add(self.study.submit(config, steps), config, steps, group, payload)

    def _answered_at(self, entry: _Entry[P]) -> float:
        trial = self.study.runtime.state.trials.get(entry.trial_id)
        if trial is None or entry.steps not in trial.answered:
            return math.inf
        return trial.answered[entry.steps]

    def _scripted(self, script: deque[tuple[str, int]]) -> _Entry[P] | None:
        """A replay: the next result the live tuner was handed, once the log prefix holds it.

        Raises:
            CausalOrderBroken: in causal order, the log hands over a result before one
                submitted earlier in its group.
        """
        if not script:
            return None  # the live tuner was handed nothing more
        entry = next((e for e in self._entries if (e.trial_id, e.steps) == script[0]), None)
        if entry is None or not entry.future.done():
            return None
        if self.causal:
            first = next(e for e in self._entries if e.group == entry.group)
            if first is not entry:
                raise CausalOrderBroken(f"the log hands over the result of trial {entry.trial_id} at {entry.steps} "
                                        f"steps before that of trial {first.trial_id} at {first.steps} steps, "
                                        f"submitted earlier in causal group {entry.group}")
        script.popleft()
        return entry

    def _pick(self) -> _Entry[P] | None:
        script = self.study.release_script
        if script is not None:
            return self._scripted(script)
        if self.causal:
            heads: dict[int, _Entry[P]] = {}
            for e in self._entries:  # in submission order: the first of each group is its head
                heads.setdefault(e.group, e)
            done = [e for e in heads.values() if e.future.done()]
            return min(done, key=lambda e: (e.group, e.index)) if done else None
        done = [e for e in self._entries if e.future.done()]
        return min(done, key=lambda e: (self._answered_at(e), e.index)) if done else None

    async def next(self) -> tuple[P, TrialResult | None]:
        """The next ``(payload, result)``: the trial's metrics at the requested steps, a failed
        :class:`TrialResult` when its training failed (a loss: see :class:`Tuner`), or None for
        a cancelled request. Raises IndexError when nothing is registered."""
        if not self._entries:
            raise IndexError("no request is waiting")
        while True:
            entry = self._pick()
            if entry is not None:
                self._entries.remove(entry)
                f = entry.future
                if f.cancelled():
                    return entry.payload, None
                self.study.release(entry.trial_id, entry.steps)
                error = f.exception()
                if isinstance(error, TrialFailed):
                    return entry.payload, TrialResult(entry.trial_id, entry.config, entry.steps, {},
                                                      error=error.error or "failed")
                return entry.payload, TrialResult(entry.trial_id, entry.config, entry.steps, f.result())
            running = [e.future for e in self._entries if not e.future.done()]
            if not running:
                if self.study.release_script is not None:
                    await asyncio.Event().wait()  # a replay: the live tuner was handed nothing more here
                # unreachable live: a done head or a done result would have been picked
                raise RuntimeError("the inbox has results but none can be handed over")
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)

    async def results(self) -> AsyncIterator[tuple[P, TrialResult]]:
        """``(payload, result)`` of every request, the ones registered while iterating included,
        until none is waiting; cancelled requests are left out. The loop of every asynchronous
        tuner: ``async for payload, result in inbox.results(): ...``."""
        while self:
            payload, result = await self.next()
            if result is not None:
                yield payload, result
