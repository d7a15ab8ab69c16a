"""Portable, tamper-evident logs and the reproducibility audit (``stagetree log``/``replay verify``).

A *source* is a run directory (``log/``, ``state/``, ``checkpoints/``) or a JSONL export. An
export holds a header line and one line per record, each with the stream's hash chain after it
(:func:`events.log.chain_next`), so editing, inserting, deleting or reordering any line is
detectable; with an HMAC secret (``--log-key`` or ``STAGETREE_LOG_KEY``) an edited export
cannot be re-sealed without the key.

``verify`` checks, and names the first failing offset, event and check:

1. ``chain``: every stream's records are dense from offset 0 and their chain values recompute
   (a Kafka deployment: every partition's chain up to each of its LogSealed records; offsets
   there have gaps, where transaction markers are);
2. ``decision``: every decision (StageDispatched, CheckpointEvicted, PathPreempted,
   CheckpointRequested; on a partitioned stream also a WorkerLost that ``serve`` decided)
   equals what its decider recomputes from the log prefix it records (``decided_at``; on a
   partitioned plan stream the offset of every partition's last folded record,
   ``decided_at_partitions``: each partition folded up to it and the states merged),
   DESIGN.md invariant 3 (replay/decisions.py);
3. ``projection``: the projection rebuilt by folding the plan stream equals the stored one byte
   for byte (run dir: ``state/``; export: the digest in its header);
4. ``checkpoint``: every checkpoint referenced by a CheckpointSaved exists and matches its sha256,
   except those the plans no longer reference (evicted under a budget, or dropped as corrupt),
   which are expected missing.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from events import topics
from events.codec import InvalidEvent, decode
from events.log import (  # noqa: F401 (KEY_ENV, secret_from: re-exported from their old home)
    CHAIN_START,
    KEY_ENV,
    EmbeddedLog,
    LogError,
    Record,
    chain_algorithm,
    chain_next,
    secret_from,
)
from events.models import CheckpointRequested, CheckpointSaved, LogSealed, PathPreempted, StageDispatched
from projections.partitions import merge
from projections.state import State
from projections.store import READ_BATCH, ProjectionStore, all_keys, fold_records, snapshot
from replay.decisions import DecisionCheck, Mismatch, replay_partitioned

if TYPE_CHECKING:
    from events.kafka_log import KafkaLog

EXPORT_FORMAT = "stagetree-log"
EXPORT_VERSION = 2
"""Version 2 writes a record whose bytes are not UTF-8 (a dead-lettered record) as ``value_b64``
(base64) instead of ``value``; version 1 exports (``value`` only) still read."""


class AuditError(ValueError):
    """A source cannot be read (missing, not a run dir or export, malformed export)."""


class LogDamaged(LogError):
    """A run directory's log is there but cannot be read: its metadata (CURRENT, the MANIFEST)
    cannot be opened, or a table file holds a block RocksDB cannot read before the stream's end
    (the message names the stream, the offset and RocksDB's status). A :class:`LogError`, as
    before, for the commands that need the records (``log export``, ``report``); ``replay
    verify`` makes it a failed chain check (:func:`unreadable`), not bad input."""


def projection_digest(records: dict[bytes, bytes]) -> str:
    """sha256 over the sorted projection records (key and value, length-prefixed)."""
    h = hashlib.sha256()
    for key in sorted(records):
        value = records[key]
        h.update(len(key).to_bytes(4, "big") + key + len(value).to_bytes(4, "big") + value)
    return h.hexdigest()


class Stream:
    """One stream of a source, read from the source again each time it is iterated, never held
    whole in memory (``replay verify`` of a long log holds a bounded number of records).

    Iterating gives every partition's records in turn (partition 0 first), each in the order the
    source holds them (offset order for a run directory and Kafka; line order for an export).
    :meth:`partition` is one partition's records, as a re-iterable view. ``len()`` counts the
    records (a pass over those not counted yet; a pass that reads a partition to its end counts
    it). ``read(partition)`` yields a partition's records.
    """

    def __init__(self, name: str, partitions: Iterable[int], read: Callable[[int], Iterator[Record]]) -> None:
        self.name = name
        self.partitions = tuple(sorted(set(partitions)))
        self._read = read
        self._counts: dict[int, int] = {}

    def partition(self, partition: int) -> Iterable[Record]:
        """The records of ``partition`` (none when the stream has no such partition)."""
        return _PartitionView(self, partition)

    def _records(self, partition: int) -> Iterator[Record]:
        if partition not in self.partitions:
            return
        n = 0
        for record in self._read(partition):
            n += 1
            yield record
        self._counts[partition] = n

    def __iter__(self) -> Iterator[Record]:
        for partition in self.partitions:
            yield from self._records(partition)

    def __len__(self) -> int:
        for partition in self.partitions:
            if partition not in self._counts:
                for _ in self._records(partition):
                    pass
        return sum(self._counts.values())

    def __bool__(self) -> bool:
        return any(True for _ in self)


@dataclass(frozen=True)
class _PartitionView:
    stream: Stream
    number: int

    def __iter__(self) -> Iterator[Record]:
        return self.stream._records(self.number)


def _embedded_reader(path: Path, name: str, stop: int) -> Callable[[int], Iterator[Record]]:
    """Reads ``name`` of the embedded log at ``path`` below offset ``stop`` (opened read-only for
    each pass, without the lock: a running coordinator may hold it)."""
    def read(partition: int) -> Iterator[Record]:
        log = _open_log(path)
        try:
            yield from log.read(name, 0, stop, partition=partition)
        except LogError as exc:  # the read stopped before the stream's end: a damaged table file
            raise LogDamaged(str(exc)) from None
        finally:
            log.close()
    return read


def _open_log(path: Path) -> EmbeddedLog:
    """The embedded log at ``path``, opened read-only.

    Raises:
        LogDamaged: the database is there (``CURRENT``) but cannot be opened.
        LogError: no database at ``path``.
    """
    try:
        return EmbeddedLog(path, read_only=True)
    except LogError as exc:
        if not (path / "CURRENT").is_file():
            raise
        raise LogDamaged(str(exc)) from None


@dataclass
class Source:
    """An opened source: its streams (read lazily, :class:`Stream`; records in memory work too),
    the chain algorithm it claims, where its checkpoints are, and the projection to compare with."""

    path: Path
    kind: str  # "run" | "export" | "kafka"
    streams: dict[str, Stream | list[Record]]
    chain: str
    checkpoints: str | None  # a directory or s3://BUCKET/PREFIX
    stored_projection: dict[bytes, bytes] | None = None
    projection_sha256: str | None = None
    header: dict[str, Any] = field(default_factory=dict)
    left_out: int = 0  # plan records after the stored projection's offset, left out (open_run)


def open_run(path: Path, secret: bytes | None, *, as_of_projection: bool = False) -> Source:
    """Read a run directory. Its log and projection are opened read-only (no lock: a running
    coordinator may hold them), read and closed.

    ``as_of_projection``: read the stored projection first and keep the plan stream only up to
    the offset it was folded to, so that a run still being written gives a consistent pair
    (the projection check then compares like with like); ``Source.left_out`` counts the plan
    records appended after it. Without it, a running run's projection lags its log and the
    projection check says so.

    Raises:
        AuditError: ``path`` holds no ``log/``.
        LogDamaged: the log is there but cannot be opened (the streams' reads raise it too, for
            a block that cannot be read).
    """
    if not (path / "log").is_dir():
        raise AuditError(f"{str(path)!r} is not a run directory (no log/)")
    stored = None
    if (path / "state" / "CURRENT").is_file():
        store = ProjectionStore(path / "state", read_only=True)
        try:
            stored = store.records()
        finally:
            store.close()
    elif (path / "state").is_dir():
        stored = {}  # a projection directory without a database: nothing was stored
    log = _open_log(path / "log")
    try:
        ends = {name: log.end_offset(name) for name in log.streams()}  # later appends are not read
        chain = log.chain
    except LogError as exc:  # a block of the log that cannot be read
        raise LogDamaged(str(exc)) from None
    finally:
        log.close()
    left_out = 0
    meta = stored.get(b"meta") if stored is not None else None
    if as_of_projection and meta is not None and topics.PLAN in ends:
        upto = orjson.loads(meta)["offset"]
        left_out = max(0, ends[topics.PLAN] - (upto + 1))
        ends[topics.PLAN] = min(ends[topics.PLAN], upto + 1)
    streams: dict[str, Stream | list[Record]] = {
        name: Stream(name, (0,), _embedded_reader(path / "log", name, end)) for name, end in ends.items()}
    ckpts = path / "checkpoints"
    return Source(path, "run", streams, chain, str(ckpts) if ckpts.is_dir() else None, stored, left_out=left_out)


def _export_records(path: Path) -> Iterator[Record]:
    """The records of the export at ``path``, line by line (the header skipped). Raises
    AuditError naming the line of a malformed record."""
    with path.open("rb") as f:
        next(f, None)
        for n, line in enumerate(f, start=2):
            try:
                o = orjson.loads(line)
                value = base64.b64decode(o["value_b64"], validate=True) if "value_b64" in o else o["value"].encode()
                record = Record(o["stream"], int(o["offset"]), o["key"], value, bytes.fromhex(o["chain"]),
                                int(o.get("partition", 0)))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise AuditError(f"{str(path)!r} line {n}: malformed record ({type(exc).__name__}: {exc})") from None
            yield record


def open_export(path: Path, checkpoints: str | None = None) -> Source:
    """Open a JSONL export: every line is checked here (a pass that keeps only the streams and
    partitions it names); the records are read again, line by line, whenever a stream is
    iterated. Raises AuditError naming the line of a malformed record."""
    with path.open("rb") as f:
        raw = f.readline()
    if not raw:
        raise AuditError(f"{str(path)!r} is empty")
    first = raw.rstrip(b"\r\n")
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError as exc:
        raise AuditError(f"{str(path)!r} line 1: not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise AuditError(f"{str(path)!r} is not a stagetree log export (line 1: {first[:80]!r})")
    if header.get("version", 1) > EXPORT_VERSION:
        raise AuditError(f"{str(path)!r} is a version {header.get('version')!r} export; this stagetree reads "
                         f"versions 1 to {EXPORT_VERSION}")
    partitions: dict[str, set[int]] = {}
    for record in _export_records(path):
        partitions.setdefault(record.stream, set()).add(record.partition)

    def reader(name: str) -> Callable[[int], Iterator[Record]]:
        def read(partition: int) -> Iterator[Record]:
            return (r for r in _export_records(path) if r.stream == name and r.partition == partition)
        return read

    streams: dict[str, Stream | list[Record]] = {name: Stream(name, parts, reader(name))
                                                  for name, parts in partitions.items()}
    return Source(path, "export", streams, header.get("chain", "sha256"), checkpoints,
                  projection_sha256=header.get("projection_sha256"), header=header)


class DispatchCopies:
    """The embedded log's dispatch stream (what its workers were sent) holds byte-identical
    copies of the plan stream's decisions for workers (StageDispatched, PathPreempted,
    CheckpointRequested), in the plan's order, each appended in one write with its original
    (``scheduler.service``): a copy edited and re-chained, one missing (the stream cut short) or
    one the plan does not hold is a mismatch of the decision check."""

    TYPES = (StageDispatched, PathPreempted, CheckpointRequested)

    def __init__(self) -> None:
        self.plan: list[tuple[int, str, bytes]] = []  # (plan offset, type, sha256 of the record) per decision
        self.compared = 0

    def on_plan(self, r: Record, event: Any) -> None:
        if isinstance(event, self.TYPES):
            self.plan.append((r.offset, event.type, hashlib.sha256(r.value).digest()))

    def check(self, stream: Iterable[Record]) -> Mismatch | None:
        """The first record of ``stream`` that is not the copy of the plan's next decision for
        workers, or the first such decision without a copy; None when they all match."""
        for i, r in enumerate(stream):
            if i >= len(self.plan) or hashlib.sha256(r.value).digest() != self.plan[i][2]:
                return Mismatch(None, None, f"stream {topics.DISPATCH} offset {r.offset}: not the copy of the "
                                            "plan's next decision for workers (a record of the dispatch stream "
                                            "edited, added or reordered)")
            self.compared += 1
        if self.compared < len(self.plan):
            offset, kind, _ = self.plan[self.compared]
            return Mismatch(offset, kind, f"stream {topics.DISPATCH} holds {self.compared} of the plan's "
                                          f"{len(self.plan)} decisions for workers: this one and those after it "
                                          "have no copy (the stream cut short)")
        return None


def export_complete(source: Source) -> Failure | None:
    """Whether an export holds every record its header lists: a chain cannot tell a log cut off
    after any record (a prefix chains correctly), so the header's record count per stream is
    compared. Detects a truncated or partly copied file; a header rewritten to match is not
    detected (the header is not chained: keep an export's sha256 apart, or verify the run
    directory or the deployment's sealed topics)."""
    counts = source.header.get("streams")
    if not isinstance(counts, dict):
        return None
    for name in sorted(set(counts) | set(source.streams)):
        held = len(source.streams.get(name, []))
        if counts.get(name, 0) != held:
            return Failure("chain", None, None, f"stream {name}: the export's header lists {counts.get(name, 0)} "
                                                f"records, the file holds {held} (cut off, or records added)")
    return None


def kafka_location(url: str) -> tuple[str, str]:
    """``(bootstrap servers, topic prefix)`` of ``kafka://HOST:PORT[,HOST:PORT...][/WHERE]``, where
    WHERE is the deployment's topic prefix or its plan topic ``<prefix>stagetree.plan`` (empty:
    no prefix), as :func:`events.kafka_log.parse_kafka_url` reads it. Credentials never go in the
    address: they come from ``STAGETREE_KAFKA_*``.

    Raises:
        AuditError: not such an address (named), or it holds ``user@`` credentials (masked).
    """
    from events.kafka_log import KafkaUrlError, parse_kafka_url

    try:
        return parse_kafka_url(url, topic=topics.PLAN)
    except KafkaUrlError as exc:
        raise AuditError(f"source {exc}") from None


def probe_kafka(log: KafkaLog, url: str) -> None:
    """The first contact with the cluster of source ``url`` (:meth:`KafkaLog.probe`).

    Raises:
        AuditError: no broker answered within :data:`~events.kafka_log.PROBE_DEADLINE_S`
            seconds (the message names ``url`` and the client's last error).
    """
    from events.kafka_log import KafkaLogError

    try:
        log.probe()
    except KafkaLogError as exc:
        raise AuditError(f"source {url!r}: {exc}; check the address, and that Kafka is running there") from None


def open_kafka(url: str, checkpoints: str | Path | None = None) -> Source:
    """Read ``kafka://HOST:PORT[/WHERE]`` (:func:`kafka_location`): the plan stream (every
    partition) and the dead letters of a Kafka deployment, as a plain ``read_committed``
    consumer (workers' dispatch streams hold copies of plan decisions: not read). On Kafka each
    partition's chain is carried by LogSealed events (``chain`` = "sealed").

    Raises:
        AuditError: the URL is not one, no broker answers there within
            :data:`~events.kafka_log.PROBE_DEADLINE_S` seconds, or the cluster has no plan topic
            there (a mistyped prefix or topic: an audit of nothing never passes).
    """
    from events.kafka_log import KafkaLog, security_from_env

    servers, prefix = kafka_location(url)
    security = security_from_env()
    with KafkaLog(servers, topic_prefix=prefix, security=security, read_only=True) as log:
        probe_kafka(log, url)
        if not log.has_stream(topics.PLAN):
            raise AuditError(f"{url!r}: the cluster at {servers} has no topic {log.topic(topics.PLAN)!r} (no "
                             "deployment's plan stream there: check the address and the topic prefix)")
        ends = {name: {p: log.end_offset(name, p) for p in range(log.partition_count(name))}
                for name in (topics.PLAN, topics.DEADLETTER)}

    def reader(name: str) -> Callable[[int], Iterator[Record]]:
        def read(partition: int) -> Iterator[Record]:  # up to the end when opened, in batches
            with KafkaLog(servers, topic_prefix=prefix, security=security, read_only=True) as log:
                yield from log.read(name, 0, ends[name][partition], partition=partition)
        return read

    streams: dict[str, Stream | list[Record]] = {name: Stream(name, parts, reader(name))
                                                  for name, parts in ends.items() if any(parts.values())}
    return Source(Path(url), "kafka", streams, "sealed", str(checkpoints) if checkpoints else None)


def checkpoint_location(value: str | Path) -> str:
    """``--checkpoints``'s value, checked before any work: a checkpoint directory, ``file://DIR``
    or ``s3://BUCKET[/PREFIX]`` (the forms of
    :func:`gpu_worker.object_store.open_checkpoint_store`; an S3 store is not contacted here). A
    local one must be an existing directory: one that is not there made every checkpoint
    "missing", a failed audit, where the flag was mistyped.

    Raises:
        AuditError: naming ``--checkpoints`` and the value: not such a form (an S3 URL holding
            credentials is not echoed), a local path that does not exist or is not a directory,
            an S3 store's ``STAGETREE_S3_*`` variable unset (named).
    """
    from gpu_worker.checkpoint import LocalCheckpointStore
    from gpu_worker.object_store import open_checkpoint_store

    text = str(value)
    try:
        store = open_checkpoint_store(text)
    except ValueError as exc:
        raise AuditError(f"--checkpoints: {exc}") from None
    if isinstance(store, LocalCheckpointStore) and not store.root.is_dir():
        why = "is not a directory" if store.root.exists() else "does not exist"
        raise AuditError(f"--checkpoints {text!r} {why}: give the run's checkpoints/ directory, file://DIR or "
                         "s3://BUCKET/PREFIX")
    return text


def open_source(path: str | Path, secret: bytes | None = None, checkpoints: str | Path | None = None, *,
                as_of_projection: bool = False) -> Source:
    """A run directory, a JSONL export or a Kafka deployment (``kafka://HOST:PORT[/PREFIX]``);
    ``as_of_projection`` as for :func:`open_run`; ``checkpoints`` (``--checkpoints``) replaces a
    run directory's own ``checkpoints/``.

    Raises:
        AuditError: the source does not exist or cannot be read as one (named); ``checkpoints``
            is not a checkpoint location (:func:`checkpoint_location`), checked first.
        LogDamaged: a run directory's log that cannot be opened.
    """
    ckpts = None if checkpoints is None else checkpoint_location(checkpoints)
    p = Path(path)
    if str(path).startswith("kafka://"):
        return open_kafka(str(path), ckpts)
    if p.is_dir():
        source = open_run(p, secret, as_of_projection=as_of_projection)
        if ckpts is not None:
            source.checkpoints = ckpts
        return source
    if p.is_file():
        return open_export(p, ckpts)
    raise AuditError(f"source {str(path)!r} does not exist")


def check_key(source: Source, secret: bytes | None) -> None:
    """Refuse a keyed log without its key, or with another one, and a log chained without a key
    with one (``secret``: ``--log-key`` or ``$STAGETREE_LOG_KEY``): ``log export`` (the export's
    header carries a projection digest computed with it: the file would never verify), ``log
    import`` (the imported log would be appended to with it), ``replay explain`` and ``replay
    reexecute`` (which read the records without checking their chain), ``report --verify`` and
    ``stagetree dashboard`` (whose audit would show a wrong key as a broken chain: a tampering
    that is not there). Only the key's fit is checked, by the first record of each stream (it
    chains from :data:`~events.log.CHAIN_START` under the key): the whole chain is ``replay
    verify``'s. A deployment's sealed topics are not checked.

    Raises:
        AuditError: naming ``--log-key`` and ``$STAGETREE_LOG_KEY`` (exit 2), before anything is
            written or run.
    """
    if source.chain not in ("sha256", "hmac-sha256"):  # a deployment's sealed topics
        return
    if source.chain != chain_algorithm(secret):
        raise AuditError(f"--log-key: the log is chained with {source.chain}, but "
                         + (f"no key was given (--log-key or ${KEY_ENV})" if not secret else
                            f"a key was given (--log-key or ${KEY_ENV}): give none"))
    if secret:
        for stream in sorted(source.streams):
            first = next(iter(source.streams[stream]), None)
            if first is not None and first.offset == 0 and \
                    chain_next(CHAIN_START, stream, 0, first.key, first.value, secret) != first.chain:
                raise AuditError(f"--log-key: not the key the log was chained with (the key of --log-key or "
                                 f"${KEY_ENV}: stream {stream} offset 0 does not chain with it)")


# ----------------------------------------------------------------------------- export / import


def _value_field(record: Record) -> dict[str, str]:
    """A record's bytes in an export line: ``value`` (text) when they are UTF-8, else
    ``value_b64`` (base64), so every record, a dead-lettered one included, is carried exactly."""
    try:
        return {"value": record.value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"value_b64": base64.b64encode(record.value).decode("ascii")}


def export_log(source: Source, out: Path, secret: bytes | None = None) -> int:
    """Write ``source`` as JSONL to ``out``; returns the number of records.

    The header carries the chain algorithm, the record count per stream and the digest of the
    projection folded from the plan stream.
    """
    header = {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "chain": source.chain,
        "streams": {name: len(recs) for name, recs in sorted(source.streams.items())},
        "projection_sha256": projection_digest(plan_snapshot(source.streams.get(topics.PLAN, []), secret)),
    }
    n = 0
    with out.open("wb") as f:
        f.write(orjson.dumps(header) + b"\n")
        for name in sorted(source.streams):
            for r in source.streams[name]:
                line = {"stream": r.stream, "offset": r.offset, "key": r.key, **_value_field(r), "chain": r.chain.hex()}
                if r.partition:
                    line["partition"] = r.partition
                f.write(orjson.dumps(line) + b"\n")
                n += 1
    return n


class ImportRefused(Exception):
    """``log import`` refused a source that fails a check of :func:`check_import` (exit 1, not
    bad input): ``failure`` is the first; nothing was written."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def check_import(source: Source, secret: bytes | None = None) -> tuple[AuditResult, State | None]:
    """The checks of :func:`verify` whose evidence ``log import`` would not carry into the run
    directory it writes, made by verify's own code: ``chain`` (every stream's hash chain and,
    for an export, its header's record count per stream) and ``projection`` (the plan stream's
    fold against the export header's digest, or a run directory's stored projection). The
    imported log keeps the records and their chain values but not the header, and its
    projection is rebuilt from the records: without these checks an export cut short, or
    whose records no longer fold to its digest, became a directory that verifies.

    Not made (listed as skipped): ``decision`` (the records it reads are imported byte for byte,
    so the imported directory fails it as the export does; it would about triple the import's
    time), ``checkpoint`` (an export holds none) and verify's ``tuner`` check (it needs the
    study file). ``replay verify`` makes them all.

    Returns:
        The result, and the plan stream's fold (None when the log cannot be read).
    """
    return _checked(replace(source, checkpoints=None), secret, None, decisions=False)


def import_log(source: Source, out: Path, secret: bytes | None) -> None:
    """Create run directory ``out`` from ``source``: its log with the chain values as exported,
    and ``state/`` rebuilt by folding the plan stream, once the source passed the checks of
    :func:`check_import` (nothing is written before).

    Raises:
        AuditError: ``out`` already holds a log; the source is a Kafka deployment's (sealed);
            the source is not chained with ``secret``'s algorithm.
        ImportRefused: the source fails a check of :func:`check_import` (``out`` untouched).
    """
    if (out / "log").exists():
        raise AuditError(f"{str(out)!r} already holds a log")
    if source.chain == "sealed":
        raise AuditError("the export is of a Kafka deployment (its partitioned plan stream sealed by LogSealed "
                         "events, not chained record by record): it cannot become a run directory's log; audit it "
                         "with `stagetree replay verify FILE`, or watch it with `stagetree dashboard FILE`")
    if source.chain != chain_algorithm(secret):
        raise AuditError(f"the export is chained with {source.chain}: pass the matching --log-key "
                         f"(or none for sha256) so the imported log can be appended to")
    result, state = check_import(source, secret)
    if result.first_failure is not None or state is None:
        raise ImportRefused(result.first_failure or Failure("chain", None, None, "the log cannot be read"))
    log = EmbeddedLog(out / "log", secret=secret)
    try:
        for name in sorted(source.streams):
            log.import_records(name, [(r.key, r.value, r.chain) for r in source.streams[name]])
    finally:
        log.close()
    store = ProjectionStore(out / "state")
    try:
        store.commit(state, set(all_keys(state)))
    finally:
        store.close()


# ----------------------------------------------------------------------------- verify


YOUNG_COLLECTION_EVERY = 100_000
"""The threshold of the youngest generation of Python's cyclic garbage collector while a log
is folded (:func:`rare_collections`): container objects allocated and not freed since its last
collection (Python's default is 700)."""

_gc_lock = threading.Lock()
_gc_users = 0
_gc_saved: tuple[int, int, int] | None = None


@contextmanager
def rare_collections() -> Iterator[None]:
    """Run the body with the cyclic garbage collector's youngest generation collected once
    :data:`YOUNG_COLLECTION_EVERY` container objects more were allocated than freed, instead of
    700; the thresholds are put back when the last body using it (nested, or in other threads)
    ends, also on an exception.

    A fold keeps a batch of decoded events (:data:`projections.store.READ_BATCH`) and grows the
    projection by a few objects per record: with the default threshold the collector runs every
    few dozen records, and its older generations walk the projection (and whatever else the
    process holds) again and again, about a fifth of the fold's time. Cyclic garbage is still
    collected, in larger batches, so memory stays bounded."""
    global _gc_users, _gc_saved
    with _gc_lock:
        if _gc_users == 0:
            _gc_saved = gc.get_threshold()
            _, older, oldest = _gc_saved
            gc.set_threshold(max(YOUNG_COLLECTION_EVERY, _gc_saved[0]), older, oldest)
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_saved is not None:
                gc.set_threshold(*_gc_saved)
                _gc_saved = None


def fold(records: Iterable[Record], on_event: Callable[[Record, Any, State], None] | None = None,
         after: Callable[[int, State], None] | None = None, secret: bytes | None = None,
         on_chain: Callable[[Record, bytes], None] | None = None) -> State:
    """Fold plan-stream records into a fresh state with the projector's own fold
    (:func:`projections.store.fold_records`); ``on_event``/``after``/``on_chain`` as there. ``after(-1, state)``
    runs first, on the empty state. Records of several partitions are folded partition by
    partition and their states merged (:func:`projections.partitions.merge`); ``after`` then
    sees each record's partition's state. A :class:`Stream` is read and folded in batches of
    :data:`projections.store.READ_BATCH` records (what is held at once)."""
    states = {}
    with rare_collections():
        for partition, recs in by_partition(records).items():
            state = states[partition] = State()
            if after is not None and partition == 0:
                after(-1, state)
            for batch in batches(recs):
                fold_records(state, batch, secret=secret, on_event=on_event, after=after, on_chain=on_chain)
    return merge(states)


def batches(records: Iterable[Record], size: int = READ_BATCH) -> Iterator[list[Record]]:
    """``records`` in lists of ``size`` (the last one shorter), read as they are needed."""
    it = iter(records)
    while batch := list(islice(it, size)):
        yield batch


def by_partition(records: Iterable[Record]) -> dict[int, Iterable[Record]]:
    """Plan-stream records grouped by partition, in offset order within each (partition 0 is
    always there: an unpartitioned stream is partition 0). A :class:`Stream` is not read here:
    its partitions come as views that read the source when iterated (in the source's order)."""
    if isinstance(records, Stream):
        return {p: records.partition(p) for p in sorted({0, *records.partitions})}
    parts: dict[int, list[Record]] = {0: []}
    for r in records:
        parts.setdefault(r.partition, []).append(r)
    for recs in parts.values():
        recs.sort(key=lambda r: r.offset)
    return dict(parts)


def plan_snapshot(records: Iterable[Record], secret: bytes | None = None) -> dict[bytes, bytes]:
    """The projection records of the plan stream's fold: :func:`projections.store.snapshot`
    of its one partition, or of every partition of a partitioned stream, each key prefixed
    with ``p<partition>/``."""
    parts = by_partition(records)
    out = {}
    with rare_collections():
        for partition, recs in parts.items():
            state = State()
            for batch in batches(recs):
                fold_records(state, batch, secret=secret)
            if set(parts) == {0}:
                return snapshot(state)
            out.update({f"p{partition}/".encode() + k: v for k, v in snapshot(state).items()})
    return out


@dataclass
class Failure:
    """The first thing that did not match: the check, the stream offset and event, and why."""

    check: str
    offset: int | None
    event: str | None
    detail: str

    def __str__(self) -> str:
        event = f" ({self.event})" if self.event else ""  # a record that is not an event names none
        where = "the log" if self.offset is None else f"offset {self.offset}{event}"
        return f"{self.check} check failed at {where}: {self.detail}"


@dataclass
class AuditResult:
    """The outcome of :func:`verify`: one entry per check, and the first failure (None: all ok).
    ``damaged``: the log could not be read (:func:`unreadable`); the checks that need its
    records were not made."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    first_failure: Failure | None = None
    events: int = 0
    anchor: str | None = None
    """The anchor of the plan stream's last record (``STREAM@OFFSET:CHAIN``, :mod:`replay.anchor`)
    when every check passed and the records carry their chain; else None."""
    damaged: bool = False

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def add(self, name: str, failure: Failure | None, detail: str, *, skipped: bool = False) -> None:
        """Record check ``name``: passed (``failure`` None), failed, or ``skipped`` (not made:
        nothing to check it against; ``ok`` then, as it fails nothing, and said so)."""
        self.checks.append({"name": name, "ok": failure is None, "skipped": skipped,
                            "detail": str(failure) if failure else detail})
        if failure is not None and self.first_failure is None:
            self.first_failure = failure

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": self.checks, "events": self.events,
                "first_failure": str(self.first_failure) if self.first_failure else None, "anchor": self.anchor}


CHECKS = ("chain", "decision", "projection", "checkpoint")
"""The checks of :func:`verify`, in the order it makes them."""

NOT_READ = "not checked: the log cannot be read (the chain check names the damage)"
"""The detail of a check not made because the log cannot be read (:func:`unreadable`)."""


def unreadable(error: LogDamaged, also: Iterable[str] = ()) -> AuditResult:
    """The result of verifying a log that cannot be read (``error``: damaged metadata, or a
    block of a table file that cannot be read): the chain check fails naming the damage, and
    every other check (those of :data:`CHECKS`, then ``also``) is said not to be made (skipped),
    none of them "ok" over records that were not read."""
    result = AuditResult(damaged=True)
    result.add("chain", Failure("chain", None, None, str(error)), "")
    for name in [*CHECKS[1:], *also]:
        result.add(name, None, NOT_READ, skipped=True)
    return result


def _event_name(record: Record) -> str:
    """What a record holds, for a failure's message: its event's type; on the Optuna journal's
    stream (:data:`events.topics.OPTUNA`, not events) its journal operation (``optuna op_code
    6``); ``undecodable`` for a record that is neither."""
    if record.stream == topics.OPTUNA:
        try:
            op = orjson.loads(record.value).get("op_code")
        except (orjson.JSONDecodeError, AttributeError):
            op = None
        return f"optuna op_code {op}" if isinstance(op, int) and not isinstance(op, bool) else "undecodable"
    try:
        return decode(record.value).type
    except InvalidEvent:
        return "undecodable"


def _seal(record: Record) -> LogSealed | None:
    """The LogSealed event ``record`` holds, or None."""
    if b'"LogSealed"' not in record.value:
        return None
    try:
        seal = decode(record.value)
    except InvalidEvent:
        return None
    return seal if isinstance(seal, LogSealed) else None


def check_seals(source: Source, secret: bytes | None) -> Failure | None:
    """A sealed plan stream (Kafka): recompute each partition's chain and check every LogSealed
    record in it. Offsets increase but may have gaps (transaction markers take offsets and are
    never read); the chain covers every record that is there, so a deleted, inserted or edited
    record still breaks it at the next seal.

    Two passes over each partition, holding no records: the first notes the offsets the seals
    name, the second keeps the chain only at those offsets."""
    algorithm = chain_algorithm(secret)
    for partition, records in sorted(by_partition(source.streams.get(topics.PLAN, [])).items()):
        where = f"stream {topics.PLAN}" + (f" partition {partition}" if partition else "")
        named = {seal.offset for seal in map(_seal, records) if seal is not None}
        head, previous = CHAIN_START, -1
        chain_after: dict[int, bytes] = {}
        last_named = max(named, default=-1)  # once every seal is checked: the last offset sealed
        unsealed: list[int] = []  # the first record after it (not a seal)
        count_unsealed = 0
        for r in records:
            if r.offset <= previous:
                return Failure("chain", r.offset, None, f"{where}: offset {r.offset} comes after offset {previous}")
            previous = r.offset
            seal = _seal(r)
            if seal is not None:
                if (seal.partition or 0) != partition:
                    return Failure("chain", r.offset, seal.type, f"{where}: the seal names partition "
                                                                  f"{seal.partition or 0}")
                if seal.algorithm != algorithm:
                    return Failure("chain", r.offset, seal.type, f"sealed with {seal.algorithm}, but verification "
                                                                  f"was given {'a' if secret else 'no'} secret")
                if seal.offset >= r.offset:
                    return Failure("chain", r.offset, seal.type, f"seals offset {seal.offset}, not before itself")
                if (chain_after.get(seal.offset) or b"").hex() != seal.chain:
                    return Failure("chain", r.offset, seal.type,
                                   f"{where}: the chain up to offset {seal.offset} does not match its seal (a "
                                   f"record at or before it was edited, inserted, deleted or moved)")
            elif r.offset > last_named:
                count_unsealed += 1
                if not unsealed:
                    unsealed.append(r.offset)
            head = chain_next(head, topics.PLAN, r.offset, r.key, r.value, secret)
            if r.offset in named:
                chain_after[r.offset] = head
        if unsealed:
            return Failure("chain", unsealed[0], None, f"{where}: {count_unsealed} records from offset {unsealed[0]} "
                                                       "on are not sealed (a study still running, or a truncated seal)")
    return None


def check_chain(source: Source, secret: bytes | None, names: Iterable[str] | None = None) -> Failure | None:
    """Recompute every stream's hash chain (those named in ``names`` only, when given), in the
    order of their names; the first gap or mismatch."""
    if source.chain == "sealed":
        return check_seals(source, secret)
    if source.chain != chain_algorithm(secret):
        return Failure("chain", None, None, f"the log is chained with {source.chain}, "
                       f"but verification was given {'a' if secret else 'no'} secret")
    for name in sorted(source.streams if names is None else set(names) & set(source.streams)):
        check = ChainCheck(name)
        head = CHAIN_START
        for r in source.streams[name]:
            head = chain_next(head, name, r.offset, r.key, r.value, secret)
            check(r, head)
            if check.failure is not None:
                return check.failure
    return None


@dataclass
class ChainCheck:
    """The check of one dense stream's stored chain, record by record in offset order, called
    with each record and the chain after it as recomputed (:func:`check_chain`; the plan stream
    in the fold's own pass, :func:`projections.store.fold_records`' ``on_chain``). ``failure``:
    the first gap or mismatch; records after it are not looked at."""

    stream: str
    expected: int = 0
    failure: Failure | None = None

    def __call__(self, r: Record, head: bytes) -> None:
        if self.failure is not None:
            return
        if r.offset != self.expected:
            why = (f"is missing (next record has offset {r.offset})" if r.offset > self.expected else
                   f"is not next: the record there has offset {r.offset} (a record duplicated or out of order)")
            self.failure = Failure("chain", self.expected, None, f"stream {self.stream}: offset {self.expected} {why}")
        elif head != r.chain:
            self.failure = Failure("chain", r.offset, _event_name(r),
                                   f"stream {self.stream}: the hash chain does not match (record edited, inserted, "
                                   "deleted or moved)")
        self.expected += 1


def verify(source: Source, secret: bytes | None = None, progress: Callable[[int], None] | None = None) -> AuditResult:
    """Run every check on ``source``; see the module docstring. Never raises for a mismatch.

    Memory is flat in the log's length: the streams are read again by each pass that needs them
    (:class:`Stream`): the plan stream twice (the decisions' prefixes, then the fold, which
    checks its chain as it goes), every other stream once (its chain); the fold holds
    :data:`projections.store.READ_BATCH` records at a time. What is kept
    besides the projection: the decision prefixes still to visit and the recomputed decision
    groups not yet matched (:class:`replay.decisions.DecisionCheck`), the offsets the seals
    name, and one entry per checkpoint object (not per CheckpointSaved). The garbage collector
    runs rarely meanwhile (:func:`rare_collections`).

    A log that cannot be read to the end of a stream (:class:`LogDamaged`) is a failed chain
    check naming the damage, the other checks not made (:func:`unreadable`)."""
    return _checked(source, secret, progress)[0]


def _checked(source: Source, secret: bytes | None, progress: Callable[[int], None] | None, *,
             decisions: bool = True) -> tuple[AuditResult, State | None]:
    """:func:`_verify` with rare garbage collections, a log it cannot read reported as the
    failed check naming the damage (no fold then: None)."""
    with rare_collections():
        try:
            return _verify(source, secret, progress, decisions=decisions)
        except LogDamaged as exc:
            return unreadable(exc), None


def _verify(source: Source, secret: bytes | None, progress: Callable[[int], None] | None, *,
            decisions: bool = True) -> tuple[AuditResult, State]:
    """:func:`verify`'s checks, and the plan stream's fold. ``decisions=False``
    (:func:`check_import`): the decision check of an unpartitioned plan stream is not made
    (listed as skipped); a partitioned one's fold recomputes them as it goes."""
    result = AuditResult()
    plan = source.streams.get(topics.PLAN, [])
    parts = by_partition(plan)
    # The plan stream's chain is recomputed by the fold anyway: one stream of one partition,
    # read in the source's order, is checked in the fold's pass instead of a pass of its own.
    plan_chain = (ChainCheck(topics.PLAN) if isinstance(plan, Stream) and set(parts) == {0}
                  and source.chain == chain_algorithm(secret) else None)
    names = sorted(source.streams)
    failure = check_chain(source, secret, None if plan_chain is None else [n for n in names if n < topics.PLAN])

    def add_chain() -> None:  # the first failure in the order of the streams' names, as check_chain's
        first = failure
        if first is None and plan_chain is not None:
            first = plan_chain.failure or check_chain(source, secret, [n for n in names if n > topics.PLAN])
        result.events = sum(len(v) for v in source.streams.values())  # counted by the passes that read them
        if first is None and source.kind == "export":
            first = export_complete(source)
        result.add("chain", first, f"{result.events} records in {len(source.streams)} streams chain correctly "
                                   f"({source.chain})")

    saved: dict[str, tuple[int, str, str, int]] = {}  # checkpoint ref -> (offset, type, node, step) of its first save

    def on_saved(r: Record, event: Any, state: State) -> None:
        if progress is not None:
            progress(1)
        if isinstance(event, CheckpointSaved) and event.ref not in saved:
            saved[event.ref] = (r.offset, event.type, event.node_id, event.step)

    if set(parts) == {0}:
        # A decision records the offset of the last event its decider had folded
        # (``decided_at``); each decider is re-run on exactly that prefix, remembered while
        # folding, with the parameters the decision records (policy, checkpoint budget):
        # replay/decisions.py.
        check = DecisionCheck(plan) if decisions else None
        copies, copied = DispatchCopies(), ""

        def on_event(r: Record, event: Any, state: State) -> None:
            on_saved(r, event, state)
            if check is not None:
                check.on_event(r, event)
                copies.on_plan(r, event)

        state = fold(plan, on_event, None if check is None else check.after, secret=secret, on_chain=plan_chain)
        mismatch, checked = (None, {}) if check is None else (check.finish(), check.checked)
        if check is not None and mismatch is None and topics.DISPATCH in source.streams:
            mismatch = copies.check(source.streams[topics.DISPATCH])
            copied = f"; the dispatch stream's {copies.compared} records are copies of them, byte for byte"
        rebuilt = snapshot(state)
    else:
        # A partitioned stream (Kafka): a decision's prefix is every partition's last offset.
        mismatch, checked, states = replay_partitioned(
            parts, lambda st, recs: fold_records(st, recs, secret=secret, on_event=on_saved))
        state = merge(states)
        rebuilt = {f"p{p}/".encode() + k: v for p in sorted(parts) for k, v in snapshot(states[p]).items()}
        copied = ""  # a deployment's workers read topics of their own, which verify does not read
    add_chain()
    counts = ", ".join(f"{n} {name}" for name, n in sorted(checked.items())) or "no"
    if set(parts) == {0} and not decisions:
        result.add("decision", None, "not checked: the decisions were not recomputed", skipped=True)
    else:
        result.add("decision", None if mismatch is None else Failure("decision", mismatch.offset, mismatch.event,
                                                                     mismatch.detail),
                   f"{counts} decisions recomputed from their log prefixes{copied}")

    if source.stored_projection is not None and not source.stored_projection and state.offset < 0:
        # a run that ended before its first record (a worker that failed to start)
        result.add("projection", None, "the log holds no plan record and nothing was projected")
    elif source.stored_projection is not None:
        failure = None
        if rebuilt != source.stored_projection:
            keys = sorted(set(rebuilt) | set(source.stored_projection))
            bad = next(k for k in keys if rebuilt.get(k) != source.stored_projection.get(k))
            failure = Failure("projection", None, None, f"the stored projection differs from the log's fold at "
                                                        f"record {bad.decode(errors='replace')!r}")
        result.add("projection", failure, f"{len(rebuilt)} projection records equal the log's fold byte for byte")
    elif source.projection_sha256 is not None:
        digest = projection_digest(rebuilt)
        failure = None if digest == source.projection_sha256 else Failure(
            "projection", None, None,
            f"the fold's digest {digest} differs from the export's {source.projection_sha256}")
        result.add("projection", failure, "the fold's digest equals the export's")
    else:
        result.add("projection", None, "not checked: the source holds no projection and no digest of one (an export "
                                       "written without it, a deployment's topics)", skipped=True)

    if source.checkpoints is None:
        result.add("checkpoint", None, "not checked: no checkpoint directory given", skipped=True)
    else:
        from gpu_worker.checkpoint import CheckpointCorrupt, CheckpointMissing  # torch: only for this check
        from gpu_worker.object_store import open_checkpoint_store

        failure = None
        store = open_checkpoint_store(source.checkpoints)
        seen: set[str] = set()
        gone = {ref for ref, obj in state.objects.items() if obj.references == 0}  # evicted or dropped: deleted
        for ref, (offset, etype, node_id, step) in saved.items():
            if ref in gone:
                continue
            seen.add(ref)
            try:
                store.get(ref)  # re-hashes the object
            except (CheckpointMissing, CheckpointCorrupt) as exc:
                why = "is missing" if isinstance(exc, CheckpointMissing) else "does not match its sha256"
                failure = Failure("checkpoint", offset, etype,
                                  f"checkpoint {ref} of node {node_id} at step {step} {why}")
                break
        left = sorted(ref for ref in gone if failure is None and store.exists(ref))
        result.add("checkpoint", failure, f"{len(seen)} checkpoint objects exist and match their sha256"
                   + (f"; {len(gone)} no plan references any more (evicted, or dropped as corrupt) are expected "
                      "missing" if gone else "")
                   + (f", but {len(left)} of them are still stored (not deleted: space the budget does not "
                      f"count), e.g. {left[0]}" if left else ""))
    return result, state
