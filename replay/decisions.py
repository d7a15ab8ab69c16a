"""Recomputing every recorded decision from the log prefix it records (DESIGN.md invariant 3).

A decision event records ``decided_at``, the offset of the last plan-stream event its decider
had folded. ``replay verify`` folds the log once; after each offset that some decision names it
asks that decision's decider again, on exactly that state and with the parameters the decision
records (policy, checkpoint budget), and compares what it gets with what was recorded, event by
event, in order. Deciders (one entry each in :data:`DECIDERS`):

* **dispatch** (``StageDispatched``): ``scheduler.decide.decide``;
* **eviction** (``CheckpointEvicted``): ``scheduler.eviction.evictions_for_dispatch``, the
  evictions decided together before a dispatch;
* **in-flight** (``PathPreempted``, ``CheckpointRequested``):
  ``scheduler.inflight.inflight_decisions``, the decisions about running paths of one pass.

A group recomputed at a prefix must match the recorded group completely: a decision edited,
dropped, added or moved is named by its offset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from events.codec import InvalidEvent, decode
from events.log import Record
from events.models import CheckpointEvicted, CheckpointRequested, Event, PathPreempted, StageDispatched
from projections.state import State
from scheduler.decide import decide
from scheduler.eviction import evictions_for_dispatch
from scheduler.inflight import inflight_decisions

Params = tuple[Any, ...]


@dataclass(frozen=True)
class Decider:
    """One kind of decision: its event types, what its recomputation needs beyond the state (read
    from the recorded event), the recomputation, and a one-line description of a decision."""

    name: str
    types: tuple[type[Event], ...]
    params: Callable[[Any], Params]
    recompute: Callable[[State, Params], list[Event]]
    describe: Callable[[Any], str]


def _dispatch(state: State, params: Params) -> list[Event]:
    decision = decide(state, params[0])
    return [] if decision is None else [decision]


def _describe_dispatch(e: StageDispatched) -> str:
    return (f"{e.dispatch_id} to {e.worker_id}: {[(s.node_id, s.from_step, s.to_step) for s in e.stages]} "
            f"with policy {e.policy!r}")


def _describe_eviction(e: CheckpointEvicted) -> str:
    return f"evict {e.node_id}@{e.step} ({e.ref[:12]}, {e.size} bytes): {e.reason}"


def _describe_inflight(e: PathPreempted | CheckpointRequested) -> str:
    if isinstance(e, PathPreempted):
        return f"preempt {e.dispatch_id} until {(e.until_stage, e.until_step)}: {e.reason}"
    return f"save {e.node_id}@{e.step} in {e.dispatch_id}" + (" and evaluate" if e.evaluate else "")


DECIDERS: tuple[Decider, ...] = (
    Decider("dispatch", (StageDispatched,), lambda e: (e.policy,), _dispatch, _describe_dispatch),
    Decider("eviction", (CheckpointEvicted,), lambda e: (e.checkpoint_budget, e.policy),
            lambda state, p: list(evictions_for_dispatch(state, p[0], p[1])), _describe_eviction),
    Decider("in-flight", (PathPreempted, CheckpointRequested), lambda e: (e.checkpoint_budget,),
            lambda state, p: inflight_decisions(state, p[0]), _describe_inflight),
)
_BY_TYPE = {t: d for d in DECIDERS for t in d.types}
_MARKERS = tuple(f'"{t.type}"'.encode() for t in _BY_TYPE)


def same_decision(a: Event, b: Event) -> bool:
    """Whether two decision events carry the same decision (header fields ignored)."""
    return type(a) is type(b) and a.payload() == b.payload()


@dataclass
class Mismatch:
    """A recorded decision that is not what its decider computes from its prefix."""

    offset: int | None
    event: str | None
    detail: str


@dataclass
class DecisionCheck:
    """Recomputes the decisions of a plan stream while it is folded: build it over the records
    (it notes which prefixes to stop at), pass :meth:`after` and :meth:`on_event` to the fold,
    then :meth:`finish`. ``checked`` counts the decisions compared, per decider."""

    records: Iterable[Record]
    wanted: dict[int, set[tuple[str, Params]]] = field(default_factory=dict)
    expected: dict[tuple[int, str, Params], list[Event]] = field(default_factory=dict)
    seen: dict[tuple[int, str, Params], int] = field(default_factory=dict)
    where: dict[tuple[int, str, Params], int] = field(default_factory=dict)
    checked: dict[str, int] = field(default_factory=dict)
    mismatch: Mismatch | None = None

    def __post_init__(self) -> None:
        for r in self.records:
            if not any(m in r.value for m in _MARKERS):
                continue
            try:
                event = decode(r.value)
            except InvalidEvent:
                continue
            decider = _BY_TYPE.get(type(event))
            if decider is not None:
                key = (decider.name, decider.params(event))
                self.wanted.setdefault(event.decided_at, set()).add(key)  # type: ignore[attr-defined]

    def after(self, offset: int, state: State) -> None:
        for name, params in sorted(self.wanted.get(offset, ()), key=repr):
            decider = next(d for d in DECIDERS if d.name == name)
            self.expected[(offset, name, params)] = decider.recompute(state, params)

    def on_event(self, record: Record, event: Event) -> None:
        decider = _BY_TYPE.get(type(event))
        if decider is None or self.mismatch is not None:
            return
        prefix = event.decided_at  # type: ignore[attr-defined]
        key = (prefix, decider.name, decider.params(event))
        self.checked[decider.name] = self.checked.get(decider.name, 0) + 1
        if key not in self.expected:
            self.mismatch = Mismatch(record.offset, event.type,
                                     f"decided at offset {prefix}, which is not before it")
            return
        index = self.seen.get(key, 0)
        self.seen[key] = index + 1
        self.where.setdefault(key, record.offset)
        expected = self.expected[key]
        again = expected[index] if index < len(expected) else None
        if again is None or not same_decision(again, event):
            what = "nothing more" if again is None else decider.describe(again)
            self.mismatch = Mismatch(record.offset, event.type,
                                     f"recorded {decider.describe(event)}; the {decider.name} decider computes {what} "
                                     f"from the prefix up to offset {prefix} (decision {index + 1} of that prefix)")

    def finish(self) -> Mismatch | None:
        """The first mismatch, including recorded groups shorter than what is recomputed (a
        decision dropped from the log)."""
        if self.mismatch is not None:
            return self.mismatch
        for key, expected in sorted(self.expected.items(), key=lambda kv: kv[0][0]):
            got = self.seen.get(key, 0)
            if got < len(expected):
                prefix, name, _ = key
                decider = next(d for d in DECIDERS if d.name == name)
                return Mismatch(self.where.get(key), None,
                                f"the {name} decider computes {len(expected)} decisions from the prefix up to offset "
                                f"{prefix}, the log records {got}; missing: {decider.describe(expected[got])}")
        return None
