"""The audit commands of the ``stagetree`` CLI: ``log export|import``, ``replay
verify|explain|reexecute``, ``report``.

Each handler takes the parsed arguments and a console and returns an exit code: 0 when
everything matched, 1 when a check failed or a stage diverged (the message names the first
failing offset, event and check, or the trial, node and step), 2 for bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from rich.markup import escape

from events import topics
from events.keys import secret_from
from stagetree.outputs import check_output_dir, check_output_file
from stagetree.words import counted

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


def _progress(console: Console, quiet: bool) -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=quiet, transient=True)


# Handlers import what they use when they run: building the parser (every command, and every
# worker process re-importing the CLI) must not import torch, pydantic, matplotlib or the audit.


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from replay.audit import check_key, export_log, open_source

    out = check_output_file("--out", args.out)  # before a Kafka source's whole read
    secret = secret_from(args.log_key)
    source = open_source(args.source, secret)
    check_key(source, secret)
    n = export_log(source, out, secret)
    console.print(f"exported {n} records ({source.chain} chain) to {escape(args.out)}")
    return 0


def cmd_import(args: argparse.Namespace, console: Console) -> int:
    from replay.audit import ImportRefused, check_key, import_log, open_source

    out = check_output_dir("--out", args.out)
    secret = secret_from(args.log_key)
    source = open_source(args.file)
    check_key(source, secret)
    try:
        import_log(source, out, secret)
    except ImportRefused as exc:  # a failed check, not bad input (exit 1), as replay verify's
        console.print(f"[red]import refused[/red]: {escape(str(exc))}; nothing was written (`stagetree replay "
                      f"verify {escape(str(args.file))}` tells the whole story)")
        return 1
    console.print(f"imported {sum(len(v) for v in source.streams.values())} records into {escape(args.out)}")
    return 0


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    from replay.anchor import Anchor, check_anchors
    from replay.audit import AuditError, LogDamaged, open_source, unreadable
    from replay.tuner import later_checks, verify_all

    if args.json:
        check_output_file("--json", args.json)  # before the audit, not once it is done
    try:
        anchors = [Anchor.parse(a) for a in args.anchor]
    except ValueError as exc:
        raise AuditError(str(exc)) from None
    secret = secret_from(args.log_key)
    try:
        source = open_source(args.source, secret, args.checkpoints)
        total = len(source.streams.get(topics.PLAN, []))
    except LogDamaged as exc:  # a run directory whose log cannot be read: a failed check, not bad input
        result = unreadable(exc, also=later_checks(anchors))
    else:
        if anchors and source.chain == "sealed":  # before the audit, not once it is done
            check_anchors(source, anchors)
        with _progress(console, args.quiet) as progress:
            task = progress.add_task("verify", total=total)
            result = verify_all(source, secret, progress=lambda n: progress.advance(task, n),
                                study_file=args.study, anchors=anchors)
    for check in result.checks:
        mark = "[yellow]skipped[/yellow]" if check.get("skipped") else "[green]ok[/green]" if check["ok"] \
            else "[red]FAILED[/red]"
        console.print(f"{mark} {check['name']}: {escape(check['detail'])}")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2))
    if result.ok:
        console.print(f"[green]verified[/green]: {result.events} records of {escape(str(args.source))}")
        if result.anchor is not None:
            console.print(f"anchor: {result.anchor} (keep it apart from the log: `--anchor` then proves the log still "
                          "holds this record, with everything before it unchanged)", soft_wrap=True)
        return 0
    console.print(f"[red]verification failed[/red]: {escape(str(result.first_failure))}")
    return 1


def cmd_explain(args: argparse.Namespace, console: Console) -> int:
    from replay.audit import check_key, open_source
    from replay.explain import explain

    secret = secret_from(args.log_key)
    source = open_source(args.source, secret)
    check_key(source, secret)
    story = explain(source, args.trial, secret=secret)
    if args.json:
        console.print_json(orjson.dumps(story.as_dict()).decode())
    else:
        for line in story.lines():
            console.print(escape(line), highlight=False)
    return 0


def cmd_reexecute(args: argparse.Namespace, console: Console) -> int:
    from projections.queries import trials_through
    from replay.audit import check_key, fold, open_source
    from replay.reexecute import reexecute

    secret = secret_from(args.log_key)
    source = open_source(args.source, secret, args.checkpoints)
    check_key(source, secret)
    state = fold(source.streams.get(topics.PLAN, []))
    with _progress(console, args.quiet) as progress:
        task = progress.add_task("re-execute", total=None)
        result = reexecute(source, study_file=args.study, workers=args.workers, sample=args.sample, seed=args.seed,
                           progress=lambda n: progress.advance(task, n),
                           trials_at=lambda p, n, s: trials_through(state, p, n, s))
    for d in result.divergences:
        console.print(f"[red]diverged[/red]: {escape(str(d))}")
    if result.ok:
        workers = counted(args.workers, "worker")
        console.print(f"[green]reproduced[/green]: {result.stages} stages bit for bit on {workers}")
        return 0
    console.print(f"[red]{len(result.divergences)} divergences[/red] in {result.stages} stages")
    return 1


def register(sub: argparse._SubParsersAction, positive: type | object) -> None:  # type: ignore[type-arg]
    """Add the ``log`` and ``replay`` command groups to the ``stagetree`` parser."""
    key_help = "HMAC secret of the log's hash chain (default: $STAGETREE_LOG_KEY)"
    log = sub.add_parser("log", help="export or import a portable, tamper-evident log").add_subparsers(
        dest="log_command", required=True)
    exp = log.add_parser("export", help="write a run's log as JSONL with its hash chain")
    exp.add_argument("source", help="run directory or kafka://HOST:PORT[/PREFIX]")
    exp.add_argument("--out", required=True, help="the JSONL file to write")
    exp.add_argument("--log-key", help=key_help)
    exp.set_defaults(func=cmd_export)
    imp = log.add_parser("import", help="create a run directory from a JSONL export")
    imp.add_argument("file", help="the JSONL export")
    imp.add_argument("--out", required=True, help="run directory to create")
    imp.add_argument("--log-key", help=key_help)
    imp.set_defaults(func=cmd_import)

    replay = sub.add_parser("replay", help="audit a finished study").add_subparsers(dest="replay_command",
                                                                                     required=True)
    ver = replay.add_parser("verify", help="check hash chain, decisions, projections, checkpoints and tuner decisions")
    ver.add_argument("source", help="run directory, JSONL export, or kafka://HOST:PORT[/PREFIX]")
    ver.add_argument("--study", help="study file whose tuners recompute the tuner decisions (default: the one each "
                                     "study's StudyStarted records; without one they are not recomputed)")
    ver.add_argument("--checkpoints", help="checkpoint directory (default: the run directory's)")
    ver.add_argument("--log-key", help=key_help)
    ver.add_argument("--anchor", action="append", default=[], metavar="STREAM@OFFSET:CHAIN",
                     help="an anchor `stagetree run` or an earlier verify printed, kept apart from the log: the log "
                          "must still hold that record with that chain (catches a log cut or rewritten before it); "
                          "repeatable")
    ver.add_argument("--json", help="also write the audit result as JSON to this file")
    ver.add_argument("--quiet", action="store_true", help="no progress bar")
    ver.set_defaults(func=cmd_verify)
    exp_ = replay.add_parser("explain", help="a trial's whole story from the log, with every decision about it")
    exp_.add_argument("source", help="run directory, JSONL export, or kafka://HOST:PORT[/PREFIX]")
    exp_.add_argument("trial", help="trial id, or a unique prefix of one")
    exp_.add_argument("--json", action="store_true", help="print the story as JSON")
    exp_.add_argument("--log-key", help=key_help)
    exp_.set_defaults(func=cmd_explain)
    rex = replay.add_parser("reexecute", help="re-run recorded stages and compare bit for bit")
    rex.add_argument("source", help="run directory or JSONL export")
    rex.add_argument("--workers", type=positive, default=1, help="fresh worker processes (default 1)")
    rex.add_argument("--sample", type=positive, help="re-run only this many stages, chosen with --seed")
    rex.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    rex.add_argument("--study", help="study file (default: the one the log records)")
    rex.add_argument("--checkpoints", help="checkpoint directory (default: the run directory's)")
    rex.add_argument("--log-key", help=key_help)
    rex.add_argument("--quiet", action="store_true", help="no progress bar")
    rex.set_defaults(func=cmd_reexecute)
    from replay.report.cli import register as register_report

    register_report(sub)
