"""Placing a trial in a search plan (Hippo §3.2 / thesis §4.2.1), and counting unique steps.

A trial is a hyper-parameter configuration (functions of the global step) and a target step.
Walking from a root, the trial follows a node as long as every hyper-parameter has the same
value as under that node; at the first step where a value differs it follows the child that
starts at that step with matching values, or a new child is appended there. Nodes are never
split: a shorter shared stage (A3 in the papers' Fig. 5) is only a new request step or a new
child edge. Two trials therefore share exactly the steps before their first divergence, the
sharing rule of DESIGN.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from events.hp import HPConfig, first_divergence, value_key
from projections.queries import unique_steps
from projections.state import Node, Plan


@dataclass(frozen=True)
class Placement:
    """Where a trial ends: an existing ``node_id``, or a new node under ``parent_id`` (None: a
    new root) starting at ``start_step``."""

    node_id: str | None
    parent_id: str | None = None
    start_step: int = 0


_CHILDREN = "search_plan.children"
"""Key of the child index in :attr:`Plan.cache`: parent node id (None: the roots) -> ``[children indexed, {(start
step, values at start) -> first such child}]``, or None for a parent whose children cannot all
be indexed (a value overflows)."""

Values = tuple[tuple[str, tuple[object, ...]], ...]

_DIVERGENCE = "search_plan.divergence"
"""Key of the divergence memo in :attr:`Plan.cache`: ``(node id, start step, configuration) ->
(step, diverged)``: ``first_divergence(node.hp, configuration, start step, stop)`` is ``step``
for every stop above it when ``diverged``, else nothing diverges before ``step``."""
_VALUES = "search_plan.values"
"""Key of the memo of :func:`_values_at` in :attr:`Plan.cache`: ``(configuration, step) -> values``."""
_PATHS = "search_plan.paths"
"""Key of the path memo in :attr:`Plan.cache`: ``configuration -> id of the deepest node a
placement of it reached``. A placement with more steps than that node's start step walks the
same path down to it (see :func:`place`), so it starts there instead of at the root."""
_MEMO_LIMIT = 1 << 16
"""Entries a memo keeps before it is dropped and started again (it is only a cache)."""

Config = tuple[tuple[str, bytes], ...]
"""A configuration as a hashable key: ``(name, canonical JSON of the sequence)`` sorted by name
(sequences are equal exactly when their canonical JSON is, :attr:`events.hp.HPFunction.canonical`;
bytes keep their hash, so a key is hashed without calling back into the sequences)."""


def _memo(plan: Plan, name: str) -> dict[Any, Any]:
    memo = plan.cache.get(name)
    if memo is None or len(memo) >= _MEMO_LIMIT:
        memo = plan.cache[name] = {}
    return memo


def _divergence(plan: Plan, node: Node, hp: HPConfig, config: Config, start: int, stop: int) -> int:
    """``first_divergence(node.hp, hp, start, stop)``, memoised per (node, start, configuration)
    in ``plan.cache``: a trial extended by successive requests walks the same path again, and
    only the steps past what was scanned before are scanned (a node's configuration never
    changes). Raises ValueError as :func:`events.hp.first_divergence`."""
    memo = _memo(plan, _DIVERGENCE)
    key = (node.node_id, start, config)
    entry = memo.get(key)
    scan_from = start
    if entry is not None:
        step, diverged = entry
        if diverged or stop <= step:
            return min(step, stop)
        scan_from = max(step, start)
    d = first_divergence(node.hp, hp, scan_from, stop)
    memo[key] = (d, d < stop)
    return d


def _values_memo(plan: Plan, hp: HPConfig, config: Config, step: int) -> Values | None:
    """:func:`_values_at`, memoised per (configuration, step) in ``plan.cache``."""
    memo = _memo(plan, _VALUES)
    key = (config, step)
    if key not in memo:
        memo[key] = _values_at(hp, step)
    values: Values | None = memo[key]
    return values


def _values_at(hp: HPConfig, step: int) -> Values | None:
    """``(name, value_key(value at step))`` for every hyper-parameter, sorted by name, so two
    configurations get equal keys exactly when their values are the same (:func:`events.hp.same_value`:
    32 and 32.0 are not); None when a value cannot be computed (an exponential leaving the
    float range)."""
    try:
        return tuple((name, value_key(hp[name].value(step))) for name in sorted(hp))
    except ArithmeticError:
        return None


def _child_index(plan: Plan, node: Node | None) -> dict[tuple[int, Values], str] | None:
    """Children of ``node`` (None: the plan's roots) by (start step, values there), first child
    in ``children`` (``roots``) order winning, or None when some child's values cannot be computed.

    Kept in ``plan.cache`` and extended when children were appended since (children are
    append-only, so the count tells what is new); a plan rebuilt from its records starts
    with no index.
    """
    index = plan.cache.setdefault(_CHILDREN, {})
    owner = None if node is None else node.node_id
    children = plan.roots if node is None else node.children
    entry = index.get(owner)
    if entry is None or entry[0] > len(children):
        entry = index[owner] = [0, {}]
    if entry[1] is not None and entry[0] < len(children):
        by_values = entry[1]
        for child_id in children[entry[0]:]:
            child = plan.nodes[child_id]
            values = _values_at(child.hp, child.start_step)
            if values is None:
                by_values = None
                break
            by_values.setdefault((child.start_step, values), child_id)
        entry[0], entry[1] = len(children), by_values
    return entry[1]


def _root(plan: Plan, hp: HPConfig, config: Config, steps: int) -> Node | None:
    """The root that ``(hp, steps)`` starts under: the first root with the same values at step 0
    (looked up in the child index), or None."""
    roots = _child_index(plan, None) if plan.roots and steps > 0 else None
    values = _values_memo(plan, hp, config, 0) if roots is not None else None
    if roots is not None and values is not None:
        # Equal values at 0 <=> first_divergence(root.hp, hp, 0, steps) > 0 (as 0 < steps).
        root_id = roots.get((0, values))
        return plan.nodes[root_id] if root_id is not None else None
    for root_id in plan.roots:
        root = plan.nodes[root_id]
        if _divergence(plan, root, hp, config, 0, steps) > 0:
            return root
    return None


def place(plan: Plan, hp: HPConfig, steps: int) -> Placement:
    """Find the node serving ``(hp, steps)`` in ``plan``, or where a new one must be appended.

    Pure: the search plan is not modified (only the memos in ``plan.cache`` may grow).
    Cost: one divergence scan per node on the trial's path (memoised: a configuration placed
    again with more steps scans only the new steps, :func:`_divergence`, and starts at the
    deepest node an earlier placement of it reached, when it asks for more steps than that
    node's start step: a trial extended by successive requests does not walk its path from the
    root at each one); the root, and at each branch point the child that starts there, with the
    trial's values is looked up in an index (Hippo §3.2: the child edge ``(start, hp_config)``),
    so roots and siblings are not scanned.

    A configuration that names other hyper-parameters than a node shares nothing with it (it
    gets a root of its own); a study's trials all name the trainer's hyper-parameters
    (``stagetree.study.validate_config``), so within a plan they match.
    """
    config: Config = tuple(sorted((name, fn.canonical) for name, fn in hp.items()))
    paths = _memo(plan, _PATHS)
    reached = paths.get(config)
    current: Node | None = None
    if reached is not None and steps > plan.nodes[reached].start_step:
        current = plan.nodes[reached]
    else:
        current = _root(plan, hp, config, steps)
        if current is None:
            return Placement(None, None, 0)
    while True:
        # Every node visited is on the configuration's path: each placement with more steps than
        # its start step reaches it (the divergences above it are below its start step, and a
        # child once followed stays the first match, as children are only appended).
        if reached is None or current.depth > plan.nodes[reached].depth:
            paths[config] = reached = current.node_id
        d = _divergence(plan, current, hp, config, current.start_step, steps)
        if d >= steps:
            return Placement(current.node_id)
        follow = None
        index = _child_index(plan, current) if current.children else None
        values = _values_memo(plan, hp, config, d) if index is not None else None
        if index is not None and values is not None:
            # Equal values at d <=> first_divergence(child.hp, hp, d, steps) > d (as d < steps).
            child_id = index.get((d, values))
            follow = plan.nodes[child_id] if child_id is not None else None
        elif current.children:
            for child_id in current.children:
                child = plan.nodes[child_id]
                if child.start_step == d and first_divergence(child.hp, hp, d, steps) > d:
                    follow = child
                    break
        if follow is None:
            return Placement(None, current.node_id, d)
        current = follow


def add_node(plan: Plan, placement: Placement, hp: HPConfig) -> Node:
    """Append the node described by ``placement`` (with ``node_id`` None) and return it."""
    parent = plan.nodes[placement.parent_id] if placement.parent_id is not None else None
    node = Node(
        node_id=plan.new_node_id(),
        plan_key=plan.plan_key,
        parent_id=placement.parent_id,
        start_step=placement.start_step,
        depth=parent.depth + 1 if parent else 0,
        hp=dict(hp),
    )
    plan.nodes[node.node_id] = node
    if parent is None:
        plan.roots.append(node.node_id)
    else:
        parent.children.append(node.node_id)
    return node


def insert(plan: Plan, hp: HPConfig, steps: int) -> Node:
    """Place ``(hp, steps)``, appending a node if needed; returns the serving node."""
    placement = place(plan, hp, steps)
    if placement.node_id is not None:
        return plan.nodes[placement.node_id]
    return add_node(plan, placement, hp)


def merged_unique_steps(trials: list[tuple[HPConfig, int]]) -> int:
    """Unique steps of ``(hp, steps)`` trials if they were all merged in one plan.

    This is the denominator of the merge rate p = total steps / unique steps (Hippo §6.2),
    computed the same way whatever mode the study ran in.
    """
    plan = Plan(plan_key="scratch", seed=0)
    targets = [(insert(plan, hp, steps).node_id, steps) for hp, steps in trials]
    return unique_steps(plan, targets)
