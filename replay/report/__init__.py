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

A package along its seams: :mod:`.load` (reading a source), :mod:`.tree` (the executed stage
tree), :mod:`.pictures` (matplotlib figures), :mod:`.html` (the page) and :mod:`.cli` (building
the report, the command).
"""

import importlib
from typing import Any

_WHERE = {
    **dict.fromkeys(("add_arguments", "build_report", "cmd_report", "main", "parser", "register"), "cli"),
    **dict.fromkeys(("SAVINGS_ROWS", "audit_html", "savings_html", "trials_html"), "html"),
    **dict.fromkeys(("ReportError", "RunData", "StageRun", "computed_summary", "load_run", "stage_runs",
                     "study_trials"), "load"),
    **dict.fromkeys(("plot_curves", "plot_gantt", "plot_stage_tree"), "pictures"),
    "PICTURES": "style",
    **dict.fromkeys(("TreeStage", "stage_tree", "trial_path"), "tree"),
}


def __getattr__(name: str) -> Any:
    """Names resolve on first use (matplotlib loads only when a picture is drawn)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'replay.report' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"replay.report.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "PICTURES",
    "SAVINGS_ROWS",
    "ReportError",
    "RunData",
    "StageRun",
    "TreeStage",
    "add_arguments",
    "audit_html",
    "build_report",
    "cmd_report",
    "computed_summary",
    "load_run",
    "main",
    "parser",
    "plot_curves",
    "plot_gantt",
    "plot_stage_tree",
    "register",
    "savings_html",
    "stage_runs",
    "stage_tree",
    "study_trials",
    "trial_path",
    "trials_html",
]
