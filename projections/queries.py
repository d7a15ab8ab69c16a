"""Read-side queries over the projected search plan: the one way to read paths and sharing.

Everything here is a pure function of a :class:`~projections.state.State` (or one
:class:`~projections.state.Plan`): the summary, the HTML report, ``replay explain``, the
dashboard and the CLI ask these questions instead of walking the plan themselves.

Terms (DESIGN.md): a *segment* ``(plan_key, node_id, start, end)`` is the step range
``[start, end)`` of one node that a request trains through; the *path* of a request
``(node, steps)`` is its segments from the node up to the root, where the node covers
``[node.start_step, steps)`` and every ancestor ``[its start, its child's start)``. Two trials
*share* the steps where their paths' segments on the same node overlap (nodes are never split,
so step ``s`` of a node is the same prefix for every trial through it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from projections.state import Node, Plan, State, Trial


class Segment(NamedTuple):
    """Steps ``[start, end)`` of ``node_id`` in plan ``plan_key`` (steps)."""

    plan_key: str
    node_id: str
    start: int
    end: int

    @property
    def steps(self) -> int:
        return self.end - self.start


def node_number(node_id: str) -> int:
    """The ordinal of a node id (``"n12"`` -> 12): nodes are numbered in the order the plan
    appended them (:meth:`Plan.new_node_id`). Raises ValueError for another form."""
    if not node_id.startswith("n") or not node_id[1:].isdigit():
        raise ValueError(f"`node_id` is {node_id!r}, but node ids are n<number>")
    return int(node_id[1:])


def ancestors(plan: Plan, node: Node) -> Iterator[Node]:
    """``node``, its parent, ..., the root."""
    current: Node | None = node
    while current is not None:
        yield current
        current = plan.nodes[current.parent_id] if current.parent_id is not None else None


def path(plan: Plan, node_id: str, steps: int) -> list[Segment]:
    """The segments a request ``(node_id, steps)`` trains through, from ``node_id`` up to the
    root (see the module docstring). Raises KeyError for an unknown node."""
    out = []
    end = steps
    for node in ancestors(plan, plan.nodes[node_id]):
        out.append(Segment(plan.plan_key, node.node_id, node.start_step, end))
        end = node.start_step
    return out


def terminal(trial: Trial) -> tuple[str, int] | None:
    """``(node_id, steps)`` of a trial's largest request, or None before it has one."""
    if not trial.requests:
        return None
    steps = trial.steps if trial.steps in trial.requests else max(trial.requests)
    return trial.requests[steps], steps


def trial_path(state: State, trial: Trial) -> list[Segment]:
    """The segments of the trial's largest request (empty without one, or for an unknown plan)."""
    end = terminal(trial)
    plan = state.plans.get(trial.plan_key)
    if end is None or plan is None or end[0] not in plan.nodes:
        return []
    return path(plan, *end)


def needed(plan: Plan, targets: Iterable[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """The steps requests need, per node: ``node_id -> (start, end)`` with ``end`` the largest
    step any of ``targets`` (``(node_id, steps)`` requests) trains on or below that node."""
    end: dict[str, int] = {}
    for node_id, steps in targets:
        for segment in path(plan, node_id, steps):
            if end.get(segment.node_id, -1) < segment.end:
                end[segment.node_id] = segment.end
    return {n: (plan.nodes[n].start_step, stop) for n, stop in end.items()}


def unique_steps(plan: Plan, targets: Iterable[tuple[str, int]]) -> int:
    """Steps of the union of the requests' paths: the unique training steps after merging
    (the denominator of the merge rate p, Hippo §6.2). ``targets``: ``(node_id, steps)``."""
    return sum(stop - start for start, stop in needed(plan, targets).values())


def study_needs(state: State, study_id: str) -> dict[tuple[str, str], tuple[int, int]]:
    """The steps the study's trials need, per ``(plan_key, node_id)``: ``(start, end)`` over
    each trial's maximum request; their lengths sum to the study's unique steps (thesis §4.2.1)."""
    targets: dict[str, list[tuple[str, int]]] = {}
    for trial in state.trials.values():
        if trial.study_id == study_id and trial.steps in trial.requests:
            targets.setdefault(trial.plan_key, []).append((trial.requests[trial.steps], trial.steps))
    return {(key, node_id): span for key, requests in targets.items()
            for node_id, span in needed(state.plans[key], requests).items()}


def trials_through(state: State, plan_key: str, node_id: str, step: int) -> list[str]:
    """Sorted ids of the trials whose path trains ``node_id`` of ``plan_key`` up to ``step``
    or beyond (who a stage ending at ``step`` served)."""
    return sorted(t.trial_id for t in state.trials.values() if t.plan_key == plan_key
                  and any(s.node_id == node_id and step <= s.end for s in trial_path(state, t)))


def sharing(state: State, trial: Trial) -> dict[str, list[Segment]]:
    """For each other trial on the trial's plan, the segments of the trial's path it shares
    (the overlap of both paths on each node); trials sharing nothing are left out."""
    mine = {s.node_id: s for s in trial_path(state, trial)}
    out: dict[str, list[Segment]] = {}
    for other in state.trials.values():
        if other.trial_id == trial.trial_id or other.plan_key != trial.plan_key:
            continue
        common = []
        for s in trial_path(state, other):
            m = mine.get(s.node_id)
            if m is not None and min(m.end, s.end) > max(m.start, s.start):
                common.append(Segment(s.plan_key, s.node_id, max(m.start, s.start), min(m.end, s.end)))
        if common:
            out[other.trial_id] = sorted(common, key=lambda s: s.start)
    return out
