"""Critical paths through a stage tree (Hippo §4.3, thesis §4.3.1).

The critical path is the root-to-leaf chain of stages with the largest estimated time
(steps x seconds per step). A whole path goes to one idle worker as one batch, so consecutive
stages keep their weights in memory. Only paths whose first stage can start now are
candidates: its source checkpoint exists, or it starts from a fresh initialisation; stages
hanging off in-flight work wait until the checkpoint they need is saved.

Ties are broken by stage key order, so the choice is a deterministic function of the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.stage_tree import Stage, StageKey, StageTree

READY = ("fresh", "ckpt")


@dataclass(frozen=True)
class Path:
    """A chain of stages, first to last, and its estimated time in seconds."""

    plan_key: str
    stages: tuple[Stage, ...]
    est_seconds: float


def _longest(tree: StageTree) -> dict[StageKey, float]:
    """Longest estimated time from each stage down to a leaf (the stage included)."""
    memo: dict[StageKey, float] = {}
    # Deepest stages first, so every child is known before its parent (no recursion).
    for key in sorted(tree.stages, key=lambda k: _depth(tree, k), reverse=True):
        below = [memo[c] for c in tree.children.get(key, [])]
        memo[key] = tree.stages[key].est_seconds + (max(below) if below else 0.0)
    return memo


def _depth(tree: StageTree, key: StageKey) -> int:
    depth = 0
    parent = tree.stages[key].parent
    while parent is not None:
        depth += 1
        parent = tree.stages[parent].parent
    return depth


def critical_path(tree: StageTree) -> Path | None:
    """The longest path starting at a ready root stage, or None when nothing can start."""
    if not tree.stages:
        return None
    longest = _longest(tree)
    best: Stage | None = None
    for root in tree.roots():
        if root.source in READY and (best is None or longest[root.key] > longest[best.key]):
            best = root
    if best is None:
        return None
    chain = [best]
    while True:
        kids = tree.children.get(chain[-1].key, [])
        if not kids:
            break
        nxt = kids[0]
        for k in kids[1:]:
            if longest[k] > longest[nxt]:
                nxt = k
        chain.append(tree.stages[nxt])
    return Path(tree.plan_key, tuple(chain), longest[best.key])
