"""Log transports: the append/read-from-offset interface, and the embedded RocksDB log.

The interface is Kafka's, reduced to what stagetree needs: named streams (topics), each a
totally ordered sequence of records addressed by a 0-based offset, each record carrying a key
(the plan key or worker id) and a value (an encoded event). The embedded log implements it on
one RocksDB database (rocksdict) owned by a single writing process; the Kafka transport
implements the same :class:`EventLog` protocol on confluent-kafka.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from events.codec import encode
from events.errors import LogError  # the root of the errors below (defined apart: importable cheaply)
from events.keys import KEY_ENV, secret_from  # noqa: F401 (re-exported from their old home)
from events.models import Event, WorkerJoined, WorkerLost


class LogLocked(LogError):
    """Another process holds the embedded log open for writing."""


def held_elsewhere(path: str | Path) -> bool:
    """Whether a process holds the embedded log (or projection) at ``path`` open for writing:
    RocksDB's ``LOCK`` file carries an fcntl lock, tried here without opening the database.

    Only for a process that does not hold it open itself: closing the descriptor of the try
    would release its own fcntl locks on the file (POSIX drops them all at any close).
    """
    import fcntl

    try:
        fd = os.open(Path(path) / "LOCK", os.O_RDWR)
    except OSError:  # no LOCK file: never opened for writing
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Record:
    """One record of a stream: ``offset`` (0-based), ``key``, ``value`` (encoded event bytes),
    ``chain``, the stream's hash chain after this record (32 bytes; empty if the transport keeps
    none), and ``partition``, the partition of the stream that holds it (0 on an unpartitioned
    stream; offsets count within a partition)."""

    stream: str
    offset: int
    key: str
    value: bytes
    chain: bytes = b""
    partition: int = 0


class EventLog(Protocol):
    """What every log transport provides.

    Contract: a stream has one or more partitions; offsets of a partition increase from 0
    (dense on the embedded log; on Kafka, transaction markers leave gaps, so a reader tracks the
    last offset it applied, never a count); ``append`` returns only after the record is durable
    (a crash of the writing process afterwards loses nothing); ``read`` yields the records of
    one partition in offset order starting at ``start``; records are never changed or removed.
    A record's partition is chosen from its key (:func:`events.kafka_log.partition_for`), so
    every record of one key is in one partition, in append order. Implementations are used from
    one thread at a time unless they say otherwise.
    """

    def append(self, stream: str, key: str, value: bytes) -> int: ...

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]: ...

    def read(self, stream: str, start: int = 0, stop: int | None = None, partition: int = 0) -> Iterator[Record]: ...

    def end_offset(self, stream: str, partition: int = 0) -> int: ...

    def partition_count(self, stream: str) -> int: ...

    def close(self) -> None: ...


def event_key(event: Event) -> str:
    """The record key of an event on the plan stream: plan key, else worker id, else study id."""
    for attr in ("plan_key", "worker_id", "study_id"):
        value = getattr(event, attr, None)
        if value:
            return str(value)
    return ""


BROADCAST = (WorkerJoined, WorkerLost)
"""Event types written to *every* partition of a partitioned plan stream: a worker's arrival or
loss changes each plan whose stages it was running, and one partition holds a plan's whole
history (DESIGN.md "The event log"). On an unpartitioned stream they are written once."""


def is_broadcast(event: Event) -> bool:
    """Whether ``event`` goes to every partition of the plan stream (see :data:`BROADCAST`)."""
    return isinstance(event, BROADCAST)


def check_items(stream: str, items: Sequence[tuple[str, bytes]]) -> list[tuple[bytes, bytes]]:
    """The ``(key, value)`` items of an append as bytes, after checking every one before anything
    is written (the contract of ``append_many``: bad input appends nothing).

    Raises:
        TypeError: a key is not a str or a value not bytes, naming the item and the stream.
    """
    out = []
    for i, (key, value) in enumerate(items):
        if not isinstance(key, str):
            raise TypeError(f"item {i} of the append to {stream!r}: key is {type(key).__name__} {key!r}, "
                            "but must be str")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"item {i} of the append to {stream!r}: value is {type(value).__name__}, "
                            "but must be bytes")
        out.append((key.encode("utf-8"), bytes(value)))
    return out


def append_events(log: EventLog, stream: str, items: Sequence[tuple[str, Event]]) -> list[int]:
    """Encode and append ``(key, event)`` pairs atomically; returns their offsets."""
    return log.append_many(stream, [(key, encode(ev)) for key, ev in items])


def append_event_streams(log: EmbeddedLog, batches: Sequence[tuple[str, Sequence[tuple[str, Event]]]], *,
                         durable: bool = True) -> list[list[int]]:
    """Encode and append ``(stream, [(key, event)])`` batches in one atomic write
    (:meth:`EmbeddedLog.append_streams`); returns each batch's offsets."""
    return log.append_streams([(stream, [(key, encode(ev)) for key, ev in items]) for stream, items in batches],
                              durable=durable)


_OFFSET = struct.Struct(">Q")
_KEYLEN = struct.Struct(">I")

CHAIN_START = bytes(32)
"""The chain value before a stream's first record."""


def chain_next(prev: bytes, stream: str, offset: int, key: str, value: bytes, secret: bytes | None = None) -> bytes:
    """The hash chain after a record: sha256 (or HMAC-SHA256 keyed with ``secret``) of the
    previous chain value, the stream name, the offset, the key and the value.

    Any insertion, deletion, reordering or edit of a record changes every later chain value;
    with a secret, an edited log cannot be re-sealed without it.
    """
    kb = key.encode()
    msg = prev + stream.encode() + b"\x00" + _OFFSET.pack(offset) + _KEYLEN.pack(len(kb)) + kb + value
    if secret:
        return hmac.new(secret, msg, hashlib.sha256).digest()
    return hashlib.sha256(msg).digest()


def chain_algorithm(secret: bytes | None) -> str:
    return "hmac-sha256" if secret else "sha256"


_CHAIN_META = b"m:chain"
_KEY_META = b"m:chain-key"
"""A keyed log's mark of its key: HMAC-SHA256 of :data:`_KEY_CHECK` under the key."""
_KEY_CHECK = b"stagetree: the key of this log's hash chain"


def _record_key(stream: str, offset: int) -> bytes:
    return b"r" + stream.encode() + b"\x00" + _OFFSET.pack(offset)


ROCKSDICT_CONFIG = "rocksdict-config.json"


class ReadOnlyRocks:
    """A RocksDB database at ``path`` opened read-only without writing anything there.

    rocksdict rewrites its ``rocksdict-config.json`` beside the database on every open, read-only
    ones too: on a read-only file system (an auditor's copy of a run) the open failed with EROFS,
    and elsewhere every audit or dashboard touched the run directory. The database is opened
    through a temporary directory instead (``scratch``): a symbolic link to each of its files,
    but a copy of that config and of ``CURRENT`` (which names the manifest), and none of
    RocksDB's own info logs or lock (a read-only open writes its info log there). What it reads
    is the database as it was when opened, as a read-only open's. :meth:`close` closes it and
    removes the directory.

    Raises:
        OSError: the database directory cannot be listed; rocksdict's errors on opening.
    """

    def __init__(self, path: Path, opts: Options) -> None:
        self.path = path
        self.scratch = tempfile.mkdtemp(prefix="stagetree-read-")
        try:
            for entry in os.scandir(path):
                target = os.path.join(self.scratch, entry.name)
                if entry.name in (ROCKSDICT_CONFIG, "CURRENT"):  # CURRENT: the manifest listed here, even
                    shutil.copyfile(entry.path, target)  # when a running writer moves on meanwhile
                elif not (entry.name == "LOCK" or entry.name.startswith("LOG")):
                    os.symlink(os.path.abspath(entry.path), target)
            self.db = Rdict(self.scratch, opts, access_type=AccessType.read_only())
        except BaseException as exc:
            shutil.rmtree(self.scratch, ignore_errors=True)
            if type(exc) is Exception:  # rocksdict's: RocksDB's status
                raise LogError(f"the database at {path} cannot be opened (damaged?): {self.named(exc)}") from None
            raise

    def named(self, error: Exception) -> str:
        """RocksDB's message ``error`` with the files it names in the scratch copy named where they are."""
        return str(error).replace(self.scratch, str(self.path))

    def close(self) -> None:
        try:
            self.db.close()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


class EmbeddedLog:
    """A durable single-writer log in RocksDB (rocksdict), with Kafka's stream/offset interface.

    Layout: key ``b"r" + stream + b"\\0" + offset (8 bytes, big-endian)`` -> ``len(key) (4 bytes)
    + key + chain (32 bytes) + value``. Every append is one WriteBatch written with
    ``sync=True``, so an acknowledged record survives a kill -9 of the process and a power loss;
    :meth:`append_streams` writes records of several streams in one such batch, and with
    ``durable=False`` leaves the fsync to the next durable append (or :meth:`sync`): such records
    survive a kill -9 (they are in the operating system's hands) and, on a power loss, only a
    tail of them after the last durable append can be lost (the write-ahead log keeps order).
    :meth:`sync_soon` is a group commit: a background thread makes everything appended so far
    durable (one fsync of the write-ahead log, milliseconds, while appends go on), so a writer
    that needs durability soon but not before it goes on pays no fsync per append.
    The log is the one writer of its streams, so it also writes each stream's hash chain
    (:func:`chain_next`), keyed with ``secret`` when given; the algorithm is recorded in the
    database and the same secret is needed to append again.

    Args:
        path: directory of the database (created if absent).
        sync: fsync the write-ahead log on every append (default True).
        secret: HMAC key of the hash chain (None: plain sha256).
        read_only: open for reading only: no lock is taken (a running study may hold the log),
            nothing is written, and no secret is needed (``chain`` says how it was written).
            The reader sees the log as it was when opened.
        follow: open as a RocksDB *secondary instance* (read-only, no lock) that sees what the
            writer appends after it opened, each time :meth:`catch_up` is called: how a reader
            beside a running coordinator (``stagetree dashboard``) follows the log. Its own small
            info directory is a temporary directory, removed by :meth:`close`. Implies
            ``read_only``.

    Raises:
        LogLocked: the database is open in another process.
        LogError: ``secret`` does not match how the log was created.

    Thread safety: appends are serialized by a lock; reads may run concurrently with appends.
    """

    def __init__(self, path: str | Path, *, sync: bool = True, secret: bytes | None = None,
                 read_only: bool = False, follow: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only or follow
        self._secondary: str | None = None
        self._read_only: ReadOnlyRocks | None = None
        opts = Options(raw_mode=True)
        if self.read_only:
            if not (self.path / "CURRENT").is_file():
                raise LogError(f"no log at {self.path}")
            if follow:
                # A secondary keeps every table file open, so one the writer compacts away
                # while it has not caught up yet stays readable (RocksDB's advice for secondaries).
                opts.set_max_open_files(-1)
                self._secondary = tempfile.mkdtemp(prefix="stagetree-follow-")
                access = AccessType.secondary(self._secondary)
                try:
                    self._db = Rdict(str(self.path), opts, access_type=access)
                except Exception:
                    self._remove_secondary()
                    raise
            else:  # nothing written where the log is (a read-only file system, an audit)
                self._read_only = ReadOnlyRocks(self.path, opts)
                self._db = self._read_only.db
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            opts.create_if_missing(True)
            try:
                self._db = Rdict(str(self.path), opts)
            except Exception as exc:  # rocksdict raises a bare Exception on a held LOCK
                if "lock" in str(exc).lower():
                    raise LogLocked(f"the log at {self.path} is open in another process") from exc
                raise LogError(f"the log at {self.path} cannot be opened (damaged?): {exc}") from None
        self._wopts = WriteOptions()
        self._wopts.sync = sync
        self._lazy = WriteOptions()  # appends with durable=False: the next durable write syncs them
        self._lazy.sync = False
        self._lock = threading.Lock()
        self._sync_wanted = threading.Event()  # sync_soon() was called since the syncer's last fsync
        self._syncer: threading.Thread | None = None
        self._closing = False
        self._ends: dict[str, int] = {}
        self._heads: dict[str, bytes] = {}
        self.secret = secret or None
        algo = chain_algorithm(self.secret).encode()
        try:
            stored = self._db.get(_CHAIN_META)
        except Exception as exc:  # rocksdict's bare Exception: a block it cannot read
            if type(exc) is not Exception:
                raise
            self.close()
            raise LogError(f"the log at {self.path} cannot be read (damaged?): {self._named(exc)}") from None
        if self.read_only:
            self._chain = bytes(stored).decode() if stored is not None else chain_algorithm(None)
            return
        self._chain = algo.decode()
        if stored is None:
            self._db.put(_CHAIN_META, algo, self._wopts)
        elif bytes(stored) != algo:
            self._db.close()
            raise LogError(f"the log at {self.path} is chained with {bytes(stored).decode()}, "
                           f"but was opened for {algo.decode()} (a wrong or missing log key: --log-key or "
                           f"${KEY_ENV})")
        if self.secret is not None:
            self._check_secret(self.secret)

    def _check_secret(self, secret: bytes) -> None:
        """Refuse to write to a keyed log with another key than its own: every record appended
        would break its chain for ever, under either key. The log keeps a mark of its key
        (:data:`_KEY_META`); one written before the mark existed is checked by its first
        record (which chains from :data:`CHAIN_START` under the key), then marked.

        Raises:
            LogError: ``secret`` is not the log's key (the database is closed).
        """
        mark = hmac.new(secret, _KEY_CHECK, hashlib.sha256).digest()
        stored = self._db.get(_KEY_META)
        if stored is None:
            first = self._first_record()
            matches = first is None or chain_next(CHAIN_START, first.stream, first.offset, first.key, first.value,
                                                  secret) == first.chain
        else:
            matches = hmac.compare_digest(bytes(stored), mark)
        if not matches:
            self._db.close()
            raise LogError(f"the log at {self.path} is chained with another key than the one it was opened with (a "
                           f"wrong log key: --log-key or ${KEY_ENV}; records appended with it would never verify)")
        if stored is None:
            self._db.put(_KEY_META, mark, self._wopts)

    def _first_record(self) -> Record | None:
        """The first record of the log's first stream (offset 0 of a log never cut), or None."""
        it = self._db.iter()
        it.seek(b"r")
        key = bytes(it.key()) if it.valid() and bytes(it.key()).startswith(b"r") else None
        del it
        if key is None:
            return None
        stream, offset = key[1:-9].decode(), _OFFSET.unpack(key[-8:])[0]
        return next(iter(self.read(stream, offset, offset + 1)), None)

    def catch_up(self) -> None:
        """See what the writer appended since the log was opened or last caught up (a log opened
        with ``follow=True``; RocksDB's ``TryCatchUpWithPrimary``: reads the writer's new
        manifest and write-ahead-log entries, milliseconds).

        Raises:
            LogError: the log was not opened with ``follow=True``.
        """
        if self._secondary is None:
            raise LogError(f"the log at {self.path} was not opened with follow=True")
        with self._lock:
            self._db.try_catch_up_with_primary()
            self._ends.clear()
            self._heads.clear()

    @property
    def chain(self) -> str:
        """The chain algorithm the log was written with: ``sha256`` or ``hmac-sha256``."""
        return self._chain

    def head(self, stream: str) -> bytes:
        """The chain value after the last record of ``stream`` (CHAIN_START when empty)."""
        head = self._heads.get(stream)
        if head is None:
            end = self.end_offset(stream)
            head = CHAIN_START if end == 0 else next(iter(self.read(stream, end - 1))).chain
            self._heads[stream] = head
        return head

    def partition_count(self, stream: str) -> int:
        """1: every stream of the embedded log is one partition."""
        return 1

    @staticmethod
    def _only_partition(partition: int) -> None:
        if partition != 0:
            raise ValueError(f"`partition` is {partition!r}, but the embedded log has one partition per stream (0)")

    def end_offset(self, stream: str, partition: int = 0) -> int:
        """The offset the next append to ``stream`` will get (= number of records)."""
        self._only_partition(partition)
        end = self._ends.get(stream)
        if end is None:
            prefix = b"r" + stream.encode() + b"\x00"
            it = self._db.iter()
            it.seek_for_prev(prefix + b"\xff" * 8)
            end = 0
            if it.valid():
                k = it.key()
                if k.startswith(prefix) and len(k) == len(prefix) + 8:
                    end = _OFFSET.unpack(k[len(prefix):])[0] + 1
            else:  # no record before it, or a block RocksDB cannot read (which it says only here)
                self._check(it, f"the end of stream {stream!r}")
            del it
            self._ends[stream] = end
        return end

    def append(self, stream: str, key: str, value: bytes) -> int:
        """Append one record; returns its offset once it is durable."""
        return self.append_many(stream, [(key, value)])[0]

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        """Append records atomically (all or none) in order; returns their offsets.

        Raises:
            TypeError: a key is not a str or a value not bytes (the item is named; nothing is
                appended).
        """
        return self.append_streams([(stream, items)])[0]

    def append_streams(self, batches: Sequence[tuple[str, Sequence[tuple[str, bytes]]]], *,
                       durable: bool = True) -> list[list[int]]:
        """Append ``(stream, items)`` batches atomically (all or none) in one write: each
        stream's items in order after its earlier records; returns each batch's offsets.
        ``durable``: fsync before returning (the log's ``sync`` setting); False leaves it to the
        next durable append or :meth:`sync` (see the class docstring).

        Raises:
            TypeError: a key is not a str or a value not bytes (the item is named; nothing is
                appended).
        """
        if self.read_only:
            raise LogError(f"the log at {self.path} was opened read-only")
        for stream, items in batches:
            check_items(stream, items)
        with self._lock:
            ends: dict[str, int] = {}
            heads: dict[str, bytes] = {}
            chained: list[tuple[str, int, list[tuple[str, bytes, bytes]]]] = []
            for stream, items in batches:
                start = ends.get(stream, self.end_offset(stream))
                head = heads.get(stream, self.head(stream))
                records = []
                for i, (key, value) in enumerate(items):
                    head = chain_next(head, stream, start + i, key, value, self.secret)
                    records.append((key, value, head))
                chained.append((stream, start, records))
                ends[stream], heads[stream] = start + len(records), head
            return self._write(chained, durable)

    def sync(self) -> None:
        """Make every record appended so far durable (fsync the write-ahead log)."""
        if not self.read_only:
            with self._lock:
                self._db.flush_wal(True)

    def sync_soon(self) -> None:
        """Have every record appended so far made durable by the log's syncer thread, without
        waiting (a group commit: appends made meanwhile share the next fsync). On a power loss
        only records appended after the syncer's last fsync can be lost, a tail of the log (the
        write-ahead log keeps order); a kill -9 loses none. :meth:`sync` waits."""
        if self.read_only:
            raise LogError(f"the log at {self.path} was opened read-only")
        if not self._wopts.sync:
            return  # a log opened with sync=False fsyncs nothing
        if self._syncer is None:
            self._syncer = threading.Thread(target=self._sync_loop, name=f"log-syncer-{self.path.name}", daemon=True)
            self._syncer.start()
        self._sync_wanted.set()

    def _sync_loop(self) -> None:
        """The syncer thread: one fsync of the write-ahead log per wake-up (RocksDB's FlushWAL
        runs beside appends, and rocksdict releases the GIL meanwhile), until :meth:`close`."""
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._closing:
                return
            self._db.flush_wal(True)

    def import_records(self, stream: str, records: Sequence[tuple[str, bytes, bytes]]) -> list[int]:
        """Append ``(key, value, chain)`` records keeping the given chain values (log import):
        they are not checked here (``stagetree log import`` checks the export first, with
        ``replay verify``'s own code: :func:`replay.audit.check_import`)."""
        if self.read_only:
            raise LogError(f"the log at {self.path} was opened read-only")
        with self._lock:
            return self._write([(stream, self.end_offset(stream), list(records))])[0]

    def _write(self, chained: list[tuple[str, int, list[tuple[str, bytes, bytes]]]], durable: bool = True
               ) -> list[list[int]]:
        """Write ``(stream, start offset, [(key, value, chain)])`` batches as one WriteBatch."""
        batch = WriteBatch(raw_mode=True)
        for stream, start, records in chained:
            for i, (key, value, chain) in enumerate(records):
                if len(chain) != 32:
                    raise ValueError(f"`chain` of record {start + i} has {len(chain)} bytes, but must have 32")
                kb = key.encode()
                batch.put(_record_key(stream, start + i), _KEYLEN.pack(len(kb)) + kb + chain + value)
        if any(records for _, _, records in chained):
            self._db.write(batch, self._wopts if durable else self._lazy)
            for stream, start, records in chained:
                if records:
                    self._ends[stream] = start + len(records)
                    self._heads[stream] = records[-1][2]
        return [list(range(start, start + len(records))) for _, start, records in chained]

    def streams(self) -> list[str]:
        """Names of the streams that hold records, sorted."""
        names = set()
        it = self._db.iter()
        it.seek(b"r")
        while it.valid():
            raw_key = it.key()
            if not raw_key.startswith(b"r"):
                break
            names.add(bytes(raw_key[1:-9]).decode())
            it.next()
        else:  # the end, or a block RocksDB cannot read
            self._check(it, "its streams")
        del it
        return sorted(names)

    def _check(self, it: Any, what: str) -> None:
        """Raise LogError naming ``what`` was read when the iterator ``it`` stopped at a block
        RocksDB cannot read (its status; an iterator says nothing else)."""
        try:
            it.status()
        except Exception as exc:  # rocksdict raises a bare Exception with RocksDB's status
            raise LogError(f"the log at {self.path} cannot be read ({what}): the store reports "
                           f"{self._named(exc)}") from None

    def _named(self, error: Exception) -> str:
        return self._read_only.named(error) if self._read_only is not None else str(error)

    def read(self, stream: str, start: int = 0, stop: int | None = None, partition: int = 0) -> Iterator[Record]:
        """Yield records of ``stream`` with ``start <= offset < stop`` (stop: current end).
        ``partition`` must be 0 (ValueError otherwise)."""
        self._only_partition(partition)
        if start < 0:
            raise ValueError(f"`start` is {start}, but must be >= 0")
        end = self.end_offset(stream) if stop is None else min(stop, self.end_offset(stream))
        prefix = b"r" + stream.encode() + b"\x00"
        expected = start
        for raw_key, raw in self._db.items(from_key=_record_key(stream, start)):
            if not raw_key.startswith(prefix):
                break
            offset = _OFFSET.unpack(raw_key[len(prefix):])[0]
            if offset >= end or offset != expected:
                break
            (klen,) = _KEYLEN.unpack_from(raw)
            body = 4 + klen
            yield Record(stream, offset, raw[4:body].decode(), bytes(raw[body + 32 :]), bytes(raw[body : body + 32]))
            expected += 1
        if expected < end:  # RocksDB's iterator stops at a block it cannot read, saying nothing
            raise LogError(f"the log at {self.path} cannot be read past offset {expected - 1} of stream {stream!r} "
                           f"({end} records): {self._damage(stream, expected)}")

    def _damage(self, stream: str, offset: int) -> str:
        """Why the record at ``offset`` of ``stream`` cannot be read: the store's status."""
        it = self._db.iter()
        it.seek(_record_key(stream, offset))
        try:
            it.status()
        except Exception as exc:  # rocksdict raises a bare Exception with RocksDB's status
            return f"the store reports {self._named(exc)}"
        finally:
            del it
        return f"the record at offset {offset} is missing"

    def close(self) -> None:
        """Make what was appended durable, flush and release the database (and its LOCK); a
        follower's directory is removed."""
        if self._syncer is not None:
            self._closing = True
            self._sync_wanted.set()
            self._syncer.join()
            self._syncer = None
            self._db.flush_wal(True)
        if self._read_only is not None:
            self._read_only.close()
        else:
            self._db.close()
        self._remove_secondary()

    def _remove_secondary(self) -> None:
        if self._secondary is not None:
            shutil.rmtree(self._secondary, ignore_errors=True)
            self._secondary = None

    def __enter__(self) -> EmbeddedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
