"""What the dashboard page shows, as JSON: pure functions of the folded plan stream.

:class:`LiveProjection` folds plan-stream records as they arrive, with the one fold
(:func:`projections.store.fold_records`), and keeps the decoded events in log order. The view of
a study (:func:`study_view`) is assembled from it with the report's own data preparation
(:func:`replay.report.load.run_data`, :func:`~replay.report.tree.stage_tree`, the metric and best
trial of :mod:`replay.report.pictures`, the summary of :mod:`projections.summary`) and the read
side of :mod:`projections.queries` (paths, decisions): nothing here walks the plan itself.

Every string in a view is data (study names, trial ids, hyper-parameter texts, metric names);
the page renders it as text, never as HTML.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from events.log import Record, is_broadcast
from events.models import Event, StudyStarted, TrialSubmitted
from events.settings import describe
from projections.partitions import merge
from projections.queries import promotion, study_decisions, trial_path
from projections.state import State, Trial
from projections.store import fold_records
from projections.summary import last_started, trial_based_estimate
from replay.audit import by_partition
from replay.report.html import idle_figures
from replay.report.load import RunData, finished_summary, run_data, study_trials
from replay.report.pictures import best_trial_id, curve_metric
from replay.report.tree import stage_label, stage_tree

FINISHED = ("done", "failed")
"""Trial statuses counted as finished (a cancelled trial is neither finished nor running)."""


class LiveProjection:
    """The plan stream folded so far: ``state`` (the one fold), the decoded ``events``
    (``(offset, event)`` in log order, those the reducer rejected included, as the report reads
    them), how many records could not be decoded, and ``version``, bumped by every fold that
    brought records. Not thread-safe: fold and read from one thread (the server's loop).

    A partitioned plan stream (Kafka) is folded partition by partition, each into a state of
    its own, and ``state`` is their merged view (:func:`projections.partitions.merge`, as the
    scheduler and the SDK see it); ``events`` holds one copy of the events written to every
    partition (WorkerJoined, WorkerLost) and keeps each partition's order."""

    def __init__(self) -> None:
        self.parts: dict[int, State] = {}
        self._view: State | None = None
        self._broadcast: set[str] = set()  # event ids of the broadcast events in `events`
        self.events: list[tuple[int, Event]] = []
        self.promotions: dict[str, list[tuple[int, int]]] = {}  # trial id -> (from_step, to_steps), log order
        self.records = 0
        self.invalid_events = 0
        self.version = 0

    @property
    def state(self) -> State:
        """The folded plan stream (the merged view of its partitions)."""
        if self._view is None:
            self._view = merge(self.parts) if self.parts else State()
        return self._view

    def fold(self, records: Iterable[Record]) -> int:
        """Fold ``records`` (the plan stream's, in offset order within each partition, after
        those folded before); returns how many there were."""
        batch = list(records)
        if not batch:
            return 0
        decoded = 0

        def seen(record: Record, event: Event, state: State) -> None:
            nonlocal decoded
            decoded += 1
            if is_broadcast(event):
                if event.event_id in self._broadcast:
                    return
                self._broadcast.add(event.event_id)
            self.events.append((record.offset, event))
            if isinstance(event, TrialSubmitted):
                promoted = promotion(state, event)
                if promoted is not None:
                    self.promotions.setdefault(promoted[0], []).append((promoted[1], promoted[2]))

        for partition, part in by_partition(batch).items():
            if part:
                fold_records(self.parts.setdefault(partition, State()), part, on_event=seen)
        self._view = None
        self.records += len(batch)
        self.invalid_events += len(batch) - decoded
        self.version += 1
        return len(batch)


def studies(live: LiveProjection) -> list[dict[str, Any]]:
    """The studies of the log, in the order they first started (then studies known only from
    their trials, by id): ``id``, ``name``, ``mode``, ``finished``, ``trials``, ``finished_trials``."""
    order: list[str] = []
    for _, event in live.events:
        if isinstance(event, StudyStarted) and event.study_id not in order:
            order.append(event.study_id)
    order += sorted({t.study_id for t in live.state.trials.values()} - set(order))
    out = []
    for study_id in order:
        record = live.state.studies.get(study_id, {})
        trials = [t for t in live.state.trials.values() if t.study_id == study_id]
        out.append({"id": study_id, "name": record.get("name", study_id), "mode": record.get("mode"),
                    "finished": bool(record.get("finished")), "trials": len(trials),
                    "finished_trials": sum(t.status in FINISHED for t in trials)})
    return out


def default_study(live: LiveProjection) -> str | None:
    """The study the page opens on: the one started last (:func:`projections.summary.last_started`),
    else any with trials."""
    started = last_started(e for _, e in live.events)
    if started is not None:
        return started
    listed = studies(live)
    return listed[-1]["id"] if listed else None


def _number(value: Any) -> float | None:
    """A finite number, else None (JSON has no NaN; a diverged metric is shown as missing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _final_step(trial: Trial, metric: str | None) -> int | None:
    """The last step ``trial`` has results at (None without results or a metric)."""
    return max(trial.results) if trial.results and metric else None


def _final(trial: Trial, metric: str | None) -> float | None:
    step = _final_step(trial, metric)
    return None if step is None else _number(trial.results[step].get(metric))


def _decision_text(decisions: list[Any]) -> str:
    """The last decision in words (the table's "final decision"); "" without one."""
    if not decisions:
        return ""
    last = decisions[-1]
    if last.kind == "promote":
        return f"promoted to {last.to_steps} steps at step {last.step}"
    if last.kind == "stop":
        return f"stopped at step {last.step}"
    return f"{last.kind} at step {last.step}"


RUNNING_HORIZON_SECONDS = 120.0
"""How long after the log's last event a running stage is still drawn growing to ``now``."""


def study_view(live: LiveProjection, study_id: str, source: Path | str = "", now: float | None = None
               ) -> dict[str, Any]:
    """Everything the page draws for ``study_id``, as JSON-ready data.

    Keys: ``study`` (id, name, mode, workers, metric and its mode, finished), ``figures`` (the
    summary's figures: trials finished / running / total, merge rate p, total / unique /
    executed steps, worker-seconds, the trial-based estimate and the worker-seconds saved,
    idle worker-seconds and ratio, end-to-end seconds, best trial, metric and the step of that metric), ``trials`` (the
    table: id, status, final decision, steps asked, steps with metrics, the metric at its last
    result, the hyper-parameters as text, its path from the root), ``tree`` (executed and running
    stages in drawing order, with their parent row, shared / running flags and trials),
    ``gantt`` (every stage run per worker in seconds since the first event: finished, failed,
    stopped (its path preempted), running, preempted (no end yet) or lost), ``curves`` (metric
    against steps per trial, promotion and stop marks).
    ``now`` (epoch seconds, a live source only): running stages are drawn up to it, as long as
    the log's last event is at most :data:`RUNNING_HORIZON_SECONDS` older (else up to that
    event: a run killed without an end event does not grow for ever).

    Raises:
        KeyError: no study ``study_id`` in the log.
    """
    state = live.state
    if study_id not in state.studies and not any(t.study_id == study_id for t in state.trials.values()):
        raise KeyError(study_id)
    summary, note = finished_summary(Path(str(source)), live.events, study_id)
    data: RunData = run_data(Path(str(source)), live.events, state, study_id, invalid_events=live.invalid_events,
                             plan_events=True, summary=summary, summary_source=note)
    trials = study_trials(data)
    metric, mode = curve_metric(data, trials)
    best = best_trial_id(data, trials, metric, mode)
    record = state.studies.get(study_id, {})
    plan_keys = {t.plan_key for t in trials} | ({record["plan_key"]} if record.get("plan_key") else set())

    runs = [r for r in data.runs if r.plan_key in plan_keys]
    for run in runs:
        if run.status == "unfinished":
            dispatch = state.dispatches.get(run.dispatch_id)
            run.status = dispatch.status if dispatch is not None and dispatch.status in ("running", "preempted") \
                else "lost"
    stages = stage_tree(state, runs, statuses=("finished", "running"))
    running_keys = {r.key for r in runs if r.status == "running"}
    row_of = {(s.plan_key, s.node_id, s.from_step, s.to_step): s.row for s in stages}
    multi_plan = len({s.plan_key for s in stages}) > 1
    shared_keys = {key for key, row in row_of.items() if stages[row].shared}

    decided = study_decisions(state, study_id, live.promotions)
    table = []
    for t in trials:
        table.append({
            "id": t.trial_id,
            "status": t.status,
            "error": t.error,
            "decision": _decision_text(decided.get(t.trial_id, [])),
            "steps": t.steps,
            "trained": max(t.results, default=0),
            "metric": _final(t, metric),
            "best": t.trial_id == best,
            "hp": {name: str(fn) for name, fn in sorted(t.hp.items())},
            "path": [[s.node_id, s.start, s.end] for s in reversed(trial_path(state, t))],  # from the root
        })

    curves = []
    marks: list[dict[str, Any]] = []
    for t in trials:
        points = [(s, _number(m.get(metric))) for s, m in sorted(t.results.items())] if metric else []
        points = [(s, v) for s, v in points if v is not None]
        curves.append({"id": t.trial_id, "steps": [s for s, _ in points], "values": [v for _, v in points],
                       "status": t.status})
        at = dict(points)
        for d in decided.get(t.trial_id, []):
            if d.step in at:
                marks.append({"trial": t.trial_id, "kind": d.kind, "step": d.step, "value": at[d.step],
                              "to_steps": d.to_steps, "source": d.source})

    t0 = data.t0
    last = max((e.ts for _, e in live.events if e.ts), default=None)
    horizon = now if now is not None and last is not None and now - last <= RUNNING_HORIZON_SECONDS else last
    gantt = []
    for r in runs:
        if r.start_ts is None or r.end_ts is None or t0 is None:
            continue
        row = row_of.get(r.key)
        end = max(r.end_ts, horizon or 0.0) if r.status == "running" else r.end_ts
        gantt.append({"worker": r.worker_id, "start": r.start_ts - t0, "end": max(end, r.start_ts) - t0,
                      "status": r.status, "stopped_at": r.stopped_at, "label": stage_label(r, multi_plan),
                      "node": r.node_id,
                      "from": r.from_step, "to": r.to_step, "shared": r.key in shared_keys, "stage": row,
                      "trials": sorted(stages[row].trials) if row is not None else []})

    return {
        "study": {"id": study_id, "name": record.get("name", study_id), "mode": record.get("mode"),
                  "workers": record.get("workers"), "metric": metric, "metric_mode": mode,
                  "finished": bool(record.get("finished")), "simulated": data.simulated,
                  "tuner": describe(record["tuner_settings"]) if record.get("tuner_settings") else None},
        "figures": _figures(data, trials, stages, metric, best),
        "trials": table,
        "tree": [{"row": s.row, "plan": s.plan_key, "node": s.node_id, "from": s.from_step, "to": s.to_step,
                  "label": stage_label(s, multi_plan), "parent": s.parent, "shared": s.shared,
                  "running": (s.plan_key, s.node_id, s.from_step, s.to_step) in running_keys,
                  "executions": s.executions, "trials": sorted(s.trials)} for s in stages],
        "gantt": gantt,
        "curves": {"metric": metric, "mode": mode, "best": best, "trials": curves, "marks": marks},
        "log": {"records": live.records, "offset": state.offset, "invalid_events": live.invalid_events},
    }


def _figures(data: RunData, trials: list[Trial], stages: list[Any], metric: str | None, best: str | None
             ) -> dict[str, Any]:
    """The figures row: the summary's (computed from the log), with counts of trials and stages."""
    summary = data.summary or {}
    idle, idle_ratio = idle_figures(summary)
    estimate = trial_based_estimate(data.state, data.study_id or "", summary)
    best_trial = next((t for t in trials if t.trial_id == best), None)
    return {
        "trials": len(trials),
        "finished_trials": sum(t.status in FINISHED for t in trials),
        "failed_trials": sum(t.status == "failed" for t in trials),
        "running_trials": sum(t.status == "pending" for t in trials),
        "merge_rate": _number(summary.get("merge_rate")),
        "k_wise_merge_rate": _number(summary.get("k_wise_merge_rate")),
        "studies_sharing_plan": summary.get("studies_sharing_plan") or [],
        "total_steps": summary.get("total_steps"),
        "unique_steps": summary.get("unique_steps"),
        "executed_steps": summary.get("executed_steps"),
        "worker_seconds": _number(summary.get("worker_seconds")),
        **{k: _number(v) if k != "delivered_steps" else v for k, v in estimate.items()},
        "idle_worker_seconds": _number(idle),
        "idle_ratio": _number(idle_ratio),
        "end_to_end_seconds": _number(summary.get("end_to_end_seconds")),
        "best_trial": best,
        "best_metric": (_number(summary.get("best_metric")) if summary.get("best_metric") is not None
                        else _final(best_trial, metric) if best_trial is not None else None),
        # the step of that metric: the tuner's (StudyFinished), else the final step _final reads
        "best_step": (summary.get("best_step") if summary.get("best_metric") is not None
                      else _final_step(best_trial, metric) if best_trial is not None else None),
        "shared_stages": sum(s.shared for s in stages),
        "stages": len(stages),
    }


__all__ = ["FINISHED", "LiveProjection", "default_study", "studies", "study_view"]
