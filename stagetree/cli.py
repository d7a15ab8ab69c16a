"""The ``stagetree`` command.

``stagetree run FILE [--workers N] [--out DIR] [--no-merge] [--resume]`` runs the study defined
in FILE (module-level ``trainer`` and ``tuner``, optional ``seed`` and ``name``) in embedded
mode, shows live progress, and writes ``DIR/summary.json``.

Exit codes: 0 success; 1 the study ran but a trial failed or the run broke; 2 bad input
(study file, flags, run directory).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape

from events.models import StudyFinished, StudyStarted
from gpu_worker.loader import StudyFileError, load_module, trainer_of
from events import tracing
from events.log import LogError
from replay.audit import AuditError, secret_from
from replay.commands import register
from stagetree.embedded import CoordinatorError, EmbeddedCoordinator
from stagetree.progress import Progress
from stagetree.study import Study, TrialFailed, validate_config
from stagetree.summary import build_summary, elapsed_before
from stagetree.tuners import Tuner, TunerResult


class UsageError(ValueError):
    """Bad command-line input; reported with exit code 2."""


def _study_file(path: str) -> tuple[Any, Any, Tuner, int, str]:
    module = load_module(path)
    trainer = trainer_of(module, path)
    tuner = getattr(module, "tuner", None)
    if not isinstance(tuner, Tuner):
        raise StudyFileError(f"study file {path!r} must define `tuner` as a stagetree Tuner, got {tuner!r}")
    seed = getattr(module, "seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise StudyFileError(f"study file {path!r}: `seed` is {seed!r}, but must be an int in [0, 2**63)")
    for i, config in enumerate(tuner.space):
        try:
            validate_config(trainer, config)
        except ValueError as exc:
            raise StudyFileError(f"study file {path!r}: configuration {i} of the tuner's space: {exc}") from None
    name = getattr(module, "name", Path(path).stem)
    if not isinstance(name, str) or not name:
        raise StudyFileError(f"study file {path!r}: `name` is {name!r}, but must be a non-empty string")
    return module, trainer, tuner, seed, name


async def _run_embedded(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    _, trainer, tuner, seed, name = _study_file(args.file)
    out = Path(args.out) if args.out else Path("runs") / name
    has_log = (out / "log").exists()
    if has_log and not args.resume:
        raise UsageError(f"--out {str(out)!r} already holds a run; pass --resume to continue it or choose another --out")
    if args.resume and not has_log:
        raise UsageError(f"--resume: {str(out)!r} holds no run to resume")
    mode = "trial" if args.no_merge else "merged"
    async with EmbeddedCoordinator(out, args.file, args.workers, device=args.device,
                                   secret=secret_from(args.log_key)) as coord:
        await coord.ready()
        started = time.monotonic()  # end-to-end time runs from a ready cluster to the answer
        prior = coord.state.studies.get(name)
        if prior is not None and prior["mode"] != mode:
            raise UsageError(f"{str(out)!r} holds a {prior['mode']!r} run of {name!r}; it cannot resume as {mode!r}")
        before = elapsed_before(coord.log, name) if prior is not None else 0.0
        study = Study(coord, name, trainer, seed, merge=not args.no_merge)
        coord.append([StudyStarted(producer="cli", study_id=name, name=name, plan_key=study.plan_key, mode=mode,
                                   workers=args.workers, seed=seed, trainer=f"{trainer.name}@{trainer.version}",
                                   metric=tuner.metric, metric_mode=tuner.mode,
                                   study_file=str(Path(args.file).resolve()))])
        progress = Progress(lambda: coord.state, f"{name} ({mode}, {args.workers} workers)",
                            enabled=not args.quiet)
        coord.on_fold.append(progress.on_fold)
        with progress:
            result: TunerResult = await tuner.run(study)
            await coord.drain()
        e2e = before + (time.monotonic() - started)
        best = result.best
        value = best.metrics.get(result.metric) if best else None
        best_metric = float(value) if value is not None else None
        coord.append([StudyFinished(producer="cli", study_id=name, best_trial=best.trial_id if best else None,
                                    best_metric=best_metric, end_to_end_seconds=e2e)])
        summary = build_summary(coord.state, name, mode=mode, workers=args.workers,
                                best_trial=best.trial_id if best else None, best_metric=best_metric,
                                end_to_end_seconds=e2e)
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    return summary | {"out": str(out)}


def _print_summary(summary: dict[str, Any], console: Console) -> None:
    best = next((t for t in summary["trials"] if t["trial_id"] == summary["best_trial"]), None)
    console.print(f"[bold]{summary['name']}[/bold] ({summary['mode']}, {summary['workers']} workers): "
                  f"{len(summary['trials'])} trials, best {summary['best_trial']} = {summary['best_metric']}")
    if best is not None:
        console.print(f"  best hp: {best['hp']}  at {best['steps']} steps")
    rate = summary["merge_rate"]
    console.print(f"  steps: total {summary['total_steps']}, unique {summary['unique_steps']}, "
                  f"executed {summary['executed_steps']}; merge rate p = {rate:.3f}" if rate else "")
    console.print(f"  worker-seconds {summary['worker_seconds']:.1f}, end-to-end {summary['end_to_end_seconds']:.1f} s")
    console.print(f"  summary: {summary['out']}/summary.json")


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


class _Sub(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommand parsers that all take ``--otel-exporter`` (at any depth)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser = super().add_parser(name, **kwargs)
        parser.register("action", "parsers", _Sub)
        parser.add_argument("--otel-exporter", default=None,
                            help="none (default), console, otlp or jsonl:PATH (default: $STAGETREE_OTEL_EXPORTER)")
        return parser


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree", description="Hyper-parameter optimization over stage trees.")
    p.register("action", "parsers", _Sub)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a study file")
    run.add_argument("file", help="Python study file defining `trainer` and `tuner` (optional `seed`, `name`)")
    run.add_argument("--workers", type=_positive, default=1, help="worker processes, one per device (default 1)")
    run.add_argument("--out", help="run directory (default runs/<name>)")
    run.add_argument("--no-merge", action="store_true", help="trial-based baseline: no sharing between trials")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its log")
    run.add_argument("--device", default="auto", help="auto (cuda:i when present, else cpu), cpu, or cuda:N")
    run.add_argument("--quiet", action="store_true", help="no live progress display")
    run.add_argument("--log-key", help="HMAC secret of the log's hash chain (default: $STAGETREE_LOG_KEY)")
    run.set_defaults(func=cmd_run)
    register(sub, _positive)
    return p


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    summary = asyncio.run(_run_embedded(args, console))
    _print_summary(summary, console)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    try:
        tracing.configure(args.otel_exporter, "stagetree")
        return int(args.func(args, console))
    except (UsageError, StudyFileError, AuditError, LogError, ValueError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    except (TrialFailed, CoordinatorError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 1
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
