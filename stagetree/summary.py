"""The result of a run: ``summary.json``, computed from the projection and the log."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from events import topics
from events.codec import InvalidEvent, decode
from events.hp import config_to_json
from events.log import EventLog
from events.models import Event, StudyStarted
from projections.search_plan import merged_unique_steps
from projections.state import State


def elapsed(events: Iterable[Event], study_id: str) -> float:
    """Wall seconds of the incarnations of ``study_id`` in ``events``: for each StudyStarted, the
    time up to the last event before the next StudyStarted (a killed run ends at its last event)."""
    total, start, last = 0.0, None, None
    for event in events:
        if isinstance(event, StudyStarted) and event.study_id == study_id:
            if start is not None and last is not None:
                total += max(0.0, last - start)
            start = event.ts
        if event.ts:
            last = event.ts
    if start is not None and last is not None:
        total += max(0.0, last - start)
    return total


def elapsed_before(log: EventLog, study_id: str) -> float:
    """:func:`elapsed` over the plan stream of ``log`` (undecodable records skipped)."""

    def events() -> Iterator[Event]:
        for record in log.read(topics.PLAN):
            try:
                yield decode(record.value)
            except InvalidEvent:
                continue

    return elapsed(events(), study_id)


def build_summary(state: State, study_id: str, *, mode: str, workers: int, best_trial: str | None,
                  best_metric: float | None, end_to_end_seconds: float) -> dict[str, Any]:
    """The ``summary.json`` document of a study (keys as in the README).

    ``total_steps`` sums each trial's maximum steps asked; ``unique_steps`` counts the steps of
    the union of the trials' prefixes as if merged (so p is the same in both modes);
    ``executed_steps`` counts the steps workers actually trained in finished stages;
    ``merge_rate`` = total / unique (Hippo §6.2); ``worker_seconds`` sums the time each worker
    was held by a stage (the papers' GPU-hours, in seconds). Executed steps and worker-seconds
    count the study's own plans, so other studies on the same log do not mix in.
    """
    study = state.studies.get(study_id, {})
    trials = sorted((t for t in state.trials.values() if t.study_id == study_id), key=lambda t: t.trial_id)
    total = sum(t.steps for t in trials)
    plan_keys = {t.plan_key for t in trials}
    plans = [state.plans[k] for k in sorted(plan_keys)]
    unique = merged_unique_steps([(t.hp, t.steps) for t in trials]) if trials else 0
    return {
        "name": study.get("name", study_id),
        "mode": mode,
        "workers": workers,
        "trials": [
            {
                "trial_id": t.trial_id,
                "hp": config_to_json(t.hp),
                "steps": t.steps,
                "metrics": t.results.get(t.steps),
                "status": t.status,
            }
            for t in trials
        ],
        "best_trial": best_trial,
        "best_metric": best_metric,
        "total_steps": total,
        "unique_steps": unique,
        "executed_steps": sum(p.executed_steps for p in plans),
        "merge_rate": total / unique if unique else None,
        "worker_seconds": sum(p.worker_seconds for p in plans),
        "end_to_end_seconds": end_to_end_seconds,
    }
