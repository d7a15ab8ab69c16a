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
dropped, added or moved is named by its offset. Each decision records the version of its
decider's rules (``rules``): one other than this stagetree's is named as such (verify that log
with a stagetree of those rules), and a mismatch of a decision that records none (a log written
before the field) says that it may be a change of rules rather than an edit.

Tuner decisions (``TunerDecided``) are recomputed by :mod:`replay.tuner` instead: their decider
is the study file's tuner, run again over the log (``replay verify --study``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from events.codec import InvalidEvent, decode
from events.log import Record
from events.models import (
    HEADER_FIELDS,
    CheckpointEvicted,
    CheckpointRequested,
    DecisionEvent,
    Event,
    PathPreempted,
    StageDispatched,
    WorkerLost,
)
from projections.partitions import merge
from projections.state import State
from projections.store import READ_BATCH
from scheduler import decide as dispatch_rules
from scheduler import eviction as eviction_rules
from scheduler import inflight as inflight_rules
from scheduler.decide import decide
from scheduler.eviction import evictions_for_dispatch
from scheduler.inflight import inflight_decisions

Params = tuple[Any, ...]


@dataclass(frozen=True)
class Decider:
    """One kind of decision: its event types, what its recomputation needs beyond the state (read
    from the recorded event), the recomputation, a one-line description of a decision, and the
    version of its rules in this stagetree (None: it follows none, as WorkerLost)."""

    name: str
    types: tuple[type[Event], ...]
    params: Callable[[Any], Params]
    recompute: Callable[[State, Params], list[Event]]
    describe: Callable[[Any], str]
    rules: int | None = None

    def other_rules(self, event: DecisionEvent) -> str | None:
        """Why ``event`` cannot be recomputed here: it records other rules than this
        stagetree's (None: the same, or none recorded)."""
        if event.rules is None or event.rules == self.rules:
            return None
        return (f"decided by the {self.name} decider's rules {event.rules}; this stagetree decides by rules "
                f"{self.rules}: verify the log with a stagetree of those rules (a change of rules, not an edit)")

    def hint(self, event: DecisionEvent) -> str:
        """What a mismatch of ``event`` may be besides an edit: a decision that records no rules
        (a log written before the field) may have been decided by older rules."""
        if event.rules is not None or self.rules is None:
            return ""
        return (f" (the decision records no rules version: if the log predates 2026-11-28, it may have been "
                f"decided by older {self.name} rules, not edited)")


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
    Decider("dispatch", (StageDispatched,), lambda e: (e.policy,), _dispatch, _describe_dispatch,
            dispatch_rules.RULES),
    Decider("eviction", (CheckpointEvicted,), lambda e: (e.checkpoint_budget, e.policy),
            lambda state, p: list(evictions_for_dispatch(state, p[0], p[1])), _describe_eviction,
            eviction_rules.RULES),
    Decider("in-flight", (PathPreempted, CheckpointRequested), lambda e: (e.checkpoint_budget,),
            lambda state, p: inflight_decisions(state, p[0]), _describe_inflight, inflight_rules.RULES),
)
_BY_TYPE = {t: d for d in DECIDERS for t in d.types}
_MARKERS = tuple(f'"{t.type}"'.encode() for t in _BY_TYPE)
_MAY_DECIDE = re.compile(b"|".join(re.escape(m) for m in _MARKERS))
"""Finds any of :data:`_MARKERS` in a record's bytes (one scan, not one per marker): a record
without one holds no decision of :data:`DECIDERS` and is not decoded by the first pass."""
_MAY_DECIDE_PARTITIONED = re.compile(b"|".join(re.escape(m) for m in (*_MARKERS, b'"WorkerLost"')))


def same_decision(a: Event, b: Event) -> bool:
    """Whether two decision events carry the same decision: of one type, with equal fields but
    the header's (:data:`events.models.HEADER_FIELDS`) and ``rules`` (checked apart, by
    :meth:`Decider.other_rules`: a decision that records none compares with its recomputation);
    nested models compare by value, as their payloads would (without serializing them)."""
    if type(a) is not type(b):
        return False
    mine, theirs = a.__dict__, b.__dict__
    return all(value == theirs[name] for name, value in mine.items() if name not in _NOT_COMPARED)


_NOT_COMPARED = frozenset((*HEADER_FIELDS, "rules"))


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
    matched: dict[tuple[int, str, Params], int] = field(default_factory=dict)
    """Groups recorded in full: their size (their recomputed events are dropped)."""
    checked: dict[str, int] = field(default_factory=dict)
    mismatch: Mismatch | None = None

    def __post_init__(self) -> None:
        for r in self.records:
            if _MAY_DECIDE.search(r.value) is None:
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
        for name, params in sorted(self.wanted.pop(offset, ()), key=repr):
            decider = next(d for d in DECIDERS if d.name == name)
            self.expected[(offset, name, params)] = decider.recompute(state, params)

    def on_event(self, record: Record, event: Event) -> None:
        decider = _BY_TYPE.get(type(event))
        if decider is None or self.mismatch is not None:
            return
        prefix = event.decided_at  # type: ignore[attr-defined]
        key = (prefix, decider.name, decider.params(event))
        self.checked[decider.name] = self.checked.get(decider.name, 0) + 1
        if key not in self.expected and key not in self.matched:
            self.mismatch = Mismatch(record.offset, event.type,
                                     f"decided at offset {prefix}, which is not before it")
            return
        expected = self.expected.get(key, [])
        index = self.seen.get(key, self.matched.get(key, 0))
        self.seen[key] = index + 1
        self.where.setdefault(key, record.offset)
        again = expected[index] if index < len(expected) else None
        other = decider.other_rules(event)  # type: ignore[arg-type]
        if other is not None:
            self.mismatch = Mismatch(record.offset, event.type, other)
        elif again is None or not same_decision(again, event):
            what = "nothing more" if again is None else decider.describe(again)
            self.mismatch = Mismatch(record.offset, event.type,
                                     f"recorded {decider.describe(event)}; the {decider.name} decider computes {what} "
                                     f"from the prefix up to offset {prefix} (decision {index + 1} of that prefix)"
                                     + decider.hint(event))  # type: ignore[arg-type]
        elif index + 1 == len(expected):  # the group is complete: keep its size only
            self.matched[key] = len(self.expected.pop(key))
            del self.seen[key], self.where[key]

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


# ----------------------------------------------------------------------------- partitioned streams


def _check_worker_lost(state: State, params: Params) -> list[Event]:
    """A WorkerLost ``serve`` decided (a heartbeat timeout, a clock: not recomputable) is checked
    instead: the worker it names was alive in its prefix."""
    worker_id, reason = params
    worker = state.workers.get(worker_id)
    if worker is None or not worker.alive:
        return []
    return [WorkerLost(worker_id=worker_id, reason=reason, decided_at=state.offset)]


LIVENESS = Decider("liveness", (WorkerLost,), lambda e: (e.worker_id, e.reason), _check_worker_lost,
                   lambda e: f"{e.worker_id} lost: {e.reason}")
"""Checked only where a WorkerLost records a partitioned prefix (``stagetree serve``'s); a
worker's own goodbye and the embedded coordinator's record none."""


def prefix_of(event: DecisionEvent) -> dict[int, int] | None:
    """The prefix a decision recorded on a partitioned stream, ``{partition: last folded
    offset}``; None when it records none."""
    return None if event.decided_at_partitions is None else dict(event.decided_at_partitions)


def replay_partitioned(parts: Mapping[int, Iterable[Record]], fold: Callable[[State, list[Record]], object]
                       ) -> tuple[Mismatch | None, dict[str, int], dict[int, State]]:
    """Recompute the decisions of a partitioned plan stream (``parts``: each partition's
    records in offset order, iterable twice: a first pass notes the decisions, the second folds
    in batches of at most :data:`projections.store.READ_BATCH` records): ``(first mismatch,
    decisions checked per decider, each partition's final state)``. ``fold(state, records)``
    folds records into a partition's state (the one fold, with the caller's hooks).

    A decision records the offset of every partition's last folded record
    (``decided_at_partitions``). The decisions of one decider at one prefix form a group,
    recomputed once from the merged view of the partitions folded to exactly those offsets
    (:func:`projections.partitions.merge`) and compared with the recorded group as a whole
    (recorded across partitions, so without an order). Groups are visited in the order of their
    prefixes and each partition's fold only moves forward: a prefix behind one visited before
    (two deciders at once, or one that had not folded its predecessor's decisions) is a
    mismatch too.
    """
    groups: dict[tuple[tuple[tuple[int, int], ...], str, Params], list[tuple[_At, Event]]] = {}
    mismatch: Mismatch | None = None
    for records in parts.values():
        for r in records:
            if _MAY_DECIDE_PARTITIONED.search(r.value) is None:
                continue
            try:
                event = decode(r.value)
            except InvalidEvent:
                continue
            decider = LIVENESS if isinstance(event, WorkerLost) else _BY_TYPE.get(type(event))
            if decider is None or not isinstance(event, DecisionEvent):
                continue
            prefix = prefix_of(event)
            if prefix is None:
                if decider is not LIVENESS:
                    mismatch = mismatch or Mismatch(r.offset, event.type, f"partition {r.partition}: the decision "
                                                                          "records no prefix of every partition")
                continue
            key = (tuple(sorted(prefix.items())), decider.name, decider.params(event))
            groups.setdefault(key, []).append((_At(r.partition, r.offset), event))
    states = {p: State() for p in parts}
    readers = {p: iter(records) for p, records in parts.items()}
    ahead: dict[int, Record] = {}  # per partition, the record read past the last prefix folded to

    def advance(partition: int, upto: int) -> None:
        state, reader = states.setdefault(partition, State()), readers.get(partition)
        batch: list[Record] = []
        while reader is not None:
            r = ahead.pop(partition, None) or next(reader, None)
            if r is None:
                readers.pop(partition)
                break
            if r.offset > upto:
                ahead[partition] = r
                break
            batch.append(r)
            if len(batch) == READ_BATCH:
                fold(state, batch)
                batch = []
        if batch:
            fold(state, batch)

    checked: dict[str, int] = {}
    for key in sorted(groups, key=lambda k: (sum(o for _, o in k[0]), k[0], k[1], repr(k[2]))):
        if mismatch is not None:
            break
        prefix, name, params = dict(key[0]), key[1], key[2]
        copies = sorted(groups.pop(key), key=lambda x: (x[0].partition, x[0].offset))
        late = [rec for rec, _ in copies if prefix.get(rec.partition, -1) >= rec.offset]
        # a broadcast decision (WorkerLost) is one event with a copy in every partition
        recorded: list[tuple[_At, Event]] = []
        for rec, e in copies:
            if all(e.event_id != other.event_id for _, other in recorded):
                recorded.append((rec, e))
        at, first = recorded[0]
        checked[name] = checked.get(name, 0) + len(recorded)
        if late:
            mismatch = Mismatch(late[0].offset, first.type, f"decided at offset {prefix.get(late[0].partition)} of "
                                                            f"partition {late[0].partition}, which is not before it")
            break
        behind = [p for p, o in prefix.items() if states.setdefault(p, State()).offset > o]
        if behind:
            mismatch = Mismatch(at.offset, first.type, f"its prefix {_text(prefix)} is behind a decision checked "
                                                      f"before it in partition {behind[0]} (two deciders at once?)")
            break
        decider = LIVENESS if name == LIVENESS.name else next(d for d in DECIDERS if d.name == name)
        other = next((why for r, e in recorded if (why := decider.other_rules(e)) is not None), None)  # type: ignore
        if other is not None:
            mismatch = Mismatch(at.offset, first.type, other)
            break
        for p, o in prefix.items():
            advance(p, o)
        view = merge({p: states[p] for p in sorted(set(states) | set(prefix))})
        again = [e.model_copy(update={"decided_at_partitions": dict(prefix)})
                 for e in decider.recompute(view, params)]
        want = sorted(_compared(e) for e in again)
        got = sorted(_compared(e) for _, e in recorded)
        if got != want:
            what = "nothing" if not again else "; ".join(decider.describe(e) for e in again)
            mismatch = Mismatch(at.offset, first.type,
                                f"recorded {'; '.join(decider.describe(e) for _, e in recorded)}; the {name} decider "
                                f"computes {what} from the prefix {_text(prefix)}" + decider.hint(first))  # type: ignore
    for p in parts:
        advance(p, 2**63)  # the rest of every partition
    return mismatch, checked, states


@dataclass(frozen=True)
class _At:
    """Where a recorded decision is (its record's bytes are not kept)."""

    partition: int
    offset: int


def _compared(event: Event) -> str:
    """A decision's payload as compared without an order (every field :func:`same_decision`
    compares)."""
    return repr(sorted((k, v) for k, v in event.payload().items() if k not in _NOT_COMPARED))


def _text(prefix: dict[int, int]) -> str:
    return "at offsets " + ", ".join(f"{p}:{o}" for p, o in sorted(prefix.items()))
