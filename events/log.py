"""Log transports: the append/read-from-offset interface, and the embedded RocksDB log.

The interface is Kafka's, reduced to what stagetree needs: named streams (topics), each a
totally ordered sequence of records addressed by a 0-based offset, each record carrying a key
(the plan key or worker id) and a value (an encoded event). The embedded log implements it on
one RocksDB database (rocksdict) owned by a single writing process; the Kafka transport
implements the same :class:`EventLog` protocol on confluent-kafka.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from events.codec import encode
from events.models import Event


class LogError(Exception):
    """Root of log transport errors."""


class LogLocked(LogError):
    """Another process holds the embedded log open for writing."""


@dataclass(frozen=True, slots=True)
class Record:
    """One record of a stream: ``offset`` (0-based), ``key`` and ``value`` (encoded event bytes)."""

    stream: str
    offset: int
    key: str
    value: bytes


class EventLog(Protocol):
    """What every log transport provides.

    Contract: offsets of a stream are dense and increasing from 0; ``append`` returns only after
    the record is durable (a crash of the writing process afterwards loses nothing);
    ``read`` yields records in offset order starting at ``start``; records are never changed
    or removed. Implementations are used from one thread at a time unless they say otherwise.
    """

    def append(self, stream: str, key: str, value: bytes) -> int: ...

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]: ...

    def read(self, stream: str, start: int = 0, stop: int | None = None) -> Iterator[Record]: ...

    def end_offset(self, stream: str) -> int: ...

    def close(self) -> None: ...


def append_events(log: EventLog, stream: str, items: Sequence[tuple[str, Event]]) -> list[int]:
    """Encode and append ``(key, event)`` pairs atomically; returns their offsets."""
    return log.append_many(stream, [(key, encode(ev)) for key, ev in items])


_OFFSET = struct.Struct(">Q")
_KEYLEN = struct.Struct(">I")


def _record_key(stream: str, offset: int) -> bytes:
    return b"r" + stream.encode() + b"\x00" + _OFFSET.pack(offset)


class EmbeddedLog:
    """A durable single-writer log in RocksDB (rocksdict), with Kafka's stream/offset interface.

    Layout: key ``b"r" + stream + b"\\0" + offset (8 bytes, big-endian)`` -> ``len(key) (4 bytes)
    + key + value``. Every append is one WriteBatch written with ``sync=True``, so an
    acknowledged record survives a kill -9 of the process and a power loss.

    Args:
        path: directory of the database (created if absent).
        sync: fsync the write-ahead log on every append (default True).

    Raises:
        LogLocked: the database is open in another process.

    Thread safety: appends are serialized by a lock; reads may run concurrently with appends.
    """

    def __init__(self, path: str | Path, *, sync: bool = True) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        try:
            self._db = Rdict(str(self.path), opts)
        except Exception as exc:  # rocksdict raises a bare Exception on a held LOCK
            if "lock" in str(exc).lower():
                raise LogLocked(f"the log at {self.path} is open in another process") from exc
            raise
        self._wopts = WriteOptions()
        self._wopts.sync = sync
        self._lock = threading.Lock()
        self._ends: dict[str, int] = {}

    def end_offset(self, stream: str) -> int:
        """The offset the next append to ``stream`` will get (= number of records)."""
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
            del it
            self._ends[stream] = end
        return end

    def append(self, stream: str, key: str, value: bytes) -> int:
        """Append one record; returns its offset once it is durable."""
        return self.append_many(stream, [(key, value)])[0]

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        """Append records atomically (all or none) in order; returns their offsets."""
        with self._lock:
            start = self.end_offset(stream)
            batch = WriteBatch(raw_mode=True)
            for i, (key, value) in enumerate(items):
                kb = key.encode()
                batch.put(_record_key(stream, start + i), _KEYLEN.pack(len(kb)) + kb + value)
            if items:
                self._db.write(batch, self._wopts)
                self._ends[stream] = start + len(items)
            return list(range(start, start + len(items)))

    def read(self, stream: str, start: int = 0, stop: int | None = None) -> Iterator[Record]:
        """Yield records of ``stream`` with ``start <= offset < stop`` (stop: current end)."""
        if start < 0:
            raise ValueError(f"`start` is {start}, but must be >= 0")
        end = self.end_offset(stream) if stop is None else min(stop, self.end_offset(stream))
        prefix = b"r" + stream.encode() + b"\x00"
        for raw_key, raw in self._db.items(from_key=_record_key(stream, start)):
            if not raw_key.startswith(prefix):
                break
            offset = _OFFSET.unpack(raw_key[len(prefix):])[0]
            if offset >= end:
                break
            (klen,) = _KEYLEN.unpack_from(raw)
            yield Record(stream, offset, raw[4 : 4 + klen].decode(), bytes(raw[4 + klen :]))

    def close(self) -> None:
        """Flush and release the database (and its LOCK)."""
        self._db.close()

    def __enter__(self) -> EmbeddedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
