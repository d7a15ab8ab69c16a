"""Run a study file from Python: what ``stagetree run`` does, as a function that returns the summary.

    import stagetree

    if __name__ == "__main__":  # worker processes import this script again: keep the call under it
        summary = stagetree.run_study("study.py", out="runs/lr", workers=2)
        print(summary["best_trial"], summary["merge_rate"])

The study file is the one ``stagetree run`` takes (``trainer`` and ``tuner``, optional ``seed`` and
``name``): each worker process imports it to build the trainer, so the trainer is defined in a
file, not in the calling script or a notebook cell. Embedded mode only (a RocksDB log in ``out``);
a study on Kafka is run with ``stagetree run --bootstrap-servers`` or submitted with
:class:`stagetree.Study` over a running deployment.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from pathlib import Path
from typing import Any


def run_study(study_file: str | os.PathLike[str], *, out: str | os.PathLike[str] | None = None, workers: int = 1,
              device: str = "auto", merge: bool = True, resume: bool = False,
              checkpoint_budget: int | str | None = None, log_key: str | None = None,
              progress: bool = False) -> dict[str, Any]:
    """Run the study in ``study_file`` to its end, as ``stagetree run`` does in embedded mode (on
    this machine; ``$STAGETREE_BOOTSTRAP_SERVERS`` is not read); returns its summary.

    Args:
        study_file: a Python study file defining ``trainer`` and ``tuner`` (README "Running a study").
        out: the run directory (default ``runs/<name>``), as ``--out``: a new directory, or one
            whose log holds other studies (this one is added, sharing their plan when the keys
            match), or this study's own run with ``resume=True``.
        workers: worker processes, one per device (int >= 1).
        device: ``auto`` (``cuda:i`` when present, else cpu), ``cpu`` or ``cuda:N``.
        merge: False runs the trial-based baseline (``--no-merge``): no sharing between trials.
        resume: continue this study's run in ``out`` from its log (``--resume``).
        checkpoint_budget: bytes of checkpoints to keep at most (an int, or a size such as
            ``"500MB"``; default ``$STAGETREE_CHECKPOINT_BUDGET``, else unbounded).
        log_key: HMAC secret of the log's hash chain (default ``$STAGETREE_LOG_KEY``).
        progress: show the live progress display on the terminal.

    Returns:
        The summary written to ``out/summary.json``, with ``out`` and ``summary_file`` (the
        paths of the run directory and of that file) added (README "Running a study": ``trials`` with
        each trial's status, metrics and error, ``best_trial``, ``total_steps``,
        ``unique_steps``, ``executed_steps``, ``merge_rate``, ``worker_seconds``, ...). Trials
        that failed are listed with ``status`` "failed"; they do not raise.

    Raises:
        ValueError: a bad argument (naming it and its value), checked before anything is
            created; ``gpu_worker.loader.StudyFileError`` (a ValueError) for a study file that does
            not load; ``stagetree.errors.MetricNotReported`` when the tuner's metric is one the
            trainer does not report.
        RuntimeError: called while a worker process imports the calling script (the call is
            not under ``if __name__ == "__main__":``), or the run failed (a worker slot gave up).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "stagetree.run_study was called while a worker process was importing the calling script: worker "
            "processes start by importing the main script again (the spawn and forkserver start methods), so "
            "call run_study under `if __name__ == \"__main__\":`")
    from rich.console import Console

    from stagetree import cli
    from stagetree.sizes import parse_size

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise cli.UsageError(f"`workers` is {workers!r}, but must be an int >= 1")
    if checkpoint_budget is not None:
        if isinstance(checkpoint_budget, bool) or not isinstance(checkpoint_budget, (int, str)):
            raise cli.UsageError(f"`checkpoint_budget` is {checkpoint_budget!r}, but must be bytes (an int) or a "
                                 "size such as '500MB'")
        try:
            checkpoint_budget = parse_size(str(checkpoint_budget))
        except argparse.ArgumentTypeError as exc:
            raise cli.UsageError(f"`checkpoint_budget`: {exc}") from None
    for flag, value in (("device", device), ("log_key", log_key)):
        if value is not None and not isinstance(value, str):
            raise cli.UsageError(f"`{flag}` is {value!r}, but must be a str")
    for flag, value in (("merge", merge), ("resume", resume), ("progress", progress)):
        if not isinstance(value, bool):
            raise cli.UsageError(f"`{flag}` is {value!r}, but must be True or False")
    for flag, value in (("study_file", study_file), ("out", out)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise cli.UsageError(f"`{flag}` is {value!r}, but must be a path (a str or os.PathLike)")
    args = argparse.Namespace(
        file=str(Path(study_file)), out=None if out is None else str(Path(out)), workers=workers, device=device,
        no_merge=not merge, resume=resume, quiet=not progress, log_key=log_key, dashboard=None,
        checkpoint_budget=checkpoint_budget, checkpoint_store=None, bootstrap_servers=None)
    return cli.run_embedded(args, Console(stderr=True, soft_wrap=True, emoji=False))
