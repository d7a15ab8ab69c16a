"""``stagetree report SOURCE --out DIR``: building the report and its command."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from events.keys import secret_from
from replay.report.style import SHARED_COLOR, UNIQUE_COLOR

# ----------------------------------------------------------------------------- entry points


def build_report(source: Path, out: Path, audit: dict[str, Any] | None = None, study: str | None = None) -> Path:
    """Write the HTML report of ``source`` (run directory or JSONL export) to ``out``.

    Args:
        source: the run directory or export to report on.
        out: directory to write ``index.html``, ``stage_tree.png``, ``gantt.png`` and
            ``curves.png`` into (created; existing files of those names are replaced).
        audit: ``stagetree replay verify --json``'s result ({"ok", "checks", "first_failure"}),
            shown at the top; None shows "not audited".
        study: the study to report on (default: the directory's first, of ``summary.json``).

    Returns:
        the path of ``out/index.html``.

    Raises:
        ReportError: the source cannot be read (see :func:`load_run`).
    """
    from events.decisions import decision_from_json
    from events.settings import describe
    from projections import queries
    from replay.report.html import CSS, _e, _figure, _swatch, audit_html, savings_html, trials_html
    from replay.report.load import load_run, study_trials
    from replay.report.pictures import best_trial_id, curve_metric, plot_curves, plot_gantt, plot_stage_tree
    from replay.report.tree import stage_tree

    data = load_run(source, study)
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
    curve_marks = {t.trial_id: queries.decision_marks(data.state, t.trial_id) for t in trials}
    plot_curves(trials, metric, best, out / "curves.png", curve_marks)
    finals = {t.trial_id: d for t in trials if (d := queries.final_decision(data.state, t.trial_id)) is not None}
    decisions = {t: decision_from_json(d.decision).describe(d.tuner) for t, d in finals.items()}

    name = (data.summary or {}).get("name") or data.study_id or data.source.name
    settings = data.study_started.tuner_settings if data.study_started else None
    meta = (f"source <code>{_e(data.source)}</code> · {len(data.events):,} events"
            + (f" ({data.invalid_events} undecodable, skipped)" if data.invalid_events else "")
            + (f" · tuner <code>{_e(describe(settings))}</code>" if settings else "")
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
        f"Merged trials share their curve up to the step where their hyper-parameters diverge. The tuner's "
        f"decisions are marked where they were taken: a green triangle where a trial was promoted, a red cross "
        f"where it was stopped (or, in PBT, replaced by an exploit).")
    body = [
        f"<h1>stagetree report: {_e(name)}</h1><p class=\"meta\">{meta}</p>",
        audit_html(audit),
        savings_html(data, stages, trials),
        _figure("stage-tree", "Stage tree", "stage_tree.png", "stage tree of the study", tree_caption),
        _figure("gantt", "Workers over time", "gantt.png", "Gantt chart of workers over time", gantt_caption),
        _figure("curves", "Learning curves", "curves.png", f"learning curves of {metric}", curves_caption),
        trials_html(trials, metric, best, decisions),
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
    p.add_argument("--study", help="the study to report on, in a log of several (default: the directory's first, "
                                   "whose summary is summary.json)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--audit", help="JSON audit result to show at the top (stagetree replay verify --json FILE)")
    group.add_argument("--verify", action="store_true", help="run stagetree replay verify now and show its result")
    p.add_argument("--log-key", help="HMAC secret of the log's hash chain, for --verify (default: $STAGETREE_LOG_KEY)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree report", description="Write an HTML report of a study run.")
    add_arguments(p)
    return p


def _load_audit(path: str) -> dict[str, Any]:
    from replay.report.load import ReportError

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
    """``replay verify`` of ``source``, after the key's fit (:func:`replay.audit.check_key`): a
    wrong key, or a missing or needless one, is bad input, not an audit the report shows FAILED.

    Raises:
        ReportError: the source cannot be read, or the key does not fit (naming ``--log-key``).
    """
    from replay.audit import AuditError, check_key, open_source
    from replay.report.load import ReportError
    from replay.tuner import verify_all

    try:
        opened = open_source(source, secret)
        check_key(opened, secret)
        return verify_all(opened, secret).as_dict()
    except AuditError as exc:
        raise ReportError(str(exc)) from None


def cmd_report(args: argparse.Namespace, console: Any = None) -> int:
    """Handle parsed ``stagetree report`` arguments. Exit code: 0 written (whatever the audit
    says), 2 bad input (source, --audit file, a --log-key that does not fit the log for --verify),
    before anything is written."""
    from replay.report.load import ReportError
    from stagetree.outputs import check_output_dir

    check_output_dir("--out", args.out)  # UsageError: exit 2, before the audit
    secret = secret_from(args.log_key)
    try:
        audit = _load_audit(args.audit) if args.audit else _verify(args.source, secret) if args.verify else None
        index = build_report(Path(args.source), Path(args.out), audit, args.study)
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
