"""Critical paths through a stage tree (Hippo §4.3, thesis §4.3.1).

The critical path is the root-to-leaf chain of stages with the largest estimated time
(steps x seconds per step), and of two equally long the one with more steps. A whole path goes
to one idle worker as one batch, so consecutive stages keep their weights in memory. Only paths
whose first stage can start now are candidates: its source checkpoint exists, or it starts from
a fresh initialisation; stages
hanging off in-flight work wait until the checkpoint they need is saved.

Ties are broken by stage key order, so the choice is a deterministic function of the plan.
Everything here is linear in the number of stages (one top-down order, walked backwards),
and the descendant counts of the "most-children" ablation policy (HIPPO_SPEC §3.7) come from
the same walk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.stage_tree import Stage, StageKey, StageTree

READY = ("fresh", "ckpt")


@dataclass(frozen=True)
class Path:
    """A chain of stages, first to last, its estimated time in seconds and its steps (an
    evaluation-only stage counts one, as in its estimate)."""

    plan_key: str
    stages: tuple[Stage, ...]
    est_seconds: float
    steps: int = 0


Length = tuple[float, int]
"""How long a path is: (estimated seconds, steps). Compared as a tuple, so paths of equal
estimated time (no measurement yet, or steps measured at 0 s) are told apart by their steps."""


Price = Callable[[Stage], float]
"""Estimated seconds of a stage, where they differ from its ``est_seconds`` (the stage index
prices stages of unmeasured nodes at the plan's current mean seconds per step)."""


def top_down(tree: StageTree) -> list[StageKey]:
    """Every stage key reachable from a root, each parent before its children (breadth-first
    from the roots in key order, children in key order). Linear in the number of stages."""
    order = [stage.key for stage in tree.roots()]
    i = 0
    while i < len(order):
        order.extend(tree.children.get(order[i], ()))
        i += 1
    return order


def longest(tree: StageTree, order: list[StageKey] | None = None, price: Price | None = None
            ) -> dict[StageKey, Length]:
    """Longest :data:`Length` from each stage down to a leaf (the stage included), each stage
    costing its ``est_seconds`` (or ``price(stage)``).

    Linear: children are visited before their parent by walking :func:`top_down` backwards.
    """
    memo: dict[StageKey, Length] = {}
    stages, children = tree.stages, tree.children
    for key in reversed(top_down(tree) if order is None else order):
        stage = stages[key]
        seconds = stage.est_seconds if price is None else price(stage)
        steps = max(stage.steps, 1)
        kids = children.get(key)
        if kids:
            below = max(memo[c] for c in kids)
            memo[key] = (seconds + below[0], steps + below[1])
        else:
            memo[key] = (seconds + 0.0, steps)  # as below (0.0, 0): the same float, bit for bit
    return memo


def descendants(tree: StageTree, order: list[StageKey] | None = None) -> dict[StageKey, int]:
    """Number of stages below each stage in ``tree`` (children, grandchildren, ...; the stage
    itself not counted): the "most child stages" measure of the thesis's THR policy (§6.3,
    HIPPO_SPEC §3.7). Linear in the number of stages."""
    count: dict[StageKey, int] = {}
    for key in reversed(top_down(tree) if order is None else order):
        count[key] = sum(1 + count[c] for c in tree.children.get(key, []))
    return count


def ready_stages(tree: StageTree) -> list[Stage]:
    """Stages that can start now (a fresh initialisation or an existing checkpoint), in key
    order. They are all roots of the tree: a stage whose weights come from another stage of
    the tree, or from one in flight, waits."""
    return [stage for stage in tree.roots() if stage.source in READY]


def critical_path(tree: StageTree, lengths: dict[StageKey, Length] | None = None) -> Path | None:
    """The longest path (estimated seconds, then steps) starting at a ready root stage, or None
    when nothing can start. Equal lengths go to the smaller stage key. ``lengths``:
    :func:`longest` of ``tree``, when the caller has it (the stage index ranked by it)."""
    if not tree.stages:
        return None
    if lengths is None:
        lengths = longest(tree)
    best = longest_ready_root(tree, lengths)
    if best is None:
        return None
    chain = [best]
    while True:
        kids = tree.children.get(chain[-1].key, [])
        if not kids:
            break
        nxt = kids[0]
        for k in kids[1:]:
            if lengths[k] > lengths[nxt]:
                nxt = k
        chain.append(tree.stages[nxt])
    return Path(tree.plan_key, tuple(chain), lengths[best.key][0], lengths[best.key][1])


def longest_ready_root(tree: StageTree, lengths: dict[StageKey, Length]) -> Stage | None:
    """The ready root stage with the largest ``lengths`` (:func:`longest`), equal lengths going
    to the smaller stage key; None when no root is ready."""
    best: Stage | None = None
    for root in tree.roots():
        if root.source in READY and (best is None or lengths[root.key] > lengths[best.key]):
            best = root
    return best
