"""Checkpoint eviction under a budget: the cost-benefit rule of the TreeML thesis (§4.2.2, after
Nectar; HIPPO_SPEC §3.6), as a pure function of the projected state.

A run may keep at most ``budget`` bytes of checkpoint objects. Before a path is dispatched, the
bytes it will write (one checkpoint per stage that trains, each the size of the largest
checkpoint the run has saved so far: :func:`checkpoint_size`) are reserved next to the bytes
kept and the bytes the running paths have reserved; when they do not fit, kept checkpoints
are evicted (CheckpointEvicted decisions, appended before the dispatch and deleted from the
store only once durable), cheapest first by

    score = recompute seconds x reuse probability / bytes

* **recompute seconds**: the steps from the nearest kept checkpoint below it on its path (or a
  fresh start) x the profiled seconds per step (the node's, else its plan's, else the mean over
  plans: ``scheduler.stage_tree``);
* **reuse probability**: 1 when a pending request resumes from it (it is the nearest kept
  checkpoint on the request's path); else, while a study on the plan is live, ``f / (f + 1)``
  with ``f`` its fan-out (trials whose requests end there and could be extended, children of
  its node branching there), or 0.05 for a checkpoint in the middle of a path; 0 once no study
  on the plan is live.

Never evicted: the source of a running path (its worker may still be loading it) and of the
path about to be dispatched. The source of a pending request goes only after every other
candidate (its reuse probability is 1); its requests are then trained again from the nearest
kept checkpoint, bit for bit the same (invariant 1), and the recomputation shows in
``executed_steps``. When even that does not make room (every kept checkpoint pinned), the path
waits for a running one to end (:func:`fits`): workers idle rather than overfill the store. Only
when nothing runs does a path go ahead over the budget (a budget smaller than the checkpoints
of one path).
"""

from __future__ import annotations

from dataclasses import dataclass

from events.models import CheckpointEvicted, base_plan_key
from projections.queries import ancestors, node_number, running_dispatches
from projections.state import Node, Plan, State
from scheduler.critical_path import Path
from scheduler.decide import best_path, check_policy, fallback_sec_per_step
from scheduler.stage_tree import mean_sec_per_step, sec_per_step

RULES = 1
"""The version of the eviction rules (:func:`evictions_for_dispatch`), recorded in each
CheckpointEvicted (``rules``): a change to them that decides otherwise on the same state bumps
it, so that ``replay verify`` tells a log decided under other rules from an edited one."""

PERIPHERAL_REUSE = 0.05
"""Reuse probability of a checkpoint in the middle of a path that no request or branch uses."""

_SIZE = "eviction.size"  # State.cache key: (object count, largest object's bytes)

def checkpoint_size(state: State, plan_key: str) -> int:
    """The bytes one checkpoint of ``plan_key`` is expected to take: the largest checkpoint object
    the run has saved so far, on any plan, evicted or kept (0 before a first save).

    It never shrinks: an estimate from the checkpoints kept now fell when the large ones were
    evicted (a model whose optimizer state appears with a hyper-parameter, e.g. momentum), and the
    paths then dispatched wrote more than they reserved. Over several plans it is the largest
    model's size: it reserves too much for the smaller ones rather than too little. Until a
    checkpoint of the largest size is first saved, a path can still write more than it reserved;
    the next dispatch's evictions then make room for the excess too.
    """
    del plan_key  # the objects of the state do not name their plan
    memo = state.cache.get(_SIZE)  # objects are only ever added: their count dates the maximum
    if memo is None or memo[0] != len(state.objects):
        memo = state.cache[_SIZE] = (len(state.objects), max((o.size for o in state.objects.values()), default=0))
    return int(memo[1])


def path_bytes(state: State, path: Path) -> int:
    """Bytes a dispatched path writes: one checkpoint per stage that trains."""
    return sum(1 for s in path.stages if s.to_step > s.from_step) * checkpoint_size(state, path.plan_key)


def reserved_bytes(state: State) -> int:
    """Bytes the running paths will still write: their unfinished stages that train (up to the
    preemption point of a preempted one) and the checkpoints they were asked to save inside
    their stages and have not saved yet."""
    total = 0
    for d in running_dispatches(state):
        last = len(d.stages) - 1 if d.until is None else max(d.until[0], 0)
        count = sum(1 for node_id, a, b in d.stages[d.finished:last + 1] if b > a)
        plan = state.plans[d.plan_key]
        count += sum(1 for node_id, step, _ in d.requested if step not in plan.nodes[node_id].ckpt)
        total += count * checkpoint_size(state, d.plan_key)
    return total


def pinned_refs(state: State, path: Path | None = None) -> set[str]:
    """Checkpoints that must stay: the sources of running paths and of ``path``."""
    refs = {d.source for d in running_dispatches(state) if d.source is not None}
    if path is not None and path.stages[0].ckpt is not None:
        refs.add(path.stages[0].ckpt[2])
    return refs


@dataclass(frozen=True)
class Candidate:
    """A kept checkpoint and its cost-benefit figures (seconds, probability, bytes)."""

    plan_key: str
    node_id: str
    step: int
    ref: str
    size: int
    recompute_steps: int
    recompute_seconds: float
    reuse: float

    @property
    def score(self) -> float:
        """Recompute seconds risked per byte freed: the smallest goes first."""
        return self.recompute_seconds * self.reuse / self.size

    def reason(self, budget: int, need: int) -> str:
        return (f"needs {need} bytes within the budget of {budget}: recompute {self.recompute_steps} steps "
                f"({self.recompute_seconds:.6g} s) x reuse {self.reuse:.3g} / {self.size} bytes = "
                f"score {self.score:.6g}, the lowest")


def _nearest_below(plan: Plan, node: Node, step: int, gone: set[tuple[str, int]]) -> int:
    """The step of the nearest kept checkpoint strictly before (``node``, ``step``) on its path
    (0 for a fresh start), ignoring the places in ``gone``. An ancestor's checkpoint at the step
    where its child starts counts (the same weights)."""
    at, first = step, True
    for n in ancestors(plan, node):
        kept = [s for s in n.ckpt
                if (n.node_id, s) not in gone and n.start_step <= s and (s < at if first else s <= at)]
        if kept:
            return max(kept)
        at, first = n.start_step, False
    return 0


def _pending_anchors(plan: Plan, gone: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """For each kept checkpoint place, how many pending requests of the plan would resume from
    it (it is the nearest kept checkpoint at or below the request on its path)."""
    counts: dict[tuple[str, int], int] = {}
    for node in plan.nodes.values():
        for step, waiters in node.requests.items():
            if not waiters or step in node.metrics:
                continue
            at = step
            for n in ancestors(plan, node):
                kept = [s for s in n.ckpt if (n.node_id, s) not in gone and n.start_step <= s <= at]
                if kept:
                    key = (n.node_id, max(kept))
                    counts[key] = counts.get(key, 0) + 1
                    break
                at = n.start_step
    return counts


def _live(state: State, plan_key: str) -> bool:
    base = base_plan_key(plan_key)
    return any(not study.get("finished") and base_plan_key(study.get("plan_key", "")) == base
               for study in state.studies.values())


def candidates(state: State, pinned: set[str], gone: set[tuple[str, int]] = frozenset()) -> list[Candidate]:
    """Every kept, unpinned checkpoint place with its cost-benefit figures: the sources of pending
    requests last, each group cheapest first (ties: plan key, node number, step). ``gone``: places
    already chosen for eviction."""
    fallback = fallback_sec_per_step(state)
    out = []
    for plan_key in sorted(state.plans):
        plan = state.plans[plan_key]
        anchors = _pending_anchors(plan, gone)
        live = _live(state, plan_key)
        mean = mean_sec_per_step(plan, fallback)
        ends: dict[tuple[str, int], int] = {}
        for trial in state.trials.values():
            if trial.plan_key == plan_key:
                for steps, node_id in trial.requests.items():
                    ends[(node_id, steps)] = ends.get((node_id, steps), 0) + 1
        for node in plan.nodes.values():
            branches: dict[int, int] = {}
            for child_id in node.children:
                child = plan.nodes[child_id]
                branches[child.start_step] = branches.get(child.start_step, 0) + 1
            for step, ckpt in node.ckpt.items():
                if ckpt.ref in pinned or (node.node_id, step) in gone:
                    continue
                back = step - _nearest_below(plan, node, step, gone)
                if anchors.get((node.node_id, step)):
                    reuse = 1.0
                elif live:
                    fan = ends.get((node.node_id, step), 0) + branches.get(step, 0)
                    reuse = fan / (fan + 1) if fan else PERIPHERAL_REUSE
                else:
                    reuse = 0.0
                seconds = back * sec_per_step(plan, node, mean)
                out.append(Candidate(plan_key, node.node_id, step, ckpt.ref, ckpt.size, back, seconds, reuse))
    # a pending request's source (reuse 1) goes last, whatever its score: evicting it retrains
    # that request for certain, where any other candidate is lost only if it is asked for again
    out.sort(key=lambda c: (c.reuse >= 1.0, c.score, c.plan_key, node_number(c.node_id), c.step))
    return out


def plan_evictions(state: State, budget: int, need: int, pinned: set[str],
                   policy: str = "critical-path") -> list[CheckpointEvicted]:
    """The checkpoints to evict so that ``need`` more bytes fit within ``budget`` next to the bytes
    kept and reserved: greedy, cheapest first, the figures recomputed after each pick (evicting
    one checkpoint makes its neighbours costlier to lose). Empty when they fit already; as many
    as exist when they cannot fit. Pure: a replay recomputes it from the same state."""
    return _plan(state, budget, need, pinned, policy)[0]


def _plan(state: State, budget: int, need: int, pinned: set[str],
          policy: str) -> tuple[list[CheckpointEvicted], int, bool]:
    """:func:`plan_evictions`, the bytes still missing after them (> 0: ``need`` cannot fit),
    and whether they evict a pending request's source."""
    excess = state.stats.checkpoint_bytes + reserved_bytes(state) + need - budget
    chosen: list[Candidate] = []
    gone: set[tuple[str, int]] = set()
    refs_left: dict[str, int] = {}
    while excess > 0:
        pool = candidates(state, pinned, gone)
        if not pool:
            break
        pick = pool[0]
        chosen.append(pick)
        gone.add((pick.node_id, pick.step))
        obj = state.objects.get(pick.ref)
        left = refs_left.setdefault(pick.ref, obj.references if obj is not None else 1) - 1
        refs_left[pick.ref] = left
        if left == 0:  # the last place of the object: its bytes are freed
            excess -= pick.size
    return [CheckpointEvicted(producer="scheduler", plan_key=c.plan_key, node_id=c.node_id, step=c.step, ref=c.ref,
                              size=c.size, decided_at=state.offset, checkpoint_budget=budget,
                              reason=c.reason(budget, need), policy=check_policy(policy), rules=RULES)
            for c in chosen], excess, any(c.reuse >= 1.0 for c in chosen)


def fits(state: State, budget: int, path: Path) -> bool:
    """Whether the checkpoints ``path`` writes fit within ``budget`` next to the bytes kept and
    reserved, or nothing runs (then nothing would ever free room: the path goes ahead, the one
    case where a budget smaller than a path's checkpoints is exceeded). Before any checkpoint
    was saved their size is unknown: one path runs alone until its first one is."""
    if not running_dispatches(state):
        return True
    if checkpoint_size(state, path.plan_key) == 0:
        return False  # no checkpoint saved yet: its size is unknown until the running path saves one
    room = budget - state.stats.checkpoint_bytes - reserved_bytes(state)
    return path_bytes(state, path) <= room


def evictions_for_dispatch(state: State, budget: int, policy: str = "critical-path") -> list[CheckpointEvicted]:
    """The evictions to decide before the next dispatch (the one ``decide`` makes now under
    ``policy``): room for the bytes its path writes. Empty when no worker is idle, nothing is
    ready, or it fits; and, while a path runs, when the path would not fit even after them (its
    checkpoints' size still unknown, or too little to evict) or they would evict a pending
    request's source: the path waits for a running path to end (:func:`fits`), whose end may
    leave other candidates (a finished trial's checkpoint). Evicting then lost a source that the
    path dispatched next retrained (the evictions made another path the critical one; the bug
    bash of 2026-11-28)."""
    if not state.idle_workers():
        return []
    path = best_path(state, policy)
    if path is None:
        return []
    if not running_dispatches(state):  # nothing would free room: the path goes ahead whatever is left
        return plan_evictions(state, budget, path_bytes(state, path), pinned_refs(state, path), policy)
    if checkpoint_size(state, path.plan_key) == 0:
        return []
    evictions, missing, sources = _plan(state, budget, path_bytes(state, path), pinned_refs(state, path), policy)
    return [] if missing > 0 or sources else evictions
