"""Merge savings: a study run merged and trial-based (``--no-merge``) side by side.

What it measures
----------------
Both modes of one study file are run back to back in this one invocation (same machine, same
worker count), each by the ``stagetree`` console script into a fresh directory
(``OUT/merged`` and ``OUT/trial``, removed first). The two ``summary.json`` files, the merged
run's projection (``OUT/merged/state``) and both logs (``OUT/*/log``) give:

* **metrics check**: every trial's final metrics must be identical in both modes (invariant 1,
  "merged = independent, bit for bit"); mismatches are listed.
* **merge rate p** (dimensionless): total training steps of the trials / unique steps after
  merging (``summary["merge_rate"]``, Hippo §6.2).
* **worker-seconds** (seconds): the time workers were held by stages (the papers' GPU-hours),
  per mode, and the ratio trial / merged, also divided by p.
* **cost-weighted merge rate p_w** (dimensionless): p with every step weighted by its measured
  cost. See :func:`cost_weighted_merge_rate`.
* **end-to-end seconds** per mode (from a ready cluster to the final result, as the CLI
  measures it) and their ratio trial / merged. The subprocess wall time is shown too; the
  difference is what the CLI leaves out: interpreter start-up, worker processes spawning,
  importing torch and warming up, and writing the summary.
* **lower bound of the merged end-to-end time** (seconds): ``max(unique work / workers,
  longest path)``; see :func:`lower_bound`. The merged end-to-end time over this bound says how
  much time goes to anything but training (dispatch latency, idle workers, the tuner's rounds).
* **where the time goes** per mode: start-up before the first stage, the tail after the last
  stage, and the time workers sat idle between stages.
* **contention** per mode (CPU seconds): the CPU time of the run's own processes and of every
  other process on the machine meanwhile (Linux ``/proc/stat``). Timings of a run that shared
  its cores with other work are flagged; on a small machine they can be off by a factor of 2-3.

The issue's target: the worker-seconds ratio trial / merged is at least 0.95 x p. It is
checked against p and against p_w; p_w is the apples-to-apples one.

Everything is printed as a ``rich`` table and written to ``OUT/merge_savings.json``.

How to run
----------
::

    .venv/bin/python benchmarks/merge_savings.py [--study examples/digits.py] [--workers 2] [--out runs/bench]

It takes roughly the time of the two runs (about 50-80 s for ``examples/digits.py`` with two
workers on a 2-core machine). Exit status 0 when both runs finished, whatever the figures;
1 when a run failed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from events import topics
from events.codec import InvalidEvent, decode
from events.log import EmbeddedLog
from events.models import Event, StageFinished, StageStarted, StudyFinished, StudyStarted, WorkerJoined
from projections.state import Node, Plan, State
from projections.store import ProjectionStore

TARGET = 0.95  # the issue's target: worker-seconds ratio trial / merged >= 0.95 x p
LOWER_BOUND_SLACK = 1.10  # merged end-to-end time "within 10%" of its lower bound
CONTENDED = 0.15  # flag a run when other processes used more than this share of the cores


# ----------------------------------------------------------------------------- running

def stagetree_script() -> Path:
    """The ``stagetree`` console script installed next to this interpreter."""
    script = Path(sys.executable).parent / "stagetree"
    if not script.exists():
        raise FileNotFoundError(f"no `stagetree` console script next to {sys.executable} (looked for {script})")
    return script


def _machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores; None off Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _adopt_descendants() -> None:
    """Make this process the reaper of its orphaned descendants (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``;
    elsewhere nothing): a run's workers are children of its fork server, which outlives the
    ``stagetree`` process by a moment, so their CPU time reaches ``RUSAGE_CHILDREN`` only if this
    process reaps the server (:func:`_reap_adopted`)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap_adopted(timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s`` seconds) for every child left, adopted ones included."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def run_mode(study: Path, workers: int, out: Path, *, merge: bool) -> dict[str, float | None]:
    """Run ``study`` in one mode into ``out`` (removed first).

    Returns ``wall_s`` (subprocess wall seconds), ``own_cpu_s`` (CPU seconds of the run's
    process tree: coordinator, fork server and workers, see :func:`_adopt_descendants`) and
    ``other_cpu_s`` (CPU seconds the rest of the machine used meanwhile; None off Linux).
    Benchmarks on a shared machine are only comparable when ``other_cpu_s`` is small next to
    ``wall_s x cores``.

    Raises:
        RuntimeError: the run exited non-zero (its stderr is in the message).
    """
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(stagetree_script()), "run", str(study), "--workers", str(workers), "--out", str(out), "--quiet"]
    if not merge:
        cmd.append("--no-merge")
    _adopt_descendants()
    busy0, own0, started = _machine_busy_seconds(), _children_cpu_seconds(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    _reap_adopted()
    own, busy1 = _children_cpu_seconds() - own0, _machine_busy_seconds()
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    other = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own)
    return {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": other}


def read_events(run_dir: Path) -> list[Event]:
    """Every decodable event of a run's plan stream, in log order."""
    log = EmbeddedLog(run_dir / "log")
    try:
        events = []
        for record in log.read(topics.PLAN):
            try:
                events.append(decode(record.value))
            except InvalidEvent:
                continue  # dead-lettered by the projector; not a measurement
        return events
    finally:
        log.close()


def load_state(run_dir: Path) -> State:
    """The run's persisted projection."""
    store = ProjectionStore(run_dir / "state")
    try:
        return store.load()
    finally:
        store.close()


# ----------------------------------------------------------------------------- metrics check

def compare_metrics(merged: dict[str, Any], trial: dict[str, Any]) -> list[str]:
    """Trial ids whose final metrics (or steps, or status) differ between the two summaries,
    or that appear in only one of them; empty when every trial's result is identical."""
    a = {t["trial_id"]: (t["steps"], t["status"], t["metrics"]) for t in merged["trials"]}
    b = {t["trial_id"]: (t["steps"], t["status"], t["metrics"]) for t in trial["trials"]}
    return sorted(tid for tid in a.keys() | b.keys() if a.get(tid) != b.get(tid))


# ----------------------------------------------------------------------------- p_w

def cost_weighted_merge_rate(state: State, cost_hp: str = "batch_size") -> dict[str, Any]:
    """Cost-weighted merge rate p_w of the merged run (dimensionless), with its parts.

    p = total steps / unique steps counts every step alike, but worker-seconds weigh each step
    by what it costs. In examples/digits.py half the batch-size sequences double at step 100,
    so later steps are dearer than early ones; merging removes mostly the cheap early steps
    that many trials share (every trial starts at step 0, few reach 480). The worker-seconds
    saving is therefore smaller than p would suggest, and the fair expectation for the ratio
    trial / merged worker-seconds is p_w, not p.

    p_w = sum over trials of cost(trial's full prefix [0, steps)) / cost(unique merged steps),
    where a step on node n costs n's measured seconds per step (``Node.sec_per_step()``: the
    merged run's training seconds / steps on n; a node never trained gets the plan's mean).
    A trial's prefix is found by walking from its terminal node ``t.requests[t.steps]``
    root-ward: the terminal node covers [start_step, t.steps), each ancestor covers
    [its start_step, its child's start_step). A node's unique range is [start_step, the
    largest end any trial needs on it).

    A node's cost per step is its average: exact for the unique cost, and for a trial's prefix
    whenever the cost per step is the same all along the node. A node is one hyper-parameter
    function, so a cost-setting value (``cost_hp``, the batch size) may change inside it; a
    trial that ends inside such a node (a shorter trial sharing its prefix branches off it) is
    then priced at the node's average, too dear or too cheap (which one is first submitted
    decides whose function the node is). ``mixed_cost_nodes`` counts the nodes where a prefix
    ends inside while the value changes along the node; p_w is approximate when it is not 0.

    Returns a dict: ``p_w``; ``trial_cost_s`` (predicted training seconds of the trial-based
    baseline); ``unique_cost_s`` (same for the merged plan); ``unique_steps`` (must equal the
    summary's); ``fallback_nodes`` (nodes costed at the plan mean); ``mixed_cost_nodes`` (as
    above).
    """
    means: dict[str, float] = {}
    for key, plan in state.plans.items():
        steps = sum(n.profile_steps for n in plan.nodes.values())
        means[key] = sum(n.profile_seconds for n in plan.nodes.values()) / steps if steps else 0.0

    fallback: set[tuple[str, str]] = set()

    def cost_per_step(plan_key: str, node: Node) -> float:
        sps = node.sec_per_step()
        if sps is None:
            fallback.add((plan_key, node.node_id))
            return means[plan_key]
        return sps

    trial_cost = 0.0
    extent: dict[tuple[str, str], int] = {}  # (plan, node) -> largest end step any trial needs
    ends: dict[tuple[str, str], set[int]] = {}  # (plan, node) -> the end steps of trial prefixes on it
    for t in state.trials.values():
        plan: Plan = state.plans[t.plan_key]
        end, node_id = t.steps, t.requests.get(t.steps)
        while node_id is not None:
            node = plan.nodes[node_id]
            steps = max(0, end - node.start_step)
            trial_cost += steps * cost_per_step(t.plan_key, node)
            key = (t.plan_key, node_id)
            extent[key] = max(extent.get(key, node.start_step), end)
            ends.setdefault(key, set()).add(end)
            end, node_id = node.start_step, node.parent_id

    def mixed(key: tuple[str, str]) -> bool:
        """Whether a prefix ends inside the node while ``cost_hp`` is not constant along it."""
        node = state.plans[key[0]].nodes[key[1]]
        function = node.hp.get(cost_hp)
        if function is None or not any(node.start_step < end < extent[key] for end in ends[key]):
            return False
        first = function.value(node.start_step)
        return any(function.value(step) != first for step in range(node.start_step, extent[key]))

    unique_cost, unique_steps = 0.0, 0
    for (plan_key, node_id), end in extent.items():
        node = state.plans[plan_key].nodes[node_id]
        unique_steps += end - node.start_step
        unique_cost += (end - node.start_step) * cost_per_step(plan_key, node)
    return {
        "p_w": trial_cost / unique_cost if unique_cost else None,
        "trial_cost_s": trial_cost,
        "unique_cost_s": unique_cost,
        "unique_steps": unique_steps,
        "fallback_nodes": len(fallback),
        "mixed_cost_nodes": sum(1 for key in extent if mixed(key)),
    }


# ----------------------------------------------------------------------------- lower bound

def longest_path(state: State, finished: list[StageFinished]) -> tuple[float, int]:
    """Seconds along the heaviest root-to-leaf chain of the run's stages, and its length in stages.

    Stage tree: a stage (node, from, to) depends on the stage that produced its starting
    checkpoint: a non-empty stage on the same node ending at ``from``; or, when ``from`` is
    the node's ``start_step``, a non-empty stage ending there on the parent node (further
    ancestors when the parent starts at the same step). A stage at step 0 of a root starts
    from a fresh initialisation. When a range ran more than once, the first to finish is
    taken (it is the one that unblocked its children).
    """
    ends: dict[tuple[str, str, int], int] = {}  # (plan, node, to_step) -> index of first finisher
    for i, ev in enumerate(finished):
        if ev.to_step > ev.from_step:
            ends.setdefault((ev.plan_key, ev.node_id, ev.to_step), i)

    def parent_of(i: int) -> int | None:
        ev = finished[i]
        plan = state.plans[ev.plan_key]
        same = ends.get((ev.plan_key, ev.node_id, ev.from_step))
        if same is not None and same != i:
            return same
        node = plan.nodes[ev.node_id]
        while node.parent_id is not None and ev.from_step == node.start_step:
            node = plan.nodes[node.parent_id]
            up = ends.get((ev.plan_key, node.node_id, ev.from_step))
            if up is not None:
                return up
        return None

    best: dict[int, tuple[float, int]] = {}
    for i in range(len(finished)):  # iterative memoised walk up the chain
        chain, j = [], i
        while j is not None and j not in best:
            chain.append(j)
            j = parent_of(j)
        below = best[j] if j is not None else (0.0, 0)
        for k in reversed(chain):
            below = (below[0] + finished[k].seconds, below[1] + 1)
            best[k] = below
    return max(best.values(), default=(0.0, 0))


def lower_bound(state: State, events: list[Event], workers: int) -> dict[str, Any]:
    """The merged run's end-to-end lower bound, seconds: max(unique work / workers, longest path).

    Unique work is the sum of ``seconds`` of every StageFinished (worker time per stage,
    including checkpoint load, evaluation and save); the longest path is
    :func:`longest_path`. No schedule on ``workers`` workers can finish sooner, even with no
    start-up or coordination cost.
    """
    finished = [e for e in events if isinstance(e, StageFinished)]
    work = sum(e.seconds for e in finished)
    path_s, path_stages = longest_path(state, finished)
    return {
        "unique_work_s": work,
        "longest_path_s": path_s,
        "longest_path_stages": path_stages,
        "lower_bound_s": max(work / workers, path_s),
    }


# ----------------------------------------------------------------------------- time breakdown

def timeline(events: list[Event], workers: int) -> dict[str, float | None]:
    """Where a run's wall time went, from event timestamps (seconds, informational).

    ``startup_s``: from the start of the end-to-end clock (StudyFinished.ts -
    end_to_end_seconds; the CLI starts it once every worker has joined) to the first
    StageStarted (first tuner round and scheduling); ``workers_joined_s``: from that start to
    the last WorkerJoined (<= 0: the workers were ready before the clock started);
    ``tail_s``: last StageFinished to StudyFinished; ``held_s``: sum of StageFinished.seconds;
    ``train_s``: their train_seconds (optimizer steps only); ``idle_s``: worker time between
    the first stage and the last one spent neither held by a stage (dispatch latency, waiting
    for work); ``stages``: number of finished stages.
    """
    done = next((e for e in reversed(events) if isinstance(e, StudyFinished)), None)
    started = [e for e in events if isinstance(e, StageStarted)]
    finished = [e for e in events if isinstance(e, StageFinished)]
    if done is None or not started or not finished:
        return {}
    begin = done.ts - done.end_to_end_seconds
    first, last = min(e.ts for e in started), max(e.ts for e in finished)
    held = sum(e.seconds for e in finished)
    joined = [e.ts for e in events if isinstance(e, WorkerJoined)]
    return {
        "startup_s": first - begin,
        "workers_joined_s": max(joined) - begin if joined else None,
        "tail_s": done.ts - last,
        "held_s": held,
        "train_s": sum(e.train_seconds for e in finished),
        "idle_s": max(0.0, workers * (last - first) - held),
        "stages": float(len(finished)),
    }


# ----------------------------------------------------------------------------- report

def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def measure(study: Path, workers: int, out: Path) -> dict[str, Any]:
    """Run both modes and compute every figure; the returned dict is what merge_savings.json holds."""
    dirs = {"merged": out / "merged", "trial": out / "trial"}
    runs = {mode: run_mode(study, workers, d, merge=mode == "merged") for mode, d in dirs.items()}
    summaries = {mode: orjson.loads((d / "summary.json").read_bytes()) for mode, d in dirs.items()}
    events = {mode: read_events(d) for mode, d in dirs.items()}
    state = load_state(dirs["merged"])

    m, t = summaries["merged"], summaries["trial"]
    mismatched = compare_metrics(m, t)
    p = m["merge_rate"]
    pw = cost_weighted_merge_rate(state)
    ws_ratio = _ratio(t["worker_seconds"], m["worker_seconds"])
    lb = lower_bound(state, events["merged"], workers)
    timelines = {mode: timeline(events[mode], workers) for mode in dirs}
    studies = [e for e in events["merged"] if isinstance(e, StudyStarted)]
    return {
        "study": str(study),
        "workers": workers,
        "trials": len(m["trials"]),
        "metrics_identical": not mismatched,
        "mismatched_trials": mismatched,
        "total_steps": m["total_steps"],
        "unique_steps": m["unique_steps"],
        "executed_steps": {"merged": m["executed_steps"], "trial": t["executed_steps"]},
        "merge_rate": p,
        "cost_weighted": pw,
        "unique_steps_check": pw["unique_steps"] == m["unique_steps"],
        "worker_seconds": {"merged": m["worker_seconds"], "trial": t["worker_seconds"]},
        "worker_seconds_ratio": ws_ratio,
        "ratio_over_p": _ratio(ws_ratio, p),
        "ratio_over_p_w": _ratio(ws_ratio, pw["p_w"]),
        "target_p": ws_ratio is not None and p is not None and ws_ratio >= TARGET * p,
        "target_p_w": ws_ratio is not None and pw["p_w"] is not None and ws_ratio >= TARGET * pw["p_w"],
        "train_seconds": {mode: timelines[mode].get("train_s") for mode in dirs},
        "end_to_end_seconds": {"merged": m["end_to_end_seconds"], "trial": t["end_to_end_seconds"]},
        "subprocess_wall_seconds": {mode: run["wall_s"] for mode, run in runs.items()},
        "cpu_seconds": {mode: {"own": run["own_cpu_s"], "other_processes": run["other_cpu_s"]}
                        for mode, run in runs.items()},
        "cores": os.cpu_count(),
        "end_to_end_ratio": _ratio(t["end_to_end_seconds"], m["end_to_end_seconds"]),
        "lower_bound": lb,
        "merged_over_lower_bound": _ratio(m["end_to_end_seconds"], lb["lower_bound_s"]),
        "merged_after_startup_over_lower_bound": _ratio(
            m["end_to_end_seconds"] - timelines["merged"].get("startup_s", 0.0), lb["lower_bound_s"]),
        "within_10pct": m["end_to_end_seconds"] <= LOWER_BOUND_SLACK * lb["lower_bound_s"],
        "timeline": timelines,
        "plan_key": studies[0].plan_key if studies else None,
    }


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _yes(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


def render(r: dict[str, Any], console: Console) -> None:
    """Print the figures of :func:`measure` as rich tables."""
    ws, e2e, tr = r["worker_seconds"], r["end_to_end_seconds"], r["train_seconds"]
    pw, lb = r["cost_weighted"], r["lower_bound"]
    table = Table(title=f"merge savings: {r['study']} ({r['trials']} trials, {r['workers']} workers)")
    table.add_column("figure")
    table.add_column("merged", justify="right")
    table.add_column("trial (--no-merge)", justify="right")
    table.add_column("trial / merged", justify="right")
    table.add_row("per-trial metrics identical", _yes(r["metrics_identical"]), "",
                  "" if r["metrics_identical"] else f"{len(r['mismatched_trials'])} differ")
    table.add_row("steps: total / unique", f"{r['total_steps']} / {r['unique_steps']}", "", "")
    table.add_row("executed steps", str(r["executed_steps"]["merged"]), str(r["executed_steps"]["trial"]),
                  _f(_ratio(r["executed_steps"]["trial"], r["executed_steps"]["merged"]), ".3f"))
    table.add_row("merge rate p", _f(r["merge_rate"], ".3f"), "", "")
    table.add_row("cost-weighted merge rate p_w", _f(pw["p_w"], ".3f"), "", "")
    table.add_section()
    table.add_row("worker-seconds (s)", _f(ws["merged"]), _f(ws["trial"]), _f(r["worker_seconds_ratio"], ".3f"))
    table.add_row("  of which training (s)", _f(tr["merged"]), _f(tr["trial"]),
                  _f(_ratio(tr["trial"], tr["merged"]), ".3f"))
    table.add_row("  predicted training from profile (s)", _f(pw["unique_cost_s"]), _f(pw["trial_cost_s"]),
                  _f(pw["p_w"], ".3f"))
    table.add_row("ratio / p", "", "", _f(r["ratio_over_p"], ".3f"))
    table.add_row("ratio / p_w", "", "", _f(r["ratio_over_p_w"], ".3f"))
    table.add_row(f"ratio >= {TARGET} x p", "", "", _yes(r["target_p"]))
    table.add_row(f"ratio >= {TARGET} x p_w", "", "", _yes(r["target_p_w"]))
    table.add_section()
    walls = r["subprocess_wall_seconds"]
    table.add_row("end-to-end (s)", _f(e2e["merged"]), _f(e2e["trial"]), _f(r["end_to_end_ratio"], ".3f"))
    table.add_row("  subprocess wall (s)", _f(walls["merged"]), _f(walls["trial"]),
                  _f(_ratio(walls["trial"], walls["merged"]), ".3f"))
    table.add_row("  outside end-to-end: start-up, exit (s)", _f(walls["merged"] - e2e["merged"]),
                  _f(walls["trial"] - e2e["trial"]), "")
    for key, label in (("startup_s", "  start-up before 1st stage (s)"),
                       ("workers_joined_s", "  last worker joined (s)"),
                       ("idle_s", "  workers idle between stages (worker-s)"),
                       ("tail_s", "  tail after last stage (s)"),
                       ("stages", "  stages finished")):
        tm, tt = r["timeline"]["merged"].get(key), r["timeline"]["trial"].get(key)
        spec = ".0f" if key == "stages" else ".2f"
        table.add_row(label, _f(tm, spec), _f(tt, spec), "")
    cpu = r["cpu_seconds"]
    table.add_row("  CPU of the run / other processes (core-s)",
                  f"{_f(cpu['merged']['own'], '.0f')} / {_f(cpu['merged']['other_processes'], '.0f')}",
                  f"{_f(cpu['trial']['own'], '.0f')} / {_f(cpu['trial']['other_processes'], '.0f')}", "")
    table.add_section()
    table.add_row("unique work / workers (s)", _f(lb["unique_work_s"] / r["workers"]), "", "")
    table.add_row(f"longest path (s, {lb['longest_path_stages']} stages)", _f(lb["longest_path_s"]), "", "")
    table.add_row("lower bound (s)", _f(lb["lower_bound_s"]), "", "")
    table.add_row("merged e2e / lower bound", _f(r["merged_over_lower_bound"], ".3f"), "", "")
    table.add_row("  (e2e - start-up) / lower bound", _f(r["merged_after_startup_over_lower_bound"], ".3f"), "", "")
    table.add_row("within 10% of lower bound", _yes(r["within_10pct"]), "", "")
    console.print(table)
    if not r["metrics_identical"]:
        console.print(f"[red]metrics differ for trials: {', '.join(r['mismatched_trials'])}[/red]")
    if not r["unique_steps_check"]:
        console.print(f"[yellow]p_w walk found {pw['unique_steps']} unique steps, "
                      f"the summary {r['unique_steps']}[/yellow]")
    for mode, c in cpu.items():
        capacity = (r["cores"] or 1) * r["subprocess_wall_seconds"][mode]
        if c["other_processes"] is not None and c["other_processes"] > CONTENDED * capacity:
            console.print(f"[yellow]other processes used {c['other_processes']:.0f} of {capacity:.0f} core-seconds "
                          f"during the {mode} run: its timings are contended[/yellow]")
    if pw["mixed_cost_nodes"]:
        console.print(f"[yellow]p_w is approximate: {pw['mixed_cost_nodes']} node(s) change their cost per step "
                      "inside them where a shorter trial's prefix ends (priced at the node's average)[/yellow]")
    if pw["fallback_nodes"]:
        console.print(f"{pw['fallback_nodes']} node(s) never trained were costed at the plan's mean seconds/step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", default="examples/digits.py", help="study file (default examples/digits.py)")
    parser.add_argument("--workers", type=int, default=2, help="workers per run (default 2)")
    parser.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers is {args.workers}, but must be >= 1")
    console = Console(width=max(Console().width, 110))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with console.status(f"running {args.study} merged and --no-merge with {args.workers} workers"):
            result = measure(Path(args.study), args.workers, out)
    except (RuntimeError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    render(result, console)
    path = out / "merge_savings.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    console.print(f"figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
