"""Many trivial trials: the control plane's overhead next to Optuna's (issue 15, goal 1).

What it measures
----------------
One invocation runs, back to back on this machine:

* **stagetree**: ``stagetree run benchmarks/studies/trivial.py --workers 2`` in a fresh
  directory (``N`` trials of one step each on a one-weight model, no data; no two trials share
  a step, so every trial is its own stage, dispatched, trained, checkpointed, evaluated and
  logged durably). From ``summary.json``: the study's end-to-end seconds (first event to the
  answer) and worker-seconds; from the subprocess: its wall seconds. Start-up and exit are
  wall minus end-to-end: the interpreter, the worker processes importing torch and warming
  up, writing the summary, leaving.
* **Optuna**: ``N`` trials in one process with a durable ``JournalStorage(JournalFileBackend)``,
  each building the same trainer, training its one step and evaluating, as a user of Optuna
  would write it; the target is drawn by ``RandomSampler`` from ``[0, 1)`` (the work of a trial
  does not depend on it; Optuna's ``GridSampler`` over 1,000 values costs more than the trials:
  it reads every earlier trial at each one). Its wall
  seconds include nothing but the study (the interpreter has imported torch already).
* **the floor of start-up**: the wall seconds of ``python -c "import torch, torch._dynamo"``
  (what any process training with a torch optimizer pays before its first step).

The two run alternately ``--repeats`` times (default 3; this machine's speed drifts by a third
from one minute to the next, and both programs are affected alike within a pair). Printed: the
median of the per-pair ratios stagetree's end-to-end / Optuna's (goal: at most 2), and the
median of stagetree's start-up plus exit beyond the study (goal: under 3 s) next to the floor.
The JSON holds every run, with the machine's busy CPU seconds meanwhile (``/proc/stat``).

Usage::

    .venv/bin/python benchmarks/trivial_trials.py [--trials 1000] [--workers 2] [--repeats 3] [--out runs/bench-trivial]

Writes ``OUT/trivial_trials.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "benchmarks" / "studies" / "trivial.py"


def _cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (Linux /proc/stat: user+nice+system+irq...)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def run_stagetree(trials: int, workers: int, out: Path) -> dict[str, float]:
    """Wall, end-to-end and worker seconds of ``stagetree run`` on the trivial study."""
    shutil.rmtree(out, ignore_errors=True)
    exe = Path(sys.executable).with_name("stagetree")
    env = {**os.environ, "STAGETREE_TRIVIAL_TRIALS": str(trials)}
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    proc = subprocess.run([str(exe), "run", str(STUDY), "--workers", str(workers), "--out", str(out)],
                          env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"stagetree run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = orjson.loads((out / "summary.json").read_bytes())
    return {"wall_s": wall, "end_to_end_s": summary["end_to_end_seconds"],
            "worker_seconds": summary["worker_seconds"], "machine_cpu_s": cpu}


def run_optuna(trials: int, out: Path) -> dict[str, float]:
    """Wall seconds of the same trials in one process on Optuna with a durable journal file."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    spec = importlib.util.spec_from_file_location("trivial_study", STUDY)
    assert spec is not None and spec.loader is not None
    os.environ["STAGETREE_TRIVIAL_TRIALS"] = str(trials)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    trainer = module.trainer
    device = torch.device("cpu")

    def objective(trial: optuna.Trial) -> float:
        trainer.build(module.seed, device)
        trainer.setup({"target": trial.suggest_float("target", 0.0, 1.0)})
        trainer.train_step(torch.zeros(1, dtype=torch.long), 0)
        return float(trainer.evaluate()["loss"])

    # the first call imports what training needs (torch's optimizer code): start-up, not study time
    trainer.build(module.seed, device)
    trainer.optimizer.state_dict()
    journal = out / "optuna.journal"
    journal.unlink(missing_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    sampler = optuna.samplers.RandomSampler(seed=0)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    study = optuna.create_study(storage=storage, sampler=sampler, direction="minimize")
    study.optimize(objective, n_trials=trials)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    assert len(study.trials) == trials
    return {"wall_s": wall, "machine_cpu_s": cpu}


def torch_floor() -> float:
    """Wall seconds of a fresh interpreter importing torch and its compiler front end."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch._dynamo"], check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3,
                   help="stagetree and Optuna run alternately this many times each; medians are reported")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-trivial")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats is {args.repeats}, but must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)

    floor = torch_floor()
    pairs = []
    for _ in range(args.repeats):  # alternated: a machine whose speed drifts affects both alike
        st = run_stagetree(args.trials, args.workers, args.out / "stagetree")
        op = run_optuna(args.trials, args.out)
        pairs.append({"stagetree": st, "optuna": op, "ratio": st["end_to_end_s"] / op["wall_s"],
                      "startup_and_exit_s": st["wall_s"] - st["end_to_end_s"]})

    def median(values: list[float]) -> float:
        return statistics.median(values)

    st_e2e = median([x["stagetree"]["end_to_end_s"] for x in pairs])
    op_wall = median([x["optuna"]["wall_s"] for x in pairs])
    ratio = median([x["ratio"] for x in pairs])
    outside = median([x["startup_and_exit_s"] for x in pairs])
    result = {"trials": args.trials, "workers": args.workers, "runs": pairs, "torch_import_floor_s": floor,
              "median_stagetree_end_to_end_s": st_e2e, "median_optuna_wall_s": op_wall,
              "median_ratio_end_to_end_vs_optuna": ratio, "median_startup_and_exit_s": outside,
              "per_trial_ms": 1000 * st_e2e / args.trials, "cores": os.cpu_count()}
    (args.out / "trivial_trials.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))

    print(f"{args.trials} trivial trials, {args.workers} workers, {os.cpu_count()} cores, "
          f"{args.repeats} alternated runs each (medians; per run in the JSON)")
    print(f"  stagetree   end-to-end {st_e2e:8.2f} s  ({result['per_trial_ms']:.1f} ms per trial); runs: "
          + ", ".join(f"{x['stagetree']['end_to_end_s']:.2f}" for x in pairs))
    print(f"  optuna      wall       {op_wall:8.2f} s  (JournalFileBackend, in-process); runs: "
          + ", ".join(f"{x['optuna']['wall_s']:.2f}" for x in pairs))
    print(f"  ratio end-to-end stagetree / optuna: {ratio:.2f} (goal <= 2); per pair: "
          + ", ".join(f"{x['ratio']:.2f}" for x in pairs))
    print(f"  start-up and exit beyond the study: {outside:.2f} s (goal < 3 s); "
          f"`import torch, torch._dynamo` alone: {floor:.2f} s")
    print(f"wrote {args.out / 'trivial_trials.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
