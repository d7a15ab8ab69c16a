"""The scheduling decision: a pure function from the projected state to the next dispatch.

``decide(state)`` builds the stage tree of every plan (Algorithm 1), picks the critical path
with the largest estimated time over all plans (thesis §4.3: all stage trees together), and
gives it to the idle worker with the smallest id. The scheduler service calls it after every
fold until it returns None (no idle worker, or nothing ready), appending each decision as a
StageDispatched event that records the offset it was decided at. Because it reads nothing but
the state, a replay recomputes every decision from the log prefix (DESIGN.md invariant 3).

Re-planning triggers (Hippo §3.4) need no special code: trial added or cancelled, checkpoint
saved and worker idle are all events that change the state this function reads.

Policies (the thesis's scheduler ablation, §6.3 / HIPPO_SPEC §3.7), named in
:data:`POLICIES` and recorded in each decision:

* ``"critical-path"`` (Hippo's): the ready root-to-leaf path with the largest estimated time
  (steps x seconds per step), dispatched as one batch; ties by steps, then plan key, then stage
  key. A plan with no measurement estimates its steps at the mean over all measured plans.
* ``"bfs"`` (breadth-first): one single ready stage at a time, the shallowest first. A ready
  stage is always a root of the transient stage tree (its weights exist), so its depth there
  is 0 for all; what orders breadth-first is how deep into training it sits in the study's
  whole tree, measured by its start step (``from_step``, steps). Ties by plan key, then stage
  key ``(node_id, to_step)``.
* ``"most-children"`` (the thesis's THR): one single ready stage at a time, the one with the
  most descendant stages in the stage tree first; ties as for ``"bfs"``.

Memoisation: a plan's choice depends on that plan alone, so it is kept in ``plan.cache`` per
(policy, ``plan.revision``); the reducer bumps the revision whenever the plan changes. Within a
plan that changed, only the parts of its stage tree under the search-plan roots the reducer
touched are rebuilt (``scheduler.stage_index``), so a pass costs what changed, not the number
of pending requests. The result is the same, bit for bit, as building the whole stage tree from
scratch (:func:`choice_from_scratch`; a plan object rebuilt from records starts with an empty
cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from events.models import CheckpointSource, StageDispatched, StageSpec
from projections.state import Plan, State
from scheduler.critical_path import Length, Path, critical_path, descendants, ready_stages, top_down
from scheduler.policies import POLICIES, Policy, check_policy  # noqa: F401 (exported here too)
from scheduler.stage_index import index_of
from scheduler.stage_tree import COLD_SEC_PER_STEP, StageKey, StageTree, build_stage_tree, measured_profile

RULES = 1
"""The version of the dispatch rules (:func:`decide`), recorded in each StageDispatched
(``rules``): a change to them that decides otherwise on the same state bumps it, so that
``replay verify`` tells a log decided under other rules from an edited one."""

_MEMO = "decide.choice"  # plan.cache key prefix: (_MEMO, policy) -> (revision, choice)


@dataclass(frozen=True)
class Choice:
    """A plan's candidate dispatch under a policy; across plans the smallest ``rank`` is
    dispatched, equal ranks going to the smaller plan key.

    ``rank``: ``(-estimated seconds, -steps)`` for "critical-path"; ``(from_step,)`` (steps) for
    "bfs"; ``(-descendant stages, from_step)`` for "most-children".
    """

    path: Path
    rank: tuple[float, ...]


def _choose(tree: StageTree, policy: Policy, lengths: dict[StageKey, Length] | None = None) -> Choice | None:
    """The candidate under ``policy`` in ``tree``, or None if nothing is ready (``lengths``:
    :func:`~scheduler.critical_path.longest` of ``tree``, when the caller has it)."""
    if policy == "critical-path":
        path = critical_path(tree, lengths)
        return None if path is None else Choice(path, (-path.est_seconds, -path.steps))
    ready = ready_stages(tree)
    if not ready:
        return None
    if policy == "bfs":
        stage = min(ready, key=lambda s: (s.from_step, s.key))
        rank: tuple[float, ...] = (stage.from_step,)
    else:
        count = descendants(tree, top_down(tree))
        stage = min(ready, key=lambda s: (-count[s.key], s.from_step, s.key))
        rank = (-count[stage.key], stage.from_step)
    return Choice(Path(tree.plan_key, (stage,), stage.est_seconds), rank)


def choice_from_scratch(plan: Plan, policy: Policy = "critical-path", fallback: float = COLD_SEC_PER_STEP
                        ) -> Choice | None:
    """The plan's candidate under ``policy`` from the whole stage tree built afresh (Algorithm 1
    over every pending request, as Hippo does at every pass): what :func:`plan_choice` computes
    incrementally, kept as its reference."""
    return _choose(build_stage_tree(plan, fallback), policy)


def plan_choice(plan: Plan, policy: Policy = "critical-path", fallback: float = COLD_SEC_PER_STEP) -> Choice | None:
    """The plan's candidate under ``policy``, memoised in ``plan.cache`` per (policy,
    ``plan.revision``, and ``fallback`` while the plan has no measurement of its own).

    Hippo rebuilds the transient stage tree for every pass (§3.4); this rebuilds only the parts
    of it under search-plan roots whose nodes changed since the last pass
    (:class:`scheduler.stage_index.StageTreeIndex`), and nothing for a plan whose revision did
    not change. Equal, bit for bit, to :func:`choice_from_scratch`. A plan mutated outside the
    reducer must bump ``plan.revision`` and note the nodes in ``plan.changed`` itself.
    """
    uses_fallback = measured_profile(plan)[0] == 0
    stamp = (plan.revision, fallback if uses_fallback else None)
    memo = plan.cache.get((_MEMO, policy))
    if memo is not None and memo[0] == stamp:
        return memo[1]
    chosen = index_of(plan).choose(policy, fallback)
    choice = None if chosen is None else _choose(chosen[0], policy, chosen[1])
    plan.cache[(_MEMO, policy)] = (stamp, choice)
    return choice


def fallback_sec_per_step(state: State) -> float:
    """Seconds per step for a plan nothing was measured on yet: the mean over every plan's
    measured training (a study's trial-based plans train the same model), else the cold
    estimate (issue 11 item 15: never 1 s against measured milliseconds)."""
    steps, seconds = 0, 0.0
    for plan in state.plans.values():
        s, t = measured_profile(plan)
        steps, seconds = steps + s, seconds + t
    return seconds / steps if steps else COLD_SEC_PER_STEP


def best_path(state: State, policy: str = "critical-path") -> Path | None:
    """The path to dispatch next over all plans under ``policy`` (see the module docstring),
    or None when nothing is ready.

    Raises:
        ValueError: ``policy`` is not one of :data:`POLICIES`.
    """
    policy = check_policy(policy)
    fallback = fallback_sec_per_step(state)
    best: Choice | None = None
    for plan_key in sorted(state.plans):
        choice = plan_choice(state.plans[plan_key], policy, fallback)
        if choice is not None and (best is None or choice.rank < best.rank):
            best = choice
    return None if best is None else best.path


def decide(state: State, policy: str = "critical-path") -> StageDispatched | None:
    """The next StageDispatched for ``state`` under ``policy``, or None (no idle worker, or
    nothing ready).

    The event's ``dispatch_id`` is ``d<number of dispatches so far>``, ``decided_at`` is
    ``state.offset`` (and ``decided_at_partitions`` ``state.offsets``, for the merged view of a
    partitioned stream: :func:`projections.partitions.merge`) and ``policy`` is recorded, so
    the same state and policy always give the same decision; header fields (event id,
    timestamp) are left for the caller to stamp.

    Raises:
        ValueError: ``policy`` is not one of :data:`POLICIES` (HIPPO_SPEC §3.7).
    """
    policy = check_policy(policy)
    idle = state.idle_workers()
    if not idle:
        return None
    path = best_path(state, policy)
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
        decided_at_partitions=state.offsets,
        policy=policy,
        rules=RULES,
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
