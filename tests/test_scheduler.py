"""Algorithm 1, critical paths and dispatch decisions on the papers' examples and random plans."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hp import Constant, Cosine, Exponential, Linear, MultiStep, Piecewise, Warmup, config_values
from events.models import StageDispatched, TrialCancelled
from projections.state import Checkpoint, Node, Plan
from scheduler.critical_path import critical_path
from scheduler.simulation import Simulation, fake_ref
from scheduler.stage_tree import build_stage_tree, measured_profile


def _node(plan: Plan, node_id: str, parent: str | None, start: int, hp, ckpt=(), metrics=(), requests=()) -> Node:
    depth = plan.nodes[parent].depth + 1 if parent else 0
    node = Node(node_id, plan.plan_key, parent, start, depth, hp)
    node.ckpt = {s: Checkpoint(fake_ref(plan.plan_key, node_id, s), 1) for s in ckpt}
    node.metrics = {s: {"test_acc": 0.5} for s in metrics}
    node.requests = {s: [f"t{node_id}{s}"] for s in requests}
    plan.nodes[node_id] = node
    if parent:
        plan.nodes[parent].children.append(node_id)
    else:
        plan.roots.append(node_id)
    return node


def fig6_plan() -> Plan:
    """The search plan of Hippo Fig. 6 (HIPPO_SPEC §1.2): H1..H4 as n0..n3."""
    plan = Plan("fig6", seed=0)
    _node(plan, "n0", None, 0, {"lr": Exponential(0.1, 0.9), "bs": Constant(128)},
          ckpt=[10, 20], metrics=[10, 20], requests=[15, 30])
    _node(plan, "n1", "n0", 10, {"lr": Linear(1.0, -0.02), "bs": Constant(128)}, ckpt=[20], metrics=[20], requests=[25])
    _node(plan, "n2", "n0", 20, {"lr": Cosine(0.1, 0.0, 30), "bs": Constant(128)}, ckpt=[30], metrics=[25, 30],
          requests=[35, 40])
    _node(plan, "n3", "n2", 40, {"lr": Constant(1e-6), "bs": Constant(64)}, requests=[50])
    return plan


def test_fig6_search_plan_gives_fig7_stages() -> None:
    tree = build_stage_tree(fig6_plan())
    got = {(s.node_id, s.from_step, s.to_step, s.source, s.parent) for s in tree.stages.values()}
    assert got == {
        ("n0", 10, 15, "ckpt", None),  # H1[10->15] resumes H1@10
        ("n0", 20, 30, "ckpt", None),  # H1[20->30] resumes H1@20
        ("n1", 20, 25, "ckpt", None),  # H2[20->25] resumes H2@20
        ("n2", 30, 35, "ckpt", None),  # H3[30->35] resumes H3@30
        ("n2", 35, 40, "stage", ("n2", 35)),  # chained at the pending endpoint 35, not 30->40
        ("n3", 40, 50, "stage", ("n2", 40)),  # H4 hangs off the stage ending at H3@40
    }
    # The critical path is the H3 chain down to H4: 5 + 5 + 10 steps at the cold estimate.
    path = critical_path(tree)
    assert path is not None
    assert [(s.node_id, s.from_step, s.to_step) for s in path.stages] == [("n2", 30, 35), ("n2", 35, 40),
                                                                         ("n3", 40, 50)]


def test_fig6_running_stage_is_not_scheduled_again() -> None:
    plan = fig6_plan()
    plan.nodes["n2"].running.append(("d0", 30, 40))  # H3 30->40 is in flight
    tree = build_stage_tree(plan)
    keys = {(s.node_id, s.from_step, s.to_step, s.source) for s in tree.stages.values()}
    assert ("n2", 30, 35) not in keys and ("n2", 35, 40) not in keys
    assert ("n3", 40, 50, "inflight") in keys  # waits for the checkpoint at H3@40
    path = critical_path(tree)
    assert path is not None and path.stages[0].source == "ckpt"


def lr(*values_and_bounds):
    """Piecewise constant learning rate: lr(0.1, 100, 0.05, 200, 0.02) etc."""
    values = values_and_bounds[0::2]
    bounds = values_and_bounds[1::2]
    if len(values) == 1:
        return {"lr": Constant(values[0])}
    return {"lr": Piecewise(functions=tuple(Constant(v) for v in values), boundaries=tuple(bounds))}


FIG3 = {
    "t1": lr(0.1, 200, 0.01),
    "t2": lr(0.1, 100, 0.05, 200, 0.02),
    "t3": lr(0.1, 100, 0.05, 200, 0.01),
    "t4": lr(0.1, 100, 0.05),
}
T5 = lr(0.1, 150, 0.01)


def _trained_steps(sim: Simulation) -> Counter:
    counts: Counter = Counter()
    for plan_key, node_id, a, b in sim.trained:
        for s in range(a, b):
            counts[(plan_key, node_id, s)] += 1
    return counts


def test_fig3_to_5_trials_share_a1_and_a3_and_train_no_step_twice() -> None:
    sim = Simulation(workers=2)
    for trial_id, hp in FIG3.items():
        sim.submit(trial_id, hp, 300)
    sim.submit("t5", T5, 300)
    sim.run()
    plan = sim.state.plans["plan"]
    root = plan.nodes[plan.roots[0]]
    assert all(t.status == "done" for t in sim.state.trials.values())
    counts = _trained_steps(sim)
    assert max(counts.values()) == 1
    # A1 = root [0, 100) and A3 = root [100, 150): trained once, as separate stages that every
    # branch resumes from.
    ranges = [(n, a, b) for _, n, a, b in sim.trained]
    assert (root.node_id, 0, 100) in ranges and (root.node_id, 100, 150) in ranges
    assert sim.state.stats.executed_steps == 300 + 200 + 100 + 100 + 150  # = unique steps
    assert sum(counts.values()) == 850


def test_a_trial_written_with_numpy_ints_shares_its_steps_with_one_written_with_ints() -> None:
    """Milestones and a warm-up length written as numpy integers are the ints they are: the
    trial's prefix is the plain-int trial's, trained once for both."""
    numpy_built = {"lr": MultiStep(0.1, np.array([20]), 0.1), "wd": Warmup(0.0, np.int64(10), Constant(1e-4))}
    plain = {"lr": MultiStep(0.1, [20, 30], 0.1), "wd": Warmup(0.0, 10, Constant(1e-4))}
    sim = Simulation(workers=2)
    sim.submit("numpy", numpy_built, 40)
    sim.submit("plain", plain, 40)
    sim.run()
    assert all(t.status == "done" for t in sim.state.trials.values())
    assert max(_trained_steps(sim).values()) == 1
    assert sim.state.stats.executed_steps == 30 + 10 + 10  # [0, 30) once, then each trial's last 10 steps


def test_trial_added_while_prefix_runs_is_not_retrained() -> None:
    sim = Simulation(workers=1)
    sim.submit("t1", FIG3["t1"], 300)
    (first,) = sim.dispatch_all()
    sim.submit("t5", T5, 300)  # needs a boundary at 150 inside the running stage 0->300
    assert sim.dispatch_all() == []  # waits for the running path instead of duplicating it
    sim.execute(first)
    sim.run()
    counts = _trained_steps(sim)
    # Split during execution (Hippo §10.1): only [0,150) may be retrained, once.
    assert all(v <= 2 for v in counts.values())
    assert all(t.status == "done" for t in sim.state.trials.values())


def test_cancel_drops_only_unshared_requests() -> None:
    sim = Simulation(workers=0)
    sim.submit("a", lr(0.1), 100)
    sim.submit("b", lr(0.1), 100)  # same request as a
    sim.submit("c", lr(0.1), 50)
    sim.emit(TrialCancelled(study_id="sim", trial_id="a"))
    sim.emit(TrialCancelled(study_id="sim", trial_id="c"))
    root = sim.state.plans["plan"].nodes["n0"]
    assert root.requests == {100: ["b"]}
    assert sim.state.trials["a"].status == "cancelled"


# ----------------------------------------------------------------------------- properties

LR_FAMILY = [
    Constant(0.1),
    Constant(0.05),
    MultiStep(0.1, (8,), 0.1),
    MultiStep(0.1, (8, 16), 0.1),
    MultiStep(0.1, (12,), 0.5),
    Exponential(0.1, 0.9),
    Piecewise(functions=(Constant(0.1), Exponential(0.1, 0.9)), boundaries=(10,)),
]
BS_FAMILY = [Constant(32), MultiStep(32, (10,), 2), MultiStep(32, (6,), 2)]

trial_sets = st.lists(
    st.tuples(st.integers(0, len(LR_FAMILY) - 1), st.integers(0, len(BS_FAMILY) - 1), st.integers(1, 30)),
    min_size=1,
    max_size=12,
)


def distinct_prefix_steps(trials: list[tuple[dict, int]]) -> int:
    """Count distinct (values at steps 0..s) prefixes over all trials: the brute-force unique steps."""
    ids: dict[tuple, int] = {}
    for hp, steps in trials:
        prefix = -1
        for s in range(steps):
            key = (prefix, tuple(sorted(config_values(hp, s).items())))
            prefix = ids.setdefault(key, len(ids))
    return len(ids)


def _dispatch_counts(sim: Simulation) -> Counter:
    dispatched: Counter = Counter()
    for ev in sim.events:
        if isinstance(ev, StageDispatched):
            for s in ev.stages:
                for step in range(s.from_step, s.to_step):
                    dispatched[(ev.plan_key, s.node_id, step)] += 1
    return dispatched


@settings(max_examples=150, deadline=None)
@given(trial_sets, st.integers(1, 3))
def test_random_trials_are_covered_once_and_unique_steps_match(spec, workers) -> None:
    sim = Simulation(workers=workers)
    trials = [({"lr": LR_FAMILY[a], "bs": BS_FAMILY[b]}, steps) for a, b, steps in spec]
    for i, (hp, steps) in enumerate(trials):
        sim.submit(f"t{i}", hp, steps)
    sim.run()
    # every requested (trial, step) is covered
    for trial in sim.state.trials.values():
        assert trial.status == "done", trial
        assert trial.steps in trial.results
    # no (node, step) range is scheduled twice
    assert max(_dispatch_counts(sim).values()) == 1
    # unique steps = distinct per-step hyper-parameter prefixes = executed steps
    assert sim.state.stats.executed_steps == distinct_prefix_steps(trials)


@settings(max_examples=100, deadline=None)
@given(trial_sets, st.integers(1, 3), st.integers(0, 6))
def test_trials_arriving_during_execution_are_covered(spec, workers, split) -> None:
    """Submissions interleaved with execution: all answered, and a step is retrained only in the
    split-during-execution case (a boundary inside a running stage, Hippo §10.1): at most once more."""
    sim = Simulation(workers=workers)
    trials = [({"lr": LR_FAMILY[a], "bs": BS_FAMILY[b]}, steps) for a, b, steps in spec]
    for i, (hp, steps) in enumerate(trials):
        sim.submit(f"t{i}", hp, steps)
        if i == split:
            for d in sim.dispatch_all():
                sim.execute(d)
    sim.run()
    assert all(t.status == "done" for t in sim.state.trials.values())
    assert max(_dispatch_counts(sim).values()) <= 2
    assert sim.state.stats.executed_steps >= distinct_prefix_steps(trials)


# ----------------------------------------------------------------------------- issue 11: the sharing rule


def test_int_and_float_values_of_the_same_number_do_not_share_a_node() -> None:
    """``Constant(32)`` and ``Constant(32.0)`` are different trainings (a DataLoader rejects a
    float batch size): neither the sharing scan nor the child index may merge them."""
    sim = Simulation(workers=1)
    sim.submit("int", {"bs": Constant(32)}, 10)
    sim.submit("float", {"bs": Constant(32.0)}, 10)
    nodes = sim.state.plans["plan"].nodes
    assert sim.state.trials["int"].requests[10] != sim.state.trials["float"].requests[10]
    assert len(nodes) == 2 and all(n.parent_id is None for n in nodes.values())
    # At a branch step: both double the batch size at step 5, one to 64, one to 64.0.
    sim.submit("a", {"bs": MultiStep(32, [5], 2)}, 10)
    sim.submit("b", {"bs": Piecewise([Constant(32), Constant(64.0)], [5])}, 10)
    sim.submit("c", {"bs": Piecewise([Constant(32), Constant(64)], [5])}, 10)  # same values as a: shares
    a, b, c = (nodes[sim.state.trials[t].requests[10]] for t in "abc")
    assert a.node_id == c.node_id != b.node_id
    assert b.start_step == 5 and b.parent_id == nodes["n0"].node_id == "n0"
    sim.run()
    assert sim.state.trials["int"].results and sim.state.trials["float"].results


def test_a_trial_sharing_up_to_where_the_other_would_overflow_is_placed() -> None:
    """Placing a valid trial whose scan reaches a step where the node's own sequence cannot be
    computed any more must not raise (issue 11 item 3): that value differs from everything."""
    sim = Simulation(workers=1)
    sim.submit("a", {"lr": Exponential(1.0, 2.0)}, 1000)
    sim.submit("b", {"lr": Piecewise([Exponential(1.0, 2.0), Constant(1.0)], [1024])}, 1100)
    plan = sim.state.plans["plan"]
    b = plan.nodes[sim.state.trials["b"].requests[1100]]
    assert (b.parent_id, b.start_step) == ("n0", 1024)  # shares steps 0..1023 with a's node
    sim.run()
    assert not sim.state.rejected
    assert {(n, a, z) for _, n, a, z in sim.trained} == {("n0", 0, 1000), ("n0", 1000, 1024), ("n1", 1024, 1100)}


# ----------------------------------------------------------------------------- issue 11: cost estimates


def _measured(sim: Simulation, plan_key: str, trial_id: str, steps: int, train_seconds: float) -> None:
    """Train ``trial_id`` (alone on ``plan_key``) to ``steps``, measured at ``train_seconds``."""
    from events.models import CheckpointSaved, MetricsReported, StageFinished

    sim.submit(trial_id, {"lr": Constant(0.1)}, steps, plan_key=plan_key)
    (d,) = sim.dispatch_all()
    (spec,) = d.stages
    base = {"dispatch_id": d.dispatch_id, "plan_key": plan_key, "node_id": spec.node_id}
    sim.emit(CheckpointSaved(**base, step=steps, ref=fake_ref(plan_key, spec.node_id, steps), size=1))
    sim.emit(MetricsReported(**base, step=steps, metrics={"m": 1.0}))
    sim.emit(StageFinished(**base, worker_id=d.worker_id, from_step=0, to_step=steps, seconds=train_seconds,
                           train_seconds=train_seconds))


def test_a_plan_s_measured_seconds_are_summed_left_to_right_on_any_python() -> None:
    """Decisions read the plan's measured seconds per step; ``sum()`` of floats rounds
    differently from Python 3.12 on (compensated), so a log decided on one Python would not
    replay bit for bit on another. The sum is the plain left-to-right one everywhere."""
    plan = Plan("p", seed=0)
    for i, seconds in enumerate([1e16, 1.0, -1e16]):
        _node(plan, f"n{i}", None, 0, {"lr": Constant(0.1 * (i + 1))}).profile_seconds = seconds
        plan.nodes[f"n{i}"].profile_steps = 1
    plan.profile_revision += 1
    assert measured_profile(plan) == (3, (1e16 + 1.0) + -1e16) == (3, 0.0)  # 3.12's sum() gives 1.0


def test_a_never_measured_plan_is_estimated_from_the_measured_ones() -> None:
    """Trial-based plans train the same model: a plan with no measurement takes the others'
    seconds per step, not 1 s, so it does not outrank a longer measured path (issue 11 item 15)."""
    sim = Simulation(workers=1)
    _measured(sim, "p", "t0", 10, train_seconds=0.01)  # 1 ms per step on plan p
    sim.submit("long", {"lr": Constant(0.1)}, 110, plan_key="p")  # 100 more steps: 0.1 s
    sim.submit("short", {"lr": Constant(0.2)}, 50, plan_key="q")  # never measured: 50 steps
    (d,) = sim.dispatch_all()
    assert (d.plan_key, d.stages[-1].to_step) == ("p", 110)


def test_paths_of_equal_estimated_time_are_told_apart_by_steps() -> None:
    """Steps measured at 0 s make every path cost 0: the longer one in steps goes first, not the
    smaller key (issue 11 item 15)."""
    sim = Simulation(workers=1)
    _measured(sim, "a", "t0", 10, train_seconds=0.0)
    _measured(sim, "b", "t1", 10, train_seconds=0.0)
    sim.submit("few", {"lr": Constant(0.1)}, 20, plan_key="a")  # 10 more steps
    sim.submit("many", {"lr": Constant(0.1)}, 60, plan_key="b")  # 50 more steps
    (d,) = sim.dispatch_all()
    assert (d.plan_key, d.stages[-1].to_step) == ("b", 60)


def test_a_finished_trial_asked_for_an_earlier_step_is_done_again_when_answered() -> None:
    """Issue 11 item 14: a trial done at 20 steps, then asked for step 10 (never evaluated),
    is pending until step 10 is answered, then done (not pending for ever)."""
    sim = Simulation(workers=1)
    sim.submit("t", {"lr": Constant(0.1)}, 20)
    sim.run()
    assert sim.state.trials["t"].status == "done"
    sim.submit("t", {"lr": Constant(0.1)}, 10)
    assert sim.state.trials["t"].status == "pending"
    sim.run()
    trial = sim.state.trials["t"]
    assert sorted(trial.results) == [10, 20] and trial.status == "done"
