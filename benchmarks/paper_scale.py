"""Paper scale: the Hippo papers' evaluation (HIPPO_SPEC §8) on the cluster simulator.

What it measures
----------------
Every figure comes from :func:`stagetree.simulate.simulate`: the real log, reducer, scheduler
and tuners, with simulated GPUs on a virtual clock (``examples/paper/_paper.py`` gives the
cost and curve models, calibrated to the trial-based GPU-hours of the paper's Table 5). Hours
are virtual hours of the 40 simulated GPUs (5 x 8 K80, HIPPO_SPEC §8.1); the wall-clock
seconds each simulation took on this machine are shown at the end.

1. **Single studies** (HIPPO_SPEC §8.4/§8.5): ResNet56 SHA, ResNet56 ASHA, MobileNetV2 grid and
   BERT-Base grid (``examples/paper/*.py``), merged and trial-based (``--no-merge``), policy
   critical-path. Per study: trials; p of the search space (every configuration at the
   maximum steps, total / unique steps) next to the paper's p; p of the trials the tuner
   actually asked (the summary's ``merge_rate``; the paper's SHA logs had 4.23); GPU-hours
   and end-to-end hours merged / trial-based and the ratios trial / merged, next to the
   paper's Hippo-trial / Hippo-stage ratios (computed from Table 5: what we simulate) and the
   paper's Ray Tune / Hippo-stage ratios (§8.5).
2. **Multi-study** (HIPPO_SPEC §8.6): S1, S2, S4, S8 (``resnet20_s{k}.py``: k studies of 144
   ResNet20 trials at once on one plan). k-wise q = total steps of all studies / unique steps
   of their union next to the paper's (set 1), GPU-hours and end-to-end merged vs
   trial-based and their ratios (the paper's best, against Ray Tune: 6.77x, 3.53x).
3. **Scheduler ablation** (thesis §6.3, HIPPO_SPEC §3.7): makespan (end-to-end) of
   critical-path, bfs and most-children (the thesis' THR) for ResNet56 ASHA and MobileNetV2
   grid, merged, as ratios to critical-path.
4. **Causal-order ASHA**: ResNet56 ASHA with ``causal=True`` (decisions independent of the
   workers' timing, NASPipe) against arrival order, merged: GPU-hours, end-to-end, idle
   worker-hours (the causal mode's price: finished results waiting for earlier ones).
5. **Scheduler pass** at 10,000 nodes (``benchmarks/scheduler_scale.py``'s ``measure``):
   cold, warm and re-planned passes, in wall-clock milliseconds on this machine.

Simulations are deterministic: every figure but the wall-clock ones is the same on every run.

How to run
----------
::

    .venv/bin/python benchmarks/paper_scale.py [--quick] [--json PATH]

``--quick`` skips the scheduler ablation and S8. The full run takes about 75 s on a
2-core machine (each 448-trial simulation a few seconds). Exit status 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAPER_DIR = ROOT / "examples" / "paper"
# benchmarks/replay.py is named like the `replay` package: keep this folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from projections.search_plan import merged_unique_steps  # noqa: E402
from stagetree.simulate import SimStudy, SimulationResult, simulate  # noqa: E402
from stagetree.simulate_cli import load_simulation  # noqa: E402
from stagetree.tuners import ASHA, Tuner  # noqa: E402

WORKERS = 40
POLICY = "critical-path"

# HIPPO_SPEC §8.4 (Table 1) and §8.5 (Table 5): p, Ray Tune / Hippo-stage ratios, and the
# Hippo-trial and Hippo-stage GPU-hours and end-to-end hours.
SINGLE: list[dict[str, Any]] = [
    {"key": "resnet56_sha", "label": "ResNet56 SHA", "p": 2.447, "tune_gpu": 4.81, "tune_e2e": 2.42,
     "trial_gpu": 404.95, "stage_gpu": 83.7, "trial_e2e": 12.89, "stage_e2e": 5.76},
    {"key": "resnet56_asha", "label": "ResNet56 ASHA", "p": 2.447, "tune_gpu": 3.92, "tune_e2e": 2.38,
     "trial_gpu": 374.82, "stage_gpu": 139.03, "trial_e2e": 13.58, "stage_e2e": 7.4},
    {"key": "mobilenetv2_grid", "label": "MobileNetV2 grid", "p": 3.144, "tune_gpu": 3.15, "tune_e2e": 2.76,
     "trial_gpu": 944.88, "stage_gpu": 291.48, "trial_e2e": 30.29, "stage_e2e": 10.43},
    {"key": "bert_base_grid", "label": "BERT-Base grid", "p": 2.045, "tune_gpu": 2.07, "tune_e2e": 2.11,
     "trial_gpu": 808.21, "stage_gpu": 404.21, "trial_e2e": 24.1, "stage_e2e": 11.93},
]
MULTI_Q = {1: None, 2: 2.26, 4: 2.77, 8: 2.47}  # HIPPO_SPEC §8.6, set 1
MULTI_BEST = {"gpu_hours": 6.77, "end_to_end": 3.53}  # best multi-study result vs Ray Tune
ABLATION = ("resnet56_asha", "mobilenetv2_grid")
POLICIES = ("critical-path", "bfs", "most-children")
BIG = 448  # trials of the ResNet56 studies: each simulation of them must take well under a minute


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


# ----------------------------------------------------------------------------- running


def run(trainer: Any, studies: list[SimStudy], *, merge: bool, policy: str = POLICY,
        workers: int = WORKERS) -> tuple[SimulationResult, float]:
    """One simulation; returns its result and the wall-clock seconds it took."""
    t0 = time.perf_counter()
    result = simulate(trainer, studies, workers=workers, merge=merge, policy=policy)
    return result, time.perf_counter() - t0


def run_file(key: str, *, merge: bool, policy: str = POLICY) -> tuple[SimulationResult, float]:
    """Simulate ``examples/paper/<key>.py`` (loaded afresh, so no tuner state carries over)."""
    trainer, studies, workers = load_simulation(str(PAPER_DIR / f"{key}.py"))
    return run(trainer, studies, merge=merge, policy=policy, workers=workers or WORKERS)


def space_merge_rate(tuner: Tuner) -> float:
    """p of the tuner's search space: every configuration at the maximum steps (the tuner's
    ``max_steps``, else its ``steps``), total / unique steps (Hippo §8.2)."""
    steps = getattr(tuner, "max_steps", None) or tuner.steps  # type: ignore[attr-defined]
    trials = [(hp, steps) for hp in tuner.space]
    return len(trials) * steps / merged_unique_steps(trials)


def figures(result: SimulationResult, wall: float) -> dict[str, Any]:
    """The figures of one simulation (hours are virtual GPU hours)."""
    capacity = result.workers * result.makespan_seconds
    steps = [t["steps"] for s in result.summaries for t in s["trials"]]
    return {
        "mode": result.mode, "policy": result.policy, "workers": result.workers,
        "trials": sum(len(s["trials"]) for s in result.summaries),
        "gpu_hours": result.gpu_hours, "end_to_end_hours": result.end_to_end_hours,
        "idle_worker_hours": result.idle_worker_seconds / 3600.0,
        "idle_ratio": result.idle_worker_seconds / capacity if capacity else None,
        "total_steps": result.total_steps, "unique_steps": result.unique_steps,
        "executed_steps": result.executed_steps,
        "q": _ratio(result.total_steps, result.unique_steps),
        "best_metric": [s["best_metric"] for s in result.summaries],
        "trials_at_max_steps": sum(n == max(steps) for n in steps) if steps else 0,
        "wall_seconds": wall,
    }


def single_studies(walls: list[tuple[str, int, float]]) -> list[dict[str, Any]]:
    out = []
    for paper in SINGLE:
        _, studies, _ = load_simulation(str(PAPER_DIR / f"{paper['key']}.py"))
        row: dict[str, Any] = {"study": paper["label"], "paper": paper, "p_space": space_merge_rate(studies[0].tuner)}
        for mode in ("merged", "trial"):
            result, wall = run_file(paper["key"], merge=mode == "merged")
            row[mode] = figures(result, wall)
            walls.append((f"{paper['label']}, {mode}", row[mode]["trials"], wall))
        row["p_explored"] = row["merged"]["q"]
        row["gpu_ratio"] = _ratio(row["trial"]["gpu_hours"], row["merged"]["gpu_hours"])
        row["e2e_ratio"] = _ratio(row["trial"]["end_to_end_hours"], row["merged"]["end_to_end_hours"])
        row["paper_trial_gpu_ratio"] = paper["trial_gpu"] / paper["stage_gpu"]
        row["paper_trial_e2e_ratio"] = paper["trial_e2e"] / paper["stage_e2e"]
        out.append(row)
    return out


def multi_study(cases: list[int], walls: list[tuple[str, int, float]]) -> list[dict[str, Any]]:
    out = []
    for k in cases:
        row: dict[str, Any] = {"case": f"S{k}", "studies": k, "paper_q": MULTI_Q[k]}
        for mode in ("merged", "trial"):
            result, wall = run_file(f"resnet20_s{k}", merge=mode == "merged")
            row[mode] = figures(result, wall)
            walls.append((f"S{k}, {mode}", row[mode]["trials"], wall))
        row["q"] = row["merged"]["q"]
        row["gpu_ratio"] = _ratio(row["trial"]["gpu_hours"], row["merged"]["gpu_hours"])
        row["e2e_ratio"] = _ratio(row["trial"]["end_to_end_hours"], row["merged"]["end_to_end_hours"])
        out.append(row)
    return out


def ablation(single: list[dict[str, Any]], walls: list[tuple[str, int, float]]) -> list[dict[str, Any]]:
    out = []
    for key in ABLATION:
        label = next(p["label"] for p in SINGLE if p["key"] == key)
        runs = {POLICY: next(r["merged"] for r in single if r["paper"]["key"] == key)}  # already simulated
        for policy in POLICIES[1:]:
            result, wall = run_file(key, merge=True, policy=policy)
            runs[policy] = figures(result, wall)
            walls.append((f"{label}, merged, {policy}", runs[policy]["trials"], wall))
        critical = runs[POLICY]["end_to_end_hours"]
        for policy in POLICIES:
            runs[policy]["makespan_vs_critical"] = _ratio(runs[policy]["end_to_end_hours"], critical)
        out.append({"study": label, "policies": runs})
    return out


def causal_asha(single: list[dict[str, Any]], walls: list[tuple[str, int, float]]) -> dict[str, Any]:
    sys.path.insert(0, str(PAPER_DIR))
    from _paper import resnet56_space, resnet56_trainer  # type: ignore[import-not-found]

    arrival = next(r["merged"] for r in single if r["paper"]["key"] == "resnet56_asha")
    tuner = ASHA(resnet56_space(), metric="val_acc", mode="max", min_steps=15, max_steps=120, reduction=4,
                 causal=True)
    result, wall = run(resnet56_trainer(), [SimStudy("resnet56-asha", tuner, 0)], merge=True)
    causal = figures(result, wall)
    walls.append(("ResNet56 ASHA, merged, causal", causal["trials"], wall))
    return {"arrival": arrival, "causal": causal}


def scheduler_pass() -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("scheduler_scale", Path(__file__).resolve().parent /
                                                  "scheduler_scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(nodes=10_000)


def measure(quick: bool = False) -> dict[str, Any]:
    """Run every section (``quick``: no ablation, no S8); see the module docstring."""
    walls: list[tuple[str, int, float]] = []
    single = single_studies(walls)
    multi = multi_study([1, 2, 4] if quick else [1, 2, 4, 8], walls)
    abl = None if quick else ablation(single, walls)
    causal = causal_asha(single, walls)
    sched = scheduler_pass()
    return {"date": time.strftime("%Y-%m-%d"), "workers": WORKERS, "policy": POLICY, "quick": quick,
            "single": single, "multi": multi, "ablation": abl, "causal": causal, "scheduler_pass": sched,
            "wall_seconds": [{"run": name, "trials": n, "seconds": s} for name, n, s in walls]}


# ----------------------------------------------------------------------------- printing


def render(r: dict[str, Any], console: Console) -> None:
    """Print the figures of :func:`measure` as rich tables."""
    t = Table(title=f"single studies on {r['workers']} simulated GPUs ({r['policy']}): what ran")
    for col in ("study", "trials", "p (this space)", "p (paper)", "p (trials asked)", "best merged / trial"):
        t.add_column(col, justify="left" if col == "study" else "right")
    for row in r["single"]:
        best = " / ".join(_f(row[m]["best_metric"][0], ".4f") for m in ("merged", "trial"))
        t.add_row(row["study"], str(row["merged"]["trials"]), _f(row["p_space"], ".3f"), _f(row["paper"]["p"], ".3f"),
                  _f(row["p_explored"], ".3f"), best)
    console.print(t)

    for what, key, unit, trial_key, stage_key, tune_key in (
            ("GPU-hours", "gpu_hours", "GPU-h", "trial_gpu", "stage_gpu", "tune_gpu"),
            ("end-to-end hours", "end_to_end_hours", "h", "trial_e2e", "stage_e2e", "tune_e2e")):
        t = Table(title=f"single studies: {what} (trial / merged vs the paper's Hippo-trial / stage and Tune / stage)")
        for col in ("study", f"merged {unit}", f"trial {unit}", "trial / merged", "paper trial / stage",
                    "paper Tune / stage"):
            t.add_column(col, justify="left" if col == "study" else "right")
        for row in r["single"]:
            p = row["paper"]
            ratio = row["gpu_ratio"] if key == "gpu_hours" else row["e2e_ratio"]
            paper_ratio = row["paper_trial_gpu_ratio"] if key == "gpu_hours" else row["paper_trial_e2e_ratio"]
            t.add_row(row["study"], _f(row["merged"][key], ".1f"), _f(row["trial"][key], ".1f"), _f(ratio, ".2f", "x"),
                      f"{paper_ratio:.2f}x ({p[trial_key]:g} / {p[stage_key]:g})", f"{p[tune_key]:.2f}x")
        console.print(t)

    t = Table(title="multi-study ResNet20 (k studies of 144 trials at once, one plan)")
    for col in ("case", "trials", "q", "paper q", "GPU-h merged", "GPU-h trial", "trial / merged",
                "e2e h merged", "e2e h trial", "trial / merged"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for row in r["multi"]:
        m, tr = row["merged"], row["trial"]
        t.add_row(row["case"], str(m["trials"]), _f(row["q"], ".3f"), _f(row["paper_q"], ".2f"),
                  _f(m["gpu_hours"], ".1f"), _f(tr["gpu_hours"], ".1f"), _f(row["gpu_ratio"], ".2f", "x"),
                  _f(m["end_to_end_hours"], ".2f"), _f(tr["end_to_end_hours"], ".2f"), _f(row["e2e_ratio"], ".2f", "x"))
    console.print(t)
    console.print(f"paper (set 1, best case vs Ray Tune): {MULTI_BEST['gpu_hours']}x GPU-hours, "
                  f"{MULTI_BEST['end_to_end']}x end-to-end")

    if r["ablation"]:
        t = Table(title="scheduler ablation, merged: makespan as a ratio to critical-path")
        for col in ("study", "policy", "e2e h", "vs critical-path", "GPU-h", "idle GPU-h"):
            t.add_column(col, justify="left" if col in ("study", "policy") else "right")
        for row in r["ablation"]:
            for policy, f in row["policies"].items():
                t.add_row(row["study"], policy, _f(f["end_to_end_hours"], ".2f"),
                          _f(f["makespan_vs_critical"], ".3f", "x"), _f(f["gpu_hours"], ".1f"),
                          _f(f["idle_worker_hours"], ".1f"))
            t.add_section()
        console.print(t)
        console.print("thesis §6.3: critical-path has the lowest makespan; ASHA 1.27x faster than the comparison "
                      "policy; grid THR (most-children) ~ critical-path")

    t = Table(title="ResNet56 ASHA, merged: causal order vs arrival order")
    for col in ("order", "GPU-h", "e2e h", "idle GPU-h", "idle ratio", "trials at 120 epochs", "best val_acc"):
        t.add_column(col, justify="left" if col == "order" else "right")
    for name in ("arrival", "causal"):
        f = r["causal"][name]
        t.add_row(name, _f(f["gpu_hours"], ".1f"), _f(f["end_to_end_hours"], ".2f"), _f(f["idle_worker_hours"], ".1f"),
                  _f(100 * f["idle_ratio"] if f["idle_ratio"] is not None else None, ".1f", "%"),
                  str(f["trials_at_max_steps"]), _f(f["best_metric"][0], ".4f"))
    console.print(t)

    s = r["scheduler_pass"]
    title = f"scheduler pass, one plan of {s['nodes']:.0f} nodes ({s['trials']:.0f} trials), wall clock"
    t = Table(title=title, min_width=len(title))
    t.add_column("pass")
    t.add_column("ms", justify="right")
    passes = (("cold, critical-path", "cold_pass_s"), ("cold, critical-path, gc frozen", "cold_pass_frozen_gc_s"),
              ("cold, bfs", "bfs_pass_s"), ("cold, most-children", "most_children_pass_s"),
              ("warm (a worker joined)", "warm_pass_s"), ("after a checkpoint (plan rebuilt)", "replan_pass_s"),
              (f"{s['many_plans']:.0f} plans, cold", "many_plans_cold_s"),
              (f"{s['many_plans']:.0f} plans, after one plan's event", "many_plans_warm_s"))
    for label, key in passes:
        t.add_row(label, f"{s[key] * 1e3:.2f}")
    console.print(t)

    title = "wall-clock seconds per simulation (this machine)"
    t = Table(title=title, min_width=len(title))
    for col in ("run", "trials", "s"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for w in r["wall_seconds"]:
        flag = " [red](over a minute)[/red]" if w["trials"] >= BIG and w["seconds"] >= 60 else ""
        t.add_row(w["run"], str(w["trials"]), f"{w['seconds']:.1f}{flag}")
    console.print(t)
    big = [w["seconds"] for w in r["wall_seconds"] if w["trials"] >= BIG]
    if big:
        console.print(f"slowest simulation of {BIG}+ trials: {max(big):.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the scheduler ablation and S8")
    parser.add_argument("--json", help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 130))
    started = time.perf_counter()
    result = measure(quick=args.quick)
    result["total_wall_seconds"] = time.perf_counter() - started
    render(result, console)
    console.print(f"total: {result['total_wall_seconds']:.0f} s")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        console.print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
