"""Algorithm 1 (BuildStageTree / FindLatestCheckpoint) with the fixes of HIPPO_SPEC §2.2.

The stage tree is transient: it is derived from the search plan for every scheduling decision
and then dropped (Hippo §3.4). For every pending request ``(node, step)`` (trials waiting, no
metrics yet, not covered by an in-flight stage) we look for the nearest source below it:

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

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from projections.state import Node, Plan

COLD_SEC_PER_STEP = 1.0
"""Cold-start estimate of seconds per step before any stage of the plan was measured (the
thesis's cost estimator predicts 1 with no history, §5.2). Only ratios between stages matter
to the critical path, so any positive constant gives the same decisions until measurements
arrive; then unmeasured nodes take the plan's mean measured seconds per step."""

SourceKind = Literal["fresh", "ckpt", "stage", "inflight"]
StageKey = tuple[str, int]


@dataclass(frozen=True)
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

    def roots(self) -> list[Stage]:
        """Stages with no parent stage, in key order."""
        return [self.stages[k] for k in sorted(self.stages) if self.stages[k].parent is None]


def covers(node: Node, step: int) -> bool:
    """True when an in-flight stage on ``node`` will reach ``step`` (or evaluates there)."""
    return any(a < step <= b or step == a == b for _, a, b in node.running)


@dataclass(frozen=True)
class _Anchor:
    step: int
    kind: Literal["ckpt", "inflight"]
    ckpt: tuple[str, int, str] | None = None


def _anchor(plan: Plan, node: Node, step: int, ckpt_steps: dict[str, list[int]]) -> _Anchor | None:
    """The nearest checkpoint or in-flight stage end of ``node`` in ``[start_step, step]``.

    ``ckpt_steps`` caches each node's sorted checkpoint steps for one tree build (bisect).
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
    for _, _, b in node.running:
        if node.start_step <= b <= step and (best is None or b > best.step):
            best = _Anchor(b, "inflight")
    return best


def sec_per_step(plan: Plan, node: Node) -> float:
    """Measured seconds per step of ``node``, else the plan's mean, else the cold estimate."""
    measured = node.sec_per_step()
    if measured is not None:
        return measured
    steps = sum(n.profile_steps for n in plan.nodes.values())
    if steps:
        return sum(n.profile_seconds for n in plan.nodes.values()) / steps
    return COLD_SEC_PER_STEP


def build_stage_tree(plan: Plan) -> StageTree:
    """Algorithm 1 of the Hippo paper with the fixes of HIPPO_SPEC §2.2 (see module doc).

    Returns every stage needed to answer the plan's pending requests, each step range of each
    node at most once. Pure: ``plan`` is not modified.
    """
    endpoints: dict[str, set[int]] = defaultdict(set)
    requested: dict[str, set[int]] = defaultdict(set)
    ckpt_steps: dict[str, list[int]] = {}
    for node in plan.nodes.values():
        for step, waiters in node.requests.items():
            if waiters and step not in node.metrics and not covers(node, step):
                endpoints[node.node_id].add(step)
                requested[node.node_id].add(step)

    # FindLatestCheckpoint's recursion, memoized as boundary endpoints on parents: deepest
    # nodes first, so a parent sees every boundary its children ask of it.
    for node in sorted(plan.nodes.values(), key=lambda n: (-n.depth, int(n.node_id[1:]))):
        ends = endpoints.get(node.node_id)
        if not ends or node.parent_id is None:
            continue
        if _anchor(plan, node, min(ends), ckpt_steps) is None:
            parent = plan.nodes[node.parent_id]
            if not covers(parent, node.start_step):
                endpoints[parent.node_id].add(node.start_step)

    tree = StageTree(plan.plan_key)
    for node_id in sorted(endpoints, key=lambda n: int(n[1:])):
        node = plan.nodes[node_id]
        sps = sec_per_step(plan, node)
        previous: int | None = None
        for end in sorted(endpoints[node_id]):
            evaluate = end in requested[node_id]
            anchor = _anchor(plan, node, end, ckpt_steps)
            stage: Stage | None
            if anchor is not None and (previous is None or anchor.step >= previous):
                if anchor.kind == "ckpt":
                    stage = Stage(node_id, anchor.step, end, evaluate, "ckpt", ckpt=anchor.ckpt)
                    if anchor.step == end and not evaluate:
                        stage = None  # boundary already checkpointed
                else:
                    stage = Stage(node_id, anchor.step, end, evaluate, "inflight")
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
            if stage is None:
                continue
            est = max(stage.steps, 1) * sps
            stage = Stage(stage.node_id, stage.from_step, stage.to_step, stage.evaluate, stage.source,
                          stage.parent, stage.ckpt, est)
            tree.stages[stage.key] = stage
    for key in sorted(tree.stages):
        parent = tree.stages[key].parent
        if parent is not None:
            tree.children.setdefault(parent, []).append(key)
    return tree
