"""Projection persistence in RocksDB, and the projector that folds the plan stream into it.

The store keeps one record per object (plan, node, trial, worker, dispatch, study) as
canonical JSON, and the consumed offset under ``meta``; every fold commits the touched records
*and* the offset in one WriteBatch, so state and offset never disagree (STYLE_ANCHORS §6.3).
After a crash the projector resumes at stored offset + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from opentelemetry.trace import SpanKind

from events import topics, tracing
from events.codec import InvalidEvent, decode, encode
from events.log import EventLog, Record, chain_next
from events.models import DeadLettered, Event
from projections.reducer import Key, Rejected, apply
from projections.state import Dispatch, Node, Plan, State, Stats, Trial, Worker


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


SEP = "\x1f"  # record key separator: plan keys and ids may contain "/"


def _db_key(key: Key) -> bytes:
    return SEP.join(key).encode()


def record_of(state: State, key: Key) -> bytes | None:
    """The canonical bytes of the object named by ``key``, or None when it does not exist."""
    kind = key[0]
    if kind == "meta":
        return _dumps({"offset": state.offset, "chain": state.chain})
    if kind == "stats":
        return _dumps(state.stats.to_json())
    if kind == "seen":
        return b"1" if key[1] in state.seen else None
    if kind == "rejected":
        reason = state.rejected.get(int(key[1]))
        return None if reason is None else _dumps(reason)
    if kind == "plan":
        plan = state.plans.get(key[1])
        return None if plan is None else _dumps(plan.meta_json())
    if kind == "node":
        node = state.node(key[1], key[2])
        return None if node is None else _dumps(node.to_json())
    table: dict[str, Any] = {
        "trial": state.trials,
        "worker": state.workers,
        "dispatch": state.dispatches,
    }
    if kind in table:
        obj = table[kind].get(key[1])
        return None if obj is None else _dumps(obj.to_json())
    if kind == "study":
        study = state.studies.get(key[1])
        return None if study is None else _dumps(study)
    raise KeyError(key)


def all_keys(state: State) -> Iterator[Key]:
    """Every key of ``state``'s records."""
    yield ("meta",)
    yield ("stats",)
    for event_id in state.seen:
        yield ("seen", event_id)
    for offset in state.rejected:
        yield ("rejected", f"{offset:016d}")
    for plan in state.plans.values():
        yield ("plan", plan.plan_key)
        for node_id in plan.nodes:
            yield ("node", plan.plan_key, node_id)
    for kind, table in (("trial", state.trials), ("worker", state.workers), ("dispatch", state.dispatches), ("study", state.studies)):
        for ident in table:
            yield (kind, ident)


def snapshot(state: State) -> dict[bytes, bytes]:
    """All records of ``state`` as the store would hold them (for byte-for-byte comparisons)."""
    out = {}
    for key in all_keys(state):
        data = record_of(state, key)
        if data is not None:
            out[_db_key(key)] = data
    return out


def search_plan_records(state: State) -> dict[bytes, bytes]:
    """The search plans alone, canonical bytes per plan and node, without what depends on the
    run's timing and faults: measured seconds (profile, worker-seconds), steps executed (a stage
    retrained after a lost worker counts twice) and in-flight bookkeeping.

    Two runs of the same study, embedded or on Kafka, with any worker count, give equal
    records (DESIGN.md invariant 5).
    """
    out = {}
    for plan in state.plans.values():
        out[_db_key(("plan", plan.plan_key))] = _dumps({"plan_key": plan.plan_key, "seed": plan.seed,
                                                        "roots": plan.roots})
        for node in plan.nodes.values():
            record = node.to_json()
            for timing in ("profile_steps", "profile_seconds", "running"):
                del record[timing]
            out[_db_key(("node", plan.plan_key, node.node_id))] = _dumps(record)
    return out


class ProjectionStore:
    """The projection's RocksDB database (rocksdict, raw bytes).

    Args:
        path: database directory (created if absent).

    Only one process opens it for writing (the projector).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(str(self.path), opts)
        self._wopts = WriteOptions()
        self._wopts.sync = False  # the log is the source of truth; a lost tail is refolded

    def commit(self, state: State, touched: set[Key]) -> None:
        """Write the touched records and the offset of ``state`` atomically."""
        batch = WriteBatch(raw_mode=True)
        for key in touched | {("meta",), ("stats",)}:
            data = record_of(state, key)
            if data is None:
                batch.delete(_db_key(key))
            else:
                batch.put(_db_key(key), data)
        self._db.write(batch, self._wopts)

    def records(self) -> dict[bytes, bytes]:
        """Every stored record (key -> canonical bytes)."""
        return {bytes(k): bytes(v) for k, v in self._db.items()}

    def load(self) -> State:
        """Rebuild the in-memory state from the stored records (empty state if none)."""
        state = State()
        nodes: list[Node] = []
        for raw_key, raw in self._db.items():
            parts = bytes(raw_key).decode().split(SEP)
            kind, value = parts[0], orjson.loads(raw)
            if kind == "meta":
                state.offset = value["offset"]
                state.chain = value["chain"]
            elif kind == "stats":
                state.stats = Stats(**value)
            elif kind == "seen":
                state.seen.add(parts[1])
            elif kind == "rejected":
                state.rejected[int(parts[1])] = value
            elif kind == "plan":
                state.plans[value["plan_key"]] = Plan(value["plan_key"], value["seed"], list(value["roots"]),
                                                      executed_steps=value["executed_steps"],
                                                      worker_seconds=value["worker_seconds"])
            elif kind == "node":
                nodes.append(Node.from_json(value))
            elif kind == "trial":
                state.trials[parts[1]] = Trial.from_json(value)
            elif kind == "worker":
                state.workers[parts[1]] = Worker.from_json(value)
            elif kind == "dispatch":
                state.dispatches[parts[1]] = Dispatch.from_json(value)
            elif kind == "study":
                state.studies[parts[1]] = value
        for node in sorted(nodes, key=lambda n: int(n.node_id[1:])):
            state.plans[node.plan_key].nodes[node.node_id] = node
        return state

    def close(self) -> None:
        self._db.close()


Listener = Callable[[int, Event], None]


class Projector:
    """Folds the plan stream of ``log`` (its ``partition``) into ``state``, persisting to
    ``store`` when given.

    Each call to :meth:`catch_up` reads every record after ``state.offset``; :meth:`fold` takes
    records delivered otherwise (a faust agent's, a follower's). Either applies them with the
    reducer, dead-letters what cannot be decoded or applied (``stagetree.deadletter``, with the
    reason; only when ``dead_letters`` is true, i.e. in the one live projector, not in replays),
    and commits state + offset in one batch. Offsets may have gaps (Kafka transaction markers):
    ``state.offset`` is the last offset applied, and a record at or before it is skipped.
    """

    def __init__(self, log: EventLog, state: State | None = None, store: ProjectionStore | None = None,
                 *, dead_letters: bool = True, secret: bytes | None = None, partition: int = 0) -> None:
        self.log = log
        self.store = store
        self.state = state if state is not None else (store.load() if store is not None else State())
        self.dead_letters = dead_letters
        self.secret = secret
        self.partition = partition
        self.listeners: list[Listener] = []

    def catch_up(self, stop: int | None = None) -> list[tuple[int, Event]]:
        """Fold records from ``state.offset + 1`` up to ``stop`` (exclusive; default: the end).

        Returns the applied ``(offset, event)`` pairs, after notifying listeners.
        """
        return self.fold(self.log.read(topics.PLAN, self.state.offset + 1, stop, partition=self.partition))

    def fold(self, records: Iterable[Record]) -> list[tuple[int, Event]]:
        """Fold ``records`` (of this projector's partition, in offset order); those at or
        before ``state.offset`` were folded already and are skipped.

        Returns the applied ``(offset, event)`` pairs, after notifying listeners.
        """
        touched: set[Key] = set()
        applied: list[tuple[int, Event]] = []
        dead: list[tuple[str, bytes]] = []
        for record in records:
            if record.offset <= self.state.offset:
                continue
            self.state.chain = chain_next(bytes.fromhex(self.state.chain), topics.PLAN, record.offset, record.key,
                                          record.value, self.secret).hex()
            try:
                event = decode(record.value)
                if tracing.enabled() and event.trace:
                    with tracing.span(f"projection.apply {event.type}", parent=event.trace, kind=SpanKind.CONSUMER,
                                      attributes=tracing.messaging("process", topics.PLAN, event.event_id,
                                                                   offset=record.offset)):
                        touched |= apply(self.state, event, record.offset)
                else:
                    touched |= apply(self.state, event, record.offset)
            except (InvalidEvent, Rejected) as exc:
                reason = str(exc)
                self.state.offset = record.offset
                self.state.rejected[record.offset] = reason
                touched |= {("meta",), ("rejected", f"{record.offset:016d}")}
                letter = DeadLettered(
                    event_id=f"dl-{topics.PLAN}-{record.offset}" if not self.partition
                    else f"dl-{topics.PLAN}-{self.partition}-{record.offset}",
                    producer="projector",
                    stream=topics.PLAN,
                    offset=record.offset,
                    reason=reason,
                    raw=record.value.decode("utf-8", "replace"),
                    partition=self.partition or None,
                )
                dead.append((record.key, encode(letter)))
                continue
            applied.append((record.offset, event))
        if dead and self.dead_letters:
            self.log.append_many(topics.DEADLETTER, dead)
        if self.store is not None and touched:
            self.store.commit(self.state, touched)
        for offset, event in applied:
            for listener in self.listeners:
                listener(offset, event)
        return applied
