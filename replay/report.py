"""``stagetree report SOURCE --out DIR``: an HTML report of a finished (or interrupted) study.

The report is one self-contained ``DIR/index.html`` (inline CSS, no scripts) with PNG pictures
next to it, drawn with matplotlib's Agg renderer (no pyplot state is touched):

1. the audit result (``stagetree replay verify``) at the top, or "not audited";
2. the merge-savings table: total vs unique vs executed steps, merge rate p, worker-seconds,
   end-to-end seconds (Hippo §6.2), idle worker-seconds and the idle ratio, from
   ``summary.json`` (``summary-<study>.json`` in a ``stagetree simulate --out`` directory) or
   computed from the log;
3. ``stage_tree.png``: the executed stages (StageFinished events) as a tree over steps, shared
   stages (on the path of 2+ trials) highlighted;
4. ``gantt.png``: every stage a worker ran, over wall-clock seconds since the first event;
5. ``curves.png``: the study's metric against steps for every trial, the best highlighted;

and a table of the trials. SOURCE is a run directory (``log/``, ``state/``, ``summary.json``),
a simulated run directory (``stagetree simulate --out DIR``: ``DIR/merged`` or ``DIR/trial``,
no checkpoints, virtual timestamps from 1e9 s, shown as seconds since the first event) or a
JSONL export of ``stagetree log export``. Nothing here decides anything: event
timestamps are only drawn, never used to compute results.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from events import topics
from events.codec import InvalidEvent, decode
from events.log import Record
from events.models import (
    Event,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageStarted,
    StudyFinished,
    StudyStarted,
    WorkerLost,
)
from projections.state import State, Trial
from replay.audit import AuditError, fold, open_source, secret_from, verify
from stagetree.export.run import trial_path
from stagetree.summary import elapsed


SHARED_COLOR = "#e8743b"
UNIQUE_COLOR = "#4c78a8"
FAILED_COLOR = "#d62728"
UNFINISHED_COLOR = "#9e9e9e"
BEST_COLOR = "#c0392b"
DPI = 110

PICTURES = ("stage_tree.png", "gantt.png", "curves.png")


class ReportError(ValueError):
    """The source cannot be read: missing, not a run directory or export, log locked."""


# ----------------------------------------------------------------------------- loading


@dataclass
class StageRun:
    """One execution of a stage by a worker, from its StageStarted to its end event.

    ``status``: "finished" (StageFinished), "failed" (StageFailed) or "unfinished" (no end event:
    the worker was lost or the run was killed; ``end_ts`` is then the WorkerLost or last event).
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


def load_run(source: str | Path) -> RunData:
    """Read a run directory or a JSONL export into :class:`RunData`.

    The projection is the fold of the plan stream (``replay verify`` says whether it equals the
    stored one). Undecodable records are counted and skipped (they are the audit's business).
    A run directory's log is opened read-only, so a running study can be reported on.

    Raises:
        ReportError: the source does not exist, is not a run directory or export, or
            summary.json is invalid.
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

    starts = [e for _, e in events if isinstance(e, StudyStarted)]
    study_id = summary.get("name") if summary and isinstance(summary.get("name"), str) else None
    if study_id is None and starts:
        study_id = starts[-1].study_id
    if study_id is None and len(state.studies) == 1:
        study_id = next(iter(state.studies))
    started = next((e for e in reversed(starts) if e.study_id == study_id), None)
    finished = next((e for _, e in reversed(events) if isinstance(e, StudyFinished) and e.study_id == study_id), None)
    source_note = "from summary.json"
    if summary is None and study_id is not None:  # `stagetree simulate --out` writes one per study
        summary = _read_summary(path / f"summary-{study_id}.json")
        source_note = f"from summary-{study_id}.json"
    data = RunData(path, events, state, summary, study_id, started, finished, stage_runs(events), bad,
                   summary_source=source_note)
    data.simulated = bool((summary or {}).get("simulated")) or (started is not None and started.producer == "simulator")
    if study_id is not None:
        data.elapsed_seconds = elapsed([e for _, e in events], study_id)
    if summary is None:
        data.summary, data.summary_source = computed_summary(data), "computed from the log (no summary.json)"
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
        elif isinstance(ev, (StageFinished, StageFailed)):
            run = open_runs.pop((ev.dispatch_id, ev.node_id, ev.from_step, ev.to_step), None)
            if run is None:
                run = StageRun(ev.plan_key, ev.node_id, ev.from_step, ev.to_step, ev.dispatch_id, ev.worker_id,
                               None, None, "unfinished")
                runs.append(run)
            run.plan_key = ev.plan_key
            run.end_ts = ev.ts or None
            if isinstance(ev, StageFinished):
                run.status, run.seconds = "finished", ev.seconds
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


def computed_summary(data: RunData) -> dict[str, Any] | None:
    """The summary.json document rebuilt with :func:`stagetree.summary.build_summary` when the
    run directory has none (a killed run); None when the study is unknown."""
    from stagetree.summary import build_summary

    if data.study_id is None:
        return None
    study = data.state.studies.get(data.study_id, {})
    st, fin = data.study_started, data.study_finished
    mode = study.get("mode") or (st.mode if st else "merged")
    workers = st.workers if st else study.get("workers", 0)
    best_trial = fin.best_trial if fin else study.get("best_trial")
    best_metric = fin.best_metric if fin else study.get("best_metric")
    e2e = fin.end_to_end_seconds if fin else study.get("end_to_end_seconds")
    if e2e is None:
        e2e = data.elapsed_seconds or 0.0
    return build_summary(data.state, data.study_id, mode=mode, workers=workers, best_trial=best_trial,
                         best_metric=best_metric, end_to_end_seconds=e2e)


# ----------------------------------------------------------------------------- the stage tree


@dataclass
class TreeStage:
    """An executed stage of the tree: node ``node_id`` of ``plan_key`` over [from_step, to_step).

    ``executions`` counts its StageFinished events (2+: trained again, e.g. a lost checkpoint);
    ``trials`` the trials whose path passes through it; ``parent`` the index of the stage whose
    checkpoint it resumed from (None: a fresh initialisation); ``row`` its row in the drawing.
    """

    plan_key: str
    node_id: str
    from_step: int
    to_step: int
    executions: int = 1
    trials: set[str] = field(default_factory=set)
    parent: int | None = None
    children: list[int] = field(default_factory=list)
    row: int = 0

    @property
    def shared(self) -> bool:
        return len(self.trials) >= 2


def _node_num(node_id: str) -> tuple[int, str]:
    m = re.fullmatch(r"[A-Za-z]*(\d+)", node_id)
    return (int(m.group(1)), node_id) if m else (sys.maxsize, node_id)


def stage_tree(state: State, runs: Sequence[StageRun]) -> list[TreeStage]:
    """The executed stages (finished runs, one entry per distinct stage) as a tree, in drawing
    order (depth-first, children by start step); see :class:`TreeStage`.

    A stage's parent is the stage whose end state it starts from: on the same node, the stage
    ending at its ``from_step``; at a node's start, the stage of the parent node ending at
    ``node.start_step``. Where no stage ends exactly there, the stage covering that step, else
    the latest one before it, is used.
    """
    by_key: dict[tuple[str, str, int, int], TreeStage] = {}
    for run in runs:
        if run.status != "finished":
            continue
        st = by_key.get(run.key)
        if st is None:
            by_key[run.key] = TreeStage(*run.key)
        else:
            st.executions += 1
    stages = sorted(by_key.values(), key=lambda s: (s.plan_key, s.from_step, _node_num(s.node_id), s.to_step))
    on_node: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, s in enumerate(stages):
        on_node[(s.plan_key, s.node_id)].append(i)

    # trials passing through each stage
    segments: dict[tuple[str, str], list[tuple[int, int, str]]] = defaultdict(list)
    for trial in state.trials.values():
        for plan_key, node_id, a, b in trial_path(state, trial):
            segments[(plan_key, node_id)].append((a, b, trial.trial_id))
    for s in stages:
        for a, b, trial_id in segments.get((s.plan_key, s.node_id), []):
            inside = (s.from_step < b and s.to_step > a) if s.to_step > s.from_step else a <= s.from_step <= b
            if inside:
                s.trials.add(trial_id)

    for i, s in enumerate(stages):  # a parent starts strictly before its child: no cycles
        s.parent = _parent_of(state, s, i, stages, on_node)
        if s.parent is not None:
            stages[s.parent].children.append(i)

    # depth-first drawing order
    order: list[int] = []
    roots = [i for i, s in enumerate(stages) if s.parent is None]
    stack = list(reversed(roots))
    while stack:
        i = stack.pop()
        order.append(i)
        kids = sorted(stages[i].children, key=lambda c: (stages[c].from_step, _node_num(stages[c].node_id)))
        stack.extend(reversed(kids))
    remap = {old: new for new, old in enumerate(order)}
    out = [stages[i] for i in order]
    for row, s in enumerate(out):
        s.row = row
        s.parent = remap[s.parent] if s.parent is not None else None
        s.children = sorted(remap[c] for c in s.children)
    return out


def _parent_of(state: State, s: TreeStage, me: int, stages: list[TreeStage],
               on_node: dict[tuple[str, str], list[int]]) -> int | None:
    plan = state.plans.get(s.plan_key)
    node = plan.nodes.get(s.node_id) if plan else None
    step = s.from_step
    visited: set[str] = set()
    while node is not None and node.node_id not in visited:
        visited.add(node.node_id)
        if step > node.start_step or (node.parent_id is None and step > 0):
            cands = [i for i in on_node.get((s.plan_key, node.node_id), []) if i != me]
            exact = [i for i in cands if stages[i].to_step == step and stages[i].from_step < step]
            if exact:
                return exact[0]
            covering = [i for i in cands if stages[i].from_step < step <= stages[i].to_step]
            if covering:
                return covering[0]
            before = [i for i in cands if stages[i].to_step < step and stages[i].to_step > stages[i].from_step]
            if before:
                return max(before, key=lambda i: stages[i].to_step)
            if node.parent_id is None:
                return None
            step = node.start_step
        elif node.parent_id is None:
            return None
        node = plan.nodes.get(node.parent_id) if plan and node.parent_id else None
    return None


def _short_plan(plan_key: str) -> str:
    return plan_key.rsplit("/", 1)[-1][:8]


def _stage_label(s: TreeStage | StageRun, multi_plan: bool) -> str:
    return f"{_short_plan(s.plan_key)}:{s.node_id}" if multi_plan else s.node_id


# ----------------------------------------------------------------------------- pictures


def _placeholder(path: Path, title: str, message: str) -> None:
    fig = Figure(figsize=(8, 2.2))
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title, fontsize=11, loc="left")
    ax.text(0.5, 0.45, message, ha="center", va="center", fontsize=10, color="#666666", transform=ax.transAxes)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")


def _style(ax: Any) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=8)


def plot_stage_tree(stages: Sequence[TreeStage], path: Path) -> None:
    """Draw the stage tree to ``path`` (PNG): x = steps, one row per stage, elbow lines from a
    stage's start down from its parent stage's end, shared stages highlighted. The figure grows
    with the number of stages (about 0.2 in per row) so ~100 stages stay readable."""
    if not stages:
        _placeholder(path, "Stage tree", "no stage finished in this log")
        return
    n = len(stages)
    multi_plan = len({s.plan_key for s in stages}) > 1
    row_h = 0.24 if n <= 40 else 0.2 if n <= 120 else 0.16
    fontsize = 7.5 if n <= 40 else 6.5 if n <= 120 else 5.5
    fig = Figure(figsize=(10.5, 1.5 + row_h * n))
    ax = fig.add_subplot()
    max_step = max(s.to_step for s in stages) or 1
    plans = []
    for s in stages:
        if s.plan_key not in plans:
            plans.append(s.plan_key)
    for s in stages:
        if s.parent is not None:
            p = stages[s.parent]
            ax.plot([s.from_step, s.from_step], [p.row, s.row], color="#8a8a8a", lw=0.8, zorder=1,
                    solid_capstyle="butt")
            if p.to_step < s.from_step:  # resumed past its parent's end: dotted gap
                ax.plot([p.to_step, s.from_step], [p.row, p.row], color="#8a8a8a", lw=0.8, ls=":", zorder=1)
    for s in stages:
        color = SHARED_COLOR if s.shared else UNIQUE_COLOR
        if s.to_step > s.from_step:
            width = max(s.to_step - s.from_step, max_step * 0.004)  # a 1-step stage stays visible
            ax.barh(s.row, width, left=s.from_step, height=0.62, color=color, zorder=2,
                    edgecolor="black" if s.executions > 1 else color, linewidth=0.8 if s.executions > 1 else 0,
                    hatch="///" if s.executions > 1 else None)
        else:  # evaluate-only stage
            ax.plot([s.from_step], [s.row], marker="D", ms=4, color=color, zorder=3)
        label = f"{_stage_label(s, multi_plan)}  [{s.from_step}, {s.to_step})"
        extra = []
        if s.trials:
            extra.append(f"{len(s.trials)} trial" + ("s" if len(s.trials) != 1 else ""))
        if s.executions > 1:
            extra.append(f"trained {s.executions}×")
        if extra:
            label += "  · " + ", ".join(extra)
        ax.text(s.to_step + max_step * 0.008, s.row, label, va="center", ha="left", fontsize=fontsize,
                color="#222222", zorder=4)
    if multi_plan:  # separate the plans of a --no-merge run
        first_rows = [next(s.row for s in stages if s.plan_key == pk) for pk in plans]
        for r in first_rows[1:]:
            ax.axhline(r - 0.5, color="#dddddd", lw=0.6, zorder=0)
    ax.set_ylim(n - 0.4, -0.6)
    ax.set_xlim(0, max_step * 1.32)
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    _style(ax)
    ax.set_xlabel("step", fontsize=9)
    ax.grid(axis="x", color="#eeeeee", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    shared = sum(s.shared for s in stages)
    what = f"{len(plans)} plans" if multi_plan else "one plan"
    handles = [Patch(color=SHARED_COLOR, label="shared (on the path of 2+ trials)"),
               Patch(color=UNIQUE_COLOR, label="one trial")]
    if any(s.executions > 1 for s in stages):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="trained more than once"))
    _title_and_legend(ax, f"Stage tree: {n} executed stages in {what}, {shared} shared by 2+ trials", handles)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")


def _title_and_legend(ax: Any, title: str, handles: list[Any]) -> None:
    """Title on the left with a one-line legend under it, both above the axes (never over data)."""
    ax.set_title(title, fontsize=11, loc="left", pad=22)
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(handles), fontsize=8,
              frameon=False, borderaxespad=0.2, handlelength=1.6, columnspacing=1.4)


def _natural(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def plot_gantt(runs: Sequence[StageRun], shared: set[tuple[str, str, int, int]], t0: float | None,
               path: Path, marks: Sequence[tuple[float, str]] = (),
               xlabel: str = "seconds since the first event") -> dict[str, float]:
    """Draw the workers' stages over time to ``path`` (PNG): one row per worker, one bar per
    stage run from its StageStarted to its end event, x = seconds since ``t0`` (the first
    event), colored shared / one trial / failed / unfinished. ``marks``: (epoch seconds, label)
    drawn as vertical lines. Returns {"busy_seconds", "span_seconds"} of the drawn bars."""
    timed = [r for r in runs if r.start_ts is not None and r.end_ts is not None]
    if not timed or t0 is None:
        _placeholder(path, "Workers over time", "no timed stage in this log")
        return {"busy_seconds": 0.0, "span_seconds": 0.0}
    workers = sorted({r.worker_id for r in timed}, key=_natural)
    row = {w: i for i, w in enumerate(workers)}
    multi_plan = len({r.plan_key for r in timed}) > 1
    fig = Figure(figsize=(10.5, 1.6 + 0.55 * len(workers)))
    ax = fig.add_subplot()
    span = max(r.end_ts for r in timed) - t0  # type: ignore[operator]
    span = span if span > 0 else 1.0
    busy = 0.0
    for r in timed:
        start, width = r.start_ts - t0, max(r.end_ts - r.start_ts, 0.0)  # type: ignore[operator]
        busy += width
        if r.status == "failed":
            color, hatch = FAILED_COLOR, None
        elif r.status == "unfinished":
            color, hatch = UNFINISHED_COLOR, "///"
        else:
            color, hatch = (SHARED_COLOR if r.key in shared else UNIQUE_COLOR), None
        ax.barh(row[r.worker_id], width, left=start, height=0.6, color=color, edgecolor="white", linewidth=0.6,
                hatch=hatch, zorder=2)
        if width > span * 0.045:
            ax.text(start + width / 2, row[r.worker_id], _stage_label(r, multi_plan), ha="center", va="center",
                    fontsize=6.5, color="white", zorder=3, clip_on=True)
    for ts, label in marks:
        x = ts - t0
        ax.axvline(x, color="#555555", lw=0.8, ls="--", zorder=1)
        right = x > span * 0.8
        ax.text(x, -0.55, f"{label} " if right else f" {label}", fontsize=7, color="#555555", va="bottom",
                ha="right" if right else "left")
    first_mark = min((ts - t0 for ts, _ in marks), default=0.0)
    if first_mark > span * 0.05:  # workers start (and warm up) before the study does
        ax.axvspan(0, first_mark, color="#f2f2f2", zorder=0)
        narrow = first_mark < span * 0.12
        ax.text(first_mark / 2, (len(workers) - 1) / 2, "workers starting" if narrow else "workers\nstarting",
                ha="center", va="center", fontsize=7, color="#888888", rotation=90 if narrow else 0)
    ax.set_yticks(range(len(workers)), workers)
    ax.set_ylim(len(workers) - 0.4, -0.75)
    ax.set_xlim(0, span * 1.02)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(axis="x", color="#eeeeee", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    _style(ax)
    held = len(workers) * span
    handles = [Patch(color=SHARED_COLOR, label="shared stage"), Patch(color=UNIQUE_COLOR, label="one trial")]
    if any(r.status == "failed" for r in timed):
        handles.append(Patch(color=FAILED_COLOR, label="failed"))
    if any(r.status == "unfinished" for r in timed):
        handles.append(Patch(facecolor=UNFINISHED_COLOR, hatch="///", label="unfinished (no end event)"))
    _title_and_legend(ax, f"Workers over time: {len(timed)} stage runs, busy {busy:.1f} s of {len(workers)} × "
                          f"{span:.1f} s ({100 * busy / held:.0f}%)", handles)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")
    return {"busy_seconds": busy, "span_seconds": span}


def curve_metric(data: RunData, trials: Sequence[Trial]) -> tuple[str | None, str]:
    """The metric to draw and its mode: StudyStarted.metric (else the study record's, else the
    first metric any trial reported) and "max"/"min" (default "max", "min" for loss/error names)."""
    metric = data.study_started.metric if data.study_started else None
    mode = data.study_started.metric_mode if data.study_started else None
    study = data.state.studies.get(data.study_id or "", {})
    metric = metric or study.get("metric")
    mode = mode or study.get("metric_mode")
    if metric is None:
        metric = next((k for t in trials for _, m in sorted(t.results.items()) for k in m), None)
    if mode is None:
        mode = "min" if metric and re.search(r"loss|err", metric) else "max"
    return metric, mode


def best_trial_id(data: RunData, trials: Sequence[Trial], metric: str | None, mode: str) -> str | None:
    """The best trial: as recorded (summary.json, StudyFinished), else by the final metric."""
    if data.summary and data.summary.get("best_trial"):
        return str(data.summary["best_trial"])
    if data.study_finished and data.study_finished.best_trial:
        return data.study_finished.best_trial
    scored = []
    for t in trials:
        if t.results and metric:
            v = t.results[max(t.results)].get(metric)
            if isinstance(v, (int, float)) and math.isfinite(v):
                scored.append((v if mode == "max" else -v, t.trial_id))
    return max(scored)[1] if scored else None


def plot_curves(trials: Sequence[Trial], metric: str | None, best: str | None, path: Path) -> None:
    """Draw ``metric`` against steps for every trial to ``path`` (PNG): thin lines, the best
    trial thick and in the legend. Missing (diverged, null) values are left out."""
    lines = []
    for t in trials:
        pts = [(s, m.get(metric)) for s, m in sorted(t.results.items())] if metric else []
        pts = [(s, float(v)) for s, v in pts if isinstance(v, (int, float)) and math.isfinite(v)]
        if pts:
            lines.append((t, pts))
    if not lines:
        _placeholder(path, "Learning curves", "no metrics reported" if metric else "no metric named by the study")
        return
    fig = Figure(figsize=(9, 4.8))
    ax = fig.add_subplot()
    cmap = _tab_colors()
    best_line = None
    for i, (t, pts) in enumerate(lines):
        xs, ys = zip(*pts, strict=True)
        if t.trial_id == best:
            best_line = (t, xs, ys)
            continue
        ax.plot(xs, ys, color=cmap[i % len(cmap)], lw=0.9, alpha=0.55, marker="o", ms=2.5, zorder=2)
    handles = []
    if best_line is not None:
        t, xs, ys = best_line
        ax.plot(xs, ys, color=BEST_COLOR, lw=2.4, marker="o", ms=4.5, zorder=4)
        handles.append(Line2D([], [], color=BEST_COLOR, lw=2.4, marker="o", ms=4.5,
                              label=f"best {t.trial_id}: {metric} = {ys[-1]:.4g} at step {xs[-1]}"))
    handles.append(Line2D([], [], color="#888888", lw=0.9, alpha=0.7, marker="o", ms=2.5,
                          label=f"other trials ({len(lines) - (best_line is not None)})"))
    ax.legend(handles=handles, fontsize=8, loc="best", frameon=True, framealpha=0.9)
    steps = sorted({s for _, pts in lines for s, _ in pts})
    if len(steps) >= 3 and steps[0] > 0 and steps[-1] / steps[0] >= 16:
        ax.set_xscale("log", base=2)  # successive-halving rungs double: spread them evenly
        ax.set_xticks(steps if len(steps) <= 12 else steps[:: math.ceil(len(steps) / 12)])
        ax.get_xaxis().set_major_formatter("{x:g}")
        ax.minorticks_off()
        ax.set_xlabel("step (log scale)", fontsize=9)
    else:
        ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(metric or "", fontsize=9)
    ax.grid(color="#eeeeee", lw=0.6)
    _style(ax)
    ax.set_title(f"Learning curves: {metric} of {len(lines)} trials", fontsize=11, loc="left")
    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")


def _tab_colors() -> list[str]:
    return ["#4c78a8", "#72b7b2", "#54a24b", "#b279a2", "#9d755d", "#79706e", "#eeca3b", "#ff9da6",
            "#439894", "#83bcb6", "#88d27a", "#d6a5c9"]


# ----------------------------------------------------------------------------- HTML

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1f2328}
main{max-width:1180px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:1.6em;margin:0 0 4px} h2{font-size:1.2em;margin:0 0 10px}
.meta{color:#57606a;font-size:.9em;margin:0 0 18px}
section{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:16px 20px;margin:0 0 18px}
.audit{border-width:2px}
.audit.ok{background:#e9f7ef;border-color:#2da44e} .audit.ok h2{color:#1a7f37}
.audit.fail{background:#fdecec;border-color:#cf222e} .audit.fail h2{color:#cf222e}
.audit.none{background:#fff8e5;border-color:#d4a72c} .audit.none h2{color:#9a6700}
.audit ul{margin:8px 0 0;padding-left:20px} .audit li{margin:2px 0}
.first{font-weight:600}
code{background:#eff1f3;padding:1px 5px;border-radius:4px;font-size:.92em}
table{border-collapse:collapse;font-size:.92em}
th,td{border-bottom:1px solid #e4e7eb;padding:5px 12px;text-align:left;vertical-align:top}
th{background:#f3f5f7;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.note{color:#57606a}
tr.best td{background:#fff4e0;font-weight:600}
img{max-width:100%;height:auto;display:block;margin:6px 0}
.caption{color:#57606a;font-size:.88em;margin:4px 0 0}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;vertical-align:middle;margin-right:3px}
.trials{max-height:520px;overflow:auto}
.hp{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:.85em;color:#333}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(v: Any, fmt: str = "{:,}") -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return fmt.format(v)


def audit_html(audit: dict[str, Any] | None) -> str:
    """The audit banner: green when ``audit["ok"]``, red with the first failure otherwise, amber
    "not audited" when ``audit`` is None. ``audit`` is ``stagetree replay verify --json``'s
    document: {"ok", "checks": [{"name", "ok", "detail"}], "first_failure"}."""
    if audit is None:
        return ('<section class="audit none" id="audit"><h2>Not audited</h2>'
                "<p>not audited — run <code>stagetree replay verify</code> on this run (or "
                "<code>stagetree report SOURCE --verify</code>) to check the hash chain, every "
                "scheduling decision, the projections and the checkpoints.</p></section>")
    ok = bool(audit.get("ok"))
    checks = audit.get("checks") or []
    parts = [f'<section class="audit {"ok" if ok else "fail"}" id="audit">']
    if ok:
        parts.append("<h2>&#10004; Audit passed</h2>"
                     "<p>Every check of <code>stagetree replay verify</code> matched.</p>")
    else:
        first = audit.get("first_failure") or next(
            (f"{c.get('name')}: {c.get('detail')}" for c in checks if isinstance(c, dict) and not c.get("ok")),
            "unknown failure")
        parts.append(f'<h2>&#10008; Audit FAILED</h2><p class="first">First failure: {_e(first)}</p>')
    if checks:
        parts.append("<ul>")
        for c in checks:
            if not isinstance(c, dict):
                continue
            mark = "&#10004;" if c.get("ok") else "&#10008;"
            parts.append(f"<li>{mark} <b>{_e(c.get('name', '?'))}</b>: {_e(c.get('detail', ''))}</li>")
        parts.append("</ul>")
    if audit.get("events") is not None:
        parts.append(f'<p class="caption">{_e(audit["events"])} records checked.</p>')
    parts.append("</section>")
    return "".join(parts)


SAVINGS_ROWS: tuple[tuple[str, str, str], ...] = (
    ("total_steps", "Total steps", "sum of every trial's steps, as if each trained alone"),
    ("unique_steps", "Unique steps", "steps of the union of the trials' prefixes if merged"),
    ("executed_steps", "Executed steps", "steps workers actually trained (finished stages)"),
    ("merge_rate", "Merge rate p", "total / unique (Hippo §6.2)"),
    ("worker_seconds", "Worker-seconds", "time workers were held by stages (the papers' GPU-hours)"),
    ("end_to_end_seconds", "End-to-end seconds", "wall time from a ready cluster to the answer"),
)


def savings_html(data: RunData, stages: Sequence[TreeStage], trials: Sequence[Trial]) -> str:
    """The merge-savings table. Every value cell carries ``data-key`` and ``data-value`` (the
    exact JSON value from the summary) so tools and tests can read it back."""
    s = data.summary
    if s is None:
        return ('<section id="savings"><h2>Merge savings</h2><p>No summary: the log names no study.</p>'
                "</section>")
    fmt = {"merge_rate": "{:.3f}", "worker_seconds": "{:,.2f}", "end_to_end_seconds": "{:,.2f}"}
    rows = []

    def row(key: str, label: str, value: Any, shown: str, note: str) -> None:
        rows.append(f'<tr><th>{_e(label)}</th><td class="num" data-key="{_e(key)}" '
                    f'data-value="{_e(json.dumps(value))}">{_e(shown)}</td><td class="note">{_e(note)}</td></tr>')

    for key, label, note in SAVINGS_ROWS:
        v = s.get(key)
        row(key, label, v, _num(v, fmt.get(key, "{:,}")), note)
    idle, ratio = idle_figures(s)
    row("idle_worker_seconds", "Idle worker-seconds", idle, _num(idle, "{:,.2f}"),
        "idle worker time (includes causal-order waiting, if the tuner used it): "
        "workers × end-to-end − worker-seconds")
    row("idle_ratio", "Idle ratio", ratio, "—" if ratio is None else f"{100 * ratio:.1f}%",
        "idle worker-seconds / (workers × end-to-end)")
    total, executed = s.get("total_steps"), s.get("executed_steps")
    if isinstance(total, int) and isinstance(executed, int) and total:
        saved = total - executed
        row("saved_steps", "Steps saved", saved, f"{saved:,} ({100 * saved / total:.1f}%)",
            "total − executed: training merging avoided")
    shared = sum(st.shared for st in stages)
    row("shared_stages", "Shared stages", shared, f"{shared} of {len(stages)}",
        "executed stages on the path of 2+ trials")
    if s.get("best_trial") is not None:
        row("best_trial", "Best trial", s.get("best_trial"), str(s.get("best_trial")), "the tuner's answer")
        row("best_metric", "Best metric", s.get("best_metric"), _num(s.get("best_metric"), "{:.4f}"),
            "its metric at its final step")
    sim = (f" Simulated by <code>stagetree simulate</code> ({_e(s.get('policy') or 'critical-path')} policy): "
           "seconds are virtual seconds of simulated GPUs, timed by the trainer's cost model."
           if data.simulated else "")
    head = (f"<p class=\"caption\">{_e(s.get('name', ''))}: {_e(s.get('mode', '?'))} mode, "
            f"{_e(s.get('workers', '?'))} workers, {len(trials)} trials; values {_e(data.summary_source)}.{sim}</p>")
    return (f'<section id="savings"><h2>Merge savings</h2>{head}<table>'
            f"<tr><th>quantity</th><th>value</th><th>meaning</th></tr>{''.join(rows)}</table></section>")


def idle_figures(summary: dict[str, Any]) -> tuple[float | None, float | None]:
    """``(idle_worker_seconds, idle_ratio)`` of a summary: the summary's own idle seconds (else
    max(0, workers x end-to-end - worker-seconds), for summaries written before it existed) and
    idle / (workers x end-to-end); None where the figures are missing or the denominator is 0."""
    workers, e2e, held = summary.get("workers"), summary.get("end_to_end_seconds"), summary.get("worker_seconds")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (workers, e2e, held))
    capacity = workers * e2e if numbers else None  # type: ignore[operator]
    idle = summary.get("idle_worker_seconds")
    if not isinstance(idle, (int, float)) or isinstance(idle, bool):
        idle = max(0.0, capacity - held) if capacity is not None else None  # type: ignore[operator]
    ratio = idle / capacity if idle is not None and capacity else None
    return idle, ratio


def trials_html(trials: Sequence[Trial], metric: str | None, best: str | None) -> str:
    """A table of the trials: id, status, steps, final metric, hyper-parameters (best first)."""
    if not trials:
        return ""

    def final(t: Trial) -> Any:
        return t.results[max(t.results)].get(metric) if t.results and metric else None

    order = sorted(trials, key=lambda t: (t.trial_id != best, -t.steps, t.trial_id))
    rows = []
    for t in order:
        v = final(t)
        hp = "; ".join(f"{k}={fn}" for k, fn in sorted(t.hp.items()))
        cls = ' class="best"' if t.trial_id == best else ""
        status = t.status + (f": {t.error}" if t.error else "")
        rows.append(f"<tr{cls}><td>{_e(t.trial_id)}</td><td>{_e(status)}</td><td class=\"num\">{t.steps:,}</td>"
                    f"<td class=\"num\">{_e(_num(v, '{:.4f}'))}</td><td class=\"hp\">{_e(hp)}</td></tr>")
    return (f'<section id="trials"><h2>Trials</h2><div class="trials"><table><tr><th>trial</th><th>status</th>'
            f"<th>steps</th><th>{_e(metric or 'metric')}</th><th>hyper-parameters</th></tr>{''.join(rows)}"
            "</table></div></section>")


def _figure(section: str, title: str, src: str, alt: str, caption: str) -> str:
    return (f'<section id="{_e(section)}"><h2>{_e(title)}</h2><img src="{_e(src)}" alt="{_e(alt)}">'
            f'<p class="caption">{caption}</p></section>')


def _swatch(color: str) -> str:
    return f'<span class="swatch" style="background:{color}"></span>'


# ----------------------------------------------------------------------------- entry points


def build_report(source: Path, out: Path, audit: dict[str, Any] | None = None) -> Path:
    """Write the HTML report of ``source`` (run directory or JSONL export) to ``out``.

    Args:
        source: the run directory or export to report on.
        out: directory to write ``index.html``, ``stage_tree.png``, ``gantt.png`` and
            ``curves.png`` into (created; existing files of those names are replaced).
        audit: ``stagetree replay verify --json``'s result ({"ok", "checks", "first_failure"}),
            shown at the top; None shows "not audited".

    Returns:
        the path of ``out/index.html``.

    Raises:
        ReportError: the source cannot be read (see :func:`load_run`).
    """
    data = load_run(source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trials = study_trials(data)
    stages = stage_tree(data.state, data.runs)
    shared_keys = {(s.plan_key, s.node_id, s.from_step, s.to_step) for s in stages if s.shared}
    metric, mode = curve_metric(data, trials)
    best = best_trial_id(data, trials, metric, mode)

    plot_stage_tree(stages, out / "stage_tree.png")
    marks = [(e.ts, "study started") for e in [data.study_started] if e is not None and e.ts]
    marks += [(e.ts, "study finished") for e in [data.study_finished] if e is not None and e.ts]
    plot_gantt(data.runs, shared_keys, data.t0, out / "gantt.png", marks,
               "virtual seconds since the first event (simulated)" if data.simulated else
               "seconds since the first event")
    plot_curves(trials, metric, best, out / "curves.png")

    name = (data.summary or {}).get("name") or data.study_id or data.source.name
    meta = (f"source <code>{_e(data.source)}</code> · {len(data.events):,} events"
            + (f" ({data.invalid_events} undecodable, skipped)" if data.invalid_events else "")
            + f" · generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}")
    multi = len({s.plan_key for s in stages}) > 1
    tree_caption = (
        f"One row per executed stage (a StageFinished step range of a search-plan node), x = steps. "
        f"Grey elbows link a stage to the stage whose checkpoint it resumed from. "
        f"{_swatch(SHARED_COLOR)}shared: on the path of two or more trials, trained once for all of them; "
        f"{_swatch(UNIQUE_COLOR)}one trial. Labels: node, step range, trials through it."
        + (" Rows are grouped by plan (one per trial in a <code>--no-merge</code> run), labelled "
           "<i>plan</i>:<i>node</i>." if multi else ""))
    clock = ", on the simulator's virtual clock" if data.simulated else ""
    gantt_caption = (
        f"One bar per stage run from its StageStarted to its StageFinished event (event timestamps{clock}), "
        f"per worker; {_swatch(SHARED_COLOR)}shared stage, {_swatch(UNIQUE_COLOR)}one trial. "
        f"Gaps are time a worker waited for a dispatch or loaded and saved checkpoints outside a stage.")
    curves_caption = (
        f"{_e(metric or 'the metric')} ({_e(mode)} is better) at every step a trial reported, one thin line per "
        f"trial; the best trial{(' <code>' + _e(best) + '</code>') if best else ''} is drawn thick in red. "
        f"Merged trials share their curve up to the step where their hyper-parameters diverge.")
    body = [
        f"<h1>stagetree report: {_e(name)}</h1><p class=\"meta\">{meta}</p>",
        audit_html(audit),
        savings_html(data, stages, trials),
        _figure("stage-tree", "Stage tree", "stage_tree.png", "stage tree of the study", tree_caption),
        _figure("gantt", "Workers over time", "gantt.png", "Gantt chart of workers over time", gantt_caption),
        _figure("curves", "Learning curves", "curves.png", f"learning curves of {metric}", curves_caption),
        trials_html(trials, metric, best),
    ]
    doc = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
           "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
           f"<title>stagetree report: {_e(name)}</title><style>{CSS}</style></head>"
           f"<body><main>{''.join(body)}</main></body></html>\n")
    index = out / "index.html"
    index.write_text(doc, encoding="utf-8")
    return index


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``stagetree report`` (for wiring into the ``stagetree`` parser)."""
    p.add_argument("source", help="run directory or JSONL export (stagetree log export)")
    p.add_argument("--out", required=True, help="directory to write index.html and the PNG pictures into")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--audit", help="JSON audit result to show at the top (stagetree replay verify --json FILE)")
    group.add_argument("--verify", action="store_true", help="run stagetree replay verify now and show its result")
    p.add_argument("--log-key", help="HMAC secret of the log's hash chain, for --verify (default: $STAGETREE_LOG_KEY)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree report", description="Write an HTML report of a study run.")
    add_arguments(p)
    return p


def _load_audit(path: str) -> dict[str, Any]:
    try:
        audit = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ReportError(f"--audit {path!r}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ReportError(f"--audit {path!r} is not JSON: {exc}") from None
    if not isinstance(audit, dict) or not isinstance(audit.get("ok"), bool):
        raise ReportError(f"--audit {path!r} must hold an object with a boolean `ok` (stagetree replay verify --json)")
    return audit


def _verify(source: str, secret: bytes | None) -> dict[str, Any]:
    try:
        return verify(open_source(source, secret), secret).as_dict()
    except AuditError as exc:
        raise ReportError(str(exc)) from None


def cmd_report(args: argparse.Namespace, console: Any = None) -> int:
    """Handle parsed ``stagetree report`` arguments. Exit code: 0 written (whatever the audit
    says), 2 bad input (source, --audit file)."""
    secret = secret_from(args.log_key)
    try:
        audit = _load_audit(args.audit) if args.audit else _verify(args.source, secret) if args.verify else None
        index = build_report(Path(args.source), Path(args.out), audit)
    except ReportError as exc:
        _say(console, f"error: {exc}", err=True)
        return 2
    verdict = "" if audit is None else " (audit passed)" if audit.get("ok") else " (audit FAILED)"
    _say(console, f"report: {index}{verdict}")
    return 0


def _say(console: Any, text: str, err: bool = False) -> None:
    if console is not None and not err:
        from rich.markup import escape

        console.print(escape(text))
    else:
        print(text, file=sys.stderr if err else sys.stdout)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``report`` to the ``stagetree`` subcommands (handler: ``func(args, console)``)."""
    p = sub.add_parser("report", help="write an HTML report with pictures of a study run")
    add_arguments(p)
    p.set_defaults(func=cmd_report)


def main(argv: Sequence[str] | None = None) -> int:
    """``stagetree report SOURCE --out DIR [--audit FILE | --verify] [--log-key KEY]``; returns
    the exit code (0 written, 2 bad input)."""
    return cmd_report(parser().parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    sys.exit(main())
