"""Scheduler cost at scale: one scheduling pass and the fold of trials on a 10,000-node plan.

What it measures
----------------
A search plan of ``nodes`` nodes (default 10,000) is built through the real reducer
(:func:`projections.reducer.apply`) from random sequence trials of two hyper-parameters
(piecewise-constant and MultiStep learning rates, MultiStep batch sizes, Hippo §3.2): their
milestones fall on many different steps, so the plan branches widely. Part of the work is then
"trained" by instant simulated workers (:class:`scheduler.simulation.Simulation`), which leaves
checkpoints, metrics and measured profiles on the trained nodes; a few more dispatches stay
running and a few workers are idle, so the stage tree (Algorithm 1) has ready, chained and
in-flight stages. Then, in seconds of wall time on this machine:

* ``fold_s``, ``fold_trials_per_s``: folding the trial submissions alone into a fresh state
  (``search_plan.place`` per trial, Hippo §3.2);
* ``cold_pass_s``: one scheduling decision ``decide(state)`` with no memoised stage tree (the
  first pass after a restart: every plan's tree is built, Algorithm 1 + critical path, §4.3);
* ``warm_pass_s``: a decision after one event that leaves the plan untouched (a worker joins:
  the memoised per-plan path is reused);
* ``replan_pass_s``: a decision after one event of the plan (a checkpoint is saved: that plan's
  tree is rebuilt);
* ``many_plans_cold_s`` / ``many_plans_warm_s``: the trial-based layout (``--no-merge``), one
  plan per trial (448 plans), cold and after one event of one plan;
* ``bfs_pass_s``, ``most_children_pass_s``: a cold pass of the ablation policies (§3.7);
* ``cold_pass_frozen_gc_s``: the cold critical-path pass again after ``gc.freeze()``: the state
  holds millions of objects, and the cyclic garbage collector's full collections, triggered by
  the stages a pass allocates, walk all of them; frozen, only the scheduler's own work is left.
  A long-running simulator can freeze its state the same way.

Each figure is the median of ``repeat`` runs. Ratios are what matter; absolute times depend
on the machine. Tests never assert on these (DESIGN.md, "Standards for the code").

How to run
----------
::

    .venv/bin/python benchmarks/scheduler_scale.py [--nodes 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.hp import Constant, HPConfig, MultiStep, Piecewise
from events.models import CheckpointSaved, Event, TrialSubmitted, WorkerJoined
from projections.reducer import apply
from projections.state import State
from scheduler.decide import decide
from scheduler.simulation import Simulation, fake_ref

LRS = (0.1, 0.05, 0.02, 0.01, 0.005)
STEPS = (200, 400, 600, 800)


def random_trial(rng: random.Random) -> tuple[HPConfig, int]:
    """A random ``(hp, steps)`` trial: lr piecewise constant or MultiStep, bs MultiStep."""
    steps = rng.choice(STEPS)
    if rng.random() < 0.5:
        k = rng.randint(1, 3)
        bounds = sorted(rng.sample(range(10, steps, 10), k))
        lr = Piecewise(functions=tuple(Constant(rng.choice(LRS)) for _ in range(k + 1)), boundaries=tuple(bounds))
    else:
        lr = MultiStep(rng.choice(LRS), tuple(sorted(rng.sample(range(20, steps, 20), rng.randint(1, 2)))),
                       rng.choice((0.1, 0.5)))
    bs = Constant(32) if rng.random() < 0.5 else MultiStep(32, (rng.randrange(50, steps, 50),), 2)
    return {"bs": bs, "lr": lr}, steps


def trial_events(nodes: int, seed: int = 0, plan_key: str = "plan") -> list[Event]:
    """TrialSubmitted events that, folded in order, grow one plan to at least ``nodes`` nodes."""
    rng = random.Random(seed)
    state = State()
    events: list[Event] = []
    while plan_key not in state.plans or len(state.plans[plan_key].nodes) < nodes:
        hp, steps = random_trial(rng)
        ev = TrialSubmitted(study_id="bench", trial_id=f"t{len(events)}", plan_key=plan_key, seed=0, hp=hp,
                            steps=steps)
        apply(state, ev, len(events))
        events.append(ev)
    return events


def busy_state(nodes: int, seed: int = 0, workers: int = 8, executed: int = 16, running: int = 4,
               idle: int = 4) -> tuple[Simulation, list[Event]]:
    """A simulation holding a ``nodes``-node plan: ``executed`` dispatches of ``workers``
    instant workers finished (checkpoints, metrics, profiles), ``running`` more in flight, and
    ``idle`` idle workers. Returns it and the trial submissions."""
    trials = trial_events(nodes, seed)
    sim = Simulation(workers=workers)
    for ev in trials:
        sim.emit(ev)
    done = 0
    queue = []
    while done < executed:
        queue.extend(sim.dispatch_all())
        if not queue:
            break
        sim.execute(queue.pop(0))
        done += 1
    queue.extend(sim.dispatch_all())
    for d in queue[running:]:  # keep ``running`` dispatches in flight, finish the rest
        sim.execute(d)
    for i in range(idle):
        sim.emit(WorkerJoined(worker_id=f"idle{i}", device="sim"))
    return sim, trials


def _forget(state: State) -> None:
    """Drop every memoised result, as a restart (or a state rebuilt from its records) would."""
    for plan in state.plans.values():
        plan.cache.clear()


def _median(repeat: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeat))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(nodes: int = 10_000, repeat: int = 3, seed: int = 0) -> dict[str, float]:
    """Build the benchmark plans and time the scheduler on them; see the module docstring.

    Returns figures in seconds (``*_s``), counts, and the fold rate in trials per second.
    """
    sim, trials = busy_state(nodes, seed)
    state = sim.state
    plan = state.plans["plan"]
    out: dict[str, float] = {"nodes": float(len(plan.nodes)), "trials": float(len(trials))}

    def fold() -> float:
        fresh = State()
        t0 = time.perf_counter()
        for i, ev in enumerate(trials):
            apply(fresh, ev, i)
        return time.perf_counter() - t0

    out["fold_s"] = _median(repeat, fold)
    out["fold_trials_per_s"] = len(trials) / out["fold_s"]

    def cold(policy: str = "critical-path") -> float:
        _forget(state)
        return _timed(lambda: decide(state, policy))

    out["cold_pass_s"] = _median(repeat, cold)
    out["bfs_pass_s"] = _median(repeat, lambda: cold("bfs"))
    out["most_children_pass_s"] = _median(repeat, lambda: cold("most-children"))

    joined = [0]

    def warm() -> float:
        decide(state)
        joined[0] += 1
        sim.emit(WorkerJoined(worker_id=f"late{joined[0]}", device="sim"))
        return _timed(lambda: decide(state))

    out["warm_pass_s"] = _median(repeat, warm)

    node_ids = sorted(plan.nodes, key=lambda n: int(n[1:]))
    saved = [0]

    def replan() -> float:
        decide(state)
        node = plan.nodes[node_ids[saved[0] % len(node_ids)]]
        saved[0] += 1
        step = node.start_step + 1
        sim.emit(CheckpointSaved(dispatch_id="bench", plan_key="plan", node_id=node.node_id, step=step,
                                 ref=fake_ref("plan", node.node_id, step), size=1))
        return _timed(lambda: decide(state))

    out["replan_pass_s"] = _median(repeat, replan)

    many = Simulation(workers=4)
    rng = random.Random(seed + 1)
    for i in range(448):
        hp, steps = random_trial(rng)
        many.submit(f"t{i}", hp, steps, plan_key=f"p{i:03d}")
    mstate = many.state
    out["many_plans"] = float(len(mstate.plans))

    def many_cold() -> float:
        _forget(mstate)
        return _timed(lambda: decide(mstate))

    out["many_plans_cold_s"] = _median(repeat, many_cold)
    k = [0]

    def many_warm() -> float:
        decide(mstate)
        key = f"p{k[0] % 448:03d}"
        k[0] += 1
        node = mstate.plans[key].nodes["n0"]
        many.emit(CheckpointSaved(dispatch_id="bench", plan_key=key, node_id="n0", step=node.start_step + 3,
                                  ref=fake_ref(key, "n0", 3), size=1))
        return _timed(lambda: decide(mstate))

    out["many_plans_warm_s"] = _median(repeat, many_warm)

    gc.collect()
    gc.freeze()
    try:
        out["cold_pass_frozen_gc_s"] = _median(repeat, cold)
    finally:
        gc.unfreeze()
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the figures of :func:`measure` as a small table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000, help="plan size in nodes (default 10000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is shown")
    args = parser.parse_args(argv)
    figures = measure(args.nodes, args.repeat)
    rows = [
        ("plan nodes / trials", f"{figures['nodes']:.0f} / {figures['trials']:.0f}"),
        ("fold of the trials", f"{figures['fold_s']:.3f} s ({figures['fold_trials_per_s']:,.0f} trials/s)"),
        ("cold pass, critical-path", f"{figures['cold_pass_s'] * 1e3:.1f} ms"),
        ("cold pass, critical-path, gc frozen", f"{figures['cold_pass_frozen_gc_s'] * 1e3:.1f} ms"),
        ("cold pass, bfs", f"{figures['bfs_pass_s'] * 1e3:.1f} ms"),
        ("cold pass, most-children", f"{figures['most_children_pass_s'] * 1e3:.1f} ms"),
        ("warm pass (a worker joined)", f"{figures['warm_pass_s'] * 1e3:.3f} ms"),
        ("pass after a checkpoint (plan rebuilt)", f"{figures['replan_pass_s'] * 1e3:.1f} ms"),
        (f"{figures['many_plans']:.0f} plans, cold pass", f"{figures['many_plans_cold_s'] * 1e3:.1f} ms"),
        (f"{figures['many_plans']:.0f} plans, pass after one plan's event",
         f"{figures['many_plans_warm_s'] * 1e3:.2f} ms"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
