"""Algorithm 1 (BuildStageTree / FindLatestCheckpoint) with the fixes of HIPPO_SPEC §2.2.

The stage tree is transient: it is derived from the search plan, never stored in the log or the
projection (Hippo §3.4); between passes the scheduler keeps the part of it under each
search-plan root and rebuilds only the parts whose nodes changed (``scheduler.stage_index``,
which calls :func:`build_stage_tree` restricted to those nodes).

For every pending request ``(node, step)`` (trials waiting, no metrics yet, not covered by an
in-flight stage) we look for the nearest source below it:

* an existing checkpoint of the node in ``[start_step, step]`` (inclusive scan, fix 3), where
  the parent's checkpoint at ``start_step`` counts too (same weights);
* a lower pending endpoint on the same node: overlapping stages from one source are chained
  at every pending endpoint, so no step is trained twice (fix 5);
* the end of a stage already running on the node: the new stage waits for it (fix 1/6);
* otherwise the request recurses to ``(parent, start_step)`` (memoized, as a boundary
  endpoint on the parent); a root with no checkpoint trains from a fresh initialisation
  (root base case, fix 2).

An in-flight range ``(from, to]`` of a running stage covers a step ``s`` when
``from < s <= to`` (or ``s == from == to`` for an evaluation-only stage); such requests
produce no stage now (the running check, fix 1), and a boundary strictly inside a running
stage waits for it to finish (the split-during-execution case of §10.1).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from projections.queries import node_number
from projections.state import Node, Plan

COLD_SEC_PER_STEP = 1.0
"""Estimate of seconds per step before any stage of any plan was measured (the thesis's cost
estimator predicts 1 with no history, §5.2): every stage then costs its steps. Only ratios
between stages matter to the critical path, so any positive constant gives the same decisions
until measurements arrive. Then an unmeasured node takes its plan's mean measured seconds per
step, and a plan with no measurement the mean over all plans (:func:`measured_profile`)."""

SourceKind = Literal["fresh", "ckpt", "stage", "inflight"]
StageKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Stage:
    """A step range ``[from_step, to_step)`` trained under ``node_id``'s config.

    ``source`` says where its weights come from: a fresh initialisation, a checkpoint
    (``ckpt`` = (node_id, step, ref)), the stage ``parent`` (key (node_id, to_step)) in this
    tree, or a stage still running on a worker ("inflight": not dispatchable now).
    ``evaluate``: a trial waits for metrics at ``to_step``. ``est_seconds``: steps x estimated
    seconds per step (an evaluation-only stage counts as one step).
    """

    node_id: str
    from_step: int
    to_step: int
    evaluate: bool
    source: SourceKind
    parent: StageKey | None = None
    ckpt: tuple[str, int, str] | None = None
    est_seconds: float = 0.0

    @property
    def key(self) -> StageKey:
        return (self.node_id, self.to_step)

    @property
    def steps(self) -> int:
        return self.to_step - self.from_step


@dataclass
class StageTree:
    """The stages of one plan with their tree edges (parent stage -> child stages)."""

    plan_key: str
    stages: dict[StageKey, Stage] = field(default_factory=dict)
    children: dict[StageKey, list[StageKey]] = field(default_factory=dict)
    root_keys: list[StageKey] | None = field(default=None, compare=False, repr=False)
    """The keys of :meth:`roots`, in key order, when the tree is complete: set by
    :func:`build_stage_tree`, whose trees are not changed afterwards (each ranking of a
    component and each decision read its roots several times). None for a tree assembled
    stage by stage: :meth:`roots` then reads ``stages`` at every call."""

    def roots(self) -> list[Stage]:
        """Stages with no parent stage, in key order."""
        keys = self.root_keys
        if keys is None:
            keys = sorted(k for k, s in self.stages.items() if s.parent is None)
        return [self.stages[k] for k in keys]


def covers(node: Node, step: int) -> bool:
    """True when an in-flight stage on ``node`` will reach ``step`` (or evaluates there)."""
    return bool(node.running) and any(a < step <= b or step == a == b for _, a, b in node.running)


class _Anchor(NamedTuple):
    step: int
    kind: Literal["ckpt", "inflight"]
    ckpt: tuple[str, int, str] | None = None


def _anchor(plan: Plan, node: Node, step: int, ckpt_steps: dict[str, list[int]]) -> _Anchor | None:
    """The nearest checkpoint or in-flight stage end of ``node`` in ``[start_step, step]``.

    ``ckpt_steps`` caches each node's sorted checkpoint steps (bisect; see :func:`build_stage_tree`).
    """
    best: _Anchor | None = None
    steps = ckpt_steps.get(node.node_id)
    if steps is None:
        steps = ckpt_steps[node.node_id] = sorted(node.ckpt)
    i = bisect_right(steps, step) - 1
    if i >= 0 and steps[i] >= node.start_step:
        s = steps[i]
        best = _Anchor(s, "ckpt", (node.node_id, s, node.ckpt[s].ref))
    if node.parent_id is not None and best is None:
        parent = plan.nodes[node.parent_id]
        pc = parent.ckpt.get(node.start_step)
        if pc is not None:
            best = _Anchor(node.start_step, "ckpt", (parent.node_id, node.start_step, pc.ref))
    if node.running:
        for _, _, b in node.running:
            if node.start_step <= b <= step and (best is None or b > best.step):
                best = _Anchor(b, "inflight")
    return best


_PROFILE = "stage_tree.profile"  # plan.cache key: (profile revision, steps, seconds) measured on the plan


def measured_profile(plan: Plan) -> tuple[int, float]:
    """``(steps, seconds)`` of training measured on the plan's nodes (summed in node order),
    memoised per :attr:`Plan.profile_revision`: summed again only when a measurement changed.

    The seconds are added one by one, left to right, not with ``sum()``, whose float result
    differs between Python versions (3.12 compensates its rounding errors): a decision that
    reads this must be recomputed bit for bit by ``replay verify`` on any Python (invariant 3).
    """
    memo = plan.cache.get(_PROFILE)
    if memo is None or memo[0] != plan.profile_revision:
        steps, seconds = 0, 0.0
        for n in plan.nodes.values():
            steps += n.profile_steps
            seconds += n.profile_seconds
        memo = plan.cache[_PROFILE] = (plan.profile_revision, steps, seconds)
    return memo[1], memo[2]


def mean_sec_per_step(plan: Plan, fallback: float = COLD_SEC_PER_STEP) -> float:
    """The plan's measured seconds per step over all nodes (total seconds / total steps), or
    ``fallback`` before any measurement of the plan (the mean over other plans, else the cold
    estimate)."""
    steps, seconds = measured_profile(plan)
    return seconds / steps if steps else fallback


def sec_per_step(plan: Plan, node: Node, mean: float | None = None) -> float:
    """Measured seconds per step of ``node``, else the plan's mean, else the cold estimate.

    ``mean``: the plan's :func:`mean_sec_per_step` when the caller has it already (one tree
    build computes it once instead of once per unmeasured node).
    """
    measured = node.sec_per_step()
    if measured is not None:
        return measured
    return mean_sec_per_step(plan) if mean is None else mean


def build_stage_tree(plan: Plan, fallback: float = COLD_SEC_PER_STEP, nodes: Iterable[str] | None = None,
                     ckpt_steps: dict[str, list[int]] | None = None) -> StageTree:
    """Algorithm 1 of the Hippo paper with the fixes of HIPPO_SPEC §2.2 (see module doc).

    Returns every stage needed to answer the plan's pending requests, each step range of each
    node at most once. ``fallback``: seconds per step of a plan with no measurement yet (the
    scheduler passes the mean over all plans). ``nodes``: the ids of the nodes whose requests to
    answer (default: every node); the stages of their ancestors that they need come too, so the
    pending nodes under one search-plan root give exactly that root's share of the whole tree
    (``scheduler.stage_index``). ``ckpt_steps``: node id -> its checkpoint steps, sorted, kept
    between builds by a caller that drops the entry of every node that changed (filled here as
    nodes are visited; default: one for this build). Pure: ``plan`` is not modified.

    Cost: one pass over the nodes (or ``nodes``) to collect pending requests, then work
    proportional to the nodes with pending endpoints (and their ancestors), O(s log s) for s
    stages.
    """
    endpoints: dict[str, set[int]] = defaultdict(set)
    requested: dict[str, set[int]] = defaultdict(set)
    if ckpt_steps is None:
        ckpt_steps = {}
    for node in plan.nodes.values() if nodes is None else (plan.nodes[n] for n in nodes):
        if not node.requests:
            continue
        for step, waiters in node.requests.items():
            if waiters and step not in node.metrics and not covers(node, step):
                endpoints[node.node_id].add(step)
                requested[node.node_id].add(step)

    # FindLatestCheckpoint's recursion, memoized as boundary endpoints on parents: deepest
    # nodes first (ties by node number), so a parent sees every boundary its children ask of
    # it. Only nodes with endpoints do anything, so only they are visited, from a heap in the
    # order a sort of all nodes would give; a parent gaining its first endpoint joins the heap
    # when it comes later in that order.
    def order(n: Node) -> tuple[int, int]:
        return (-n.depth, node_number(n.node_id))

    heap = [(*order(plan.nodes[node_id]), node_id) for node_id in endpoints]
    heapq.heapify(heap)
    first: dict[str, tuple[int, _Anchor | None]] = {}  # node id -> its lowest endpoint and that one's anchor
    while heap:
        minus_depth, number, node_id = heapq.heappop(heap)
        node = plan.nodes[node_id]
        if node.parent_id is None:
            continue
        low = min(endpoints[node_id])  # final: only the deeper nodes popped before add to it
        found = _anchor(plan, node, low, ckpt_steps)
        first[node_id] = (low, found)
        if found is None:
            up = plan.nodes[node.parent_id]
            if not covers(up, node.start_step):
                if up.node_id not in endpoints and order(up) > (minus_depth, number):
                    heapq.heappush(heap, (*order(up), up.node_id))
                endpoints[up.node_id].add(node.start_step)

    tree = StageTree(plan.plan_key)
    mean = mean_sec_per_step(plan, fallback) if endpoints else fallback
    for node_id in sorted(endpoints, key=node_number):
        node = plan.nodes[node_id]
        sps = sec_per_step(plan, node, mean)
        previous: int | None = None
        req = requested.get(node_id, ())
        known = first.get(node_id)
        for end in sorted(endpoints[node_id]):
            evaluate = end in req
            anchor = known[1] if known is not None and known[0] == end else _anchor(plan, node, end, ckpt_steps)
            source: SourceKind
            parent: StageKey | None = None
            ckpt: tuple[str, int, str] | None = None
            if anchor is not None and (previous is None or anchor.step >= previous):
                start, source, ckpt = anchor
                if source == "ckpt" and start == end and not evaluate:
                    previous = end
                    continue  # boundary already checkpointed
            elif previous is not None:
                start, source, parent = previous, "stage", (node_id, previous)
            elif node.parent_id is None:
                start, source = 0, "fresh"
            elif covers(plan.nodes[node.parent_id], node.start_step):
                start, source = node.start_step, "inflight"
            else:
                start, source, parent = node.start_step, "stage", (node.parent_id, node.start_step)
            previous = end
            tree.stages[(node_id, end)] = Stage(node_id, start, end, evaluate, source, parent, ckpt,
                                                max(end - start, 1) * sps)
    roots: list[StageKey] = []
    for key in sorted(tree.stages):
        above = tree.stages[key].parent
        if above is not None:
            tree.children.setdefault(above, []).append(key)
        else:
            roots.append(key)
    tree.root_keys = roots
    return tree
