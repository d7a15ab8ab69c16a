"""The report's pictures (matplotlib, Agg renderer; no pyplot state): stage tree, Gantt, curves."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from projections.state import Trial
from replay.report.load import RunData, StageRun
from replay.report.style import BEST_COLOR, DPI, FAILED_COLOR, SHARED_COLOR, UNFINISHED_COLOR, UNIQUE_COLOR
from replay.report.tree import TreeStage, stage_label
from stagetree.words import counted

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
        label = f"{stage_label(s, multi_plan)}  [{s.from_step}, {s.to_step})"
        extra = []
        if s.trials:
            extra.append(counted(len(s.trials), "trial"))
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
            ax.text(start + width / 2, row[r.worker_id], stage_label(r, multi_plan), ha="center", va="center",
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
    # the bars' share of the chart's span, which starts with the workers' start-up: not the table's idle
    # ratio (worker-seconds held by stages over the study's end-to-end time), and labelled so
    _title_and_legend(ax, f"Workers over time: {len(timed)} stage runs, bars {busy:.1f} s of {len(workers)} × "
                          f"{span:.1f} s from the workers' start ({100 * busy / held:.0f}%)", handles)
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


def plot_curves(trials: Sequence[Trial], metric: str | None, best: str | None, path: Path,
                marks: Mapping[str, Sequence[tuple[str, int]]] | None = None) -> dict[str, int]:
    """Draw ``metric`` against steps for every trial to ``path`` (PNG): thin lines, the best
    trial thick and in the legend. Missing (diverged, null) values are left out. ``marks``:
    trial id -> ``(kind, step)`` of the tuner's decisions to mark on its curve (promote: a
    triangle, stop and exploit: a cross; :func:`projections.queries.decision_marks`). Returns
    how many promotions and stops it marked (a decision at a step without a value is not)."""
    lines = []
    for t in trials:
        pts = [(s, m.get(metric)) for s, m in sorted(t.results.items())] if metric else []
        pts = [(s, float(v)) for s, v in pts if isinstance(v, (int, float)) and math.isfinite(v)]
        if pts:
            lines.append((t, pts))
    if not lines:
        _placeholder(path, "Learning curves", "no metrics reported" if metric else "no metric named by the study")
        return {"promote": 0, "stop": 0}
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
    marked = {"promote": 0, "stop": 0}
    for t, pts in lines:
        at = dict(pts)
        for kind, step in (marks or {}).get(t.trial_id, []):
            if step in at:
                kind = "promote" if kind == "promote" else "stop"
                ax.plot([step], [at[step]], linestyle="none", zorder=5, **MARKS[kind])
                marked[kind] += 1
    handles = []
    if best_line is not None:
        t, xs, ys = best_line
        ax.plot(xs, ys, color=BEST_COLOR, lw=2.4, marker="o", ms=4.5, zorder=4)
        handles.append(Line2D([], [], color=BEST_COLOR, lw=2.4, marker="o", ms=4.5,
                              label=f"best {t.trial_id}: {metric} = {ys[-1]:.4g} at step {xs[-1]}"))
    handles.append(Line2D([], [], color="#888888", lw=0.9, alpha=0.7, marker="o", ms=2.5,
                          label=f"other trials ({len(lines) - (best_line is not None)})"))
    for kind, label in (("promote", "promoted"), ("stop", "stopped")):
        if marked[kind]:
            handles.append(Line2D([], [], linestyle="none", label=f"{label} ({marked[kind]})", **MARKS[kind]))
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
    return marked


MARKS: dict[str, dict[str, Any]] = {
    "promote": {"marker": "^", "ms": 6.5, "color": "#1a7f37", "markeredgecolor": "white", "markeredgewidth": 0.6},
    "stop": {"marker": "X", "ms": 6.5, "color": "#cf222e", "markeredgecolor": "white", "markeredgewidth": 0.6},
}
"""How the learning curves mark the tuner's decisions."""


def _tab_colors() -> list[str]:
    return ["#4c78a8", "#72b7b2", "#54a24b", "#b279a2", "#9d755d", "#79706e", "#eeca3b", "#ff9da6",
            "#439894", "#83bcb6", "#88d27a", "#d6a5c9"]
