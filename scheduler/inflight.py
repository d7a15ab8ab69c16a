"""Decisions about paths already running: preemption and saving at a new boundary.

Both are pure functions of the projected state, decided after every fold next to the dispatch
decision and recorded in the log with the prefix they were decided from (DESIGN.md invariant 3):

* **Preemption on cancel** (:class:`~events.models.PathPreempted`): when no pending request needs
  the rest of a running path any more (its trials were cancelled or stopped by their tuner), its
  worker is told to stop. What is still needed, if anything, is kept: the worker trains on to the
  last needed step (``until_stage``/``until_step``), keeps a checkpoint of what it trained, and is
  free for other work.
  A path its worker has trained to the end (PathTrained) gets neither decision: its end batches
  are on their way.
* **Split during execution** (:class:`~events.models.CheckpointRequested`, HIPPO_SPEC §10.1): when
  a request puts a boundary inside a stage of a running path (a trial asking for metrics there,
  or a child node branching there with work below it), the worker is told to save a checkpoint
  (and evaluate, for metrics) when it reaches that step, so the new branch resumes from it
  instead of retraining the prefix. A worker already past the step ignores it; Algorithm 1 then
  trains the branch from the nearest checkpoint, as before. Under a checkpoint budget a save is
  requested only while its bytes fit next to the bytes kept and reserved.

Needs are :func:`projections.queries.needed` over the pending requests (a node is needed up to
the largest step any pending request's path trains on it), read from the plan's stage-tree
index (``scheduler.stage_index``) in time proportional to the nodes asked about.
"""

from __future__ import annotations

from collections.abc import Mapping

from events.models import CheckpointRequested, Event, PathPreempted
from projections.queries import handed_on, running_dispatches
from projections.state import Dispatch, Plan, State
from scheduler.eviction import checkpoint_size, reserved_bytes
from scheduler.stage_index import index_of

RULES = 1
"""The version of the in-flight rules (:func:`inflight_decisions`: preemptions and save
requests), recorded in each PathPreempted and CheckpointRequested (``rules``): a change to them
that decides otherwise on the same state bumps it, so that ``replay verify`` tells a log decided
under other rules from an edited one."""


def pending_needs(plan: Plan) -> Mapping[str, tuple[int, int]]:
    """``node_id -> (start, end)``: the steps of each node the plan's pending requests (waiters,
    no metrics yet) need trained (:func:`projections.queries.needed` over them), read from the
    plan's stage-tree index (``scheduler.stage_index.Needs``)."""
    return index_of(plan).needs()


def _last_needed(d: Dispatch, needs: Mapping[str, tuple[int, int]], plan: Plan) -> tuple[int, int] | None:
    """``(stage index, step)``: how far the path ``d`` must still train for its plan's pending
    requests, or None when none of it is needed."""
    last = None
    for i, (node_id, a, b) in enumerate(d.stages):
        span = needs.get(node_id)
        if span is None:
            continue
        end = min(b, span[1])
        evaluates = a == b and any(plan.nodes[node_id].requests.get(b, []))
        if end > a or evaluates:
            last = (i, end)
    return last


def preemptions(state: State, budget: int | None = None) -> list[PathPreempted]:
    """A PathPreempted for each running, not yet preempted dispatch of which some tail (or all)
    is needed by no pending request (``budget``: recorded, the pass's checkpoint budget)."""
    out = []
    needs_of: dict[str, Mapping[str, tuple[int, int]]] = {}
    for d in running_dispatches(state):
        if d.until is not None or handed_on(state, d):  # a trained path (PathTrained): nothing left to stop
            continue
        plan = state.plans[d.plan_key]
        needs = needs_of.get(d.plan_key)
        if needs is None:
            needs = needs_of[d.plan_key] = pending_needs(plan)
        last = _last_needed(d, needs, plan)
        if last is not None and last == (len(d.stages) - 1, d.stages[-1][2]):
            continue  # all of it is needed
        if last is None:
            reason = "no pending request needs any of its stages"
            until_stage, until_step = None, None
        else:
            until_stage, until_step = last
            node_id = d.stages[until_stage][0]
            reason = f"no pending request needs steps after {until_step} of node {node_id}"
        out.append(PathPreempted(producer="scheduler", dispatch_id=d.dispatch_id, worker_id=d.worker_id,
                                 plan_key=d.plan_key, decided_at=state.offset, until_stage=until_stage,
                                 until_step=until_step, reason=reason, checkpoint_budget=budget, rules=RULES))
    return out


def split_requests(state: State, budget: int | None = None) -> list[CheckpointRequested]:
    """A CheckpointRequested for each boundary a pending request puts strictly inside a stage of
    a running path that the worker was not asked for yet: metrics asked at a step inside (the
    worker evaluates there too), or a child node branching there with pending work below it and
    no checkpoint there. Under ``budget`` (bytes) each one is requested only while one more
    checkpoint of the plan fits next to the bytes kept and reserved. Ordered by dispatch id, then
    step."""
    out = []
    spare = None if budget is None else budget - state.stats.checkpoint_bytes - reserved_bytes(state)
    needs_of: dict[str, Mapping[str, tuple[int, int]]] = {}
    for d in running_dispatches(state):
        if handed_on(state, d):  # every step of it is trained (PathTrained): too late to save inside
            continue
        plan = state.plans[d.plan_key]
        needs = needs_of.get(d.plan_key)
        if needs is None:
            needs = needs_of[d.plan_key] = pending_needs(plan)
        asked = {(node_id, step) for node_id, step, _ in d.requested}
        last = len(d.stages) - 1 if d.until is None else d.until[0]
        for i, (node_id, a, b) in enumerate(d.stages[: last + 1]):
            if i < d.finished:
                continue
            if d.until is not None and i == d.until[0]:
                b = min(b, d.until[1])
            node = plan.nodes[node_id]
            wanted: dict[int, bool] = {}
            for step, waiters in node.requests.items():
                if a < step < b and waiters and step not in node.metrics:
                    wanted[step] = True
            for child_id in node.children:
                child = plan.nodes[child_id]
                # the child waits for this path's weights at its start (nothing of its own to resume)
                if a < child.start_step < b and child_id in needs and child.start_step not in node.ckpt \
                        and not child.ckpt and not child.running:
                    wanted.setdefault(child.start_step, False)
            for step in sorted(wanted):
                if (node_id, step) in asked:
                    continue
                if spare is not None:
                    size = checkpoint_size(state, d.plan_key)
                    if size > spare:
                        continue
                    spare -= size
                out.append(CheckpointRequested(producer="scheduler", dispatch_id=d.dispatch_id,
                                               worker_id=d.worker_id, plan_key=d.plan_key, node_id=node_id,
                                               step=step, evaluate=wanted[step], decided_at=state.offset,
                                               checkpoint_budget=budget, rules=RULES))
    return out


def inflight_decisions(state: State, budget: int | None = None) -> list[Event]:
    """Every decision about running paths to make now: preemptions, then save requests (on the
    state as it is; the preemptions' effect on the save requests is for the next pass)."""
    return [*preemptions(state, budget), *split_requests(state, budget)]
