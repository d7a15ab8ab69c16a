"""Scheduling policies (HIPPO_SPEC §3.7) and the memoised, linear-time scheduler.

* Hand-built plans (through the real reducer) with hand-computed dispatches: critical-path
  sends the longest ready path as one batch, bfs the shallowest single ready stage,
  most-children the single ready stage with the most descendant stages.
* Random event sequences: after every event the memoised ``decide`` equals a fresh, uncached
  computation on an identical state, for every policy; the optimised stage tree, critical path
  and ``place`` equal the straightforward reference versions kept below; every policy answers
  every trial without training a step twice.
* The policy is recorded in each decision, passed through by the scheduler service, and
  ``replay verify`` recomputes each decision with the policy it records.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from pathlib import Path
from typing import get_args

import pytest
import test_scheduler  # the random trial families of the scheduler property tests
from hypothesis import given, settings
from hypothesis import strategies as st

from events import topics
from events.codec import decode, encode
from events.hp import Constant, Piecewise, first_divergence
from events.log import EmbeddedLog, append_events, event_key
from events.models import (
    CheckpointSaved,
    Event,
    StageDispatched,
    TrialCancelled,
    WorkerJoined,
    WorkerLost,
)
from projections import search_plan
from projections.queries import needed, node_number, running_dispatches
from projections.reducer import apply
from projections.state import Plan, State
from projections.store import ProjectionStore, Projector, all_keys, snapshot
from replay.audit import open_source, verify
from scheduler.critical_path import READY, critical_path
from scheduler.critical_path import Path as StagePath
from scheduler.decide import POLICIES, choice_from_scratch, decide, fallback_sec_per_step, plan_choice
from scheduler.inflight import pending_needs
from scheduler.service import SchedulerService
from scheduler.simulation import Simulation, fake_ref
from scheduler.stage_tree import Stage, StageTree, build_stage_tree, covers, mean_sec_per_step


def lr(*values_and_bounds):
    """Piecewise constant learning rate: lr(0.1, 100, 0.05, 200, 0.02) etc."""
    values, bounds = values_and_bounds[0::2], values_and_bounds[1::2]
    if len(values) == 1:
        return {"lr": Constant(values[0])}
    return {"lr": Piecewise(functions=tuple(Constant(v) for v in values), boundaries=tuple(bounds))}


def dispatch_all(sim: Simulation, policy: str) -> list[StageDispatched]:
    """Append every decision ``policy`` makes now (until no worker is idle or nothing is ready)."""
    out = []
    while (decision := decide(sim.state, policy)) is not None:
        sim.emit(decision)
        out.append(decision)
    return out


def run(sim: Simulation, policy: str) -> None:
    """Dispatch and finish work under ``policy``, oldest dispatch first, until nothing is left."""
    queue: list[StageDispatched] = []
    while True:
        queue.extend(dispatch_all(sim, policy))
        if not queue:
            return
        sim.execute(queue.pop(0))


def stages_of(decision: StageDispatched) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.from_step, s.to_step) for s in decision.stages]


# ----------------------------------------------------------------------------- hand-built plans


def three_way() -> Simulation:
    """A plan where the three policies disagree (every node measured, or cold, at 1 s/step).

    A node is a whole trial configuration; later trials branch off where they diverge.
    t1 (0.1 until 100, then 0.01; 400 steps) is node n0, t0 (0.1, 100 steps) asks n0 at 100;
    both are trained first, leaving checkpoints n0@100 and n0@400. Then t2 continues t1 with
    0.001 from 400 to 500 (n1 at 400); t3 switches to 0.05 at 20 (n2 at 20, 60 steps); t4..t6
    switch to 0.02/0.03/0.04 at 200 (n3..n5 at 200, 250 steps). Ready stages:

    * n0[0,20) fresh: one descendant n2[20,60); longest path 20 + 40 = 60 s;
    * n0[100,200) from n0@100: three descendants n3..n5[200,250); longest 100 + 50 = 150 s;
    * n1[400,500) from n0@400: no descendant; 100 s.
    """
    sim = Simulation(workers=1)
    sim.submit("t1", lr(0.1, 100, 0.01), 400)
    sim.submit("t0", lr(0.1), 100)
    (first,) = dispatch_all(sim, "critical-path")
    assert stages_of(first) == [("n0", 0, 100), ("n0", 100, 400)]
    sim.execute(first)
    sim.submit("t2", lr(0.1, 100, 0.01, 400, 0.001), 500)
    sim.submit("t3", lr(0.1, 20, 0.05), 60)
    for i, value in enumerate((0.02, 0.03, 0.04)):
        sim.submit(f"t{4 + i}", lr(0.1, 100, 0.01, 200, value), 250)
    return sim


def test_three_policies_choose_differently_as_computed_by_hand() -> None:
    sim = three_way()
    state = sim.state
    nodes = state.plans["plan"].nodes
    assert [(n, nodes[n].parent_id, nodes[n].start_step) for n in ("n1", "n2", "n3", "n4", "n5")] == [
        ("n1", "n0", 400), ("n2", "n0", 20), ("n3", "n0", 200), ("n4", "n0", 200), ("n5", "n0", 200)]
    critical = decide(state, "critical-path")
    bfs = decide(state, "bfs")
    most = decide(state, "most-children")
    assert critical is not None and bfs is not None and most is not None
    # Critical path: the longest ready root-to-leaf path (150 s), as one batch; n3 wins the
    # tie with n4 and n5 by stage key.
    assert stages_of(critical) == [("n0", 100, 200), ("n3", 200, 250)]
    assert critical.source is not None and (critical.source.node_id, critical.source.step) == ("n0", 100)
    # Breadth-first: the shallowest single ready stage (it starts at step 0).
    assert stages_of(bfs) == [("n0", 0, 20)] and bfs.source is None
    # Most children: the single ready stage with three descendant stages.
    assert stages_of(most) == [("n0", 100, 200)]
    assert (critical.policy, bfs.policy, most.policy) == ("critical-path", "bfs", "most-children")
    assert default_is_critical(state)


def default_is_critical(state: State) -> bool:
    plain = decide(state)
    return plain is not None and plain.payload() == decide(state, "critical-path").payload()


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_finishes_the_three_way_plan_without_training_twice(policy: str) -> None:
    sim = three_way()
    run(sim, policy)
    assert all(t.status == "done" for t in sim.state.trials.values())
    counts = Counter((n, s) for _, n, a, b in sim.trained for s in range(a, b))
    # Only n0[0,20) and n0[100,200) run twice: t3 and t4..t6 asked for boundaries at 20 and 200
    # after n0 was trained without checkpoints there (the exception of DESIGN.md invariant 2).
    assert {k for k, v in counts.items() if v > 1} == {("n0", s) for s in [*range(20), *range(100, 200)]}
    assert max(counts.values()) == 2
    dispatches = [e for e in sim.events if isinstance(e, StageDispatched)][1:]
    if policy != "critical-path":
        assert all(len(d.stages) == 1 and d.policy == policy for d in dispatches)


def test_bfs_goes_level_by_level_and_most_children_takes_the_bushiest_stage() -> None:
    # a (0.1 until 30, 0.05 until 60, then 0.02) is n0; b takes 0.01 from 60 (n1 at 60); c
    # takes 0.2 from 30 (n2 at 30, 40 steps). Nothing trained yet, so only the root stage
    # n0[0,30) is ready for any policy.
    def plan() -> Simulation:
        sim = Simulation(workers=1)
        sim.submit("a", lr(0.1, 30, 0.05, 60, 0.02), 90)
        sim.submit("b", lr(0.1, 30, 0.05, 60, 0.01), 90)
        sim.submit("c", lr(0.1, 30, 0.2), 40)
        return sim

    for policy in POLICIES:
        sim = plan()
        first = decide(sim.state, policy)
        assert first is not None
        assert stages_of(first)[0] == ("n0", 0, 30)
    # bfs, one stage at a time: n0[0,30); then n0[30,60) and n2[30,40) are both ready from
    # step 30: stage key order ("n0", 60) < ("n2", 40); then n2[30,40) (from 30) before
    # n0[60,90) and n1[60,90) (from 60).
    sim = plan()
    order = []
    while (d := decide(sim.state, "bfs")) is not None:
        sim.emit(d)
        order.append(stages_of(d))
        sim.execute(d)
    assert order == [[("n0", 0, 30)], [("n0", 30, 60)], [("n2", 30, 40)], [("n0", 60, 90)], [("n1", 60, 90)]]
    # most-children: after n0[0,30) the stage n0[30,60) has two descendants, n2[30,40) none.
    sim = plan()
    order = []
    while (d := decide(sim.state, "most-children")) is not None:
        sim.emit(d)
        order.append(stages_of(d))
        sim.execute(d)
    assert order[:2] == [[("n0", 0, 30)], [("n0", 30, 60)]]
    # critical-path: the longest path n0[0,30) -> n0[30,60) -> n0[60,90) in one batch (n0 wins
    # the tie with n1[60,90) by stage key).
    sim = plan()
    d = decide(sim.state, "critical-path")
    assert d is not None and stages_of(d) == [("n0", 0, 30), ("n0", 30, 60), ("n0", 60, 90)]


def test_ties_across_plans_go_to_the_smaller_plan_key() -> None:
    sim = Simulation(workers=1)
    sim.submit("b1", lr(0.1), 50, plan_key="b")
    sim.submit("a1", lr(0.1), 50, plan_key="a")
    for policy in POLICIES:
        d = decide(sim.state, policy)
        assert d is not None and d.plan_key == "a"
    # A longer path elsewhere wins the critical path; a stage with children wins most-children;
    # bfs still takes plan "a" (every ready stage starts at step 0).
    sim.submit("c1", lr(0.1, 40, 0.05), 80, plan_key="c")
    sim.submit("c2", lr(0.1, 40, 0.02), 80, plan_key="c")
    assert decide(sim.state, "critical-path").plan_key == "c"
    assert decide(sim.state, "most-children").plan_key == "c"
    assert decide(sim.state, "bfs").plan_key == "a"


def test_an_unknown_policy_is_a_value_error_naming_it(tmp_path: Path) -> None:
    sim = Simulation(workers=1)
    sim.submit("t", lr(0.1), 10)
    with pytest.raises(ValueError, match="'fifo'"):
        decide(sim.state, "fifo")
    log = EmbeddedLog(tmp_path / "log")
    try:
        with pytest.raises(ValueError, match="'fifo'"):
            SchedulerService(log, Projector(log), policy="fifo")
    finally:
        log.close()


def test_policy_names_match_the_event_contract() -> None:
    annotation = StageDispatched.model_fields["policy"].annotation
    assert POLICIES == get_args(annotation)
    assert POLICIES[0] == "critical-path" == StageDispatched.model_fields["policy"].default


def test_old_dispatches_without_a_policy_decode_as_critical_path() -> None:
    sim = three_way()
    d = decide(sim.state, "bfs")
    raw = encode(d)
    assert b'"policy":"bfs"' in raw
    old = raw.replace(b',"policy":"bfs"', b"")
    assert b"policy" not in old
    assert decode(old).policy == "critical-path"


# ----------------------------------------------------------------------------- memoisation


def test_revision_is_bumped_only_for_the_touched_plan_and_never_persisted(tmp_path: Path) -> None:
    sim = Simulation(workers=1)
    sim.submit("a1", lr(0.1), 50, plan_key="a")
    sim.submit("b1", lr(0.1), 50, plan_key="b")
    a, b = sim.state.plans["a"], sim.state.plans["b"]
    ra, rb = a.revision, b.revision
    for policy in POLICIES:
        decide(sim.state, policy)  # fill the memo
    before = snapshot(sim.state)
    sim.emit(WorkerJoined(worker_id="w9", device="sim"))
    assert (a.revision, b.revision) == (ra, rb)
    sim.emit(CheckpointSaved(dispatch_id="x", plan_key="b", node_id="n0", step=10, ref=fake_ref("b", "n0", 10),
                             size=1))
    assert (a.revision, b.revision) == (ra, rb + 1)
    # The revision and the memo are not part of the records nor of equality.
    after = snapshot(sim.state)
    plan_a = (b"plan\x1fa", b"node\x1fa\x1f")
    assert {k: v for k, v in after.items() if k.startswith(plan_a)} == {
        k: v for k, v in before.items() if k.startswith(plan_a)}
    assert all(b"revision" not in v and b"cache" not in v for v in after.values())
    twin = Plan(a.plan_key, a.seed, list(a.roots), dict(a.nodes))
    assert twin == a and twin.revision == 0 and twin.cache == {}


def test_a_state_reloaded_from_its_records_decides_the_same(tmp_path: Path) -> None:
    sim = three_way()
    for policy in POLICIES:
        decide(sim.state, policy)  # fill the memo
    store = ProjectionStore(tmp_path / "state")
    try:
        store.commit(sim.state, set(all_keys(sim.state)))
        loaded = store.load()
    finally:
        store.close()
    assert all(p.revision == 0 and p.cache == {} for p in loaded.plans.values())
    for policy in POLICIES:
        assert decide(loaded, policy).payload() == decide(sim.state, policy).payload()


# ----------------------------------------------------------------------------- reference versions
# The straightforward versions the optimised ones replaced (quadratic depth walks, a full sort
# of the nodes, a sibling scan per branch point): the optimised code must agree exactly.


def ref_place(plan: Plan, hp, steps: int) -> search_plan.Placement:
    current = None
    for root_id in plan.roots:
        root = plan.nodes[root_id]
        if first_divergence(root.hp, hp, 0, steps) > 0:
            current = root
            break
    if current is None:
        return search_plan.Placement(None, None, 0)
    while True:
        d = first_divergence(current.hp, hp, current.start_step, steps)
        if d >= steps:
            return search_plan.Placement(current.node_id)
        follow = None
        for child_id in current.children:
            child = plan.nodes[child_id]
            if child.start_step == d and first_divergence(child.hp, hp, d, steps) > d:
                follow = child
                break
        if follow is None:
            return search_plan.Placement(None, current.node_id, d)
        current = follow


def _ref_anchor(plan: Plan, node, step: int):
    best = None
    steps = sorted(node.ckpt)
    i = bisect_right(steps, step) - 1
    if i >= 0 and steps[i] >= node.start_step:
        best = (steps[i], "ckpt", (node.node_id, steps[i], node.ckpt[steps[i]].ref))
    if node.parent_id is not None and best is None:
        pc = plan.nodes[node.parent_id].ckpt.get(node.start_step)
        if pc is not None:
            best = (node.start_step, "ckpt", (node.parent_id, node.start_step, pc.ref))
    for _, _, b in node.running:
        if node.start_step <= b <= step and (best is None or b > best[0]):
            best = (b, "inflight", None)
    return best


def ref_stage_tree(plan: Plan, fallback: float = 1.0) -> StageTree:
    endpoints: dict[str, set[int]] = defaultdict(set)
    requested: dict[str, set[int]] = defaultdict(set)
    for node in plan.nodes.values():
        for step, waiters in node.requests.items():
            if waiters and step not in node.metrics and not covers(node, step):
                endpoints[node.node_id].add(step)
                requested[node.node_id].add(step)
    for node in sorted(plan.nodes.values(), key=lambda n: (-n.depth, int(n.node_id[1:]))):
        ends = endpoints.get(node.node_id)
        if not ends or node.parent_id is None:
            continue
        if _ref_anchor(plan, node, min(ends)) is None and not covers(plan.nodes[node.parent_id], node.start_step):
            endpoints[node.parent_id].add(node.start_step)
    tree = StageTree(plan.plan_key)
    for node_id in sorted(endpoints, key=lambda n: int(n[1:])):
        node = plan.nodes[node_id]
        measured = node.sec_per_step()
        sps = measured if measured is not None else mean_sec_per_step(plan, fallback)
        previous = None
        for end in sorted(endpoints[node_id]):
            evaluate = end in requested[node_id]
            anchor = _ref_anchor(plan, node, end)
            if anchor is not None and (previous is None or anchor[0] >= previous):
                stage = Stage(node_id, anchor[0], end, evaluate, anchor[1], ckpt=anchor[2])
                if anchor[1] == "ckpt" and anchor[0] == end and not evaluate:
                    stage = None
            elif previous is not None:
                stage = Stage(node_id, previous, end, evaluate, "stage", parent=(node_id, previous))
            elif node.parent_id is None:
                stage = Stage(node_id, 0, end, evaluate, "fresh")
            elif covers(plan.nodes[node.parent_id], node.start_step):
                stage = Stage(node_id, node.start_step, end, evaluate, "inflight")
            else:
                stage = Stage(node_id, node.start_step, end, evaluate, "stage",
                              parent=(node.parent_id, node.start_step))
            previous = end
            if stage is not None:
                tree.stages[stage.key] = Stage(stage.node_id, stage.from_step, stage.to_step, stage.evaluate,
                                               stage.source, stage.parent, stage.ckpt, max(stage.steps, 1) * sps)
    for key in sorted(tree.stages):
        parent = tree.stages[key].parent
        if parent is not None:
            tree.children.setdefault(parent, []).append(key)
    return tree


def _ref_depth(tree: StageTree, key) -> int:
    depth, parent = 0, tree.stages[key].parent
    while parent is not None:
        depth, parent = depth + 1, tree.stages[parent].parent
    return depth


def _ref_longest(tree: StageTree, key) -> tuple[float, int]:
    """(estimated seconds, steps) of the longest path down from ``key``: ties by steps."""
    below = max((_ref_longest(tree, c) for c in tree.children.get(key, [])), default=(0.0, 0))
    stage = tree.stages[key]
    return (stage.est_seconds + below[0], max(stage.steps, 1) + below[1])


def ref_fallback(state: State) -> float:
    """Seconds per step of an unmeasured plan: the mean over every measured node of every plan."""
    nodes = [n for plan in state.plans.values() for n in plan.nodes.values()]
    steps = sum(n.profile_steps for n in nodes)
    return sum(n.profile_seconds for n in nodes) / steps if steps else 1.0


def _ref_descendants(tree: StageTree, key) -> int:
    return sum(1 + _ref_descendants(tree, c) for c in tree.children.get(key, []))


def ref_critical_path(tree: StageTree) -> StagePath | None:
    roots = [tree.stages[k] for k in sorted(tree.stages)
             if tree.stages[k].parent is None and tree.stages[k].source in READY]
    if not roots:
        return None
    best = roots[0]
    for root in roots[1:]:
        if _ref_longest(tree, root.key) > _ref_longest(tree, best.key):
            best = root
    chain = [best]
    while kids := tree.children.get(chain[-1].key, []):
        nxt = kids[0]
        for k in kids[1:]:
            if _ref_longest(tree, k) > _ref_longest(tree, nxt):
                nxt = k
        chain.append(tree.stages[nxt])
    return StagePath(tree.plan_key, tuple(chain), *_ref_longest(tree, best.key))


def ref_choice(state: State, policy: str) -> list[tuple[str, int, int]] | None:
    """The stages ``policy`` dispatches next, computed the slow way (HIPPO_SPEC §3.7)."""
    candidates = []
    for plan_key in sorted(state.plans):
        tree = ref_stage_tree(state.plans[plan_key], ref_fallback(state))
        if policy == "critical-path":
            path = ref_critical_path(tree)
            if path is not None:
                candidates.append(((-path.est_seconds, -path.steps, plan_key), path.stages))
            continue
        for stage in tree.stages.values():
            if stage.source in READY:
                assert _ref_depth(tree, stage.key) == 0  # ready stages are roots
                rank = (stage.from_step, plan_key, stage.key)
                if policy == "most-children":
                    rank = (-_ref_descendants(tree, stage.key), *rank)
                candidates.append((rank, (stage,)))
    if not candidates:
        return None
    _, stages = min(candidates, key=lambda c: c[0])
    return [(s.node_id, s.from_step, s.to_step) for s in stages]


# ----------------------------------------------------------------------------- random sequences

LR_FAMILY = [
    *test_scheduler.LR_FAMILY,
    Piecewise(functions=(Constant(0.1), Constant(0.05), Constant(0.1)), boundaries=(4, 12)),
]
BS_FAMILY = test_scheduler.BS_FAMILY

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(LR_FAMILY) - 1), st.integers(0, len(BS_FAMILY) - 1),
              st.integers(1, 30), st.sampled_from(["p", "p", "q"])),
    st.tuples(st.just("dispatch"), st.sampled_from(POLICIES)),
    st.tuples(st.just("execute")),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("lose"), st.integers(0, 3)),
)
ops = st.lists(op, min_size=1, max_size=40)


class Checked(Simulation):
    """A simulation that, after every event, checks the memoised scheduler against a twin state
    (same events, memo dropped before each decision) and against the reference versions."""

    twin: State | None = None

    def emit(self, event: Event) -> None:
        if self.twin is None:
            self.twin = State()
        offset = self.state.offset + 1
        super().emit(event)
        apply(self.twin, event, offset)
        for plan in self.twin.plans.values():
            plan.cache.clear()
        for policy in POLICIES:
            memo, fresh = decide(self.state, policy), decide(self.twin, policy)
            assert (memo is None) == (fresh is None)
            if memo is not None:
                assert encode(memo.model_copy(update={"event_id": "x"})) == encode(
                    fresh.model_copy(update={"event_id": "x"}))
            assert (None if memo is None else stages_of(memo)) == (
                ref_choice(self.state, policy) if self.state.idle_workers() else None)
        for plan in self.state.plans.values():
            fallback = ref_fallback(self.state)
            tree, ref = build_stage_tree(plan, fallback), ref_stage_tree(plan, fallback)
            assert tree.stages == ref.stages and tree.children == ref.children
            assert critical_path(tree) == ref_critical_path(ref)


@settings(max_examples=250, deadline=None)
@given(ops, st.integers(1, 3), st.sampled_from(POLICIES))
def test_memoised_decisions_equal_fresh_ones_after_every_event(program, workers, policy) -> None:
    sim = Checked(workers=workers)
    queue: list[StageDispatched] = []
    submitted: list[str] = []
    for op in program:
        if op[0] == "submit":
            _, a, b, steps, plan_key = op
            hp = {"lr": LR_FAMILY[a], "bs": BS_FAMILY[b]}
            plan = sim.state.plans.get(plan_key)
            if plan is not None:
                assert search_plan.place(plan, hp, steps) == ref_place(plan, hp, steps)
            trial_id = f"t{len(submitted)}"
            submitted.append(trial_id)
            sim.submit(trial_id, hp, steps, plan_key=plan_key)
        elif op[0] == "dispatch":
            queue.extend(dispatch_all(sim, op[1]))
        elif op[0] == "execute" and queue:
            sim.execute(queue.pop(0))
        elif op[0] == "cancel" and op[1] < len(submitted):
            trial = sim.state.trials[submitted[op[1]]]
            if trial.status == "pending":
                sim.emit(TrialCancelled(study_id="sim", trial_id=trial.trial_id))
        elif op[0] == "lose" and op[1] < workers:
            worker_id = f"w{op[1]}"
            sim.emit(WorkerLost(worker_id=worker_id, reason="test"))
            sim.emit(WorkerJoined(worker_id=worker_id, device="sim"))
            queue = [d for d in queue if d.worker_id != worker_id]
    while queue:
        sim.execute(queue.pop(0))
    run(sim, policy)
    for trial in sim.state.trials.values():
        assert trial.status in ("done", "cancelled"), trial


class Incremental(Simulation):
    """A simulation that, after every event, checks each plan's incremental choice (the stage-tree
    index, ``scheduler.stage_index``) against the whole stage tree built from scratch, for every
    policy, and the index's needs against :func:`projections.queries.needed`."""

    def emit(self, event: Event) -> None:
        super().emit(event)
        fallback = fallback_sec_per_step(self.state)
        for plan in self.state.plans.values():
            for policy in POLICIES:
                assert plan_choice(plan, policy, fallback) == choice_from_scratch(plan, policy, fallback), policy
            targets = [(n.node_id, s) for n in plan.nodes.values() for s, w in n.requests.items()
                       if w and s not in n.metrics]
            expected = needed(plan, targets)
            needs = pending_needs(plan)
            assert dict(needs) == expected
            assert all((node_id in needs) == (node_id in expected) for node_id in plan.nodes)
        assert [d.dispatch_id for d in running_dispatches(self.state)] == sorted(
            i for i, d in self.state.dispatches.items() if d.status == "running")


busy_op = st.one_of(
    op,
    st.tuples(st.just("submit"), st.integers(0, len(LR_FAMILY) - 1), st.integers(0, len(BS_FAMILY) - 1),
              st.integers(1, 30), st.sampled_from(["p", "p", "q"])),
    st.tuples(st.just("dispatch"), st.sampled_from(POLICIES)),
    st.tuples(st.just("execute")),
)
"""Like ``op``, with submissions, dispatches and executions more frequent (work gets done)."""


@settings(max_examples=200, deadline=None)
@given(st.lists(busy_op, min_size=10, max_size=80), st.integers(1, 3),
       st.lists(st.sampled_from([0.0, 1e-7, 0.1, 0.3, 1.0, 2.5, 7.0]), min_size=1, max_size=6))
def test_the_incremental_stage_tree_decides_as_the_whole_tree_after_every_event(program, workers, seconds) -> None:
    """Random submissions (several roots and plans, chains of stages), dispatches, executions
    with per-node step times (0 s and rounding-prone values included, so the plans' mean moves),
    cancellations and lost workers: after each event every plan's choice under every policy, as
    the index keeps it, equals the whole tree's, bit for bit (estimates included)."""
    sim = Incremental(workers=workers, step_seconds=lambda plan_key, node_id: seconds[
        (node_number(node_id) + len(plan_key)) % len(seconds)])
    queue: list[StageDispatched] = []
    submitted: list[str] = []
    for op_ in program:
        if op_[0] == "submit":
            _, a, b, steps, plan_key = op_
            trial_id = f"t{len(submitted)}"
            submitted.append(trial_id)
            sim.submit(trial_id, {"lr": LR_FAMILY[a], "bs": BS_FAMILY[b]}, steps, plan_key=plan_key)
        elif op_[0] == "dispatch":
            queue.extend(dispatch_all(sim, op_[1]))
        elif op_[0] == "execute" and queue:
            sim.execute(queue.pop(0))
        elif op_[0] == "cancel" and op_[1] < len(submitted):
            if sim.state.trials[submitted[op_[1]]].status == "pending":
                sim.emit(TrialCancelled(study_id="sim", trial_id=submitted[op_[1]]))
        elif op_[0] == "lose" and op_[1] < workers:
            sim.emit(WorkerLost(worker_id=f"w{op_[1]}", reason="test"))
            sim.emit(WorkerJoined(worker_id=f"w{op_[1]}", device="sim"))
            queue = [d for d in queue if d.worker_id != f"w{op_[1]}"]
    while queue:
        sim.execute(queue.pop(0))
    run(sim, "critical-path")


def test_many_one_stage_roots_are_ranked_by_steps_whatever_the_mean() -> None:
    """Pending one-stage trials on roots of their own (the many-trivial-trials case) are ranked
    by their steps without pricing each (``stage_index``); with measured nodes beside them, the
    choice still equals the whole tree's, and the longest unmeasured one goes first."""
    sim = Incremental(workers=1, step_seconds=lambda plan_key, node_id: 0.3 if node_id == "n0" else 0.1)
    for i in range(12):
        sim.submit(f"t{i}", lr(0.01 * (i + 1)), 1 + (i * 7) % 5)
    order = []
    while (decision := decide(sim.state)) is not None:
        sim.emit(decision)
        order.append(stages_of(decision))
        sim.execute(decision)
    assert len(order) == 12
    # cold (1 s/step), then every unmeasured stage priced at the plan's mean: longest first,
    # equal steps to the smaller stage key
    assert [s[0][2] - s[0][1] for s in order] == sorted((1 + (i * 7) % 5 for i in range(12)), reverse=True)


def test_a_chain_on_unmeasured_nodes_is_priced_again_when_the_mean_moves() -> None:
    """A component of two unmeasured stages is ranked at the plan's mean seconds per step; when
    a stage elsewhere in the plan moves the mean (nothing in that component changed), it is
    priced again and overtakes a measured path it lost to before."""
    sim = Incremental(workers=2, step_seconds=lambda plan_key, node_id: 10.0 if node_id == "n1" else 1.0)
    sim.submit("t0", lr(0.1), 10)  # n0, 1 s/step
    sim.submit("t3", lr(0.9), 1)  # n1, 10 s/step
    first, second = dispatch_all(sim, "critical-path")
    sim.execute(first)  # n0 measured: mean 1 s/step
    sim.submit("t1", lr(0.1), 20)  # n0[10, 20): 10 s, measured
    sim.submit("t2", lr(0.5), 3)  # n2[0, 3) -> n3[3, 6): 6 steps at the mean
    sim.submit("t4", lr(0.5, 3, 0.6), 6)
    before = decide(sim.state)
    assert before is not None and stages_of(before) == [("n0", 10, 20)]  # 10 s > 6 x 1 s
    sim.execute(second)  # n1 measured at 10 s/step: mean (10 + 10) / 11 s/step
    after = decide(sim.state)
    assert after is not None and stages_of(after) == [("n2", 0, 3), ("n3", 3, 6)]  # 6 x 20/11 s > 10 s


def test_equal_estimates_go_to_more_steps_across_measured_and_unmeasured_stages() -> None:
    """Steps measured at 0 s: every estimate is 0 s, so the stage with more steps goes first,
    whether it is on a measured node (ranked once) or an unmeasured one (ranked by steps)."""
    sim = Incremental(workers=1, step_seconds=lambda plan_key, node_id: 0.0)
    sim.submit("t0", lr(0.1), 2)
    (first,) = dispatch_all(sim, "critical-path")
    sim.execute(first)
    sim.submit("t0", lr(0.1), 5)  # n0[2, 5): 3 steps, measured at 0 s
    sim.submit("t1", lr(0.2), 4)  # n1[0, 4): 4 steps at the mean, 0 s
    decision = decide(sim.state)
    assert decision is not None and stages_of(decision) == [("n1", 0, 4)]
    sim.submit("t2", lr(0.3), 2)  # n2[0, 2): 2 steps at the mean: the measured 3 steps go first
    sim.emit(decision)
    sim.execute(decision)
    decision = decide(sim.state)
    assert decision is not None and stages_of(decision) == [("n0", 2, 5)]


trial_sets = st.lists(
    st.tuples(st.integers(0, len(LR_FAMILY) - 1), st.integers(0, len(BS_FAMILY) - 1), st.integers(1, 30)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(trial_sets, st.integers(1, 3), st.sampled_from(POLICIES))
def test_every_policy_trains_each_unique_step_once(spec, workers, policy) -> None:
    sim = Simulation(workers=workers)
    trials = [({"lr": LR_FAMILY[a], "bs": BS_FAMILY[b]}, steps) for a, b, steps in spec]
    for i, (hp, steps) in enumerate(trials):
        sim.submit(f"t{i}", hp, steps)
    run(sim, policy)
    assert all(t.status == "done" for t in sim.state.trials.values())
    counts = Counter((n, s) for _, n, a, b in sim.trained for s in range(a, b))
    assert max(counts.values()) == 1
    assert sim.state.stats.executed_steps == search_plan.merged_unique_steps(trials)


# ----------------------------------------------------------------------------- service and audit


def _write_run(path: Path, events: list[Event]) -> None:
    log = EmbeddedLog(path / "log")
    try:
        append_events(log, topics.PLAN, [(event_key(e), e) for e in events])
    finally:
        log.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_verify_recomputes_each_decision_with_its_policy(policy: str, tmp_path: Path) -> None:
    sim = three_way()
    run(sim, policy)
    _write_run(tmp_path / "good", sim.events)
    result = verify(open_source(tmp_path / "good"))
    assert result.ok, result.first_failure
    # The same log with every decision claiming another policy: the audit recomputes with the
    # claimed policy and finds the first decision it would not have made.
    other = "bfs" if policy == "critical-path" else "critical-path"
    forged = [e.model_copy(update={"policy": other}) if isinstance(e, StageDispatched) else e for e in sim.events]
    _write_run(tmp_path / "forged", forged)
    result = verify(open_source(tmp_path / "forged"))
    failure = result.first_failure
    assert failure is not None and failure.check == "decision" and repr(other) in failure.detail


def test_the_service_decides_with_its_policy(tmp_path: Path) -> None:
    events = three_way().events
    log = EmbeddedLog(tmp_path / "log")
    try:
        append_events(log, topics.PLAN, [(event_key(e), e) for e in events])
        projector = Projector(log)
        projector.catch_up()
        service = SchedulerService(log, projector, policy="most-children")
        (decision,) = service.run_pass()
        assert decision.policy == "most-children" and stages_of(decision) == [("n0", 100, 200)]
        recorded = [decode(r.value) for r in log.read(topics.DISPATCH)]
        assert [d.policy for d in recorded] == ["most-children"]
    finally:
        log.close()
