"""Checkpoint budgets and in-flight splits at paper scale, on the cluster simulator (issue 10).

What it measures
----------------
Every figure comes from :func:`stagetree.simulate.simulate` (the real log, reducer, scheduler and
tuners; simulated GPUs on a virtual clock) with the papers' checkpoint sizes
(``examples/paper/_paper.py``: ResNet56 7 MB with momentum, BERT-Base 1.32 GB with Adam):

1. **Budgets**: ResNet56 SHA (448 trials) and BERT-Base grid (40), merged and trial-based, with
   no budget (keep-all: every checkpoint a stage ends with) and budgets of 10 %, 25 % and 50 % of
   what keep-all kept at its peak. Per run: the peak stored bytes (never above the budget: the
   figure checks itself), the checkpoints evicted, the GPU-hours and the extra GPU-hours of
   recomputation over keep-all, the end-to-end hours, and whether every trial's metrics equal
   keep-all's (they must: a budget changes no answer).
2. **In-flight splits**: ASHA and PBT on the ResNet56 space, merged, with and without saving at
   a boundary a new request puts inside a running stage (``SchedulerService(splits=False)`` is
   the papers' rule: retrain up to it later). Retrained steps / unique steps (the goal: under 1 %
   with splits). stagetree's ASHA submits the whole space at once and PBT branches at a donor's
   checkpoint, so a boundary rarely lands inside a running stage; the progressive ASHA of Li et
   al. (Algorithm 2: a new configuration is drawn each time a result comes in, 40 waiting at the
   first rung) makes it happen, and is measured too. What splits cannot save is a boundary the
   running worker had already passed when its request arrived (the papers' rule applies).

Hours are virtual hours of 40 simulated GPUs; simulations are deterministic.

How to run
----------
::

    .venv/bin/python benchmarks/checkpoint_budget.py [--json PATH]

About two minutes on a 2-core machine. Exit status 0; 1 when a budget was exceeded or an answer
changed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAPER_DIR = ROOT / "examples" / "paper"
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PAPER_DIR))

import orjson  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from stagetree import ASHA, PBT, TunerResult  # noqa: E402
from stagetree.simulate import SimStudy, SimulationResult, simulate  # noqa: E402
from stagetree.tuners._inbox import ResultInbox  # noqa: E402

FRACTIONS = (0.10, 0.25, 0.50)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"paper_{name}", PAPER_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answers(result: SimulationResult) -> list[Any]:
    return [(t["trial_id"], t["steps"], t["metrics"]) for t in result.summaries[0]["trials"]]


def budgets(study: str) -> list[dict[str, Any]]:
    rows = []
    for merge in (True, False):
        module = _load(study)
        t0 = time.perf_counter()
        keep = simulate(module.trainer, [SimStudy(module.name, module.tuner, module.seed)], workers=module.workers,
                        merge=merge)
        wall = time.perf_counter() - t0
        peak = keep.summaries[0]["peak_checkpoint_bytes"]
        rows.append(_row(study, merge, None, keep, keep, wall))
        for fraction in FRACTIONS:
            module = _load(study)
            budget = int(peak * fraction)
            t0 = time.perf_counter()
            bounded = simulate(module.trainer, [SimStudy(module.name, module.tuner, module.seed)],
                               workers=module.workers, merge=merge, checkpoint_budget=budget)
            rows.append(_row(study, merge, (fraction, budget), bounded, keep, time.perf_counter() - t0))
    return rows


def _row(study: str, merge: bool, budget: tuple[float, int] | None, r: SimulationResult, keep: SimulationResult,
         wall: float) -> dict[str, Any]:
    s = r.summaries[0]
    return {
        "study": study, "mode": "merged" if merge else "trial", "fraction": None if budget is None else budget[0],
        "budget_bytes": None if budget is None else budget[1], "peak_bytes": s["peak_checkpoint_bytes"],
        "within_budget": budget is None or s["peak_checkpoint_bytes"] <= budget[1],
        "evicted": s["checkpoints_evicted"], "gpu_hours": r.gpu_hours,
        "extra_gpu_hours": r.gpu_hours - keep.gpu_hours, "end_to_end_hours": r.end_to_end_hours,
        "executed_steps": r.executed_steps, "same_answers": _answers(r) == _answers(keep), "wall_seconds": wall,
    }


class ProgressiveASHA(ASHA):
    """ASHA as Li et al. run it (MLSys 2020, Algorithm 2): ``waiting`` configurations at the first
    rung; a new one is drawn from the space each time a result comes in (promotions first)."""

    def __init__(self, *args: Any, waiting: int = 40, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = waiting

    async def run(self, study: Any) -> TunerResult:
        budgets = self.rungs()
        inbox: ResultInbox[int] = ResultInbox(study, self.causal)
        source = iter(self.space)
        for config in itertools.islice(source, self.waiting):
            inbox.submit(config, budgets[0], 0, 0)
        at_rung: list[list[Any]] = [[] for _ in budgets]
        promoted: list[set[str]] = [set() for _ in budgets]
        everything: dict[str, Any] = {}
        async for k, result in inbox.results():
            at_rung[k].append(result)
            everything[result.trial_id] = result
            if k + 1 < len(budgets):
                for r in self.keep(at_rung[k], len(at_rung[k]) // self.reduction):
                    if r.trial_id not in promoted[k]:
                        promoted[k].add(r.trial_id)
                        inbox.submit(r.hp, budgets[k + 1], k + 1, k + 1)
            following = next(source, None)
            if following is not None:
                inbox.submit(following, budgets[0], 0, 0)
        return self._result(study, next((r for r in reversed(at_rung) if r), []), everything)


def splits() -> list[dict[str, Any]]:
    module = _load("resnet56_asha")
    trainer, space = module.trainer, module.tuner.space
    tuners = {
        "ASHA": lambda: ASHA(space, "val_acc", min_steps=15, max_steps=120, reduction=4),
        "progressive ASHA": lambda: ProgressiveASHA(space, "val_acc", min_steps=15, max_steps=120, reduction=4),
        "PBT": lambda: PBT(space, "val_acc", population=64, interval=15, max_steps=120,
                           mutations={"lr": [0.2, 0.1, 0.05, 0.02, 0.01], "momentum": [0.8, 0.9, 0.95]}),
    }
    rows = []
    for name, make in tuners.items():
        for with_splits in (False, True):
            t0 = time.perf_counter()
            r = simulate(trainer, [SimStudy(f"resnet56-{name.replace(' ', '-').lower()}", make(), 0)], workers=40,
                         splits=with_splits)
            retrained = r.executed_steps - r.unique_steps
            rows.append({"tuner": name, "splits": with_splits, "unique_steps": r.unique_steps,
                         "executed_steps": r.executed_steps, "retrained_steps": retrained,
                         "retrained_over_unique": retrained / r.unique_steps, "gpu_hours": r.gpu_hours,
                         "wall_seconds": time.perf_counter() - t0})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every figure as JSON to this file")
    args = parser.parse_args(argv)
    console = Console(width=150)
    budget_rows = budgets("resnet56_sha") + budgets("bert_base_grid")
    table = Table(title="Checkpoint budgets (40 simulated GPUs; sizes: ResNet56 7 MB, BERT-Base 1.32 GB)")
    for col in ("study", "mode", "budget", "peak stored", "evicted", "GPU-h", "extra GPU-h", "E2E h", "answers"):
        table.add_column(col, justify="left" if col in ("study", "mode") else "right")
    for r in budget_rows:
        budget = "keep-all" if r["fraction"] is None else f"{r['fraction']:.0%} = {r['budget_bytes'] / 1e6:,.0f} MB"
        table.add_row(r["study"], r["mode"], budget,
                      f"{r['peak_bytes'] / 1e6:,.0f} MB" + ("" if r["within_budget"] else " (over!)"),
                      str(r["evicted"]), f"{r['gpu_hours']:.1f}", f"{r['extra_gpu_hours']:+.1f}",
                      f"{r['end_to_end_hours']:.2f}", "same" if r["same_answers"] else "DIFFER")
    console.print(table)
    split_rows = splits()
    table = Table(title="In-flight splits: retrained / unique steps (ResNet56 space, merged, 40 GPUs)")
    for col in ("tuner", "splits", "unique", "executed", "retrained", "retrained / unique", "GPU-h"):
        table.add_column(col, justify="right")
    for r in split_rows:
        table.add_row(r["tuner"], "yes" if r["splits"] else "no (papers' rule)", f"{r['unique_steps']:,}",
                      f"{r['executed_steps']:,}", f"{r['retrained_steps']:,}", f"{r['retrained_over_unique']:.2%}",
                      f"{r['gpu_hours']:.1f}")
    console.print(table)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps({"budgets": budget_rows, "splits": split_rows},
                                                 option=orjson.OPT_INDENT_2))
    ok = all(r["within_budget"] and r["same_answers"] for r in budget_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
