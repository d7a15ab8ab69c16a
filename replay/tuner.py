"""Replaying a tuner against a finished study's log (DESIGN.md invariant 3, for the tuner).

The tuner is run again, unchanged, over the projection folded from the log. Its requests are
answered from the recorded metrics (nothing trains and nothing is appended), in the order the
log answered them (``Trial.answered``), which is the order the live tuner saw them. A tuner is
deterministic given the log when the replay asks for exactly the requests the log holds for the
study, in the same order, and reaches the recorded answer. A request the log does not hold is
a decision the live run did not take; the replay records it and stops that branch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from events import topics
from events.codec import InvalidEvent, decode
from events.models import Event, StudyFinished, StudyStarted, TrialSubmitted
from gpu_worker.trainer import Trainer
from projections.state import State
from replay.audit import AuditError, fold, open_source
from stagetree.study import Study, TrialFailed
from stagetree.tuners import Tuner, TunerResult


class Unanswered(RuntimeError):
    """The replayed tuner asked for a result the log does not hold: the replay ends there (not a
    failed trial, which a tuner would count as a loss and go on from)."""


class _ReplayRuntime:
    """The Runtime protocol over a finished projection: every answer is already known."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.requests: list[tuple[str, int]] = []
        self.missing: list[tuple[str, int]] = []

    def append(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, TrialSubmitted):
                self.missing.append((event.trial_id, event.steps))

    def watch(self, trial_id: str, steps: int) -> asyncio.Future[dict[str, float]]:
        future: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self.requests.append((trial_id, steps))
        trial = self.state.trials.get(trial_id)
        if trial is not None and steps in trial.results:
            future.set_result(dict(trial.results[steps]))
        elif trial is not None and trial.status == "cancelled":
            future.cancel()
        elif trial is not None and trial.status == "failed":
            future.set_exception(TrialFailed(trial_id, trial.error))  # failed live: a loss again
        else:  # a request the live run never made: the replay ends here
            future.set_exception(Unanswered(f"trial {trial_id} at {steps} steps is not answered in the log"))
        return future


@dataclass
class TunerReplay:
    """The outcome of :func:`replay_tuner`.

    Attributes:
        recorded: the study's requests in the log, ``(trial_id, steps)`` in log order (first
            request of each pair).
        replayed: the replayed tuner's requests, in the order it made them (first of each pair).
        missing: requests the replay made that the log never answered.
        recorded_best / replayed_best: the best trial id the log's StudyFinished holds and the
            replay's answer.
    """

    study: str
    recorded: list[tuple[str, int]]
    replayed: list[tuple[str, int]]
    missing: list[tuple[str, int]] = field(default_factory=list)
    recorded_best: str | None = None
    replayed_best: str | None = None
    result: TunerResult | None = None

    @property
    def same_requests(self) -> bool:
        return set(self.recorded) == set(self.replayed) and not self.missing

    @property
    def same_order(self) -> bool:
        return self.recorded == self.replayed and not self.missing

    @property
    def ok(self) -> bool:
        """Same requests and the same answer (order is compared by :attr:`same_order`)."""
        return self.same_requests and self.recorded_best == self.replayed_best


def _first(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    seen: set[tuple[str, int]] = set()
    out = []
    for p in pairs:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def replay_tuner(source: str | Path, study: str, tuner: Tuner, trainer: Trainer, seed: int = 0, *,
                 merge: bool | None = None, secret: bytes | None = None) -> TunerReplay:
    """Run ``tuner`` for ``study`` over the log at ``source`` (run dir, JSONL export or kafka://).

    Args:
        source: where the log is.
        study: the study id in the log.
        tuner, trainer, seed: the study file's (a fresh tuner object).
        merge: the study's mode; None reads it from the log's StudyStarted.

    Raises:
        AuditError: the source cannot be read, or the study is not in it.
    """
    opened = open_source(str(source), secret=secret)
    plan = opened.streams.get(topics.PLAN, [])
    recorded: list[tuple[str, int]] = []
    best: str | None = None
    started: StudyStarted | None = None
    for r in plan:
        try:
            event = decode(r.value)
        except InvalidEvent:
            continue
        if isinstance(event, TrialSubmitted) and event.study_id == study:
            recorded.append((event.trial_id, event.steps))
        elif isinstance(event, StudyStarted) and event.study_id == study and started is None:
            started = event
        elif isinstance(event, StudyFinished) and event.study_id == study:
            best = event.best_trial
    if started is None:
        raise AuditError(f"study {study!r} is not in {str(source)!r}")
    state = fold(plan, secret=secret)
    runtime = _ReplayRuntime(state)
    mode_merge = started.mode == "merged" if merge is None else merge

    async def go() -> TunerResult | None:
        try:
            return await tuner.run(Study(runtime, study, trainer, seed, merge=mode_merge))  # type: ignore[arg-type]
        except Unanswered:  # the tuner waited on a request the log does not answer
            return None

    result = asyncio.run(go())
    replayed_best = result.best.trial_id if result is not None and result.best else None
    return TunerReplay(study, _first(recorded), _first(runtime.requests), _first(runtime.missing), best,
                       replayed_best, result)
