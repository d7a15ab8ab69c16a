"""Projection persistence in RocksDB, and the projector that folds the plan stream into it.

The store keeps one record per object (plan, node, trial, worker, dispatch, study) as
canonical JSON, and the consumed offset under ``meta``; every fold commits the touched records
*and* the offset in one WriteBatch, so state and offset never disagree (STYLE_ANCHORS §6.3).
After a crash the projector resumes at stored offset + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from opentelemetry.trace import SpanKind
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from events import topics, tracing
from events.codec import InvalidEvent, decode, encode
from events.deadletter import dead_letter
from events.log import EventLog, ReadOnlyRocks, Record, chain_next
from events.models import DeadLettered, Event
from projections.queries import node_number
from projections.reducer import Key, Rejected, apply
from projections.state import Decided, Dispatch, Node, Plan, Rejection, State, Stats, StoredObject, Trial, Worker


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
        rejection = state.rejected.get(int(key[1]))
        return None if rejection is None else _dumps(rejection.to_json())
    if kind == "object":
        obj = state.objects.get(key[1])
        return None if obj is None else _dumps(obj.to_json())
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
    if kind == "decided":  # the tuner decisions naming a trial (TunerDecided)
        decided = state.decided.get(key[1])
        return None if not decided else _dumps([d.to_json() for d in decided])
    raise KeyError(key)


def all_keys(state: State) -> Iterator[Key]:
    """Every key of ``state``'s records."""
    yield ("meta",)
    yield ("stats",)
    for event_id in state.seen:
        yield ("seen", event_id)
    for offset in state.rejected:
        yield ("rejected", f"{offset:016d}")
    for ref in state.objects:
        yield ("object", ref)
    for plan in state.plans.values():
        yield ("plan", plan.plan_key)
        for node_id in plan.nodes:
            yield ("node", plan.plan_key, node_id)
    tables = (("trial", state.trials), ("worker", state.workers), ("dispatch", state.dispatches),
              ("study", state.studies))
    for kind, table in tables:
        for ident in table:
            yield (kind, ident)
    for trial_id in state.decided:
        yield ("decided", trial_id)


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
        path: database directory (created if absent, unless ``read_only``).
        read_only: open for reading only, without the lock (beside a running projector: the
            records as they were when opened); :meth:`commit` then raises.

    Raises:
        FileNotFoundError: ``read_only`` and there is no database at ``path``.

    Only one process opens it for writing (the projector).
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        opts = Options(raw_mode=True)
        if read_only:
            if not (self.path / "CURRENT").is_file():
                raise FileNotFoundError(f"no projection store at {self.path}")
            self._read_only: ReadOnlyRocks | None = ReadOnlyRocks(self.path, opts)  # writes nothing there
            self._db = self._read_only.db
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            opts.create_if_missing(True)
            self._read_only = None
            self._db = Rdict(str(self.path), opts)
        self._wopts = WriteOptions()
        self._wopts.sync = False  # the log is the source of truth; a lost tail is refolded

    def commit(self, state: State, touched: set[Key]) -> None:
        """Write the touched records and the offset of ``state`` atomically."""
        if self.read_only:
            raise PermissionError(f"the projection store at {self.path} was opened read-only")
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

    def position(self) -> tuple[int, str]:
        """``(offset, chain)``: the last plan-stream offset folded into the store and the hash
        chain after it (``(-1, "0" * 64)`` when nothing was), read without loading the state."""
        raw = self._db.get(b"meta")
        if raw is None:
            return State().offset, State().chain
        value = orjson.loads(raw)
        return value["offset"], value["chain"]

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
                state.rejected[int(parts[1])] = Rejection.from_json(value)
            elif kind == "object":
                state.objects[parts[1]] = StoredObject(value["size"], value["references"])
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
            elif kind == "decided":
                state.decided[parts[1]] = [Decided.from_json(d) for d in value]
        for node in sorted(nodes, key=lambda n: node_number(n.node_id)):
            state.plans[node.plan_key].nodes[node.node_id] = node
        return state

    def close(self) -> None:
        if self._read_only is not None:
            self._read_only.close()
        else:
            self._db.close()


Listener = Callable[[int, Event], None]

READ_BATCH = 1000
"""Records a reader that streams a log (``replay verify``, :func:`replay.audit.fold`) reads and
folds at a time: what it holds at once, whatever the log's length."""


@dataclass
class Folded:
    """What a fold did: the touched record keys (to commit), the applied ``(offset, event)``
    pairs, and the dead letters ``(record key, letter)`` of the records it could not use."""

    touched: set[Key] = field(default_factory=set)
    applied: list[tuple[int, Event]] = field(default_factory=list)
    letters: list[tuple[str, DeadLettered]] = field(default_factory=list)


def fold_records(state: State, records: Iterable[Record], folded: Folded | None = None, *,
                 secret: bytes | None = None,
                 on_event: Callable[[Record, Event, State], None] | None = None,
                 after: Callable[[int, State], None] | None = None, traced: bool = False,
                 on_chain: Callable[[Record, bytes], None] | None = None) -> Folded:
    """The one fold of the plan stream (DESIGN.md invariant 3), used by the live projector, the
    audit and the tests: apply ``records`` (in offset order, after ``state.offset``) to ``state``.

    For each record: advance the hash chain ``state.chain`` (sha256, or HMAC with ``secret``),
    decode it and apply it with the reducer. A record that cannot be decoded or is
    :class:`Rejected` consumes its offset, is recorded in ``state.rejected`` (capped reason,
    sha256 and size) and gets a dead letter in ``folded.letters``. ``on_event(record, event,
    state)`` runs before each decoded event is applied, ``after(offset, state)`` after each record
    (applied or rejected). ``traced``: record each apply as a span in the event's trace (the live
    projector). ``on_chain(record, chain)`` runs for each record first, with the chain after it
    as computed here (32 bytes): ``replay verify`` compares it with the chain the log stored, in
    this same pass. Offsets may have gaps (Kafka transaction markers): only the last
    offset applied is tracked.

    Any other exception is a defect: it propagates with ``state.offset`` and ``state.chain`` still
    at the last record used, so nothing is skipped; what was folded before it is in ``folded``
    (pass your own ``folded`` to keep it, and commit it).
    """
    folded = Folded() if folded is None else folded
    previous = bytes.fromhex(state.chain)  # the chain after the last record, as bytes (state.chain is hex)
    for record in records:
        head = previous = chain_next(previous, topics.PLAN, record.offset, record.key, record.value, secret)
        if on_chain is not None:
            on_chain(record, head)
        chain = head.hex()
        try:
            event = decode(record.value)
            if on_event is not None:
                on_event(record, event, state)
            if traced and event.trace and tracing.enabled():
                with tracing.span(f"projection.apply {event.type}", parent=event.trace, kind=SpanKind.CONSUMER,
                                  attributes=tracing.messaging("process", topics.PLAN, event.event_id,
                                                               offset=record.offset)):
                    touched = apply(state, event, record.offset)
            else:
                touched = apply(state, event, record.offset)
        except (InvalidEvent, Rejected) as exc:
            letter = dead_letter(topics.PLAN, record.offset, record.value, str(exc), producer="projector",
                                 partition=record.partition or None)
            state.offset, state.chain = record.offset, chain
            state.rejected[record.offset] = Rejection(letter.reason, letter.sha256 or "", letter.size or 0)
            folded.touched |= {("meta",), ("rejected", f"{record.offset:016d}")}
            folded.letters.append((record.key, letter))
        else:
            state.chain = chain
            folded.touched |= touched
            folded.applied.append((record.offset, event))
        if after is not None:
            after(record.offset, state)
    return folded


class Projector:
    """Folds the plan stream of ``log`` (its ``partition``) into ``state``, persisting to
    ``store`` when given.

    Each call to :meth:`catch_up` folds every record after ``state.offset`` with
    :func:`fold_records`; :meth:`fold` takes records delivered otherwise (a faust agent's, a
    follower's) and skips those at or before ``state.offset`` (offsets may have gaps: Kafka
    transaction markers). Either commits the touched records, the offset and the rejections in
    one batch; then, when ``dead_letters`` is true (the one live projector, not replays),
    publishes the dead letters to ``stagetree.deadletter``. Publishing after the commit is an
    outbox: a crash in between loses no letter, because a projector that starts publishes the
    rejections its state holds that the dead-letter stream lacks (same event ids, so never twice
    in effect). With ``traced`` (default) each apply is a ``projection.apply`` span in its event's
    trace (:func:`fold_records`); a replay of a finished log (``replay verify``) folds untraced:
    its events were consumed when they were written, in the run's own traces.
    """

    def __init__(self, log: EventLog, state: State | None = None, store: ProjectionStore | None = None,
                 *, dead_letters: bool = True, secret: bytes | None = None, partition: int = 0,
                 traced: bool = True) -> None:
        self.log = log
        self.traced = traced
        self.store = store
        self.state = state if state is not None else (store.load() if store is not None else State())
        self.dead_letters = dead_letters
        self.secret = secret
        self.partition = partition
        self.listeners: list[Listener] = []
        if dead_letters and self.state.rejected:
            self._publish_missing_letters()

    def _publish_missing_letters(self) -> None:
        """Publish the dead letters of rejections the dead-letter stream does not hold yet."""
        published = set()
        for record in self.log.read(topics.DEADLETTER):
            try:
                letter = decode(record.value)
            except InvalidEvent:
                continue
            if isinstance(letter, DeadLettered) and letter.stream == topics.PLAN \
                    and (letter.partition or 0) == self.partition:
                published.add(letter.offset)
        letters = []
        for offset in sorted(set(self.state.rejected) - published):
            for record in self.log.read(topics.PLAN, offset, offset + 1, partition=self.partition):
                letters.append((record.key, dead_letter(topics.PLAN, offset, record.value,
                                                        self.state.rejected[offset].reason, producer="projector",
                                                        partition=self.partition or None)))
        if letters:
            self.log.append_many(topics.DEADLETTER, [(key, encode(letter)) for key, letter in letters])

    def catch_up(self, stop: int | None = None) -> list[tuple[int, Event]]:
        """Fold records from ``state.offset + 1`` up to ``stop`` (exclusive; default: the end).

        Returns the applied ``(offset, event)`` pairs, after notifying listeners. An unexpected
        exception (a defect of the reducer) propagates after what was folded before it is
        committed; the record that raised is neither applied nor skipped.
        """
        return self.fold(self.log.read(topics.PLAN, self.state.offset + 1, stop, partition=self.partition))

    def fold(self, records: Iterable[Record]) -> list[tuple[int, Event]]:
        """Fold ``records`` (of this projector's partition, in offset order); those at or before
        ``state.offset`` were folded already and are skipped. Commits, dead-letters and notifies
        as :meth:`catch_up`; returns the applied ``(offset, event)`` pairs."""
        folded = Folded()
        try:
            fold_records(self.state, (r for r in records if r.offset > self.state.offset), folded,
                         secret=self.secret, traced=self.traced)
        finally:
            if self.store is not None and folded.touched:
                self.store.commit(self.state, folded.touched)
        if folded.letters and self.dead_letters:
            self.log.append_many(topics.DEADLETTER, [(key, encode(letter)) for key, letter in folded.letters])
        for offset, event in folded.applied:
            for listener in self.listeners:
                listener(offset, event)
        return folded.applied
