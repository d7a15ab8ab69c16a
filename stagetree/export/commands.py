"""The ``stagetree export`` commands: ``tensorboard`` and ``mlflow`` (one module per tracker,
imported when its command runs, so a missing optional dependency only stops that command).

Exit codes: 0 written; 2 bad input (the source, the study, a missing optional dependency: the
message names the extra to install).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.markup import escape

from stagetree.integration import MissingExtra


def cmd_tensorboard(args: argparse.Namespace, console: Console) -> int:
    try:
        from stagetree.export.tensorboard import export_tensorboard
    except MissingExtra as exc:
        return _missing(exc)
    from stagetree.export.run import read_run

    view = read_run(args.source, args.study)
    result = export_tensorboard(view, args.out)
    console.print(f"wrote {result['runs']} TensorBoard runs ({result['scalars']} scalars) of study "
                  f"{escape(view.study_id)} to {escape(result['out'])}: tensorboard --logdir {escape(result['out'])}")
    return 0


def cmd_mlflow(args: argparse.Namespace, console: Console) -> int:
    try:
        from stagetree.export.mlflow import export_mlflow
    except MissingExtra as exc:
        return _missing(exc)
    from mlflow.exceptions import MlflowException

    from stagetree.errors import UsageError
    from stagetree.export.run import read_run

    view = read_run(args.source, args.study)
    try:
        result = export_mlflow(view, args.tracking_uri, args.experiment)
    except MlflowException as exc:  # the tracking server or store refused (exit 2, without a traceback)
        where = args.tracking_uri if args.tracking_uri is not None else "$MLFLOW_TRACKING_URI or sqlite:///mlflow.db"
        raise UsageError(f"--tracking-uri {where}: MLflow refused the export: {exc.message}") from None
    replaced = f", replacing {result['replaced']} earlier runs" if result["replaced"] else ""
    console.print(f"logged {len(result['runs'])} MLflow runs ({result['metrics']} metric values) of study "
                  f"{escape(view.study_id)} to experiment {result['experiment_id']} at "
                  f"{escape(str(result['tracking_uri']))}{replaced}")
    return 0


def _missing(exc: MissingExtra) -> int:
    Console(stderr=True, soft_wrap=True, emoji=False).print(f"[red]error:[/red] {escape(str(exc))}")
    return 2


def register(sub: Any) -> None:
    """Add the ``export`` command group to the ``stagetree`` parser."""
    export = sub.add_parser("export", help="write a study to an experiment tracker").add_subparsers(
        dest="export_command", required=True)
    source_help = "run directory, JSONL export or kafka://HOST:PORT[/PREFIX]"
    study_help = "the study to export (default: the run's summary.json, else the last one started)"
    tb = export.add_parser("tensorboard", help="TensorBoard event files: one run per trial, scalars by step, hparams")
    tb.add_argument("source", help=source_help)
    tb.add_argument("--out", required=True, help="log directory to write (tensorboard --logdir OUT)")
    tb.add_argument("--study", help=study_help)
    tb.set_defaults(func=cmd_tensorboard)
    ml = export.add_parser("mlflow", help="MLflow runs: one per trial, params, metrics by step, sharing tags")
    ml.add_argument("source", help=source_help)
    ml.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    ml.add_argument("--experiment", help="experiment name (default: the study's name)")
    ml.add_argument("--study", help=study_help)
    ml.set_defaults(func=cmd_mlflow)
