"""``stagetree simulate FILE --workers N [--policy P] [--no-merge]``: a study file on simulated GPUs.

Runs the study (or, when the file defines ``studies``, all of them at once) with merging and
without (``--mode``), on the cluster simulator of :mod:`stagetree.simulate`, and prints
GPU-hours, end-to-end time, steps and merge rates, with the trial-based / merged ratios that
the papers' Table 5 and Figs. 13/14 report.

Study file: as for ``stagetree run`` (``trainer``, ``tuner``, optional ``seed``, ``name``), plus
optional ``workers`` (the default of ``--workers``) and ``studies`` (a list of
:class:`stagetree.simulate.SimStudy`, run concurrently on one cluster).
"""

from __future__ import annotations

import argparse
from collections.abc import Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console
from rich.table import Table

from scheduler.policies import POLICIES
from stagetree.sizes import parse_size

if TYPE_CHECKING:
    from stagetree.simulate import SimStudy, SimulationResult


def load_simulation(path: str) -> tuple[Any, list[SimStudy], int | None]:
    """The trainer, studies and default worker count of a study file.

    Raises:
        StudyFileError: the file lacks a trainer or a tuner, or ``studies``/``workers`` are
            malformed (the message names the field and value).
    """
    from gpu_worker.loader import StudyFileError, load_module, trainer_of
    from stagetree.simulate import SimStudy
    from stagetree.tuners import Tuner

    module = load_module(path)
    trainer = trainer_of(module, path)
    studies = getattr(module, "studies", None)
    if studies is None:
        tuner = getattr(module, "tuner", None)
        if not isinstance(tuner, Tuner):
            raise StudyFileError(f"study file {path!r} must define `tuner` as a stagetree Tuner, got {tuner!r}")
        name = getattr(module, "name", Path(path).stem)
        seed = getattr(module, "seed", 0)
        studies = [SimStudy(name, tuner, seed)]
    if not isinstance(studies, list) or not studies or not all(isinstance(s, SimStudy) for s in studies):
        raise StudyFileError(f"study file {path!r}: `studies` is {studies!r}, but must be a non-empty list of SimStudy")
    from stagetree.cli import _warn_unshared
    from stagetree.spaces import unshared_by_type
    from stagetree.study import validate_config

    for s in studies:
        try:
            s.tuner.check(trainer)
        except ValueError as exc:
            raise StudyFileError(f"study file {path!r}: the tuner of study {s.name!r}: {exc}") from None
        if isinstance(s.tuner.space, Sized):  # a list, a grid or a random space (never a one-shot iterator)
            try:
                _warn_unshared(path, unshared_by_type([validate_config(trainer, c) for c in s.tuner.space]))
            except ValueError:
                pass  # an invalid configuration is the simulation's error, where it is submitted
    workers = getattr(module, "workers", None)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise StudyFileError(f"study file {path!r}: `workers` is {workers!r}, but must be a positive int")
    return trainer, studies, workers


def _row(result: SimulationResult) -> dict[str, Any]:
    q = result.total_steps / result.unique_steps if result.unique_steps else None
    return {
        "mode": result.mode,
        "policy": result.policy,
        "workers": result.workers,
        "gpu_hours": result.gpu_hours,
        "end_to_end_hours": result.end_to_end_hours,
        "idle_worker_hours": result.idle_worker_seconds / 3600.0,
        "total_steps": result.total_steps,
        "unique_steps": result.unique_steps,
        "executed_steps": result.executed_steps,
        "merge_rate": q,
        "studies": [{"name": s["name"], "merge_rate": s["merge_rate"], "best_metric": s["best_metric"],
                     "best_step": s["best_step"], "best_trial": s["best_trial"], "trials": len(s["trials"]),
                     "end_to_end_hours": s["end_to_end_seconds"] / 3600.0} for s in result.summaries],
    }


def run_simulation(path: str, *, workers: int | None, policy: str, modes: list[str],
                   out: str | None = None, checkpoint_budget: int | None = None) -> dict[str, Any]:
    """Simulate the study file at ``path`` in each of ``modes`` ("merged", "trial"); returns
    the report printed by the command (and written by ``--json``)."""
    from projections.summary import summary_path
    from stagetree.simulate import simulate

    trainer, studies, default_workers = load_simulation(path)
    n = workers or default_workers or 4
    rows = {}
    for mode in modes:
        # A fresh study file per mode: tuners keep no state between runs, but be safe.
        if mode != modes[0]:
            trainer, studies, _ = load_simulation(path)
        run_dir = str(Path(out) / mode) if out else None
        result = simulate(trainer, studies, workers=n, merge=mode == "merged", policy=policy, run_dir=run_dir,
                          study_file=str(Path(path).resolve()), checkpoint_budget=checkpoint_budget)
        rows[mode] = _row(result)
        if out:
            for s in result.summaries:
                summary_path(Path(out) / mode, s["name"]).write_bytes(
                    orjson.dumps(s, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    report: dict[str, Any] = {"file": path, "workers": n, "policy": policy, "runs": rows}
    if "merged" in rows and "trial" in rows:
        m, t = rows["merged"], rows["trial"]
        report["gpu_hours_ratio"] = t["gpu_hours"] / m["gpu_hours"] if m["gpu_hours"] else None
        report["end_to_end_ratio"] = t["end_to_end_hours"] / m["end_to_end_hours"] if m["end_to_end_hours"] else None
    return report


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{report['file']} on {report['workers']} simulated GPUs ({report['policy']})")
    rows = []
    for mode, r in report["runs"].items():
        best = ", ".join(f"{s['best_metric']:.3f}" if s["best_metric"] is not None else "-" for s in r["studies"][:2])
        rows.append([mode, f"{r['gpu_hours']:.1f}", f"{r['end_to_end_hours']:.2f}", f"{r['idle_worker_hours']:.1f}",
                     str(r["total_steps"]), str(r["unique_steps"]), str(r["executed_steps"]),
                     f"{r['merge_rate']:.3f}" if r["merge_rate"] else "-", best])
    for i, col in enumerate(("mode", "GPU-h", "e2e h", "idle GPU-h", "total", "unique", "executed", "p/q", "best")):
        # a figure is never cut or wrapped on a narrow console (a pipe: 80 columns); headers fold
        table.add_column(col, justify="right" if col != "mode" else "left", overflow="fold",
                         min_width=max((len(row[i]) for row in rows), default=0))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if "gpu_hours_ratio" in report:
        ratios = {k: "-" if report[k] is None else f"{report[k]:.2f}x" for k in ("gpu_hours_ratio", "end_to_end_ratio")}
        console.print(f"trial-based / merged: GPU-hours {ratios['gpu_hours_ratio']}, "
                      f"end-to-end {ratios['end_to_end_ratio']}")


def _modes(args: argparse.Namespace) -> list[str]:
    """The modes to simulate; UsageError when ``--no-merge`` contradicts ``--mode``."""
    from stagetree.errors import UsageError

    if args.no_merge and args.mode not in (None, "trial"):
        raise UsageError(f"--no-merge (trial mode) contradicts --mode {args.mode}; pass one of them")
    mode = "trial" if args.no_merge else args.mode or "both"
    return ["merged", "trial"] if mode == "both" else [mode]


def _check_outputs(out: str | None, json_path: str | None, modes: list[str]) -> None:
    """Refuse, before anything runs (exit 2), an ``--out`` that is no directory or already holds a
    simulation of one of ``modes`` (a second one appended its decisions to the first's log and
    overwrote its summaries), and a ``--json`` that cannot be written."""
    from stagetree.errors import UsageError
    from stagetree.outputs import check_output_dir, check_output_file

    if out is not None:
        check_output_dir("--out", out)
        held = [m for m in modes if (Path(out) / m / "log" / "CURRENT").is_file()]
        if held:
            raise UsageError(f"--out {out!r} already holds a simulation ({', '.join(str(Path(out) / m) for m in held)})"
                             "; choose another --out")
    if json_path is not None:
        check_output_file("--json", json_path)


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    from stagetree.cli import _budget_default

    modes = _modes(args)
    budget = args.checkpoint_budget if args.checkpoint_budget is not None else _budget_default()
    _check_outputs(args.out, args.json, modes)
    report = run_simulation(args.file, workers=args.workers, policy=args.policy, modes=modes, out=args.out,
                            checkpoint_budget=budget)
    print_report(report, console)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0


def register(sub: argparse._SubParsersAction, positive: Any) -> None:  # type: ignore[type-arg]
    """Add ``simulate`` to the ``stagetree`` parser."""
    sim = sub.add_parser("simulate", help="run a study file on simulated GPUs (virtual clock)")
    sim.add_argument("file", help="study file (trainer, tuner or studies; optional workers)")
    sim.add_argument("--workers", type=positive, help="simulated GPUs (default: the file's `workers`, else 4)")
    sim.add_argument("--policy", choices=POLICIES, default="critical-path", help="scheduling policy")
    sim.add_argument("--mode", choices=("both", "merged", "trial"), default=None,
                     help="merged (stage tree), trial (no merging), or both and their ratios (default)")
    sim.add_argument("--no-merge", action="store_true", help="same as --mode trial")
    sim.add_argument("--out", help="keep each mode's log, projection and summaries under OUT/<mode>")
    sim.add_argument("--json", help="also write the report as JSON to this file")
    sim.add_argument("--checkpoint-budget", type=parse_size, default=None, metavar="SIZE",
                     help="bytes of checkpoints to keep at most (sizes from the trainer's cost model; default: "
                          "$STAGETREE_CHECKPOINT_BUDGET)")
    sim.set_defaults(func=cmd_simulate)
