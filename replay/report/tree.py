"""The executed stages of a run as a tree, with the trials each one served."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from projections.queries import node_number, trial_path
from projections.state import State
from replay.report.load import StageRun

# ----------------------------------------------------------------------------- the stage tree


@dataclass
class TreeStage:
    """An executed stage of the tree: node ``node_id`` of ``plan_key`` over [from_step, to_step).

    ``executions`` counts its StageFinished events (2+: trained again, e.g. a lost checkpoint);
    ``trials`` the trials whose path passes through it; ``parent`` the index of the stage whose
    checkpoint it resumed from (None: a fresh initialisation); ``row`` its row in the drawing.
    """

    plan_key: str
    node_id: str
    from_step: int
    to_step: int
    executions: int = 1
    trials: set[str] = field(default_factory=set)
    parent: int | None = None
    children: list[int] = field(default_factory=list)
    row: int = 0

    @property
    def shared(self) -> bool:
        return len(self.trials) >= 2


def stage_tree(state: State, runs: Sequence[StageRun], statuses: Collection[str] = ("finished",)) -> list[TreeStage]:
    """The executed stages (runs whose status is in ``statuses``: finished ones by default; the
    dashboard adds the running ones; one entry per distinct stage) as a tree, in drawing order
    (depth-first, children by start step); see :class:`TreeStage`.

    A stage's parent is the stage whose end state it starts from: on the same node, the stage
    ending at its ``from_step``; at a node's start, the stage of the parent node ending at
    ``node.start_step``. Where no stage ends exactly there, the stage covering that step, else
    the latest one before it, is used.
    """
    by_key: dict[tuple[str, str, int, int], TreeStage] = {}
    for run in runs:
        if run.status not in statuses:
            continue
        st = by_key.get(run.key)
        if st is None:
            by_key[run.key] = TreeStage(*run.key)
        else:
            st.executions += 1
    stages = sorted(by_key.values(), key=lambda s: (s.plan_key, s.from_step, node_number(s.node_id), s.to_step))
    on_node: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, s in enumerate(stages):
        on_node[(s.plan_key, s.node_id)].append(i)

    # trials passing through each stage
    segments: dict[tuple[str, str], list[tuple[int, int, str]]] = defaultdict(list)
    for trial in state.trials.values():
        for plan_key, node_id, a, b in trial_path(state, trial):
            segments[(plan_key, node_id)].append((a, b, trial.trial_id))
    for s in stages:
        for a, b, trial_id in segments.get((s.plan_key, s.node_id), []):
            inside = (s.from_step < b and s.to_step > a) if s.to_step > s.from_step else a <= s.from_step <= b
            if inside:
                s.trials.add(trial_id)

    for i, s in enumerate(stages):  # a parent starts strictly before its child: no cycles
        s.parent = _parent_of(state, s, i, stages, on_node)
        if s.parent is not None:
            stages[s.parent].children.append(i)

    # depth-first drawing order
    order: list[int] = []
    roots = [i for i, s in enumerate(stages) if s.parent is None]
    stack = list(reversed(roots))
    while stack:
        i = stack.pop()
        order.append(i)
        kids = sorted(stages[i].children, key=lambda c: (stages[c].from_step, node_number(stages[c].node_id)))
        stack.extend(reversed(kids))
    remap = {old: new for new, old in enumerate(order)}
    out = [stages[i] for i in order]
    for row, s in enumerate(out):
        s.row = row
        s.parent = remap[s.parent] if s.parent is not None else None
        s.children = sorted(remap[c] for c in s.children)
    return out


def _parent_of(state: State, s: TreeStage, me: int, stages: list[TreeStage],
               on_node: dict[tuple[str, str], list[int]]) -> int | None:
    plan = state.plans.get(s.plan_key)
    node = plan.nodes.get(s.node_id) if plan else None
    step = s.from_step
    visited: set[str] = set()
    while node is not None and node.node_id not in visited:
        visited.add(node.node_id)
        if step > node.start_step or (node.parent_id is None and step > 0):
            cands = [i for i in on_node.get((s.plan_key, node.node_id), []) if i != me]
            exact = [i for i in cands if stages[i].to_step == step and stages[i].from_step < step]
            if exact:
                return exact[0]
            covering = [i for i in cands if stages[i].from_step < step <= stages[i].to_step]
            if covering:
                return covering[0]
            before = [i for i in cands if stages[i].to_step < step and stages[i].to_step > stages[i].from_step]
            if before:
                return max(before, key=lambda i: stages[i].to_step)
            if node.parent_id is None:
                return None
            step = node.start_step
        elif node.parent_id is None:
            return None
        node = plan.nodes.get(node.parent_id) if plan and node.parent_id else None
    return None


def _short_plan(plan_key: str) -> str:
    return plan_key.rsplit("/", 1)[-1][:8]


def stage_label(s: TreeStage | StageRun, multi_plan: bool) -> str:
    """A stage's short name in pictures: its node id, after 8 characters of its plan key when the
    drawing holds several plans."""
    return f"{_short_plan(s.plan_key)}:{s.node_id}" if multi_plan else s.node_id
