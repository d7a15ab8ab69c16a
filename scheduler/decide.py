"""The scheduling decision: a pure function from the projected state to the next dispatch.

``decide(state)`` builds the stage tree of every plan (Algorithm 1), picks the critical path
with the largest estimated time over all plans (thesis §4.3: all stage trees together), and
gives it to the idle worker with the smallest id. The scheduler service calls it after every
fold until it returns None (no idle worker, or nothing ready), appending each decision as a
StageDispatched event that records the offset it was decided at. Because it reads nothing but
the state, a replay recomputes every decision from the log prefix (DESIGN.md invariant 3).

Re-planning triggers (Hippo §3.4) need no special code: trial added or cancelled, checkpoint
saved and worker idle are all events that change the state this function reads.
"""

from __future__ import annotations

from events.models import CheckpointSource, StageDispatched, StageSpec
from projections.state import State
from scheduler.critical_path import Path, critical_path
from scheduler.stage_tree import build_stage_tree


def best_path(state: State) -> Path | None:
    """The critical path over all plans (ties: plan key order), or None when nothing is ready."""
    best: Path | None = None
    for plan_key in sorted(state.plans):
        path = critical_path(build_stage_tree(state.plans[plan_key]))
        if path is not None and (best is None or path.est_seconds > best.est_seconds):
            best = path
    return best


def decide(state: State) -> StageDispatched | None:
    """The next StageDispatched for ``state``, or None.

    The event's ``dispatch_id`` is ``d<number of dispatches so far>`` and ``decided_at`` is
    ``state.offset``, so the same state always gives the same decision; header fields
    (event id, timestamp) are left for the caller to stamp.
    """
    idle = state.idle_workers()
    if not idle:
        return None
    path = best_path(state)
    if path is None:
        return None
    plan = state.plans[path.plan_key]
    first = path.stages[0]
    source = None
    if first.ckpt is not None:
        node_id, step, ref = first.ckpt
        source = CheckpointSource(node_id=node_id, step=step, ref=ref)
    return StageDispatched(
        producer="scheduler",
        dispatch_id=f"d{state.stats.dispatches}",
        worker_id=idle[0],
        plan_key=plan.plan_key,
        seed=plan.seed,
        decided_at=state.offset,
        source=source,
        stages=[
            StageSpec(
                node_id=s.node_id,
                hp=plan.nodes[s.node_id].hp,
                from_step=s.from_step,
                to_step=s.to_step,
                evaluate=s.evaluate,
            )
            for s in path.stages
        ],
    )


def same_decision(a: StageDispatched, b: StageDispatched) -> bool:
    """True when two dispatches carry the same decision (header fields ignored)."""
    return a.payload() == b.payload()
