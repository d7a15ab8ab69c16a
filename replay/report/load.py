"""Loading a source for the report: its events, projection, summary and stage executions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from events import topics
from events.codec import InvalidEvent, decode
from events.log import Record
from events.models import (
    Event,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageStarted,
    StageStopped,
    StudyFinished,
    StudyStarted,
    WorkerLost,
)
from projections.state import State, Trial
from projections.summary import elapsed, last_started, summary_path
from replay.audit import AuditError, fold, open_source


class ReportError(ValueError):
    """The source cannot be read: missing, not a run directory or export, log locked."""


# ----------------------------------------------------------------------------- loading


@dataclass
class StageRun:
    """One execution of a stage by a worker, from its StageStarted to its end event.

    ``status``: "finished" (StageFinished), "failed" (StageFailed), "stopped" (StageStopped: its
    path was preempted; it trained up to ``stopped_at``) or "unfinished" (no end event: the worker
    was lost or the run was killed; ``end_ts`` is then the WorkerLost or last event).
    Times are epoch seconds from the events' ``ts`` (informational, as in the log).
    """

    plan_key: str
    node_id: str
    from_step: int
    to_step: int
    dispatch_id: str
    worker_id: str
    start_ts: float | None
    end_ts: float | None
    status: str
    seconds: float = 0.0
    stopped_at: int | None = None  # a stopped run: the step its weights reached

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.plan_key, self.node_id, self.from_step, self.to_step)


@dataclass
class RunData:
    """Everything the report draws, read from one source."""

    source: Path
    events: list[tuple[int, Event]]
    state: State
    summary: dict[str, Any] | None
    study_id: str | None
    study_started: StudyStarted | None
    study_finished: StudyFinished | None
    runs: list[StageRun]
    invalid_events: int = 0
    elapsed_seconds: float | None = None  # wall seconds of the study's incarnations (log ts)
    summary_source: str = "from summary.json"
    simulated: bool = False  # written by ``stagetree simulate``: seconds are virtual GPU seconds

    @property
    def t0(self) -> float | None:
        """Epoch seconds of the first event with a timestamp."""
        return next((e.ts for _, e in self.events if e.ts), None)


def _decode_all(records: Sequence[Record]) -> tuple[list[tuple[int, Event]], int]:
    events, bad = [], 0
    for r in records:
        try:
            events.append((r.offset, decode(r.value)))
        except InvalidEvent:
            bad += 1
    return events, bad


def load_run(source: str | Path, study: str | None = None) -> RunData:
    """Read a run directory or a JSONL export into :class:`RunData` of one study: ``study``, or
    by default the one of ``summary.json`` (the directory's first), else the last started.

    The projection is the fold of the plan stream (``replay verify`` says whether it equals the
    stored one). Undecodable records are counted and skipped (they are the audit's business).
    A run directory's log is opened read-only, so a running study can be reported on.

    Raises:
        ReportError: the source does not exist, is not a run directory or export, a summary
            file is invalid, or the log holds no study ``study`` (naming the ones it holds).
    """
    path = Path(source)
    try:
        opened = open_source(path)
    except AuditError as exc:
        raise ReportError(str(exc)) from None
    records = opened.streams.get(topics.PLAN, [])
    summary = _read_summary(path / "summary.json")
    state = fold(records)
    events, bad = _decode_all(records)
    if study is not None:
        if study not in state.studies:
            held = ", ".join(map(repr, sorted(state.studies))) or "none"
            raise ReportError(f"--study {study!r}: {str(path)!r} holds no study of that name (it holds {held})")
        summary, note = finished_summary(path, events, study)  # a running study's is computed from the log
        return run_data(path, events, state, study, summary=summary, summary_source=note or "from summary.json",
                        invalid_events=bad)

    study_id = summary.get("name") if summary and isinstance(summary.get("name"), str) else None
    if study_id is None:
        study_id = last_started(e for _, e in events)
    if study_id is None and len(state.studies) == 1:
        study_id = next(iter(state.studies))
    source_note = "from summary.json"
    if study_id is not None and (summary is None or summary.get("name") != study_id):
        per_study = summary_path(path, study_id)  # one per study: `stagetree run` and `simulate --out`
        if per_study.is_file():
            summary, source_note = _read_summary(per_study), f"from {per_study.name}"
    return run_data(path, events, state, study_id, summary=summary, summary_source=source_note, invalid_events=bad)


def finished_summary(source: Path, events: list[tuple[int, Event]], study_id: str) -> tuple[dict[str, Any] | None, str]:
    """``(summary, where from)`` of ``study_id`` when it has finished and ``source`` is a run
    directory holding its ``summary-<study>.json`` (written at its end: a later study on the
    same plan adds its steps and seconds to the log's figures, never to that file), else
    ``(None, "")`` (compute it from the log; also when the file is not a JSON object of the
    study)."""
    if not any(isinstance(e, StudyFinished) and e.study_id == study_id for _, e in events):
        return None, ""
    path = summary_path(source, study_id)
    try:
        summary = _read_summary(path) if source.is_dir() else None
    except ReportError:
        return None, ""
    if summary is None or summary.get("name") != study_id:
        return None, ""
    return summary, f"from {path.name}"


def run_data(source: Path, events: list[tuple[int, Event]], state: State, study_id: str | None, *,
             summary: dict[str, Any] | None = None, summary_source: str = "from summary.json",
             invalid_events: int = 0, plan_events: bool = False) -> RunData:
    """:class:`RunData` of ``study_id`` from the decoded plan-stream ``events`` (``(offset, event)``
    in log order) and ``state``, their fold (:func:`load_run` reads them from a source; the
    dashboard folds them as they arrive). Without a ``summary`` it is computed from the log
    (:func:`computed_summary`; ``plan_events``: with the sharing figures that need the events).
    """
    started = next((e for _, e in reversed(events) if isinstance(e, StudyStarted) and e.study_id == study_id), None)
    finished = next((e for _, e in reversed(events) if isinstance(e, StudyFinished) and e.study_id == study_id), None)
    data = RunData(source, events, state, summary, study_id, started, finished, stage_runs(events), invalid_events,
                   summary_source=summary_source)
    data.simulated = bool((summary or {}).get("simulated")) or (started is not None and started.producer == "simulator")
    if study_id is not None:
        data.elapsed_seconds = elapsed([e for _, e in events], study_id)
    if summary is None:
        data.summary = computed_summary(data, [e for _, e in events] if plan_events else None)
        data.summary_source = "computed from the log (no summary.json)"
    return data


def _read_summary(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file.

    Raises:
        ReportError: the file is not JSON or not an object.
    """
    if not path.is_file():
        return None
    try:
        summary = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ReportError(f"{str(path)!r} is not JSON: {exc}") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{str(path)!r} must hold a JSON object, got {type(summary).__name__}")
    return summary


def stage_runs(events: Sequence[tuple[int, Event]]) -> list[StageRun]:
    """Pair every StageStarted with its StageFinished / StageFailed, in log order.

    An end event without a start gets ``start_ts`` None; a start without an end is
    "unfinished" and ends at its worker's WorkerLost or at the last event.
    """
    plan_of: dict[str, str] = {}
    open_runs: dict[tuple[str, str, int, int], StageRun] = {}
    runs: list[StageRun] = []
    last_ts = max((e.ts for _, e in events if e.ts), default=None)
    for _, ev in events:
        if isinstance(ev, StageDispatched):
            plan_of[ev.dispatch_id] = ev.plan_key
        elif isinstance(ev, StageStarted):
            run = StageRun(plan_of.get(ev.dispatch_id, "?"), ev.node_id, ev.from_step, ev.to_step, ev.dispatch_id,
                           ev.worker_id, ev.ts or None, None, "unfinished")
            open_runs[(ev.dispatch_id, ev.node_id, ev.from_step, ev.to_step)] = run
            runs.append(run)
        elif isinstance(ev, (StageFinished, StageFailed, StageStopped)):
            run = open_runs.pop((ev.dispatch_id, ev.node_id, ev.from_step, ev.to_step), None)
            if run is None:
                run = StageRun(ev.plan_key, ev.node_id, ev.from_step, ev.to_step, ev.dispatch_id, ev.worker_id,
                               None, None, "unfinished")
                runs.append(run)
            run.plan_key = ev.plan_key
            run.end_ts = ev.ts or None
            if isinstance(ev, (StageFinished, StageStopped)):
                run.status, run.seconds = "finished", ev.seconds
                if isinstance(ev, StageStopped):
                    run.status, run.stopped_at = "stopped", ev.step
                if run.start_ts is None and run.end_ts is not None:
                    run.start_ts = run.end_ts - ev.seconds
            else:
                run.status = "failed"
        elif isinstance(ev, WorkerLost):
            for k, run in list(open_runs.items()):
                if run.worker_id == ev.worker_id:
                    run.end_ts = ev.ts or None
                    del open_runs[k]
    for run in open_runs.values():
        run.end_ts = last_ts
    return runs


def study_trials(data: RunData) -> list[Trial]:
    """The trials of the report's study (all trials when the study is unknown), by id."""
    trials = [t for t in data.state.trials.values() if data.study_id is None or t.study_id == data.study_id]
    return sorted(trials, key=lambda t: t.trial_id)


def computed_summary(data: RunData, events: list[Event] | None = None) -> dict[str, Any] | None:
    """The summary.json document rebuilt with :func:`projections.summary.build_summary` when the
    run directory has none (a killed run, a study still running); None when the study is unknown.
    ``events``: the plan stream's events in log order, for the sharing figures (else None)."""
    from projections.summary import build_summary

    if data.study_id is None:
        return None
    study = data.state.studies.get(data.study_id, {})
    st, fin = data.study_started, data.study_finished
    mode = study.get("mode") or (st.mode if st else "merged")
    workers = st.workers if st else study.get("workers", 0)
    best_trial = fin.best_trial if fin else study.get("best_trial")
    best_metric = fin.best_metric if fin else study.get("best_metric")
    best_step = fin.best_step if fin else study.get("best_step")
    e2e = fin.end_to_end_seconds if fin else study.get("end_to_end_seconds")
    if e2e is None:
        e2e = data.elapsed_seconds or 0.0
    return build_summary(data.state, data.study_id, mode=mode, workers=workers, best_trial=best_trial,
                         best_metric=best_metric, best_step=best_step, end_to_end_seconds=e2e, events=events)
