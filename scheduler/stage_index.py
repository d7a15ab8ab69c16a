"""The stage tree kept between scheduling passes: a pass costs what changed, not the plan's size.

Hippo rebuilds the transient stage tree from the whole search plan at every pass (§3.4), which
makes a plan with n pending trials cost O(n) per dispatch. The tree is a union of independent
*components*, one per search-plan root: a stage's source is its own node, its parent or a
checkpoint on them, and its children are on its node or the node's children, so no stage links
two roots' trees. :class:`StageTreeIndex` keeps each component's stages
(:func:`~scheduler.stage_tree.build_stage_tree` restricted to the pending nodes under the root)
and rebuilds a component only when the reducer touched one of its nodes
(:attr:`projections.state.Plan.changed`). Each policy's best candidate over the components is
kept in heaps, so choosing is O(log components) plus the components whose ranking moves with
the plan's mean seconds per step:

* a component whose every stage is on a measured node has fixed estimates: its candidate is
  ranked once, when it is rebuilt;
* a component of one stage on an unmeasured node costs ``k x mean`` seconds for its ``k =
  max(steps, 1)``: for any mean >= 0 the product is strictly increasing in ``k`` (k is far below
  2^52), so these rank by ``k`` whatever the mean is, and only the best of them is priced;
* any other component with an unmeasured node is priced again when the mean moved.

The answer is the same, bit for bit, as the from-scratch computation on the whole tree
(``tests/test_scheduler_policies.py`` checks it after every event of random sequences): the
winning component's stages are those of the whole tree, priced with the same mean, and the
cross-component order is the whole tree's (longest first, equal lengths to the smaller stage key;
"bfs" and "most-children" as in ``scheduler.decide``).

The index also answers which steps the pending requests need per node (the read
``scheduler.inflight`` makes for preemption and in-flight splits) from per-node counts of the
pending nodes below, instead of walking every pending request's path.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from projections.state import Plan
from scheduler.critical_path import Length, descendants, longest, longest_ready_root, ready_stages, top_down
from scheduler.stage_tree import StageKey, StageTree, build_stage_tree, mean_sec_per_step

_INDEX = "stage_index"  # plan.cache key of the plan's StageTreeIndex

SortKey = tuple[float | int | StageKey, ...]
"""A candidate's place in a policy's order: the smallest wins (critical path: ``(-seconds,
-steps, stage key)``; bfs: ``(from_step, stage key)``; most-children: ``(-descendants,
from_step, stage key)``)."""


@dataclass
class _Component:
    """The stages answering the pending requests under one search-plan root.

    ``mean``: the seconds per step the stages of unmeasured nodes (``unmeasured``) were priced
    with; ``version``: unique per build (heap entries of an older build are stale)."""

    root: str
    version: int
    tree: StageTree
    mean: float
    unmeasured: frozenset[StageKey]
    priced: tuple[float, tuple[Length, StageKey] | None] | None = None  # (mean, best) of the last pricing
    lengths: dict[StageKey, Length] | None = None  # longest(tree) over its est_seconds, once computed

    def best_at(self, mean: float) -> tuple[Length, StageKey] | None:
        """The longest ready root's length and key with unmeasured stages priced at ``mean``."""
        if self.priced is None or self.priced[0] != mean:
            if self.unmeasured and mean != self.mean:
                unmeasured = self.unmeasured
                lengths = longest(self.tree, price=lambda s: max(s.steps, 1) * mean if s.key in unmeasured
                                  else s.est_seconds)
            else:
                lengths = self.lengths = longest(self.tree)
            root = longest_ready_root(self.tree, lengths)
            self.priced = (mean, None if root is None else (lengths[root.key], root.key))
        return self.priced[1]


@dataclass
class _Ranking:
    """One policy's candidates over the components (see the module docstring)."""

    policy: str
    fixed: list[tuple[SortKey, int, str]] = field(default_factory=list)  # heap: (sort key, version, root)
    by_steps: list[tuple[tuple[int, StageKey], int, str]] = field(default_factory=list)  # heap: ((-k, key), ...)
    priced: set[str] = field(default_factory=set)  # roots of components priced at every new mean
    live: dict[str, int] = field(default_factory=dict)  # root -> version of its entry in a heap

    def put(self, comp: _Component) -> None:
        self.drop(comp.root)
        tree = comp.tree
        ready = ready_stages(tree)
        if not ready:
            return
        if self.policy == "bfs":
            stage = min(ready, key=lambda s: (s.from_step, s.key))
            self._push(self.fixed, (stage.from_step, stage.key), comp)
        elif self.policy == "most-children":
            count = descendants(tree, top_down(tree))
            stage = min(ready, key=lambda s: (-count[s.key], s.from_step, s.key))
            self._push(self.fixed, (-count[stage.key], stage.from_step, stage.key), comp)
        elif not comp.unmeasured:
            best = comp.best_at(comp.mean)
            assert best is not None
            (seconds, steps), key = best
            self._push(self.fixed, (-seconds, -steps, key), comp)
        elif len(tree.stages) == 1:
            (stage,) = tree.stages.values()
            self._push(self.by_steps, (-max(stage.steps, 1), stage.key), comp)
        else:
            self.priced.add(comp.root)

    def _push(self, heap: list, key: tuple, comp: _Component) -> None:  # type: ignore[type-arg]
        heapq.heappush(heap, (key, comp.version, comp.root))
        self.live[comp.root] = comp.version
        if len(heap) > 64 and len(heap) > 2 * len(self.live):  # stale entries pile up: compact
            heap[:] = [e for e in heap if self.live.get(e[2]) == e[1]]
            heapq.heapify(heap)

    def drop(self, root: str) -> None:
        self.live.pop(root, None)
        self.priced.discard(root)

    def _top(self, heap: list) -> tuple | None:  # type: ignore[type-arg]
        while heap and self.live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def best(self, components: dict[str, _Component], mean: float) -> str | None:
        """The root of the component holding the policy's choice, or None."""
        candidates: list[tuple[SortKey, str]] = []
        top = self._top(self.fixed)
        if top is not None:
            candidates.append((top[0], top[2]))
        top = self._top(self.by_steps)
        if top is not None:
            (minus_k, key), _, root = top
            candidates.append(((-(-minus_k * mean + 0.0), minus_k, key), root))
        for root in self.priced:
            best = components[root].best_at(mean)
            if best is not None:
                (seconds, steps), key = best
                candidates.append(((-seconds, -steps, key), root))
        return min(candidates)[1] if candidates else None


class Needs(Mapping[str, tuple[int, int]]):
    """``node_id -> (start, end)``: the steps of each node the plan's pending requests (waiters,
    no metrics yet) need trained, ``end`` being the largest step any of them trains on or below
    the node; the same mapping as :func:`projections.queries.needed` over the pending requests,
    read from the index (a node's children, not the requests' paths)."""

    def __init__(self, index: StageTreeIndex) -> None:
        self._index = index

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, str) and self._index.below.get(node_id, 0) > 0

    def __getitem__(self, node_id: str) -> tuple[int, int]:
        index = self._index
        if index.below.get(node_id, 0) <= 0:
            raise KeyError(node_id)
        node = index.plan.nodes[node_id]
        end = index.pending.get(node_id, -1)
        for child_id in node.children:
            if index.below.get(child_id, 0) > 0:
                end = max(end, index.plan.nodes[child_id].start_step)
        return node.start_step, end

    def __iter__(self) -> Iterator[str]:
        return (node_id for node_id in self._index.plan.nodes if node_id in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class StageTreeIndex:
    """The components of ``plan``'s stage tree and the pending requests per node, kept up to
    date from :attr:`Plan.changed` (see the module docstring). Get it with :func:`index_of`."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        plan.changed.clear()
        self._root_of: dict[str, str] = {}
        self.pending: dict[str, int] = {}  # node id -> largest pending step on it
        self.below: dict[str, int] = {}  # node id -> nodes with pending requests in its subtree (itself included)
        self._pending_under: dict[str, set[str]] = {}  # root id -> its nodes with pending requests
        self.components: dict[str, _Component] = {}
        self._dirty: set[str] = set(plan.roots)
        self._rankings: dict[str, _Ranking] = {}
        self._version = 0
        self._ckpt_steps: dict[str, list[int]] = {}  # node id -> sorted checkpoint steps (dropped when it changes)
        for node_id in plan.nodes:
            self._note(node_id)

    def _root(self, node_id: str) -> str:
        root = self._root_of.get(node_id)
        if root is None:
            parent = self.plan.nodes[node_id].parent_id
            root = self._root_of[node_id] = node_id if parent is None else self._root(parent)
        return root

    def _note(self, node_id: str) -> None:
        """Re-read ``node_id``'s pending requests; its component is rebuilt at the next choice."""
        node = self.plan.nodes[node_id]
        root = self._root(node_id)
        self._dirty.add(root)
        self._ckpt_steps.pop(node_id, None)
        steps = [s for s, waiters in node.requests.items() if waiters and s not in node.metrics]
        had = node_id in self.pending
        if steps:
            self.pending[node_id] = max(steps)
        else:
            self.pending.pop(node_id, None)
        if had != bool(steps):
            under = self._pending_under.setdefault(root, set())
            if steps:
                under.add(node_id)
            else:
                under.discard(node_id)
            delta = 1 if steps else -1
            current: str | None = node_id
            while current is not None:
                self.below[current] = self.below.get(current, 0) + delta
                current = self.plan.nodes[current].parent_id

    def sync(self) -> None:
        """Read what the reducer touched since the last call."""
        if self.plan.changed:
            changed, self.plan.changed = self.plan.changed, set()
            for node_id in changed:
                self._note(node_id)

    def needs(self) -> Needs:
        """What the pending requests need per node (:class:`Needs`), as of now."""
        self.sync()
        return Needs(self)

    def choose(self, policy: str, fallback: float) -> tuple[StageTree, dict[StageKey, Length] | None] | None:
        """The stage tree of the component holding ``policy``'s choice, its stages priced as the
        whole tree's would be (``fallback``: seconds per step of a plan with no measurement), and
        :func:`~scheduler.critical_path.longest` of it when the ranking computed that already;
        None when nothing is ready."""
        self.sync()
        mean = mean_sec_per_step(self.plan, fallback)
        if self._dirty:
            for root in sorted(self._dirty):
                self._build(root, fallback, mean)
            self._dirty.clear()
        ranking = self._rankings.get(policy)
        if ranking is None:
            ranking = self._rankings[policy] = _Ranking(policy)
            for comp in self.components.values():
                ranking.put(comp)
        best = ranking.best(self.components, mean)
        if best is None:
            return None
        comp = self.components[best]
        if comp.unmeasured and comp.mean != mean:  # priced at an older mean: the same stages, priced now
            comp.tree, comp.mean, comp.lengths = self._tree(best, fallback), mean, None
        return comp.tree, comp.lengths

    def _tree(self, root: str, fallback: float) -> StageTree:
        return build_stage_tree(self.plan, fallback, sorted(self._pending_under.get(root, ())), self._ckpt_steps)

    def _build(self, root: str, fallback: float, mean: float) -> None:
        if not self._pending_under.get(root):
            self.components.pop(root, None)
            for ranking in self._rankings.values():
                ranking.drop(root)
            return
        tree = self._tree(root, fallback)
        nodes = self.plan.nodes
        unmeasured = frozenset(key for key in tree.stages if nodes[key[0]].sec_per_step() is None)
        self._version += 1
        comp = self.components[root] = _Component(root, self._version, tree, mean, unmeasured)
        for ranking in self._rankings.values():
            ranking.put(comp)


def index_of(plan: Plan) -> StageTreeIndex:
    """The plan's :class:`StageTreeIndex`, kept in ``plan.cache`` (a plan rebuilt from its
    records, or whose cache was cleared, starts a new one from all its nodes)."""
    index = plan.cache.get(_INDEX)
    if index is None:
        index = plan.cache[_INDEX] = StageTreeIndex(plan)
    return index
