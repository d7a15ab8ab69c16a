"""Content-addressed checkpoint storage and the checkpoint byte encoding.

A checkpoint object is named by the sha256 of its bytes. A store returns from
``put`` only after the object is durably written and verified, so a worker
publishes CheckpointSaved only for verified objects (DESIGN.md invariant 4).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import hashlib
import io
import mmap
import os
import queue
import re
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar, runtime_checkable

_REF_PATTERN = re.compile(r"[0-9a-f]{64}")


class CheckpointError(Exception):
    """Base class of checkpoint storage and decoding errors."""


class StorageError(CheckpointError):
    """The store could not be read or written for a reason of its own (a full or failing disk,
    an unreachable object store): an infrastructure fault, not a fact about the checkpoint.
    Workers retry it and then hand their path back; it never fails a trial (issue 11 item 16)."""


STORAGE_ATTEMPTS = 3
"""Tries of a store request that raises :class:`StorageError` before a worker gives up on it: a
stage's checkpoint read or write (:class:`~gpu_worker.executor.StageExecutor`), and the check of
its store before it joins (``stagetree worker``)."""
STORAGE_BACKOFF_S = 1.0
"""Seconds before the second of those tries, doubled for each further one (1 s, then 2 s)."""


def retry_storage(operation: Callable[[], _T], *, attempts: int = STORAGE_ATTEMPTS,
                  backoff_s: float = STORAGE_BACKOFF_S, sleep: Callable[[float], None] = time.sleep,
                  final: Callable[[StorageError], bool] = lambda exc: False) -> _T:
    """``operation()`` (a store request), tried ``attempts`` times while it raises
    :class:`StorageError`, waiting ``backoff_s`` seconds and then twice as long each time; an
    error for which ``final(error)`` is true is raised at once.

    Raises:
        StorageError: the last try's, or a final one.
    """
    for attempt in range(attempts):
        try:
            return operation()
        except StorageError as exc:
            if final(exc) or attempt + 1 == attempts:
                raise
            sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")


class CheckpointMissing(CheckpointError):
    """No object is stored under ``ref``."""

    def __init__(self, ref: str) -> None:
        super().__init__(f"checkpoint {ref} is missing")
        self.ref = ref

    def __reduce__(self) -> tuple[type, tuple[str]]:  # pickled as what it was made of, not its message
        return type(self), (self.ref,)


class CheckpointCorrupt(CheckpointError):
    """The object stored under ``ref`` hashes to ``actual`` instead."""

    def __init__(self, ref: str, actual: str) -> None:
        super().__init__(f"checkpoint {ref} is corrupt: its bytes hash to {actual}")
        self.ref = ref
        self.actual = actual

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # (another process: a pool's worker)
        return type(self), (self.ref, self.actual)


@dataclass(frozen=True)
class CheckpointRef:
    """A stored checkpoint: ``ref`` = sha256 hex digest of its bytes, ``size`` in bytes."""

    ref: str
    size: int


@runtime_checkable
class CheckpointStore(Protocol):
    """Content-addressed store of checkpoint bytes (local directory, MinIO, ...).

    ``put`` returns only after the object is durable and verified; putting
    bytes already stored is a no-op. A store may also offer ``put_many`` (several
    objects at once: one group commit, or uploads in flight together), which writers use
    when several are queued. ``get`` verifies the hash and raises
    CheckpointMissing or CheckpointCorrupt; a store may also offer ``load_pending(ref, use)`` (``use``
    of the bytes while they are hashed, returned with a :class:`Verification` that may still be
    running: :class:`LoadMemory`, :func:`use_pending`) and ``load(ref, use)`` (the same, returned once
    they verify), which workers use to load a checkpoint. ``delete`` of an absent object is
    a no-op. Any method raises StorageError when the store itself fails (a full
    disk, an unreachable server). Methods taking a ``ref`` raise ValueError when
    it is not 64 lowercase hex digits.
    """

    def put(self, data: bytes) -> CheckpointRef: ...

    def get(self, ref: str) -> bytes: ...

    def exists(self, ref: str) -> bool: ...

    def delete(self, ref: str) -> None: ...


def sha256_hex(data: bytes) -> str:
    """Return the sha256 hex digest (64 lowercase hex digits) of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """Return the sha256 hex digest of the file at ``path``, hashed through a read-only memory map
    (no copy of its bytes into this process, the GIL released while hashing). Raises OSError
    (FileNotFoundError when absent)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return sha256_hex(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


class _Stored(Exception):
    """An object written by put_written is stored intact already."""


_T = TypeVar("_T")
_U = TypeVar("_U")
_helper_pool: futures.ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _submit_helper(task: Callable[[], _T]) -> futures.Future[_T]:
    """Run ``task`` on the helper pool (two threads: a worker's reader, hashing a load, never
    waits behind its writer's hashing)."""
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None:
            _helper_pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="stagetree-checkpoint")
        return _helper_pool.submit(task)


def _beside(task: Callable[[], _T], work: Callable[[], _U]) -> tuple[_T, _U]:
    """Run ``task`` on a helper thread while ``work`` runs on this one, and return both results
    once both are done (``work``'s exception first, then ``task``'s). For hashing and I/O, which
    release the GIL: the two take the time of the longer one where a second core is free."""
    future = _submit_helper(task)
    try:
        done = work()
    except BaseException:
        futures.wait([future])
        raise
    return future.result(), done


class _Hasher:
    """The sha256 of bytes fed to it in order. From ``_BESIDE_BYTES`` on (``size``: the bytes to
    come) they are hashed on a helper thread as they come, while the caller reads the next ones
    or uses those it has; :meth:`finish` ends the feed, and its digest comes once the last view
    is hashed (:meth:`hexdigest` waits for it). Each fed view must stay unchanged until then.
    :meth:`finish` must be called once whatever happens (the helper thread then hashes what is
    left and is free), and until then its owner must not wait for other helper tasks: the
    helper thread it holds could be one they need."""

    def __init__(self, size: int) -> None:
        self._hash = hashlib.sha256()
        self._queue: queue.SimpleQueue[memoryview | None] | None = None
        if size >= _BESIDE_BYTES:
            self._queue = queue.SimpleQueue()
            started = threading.Event()
            self._digest = _submit_helper(functools.partial(self._run, started))
            # once started, the helper waits for views without the GIL; before that, a memory
            # copy holding the GIL (decoding from a view) could keep it from starting at all
            started.wait()

    def _run(self, started: threading.Event) -> str:
        started.set()
        assert self._queue is not None
        while (view := self._queue.get()) is not None:
            self._hash.update(view)
        return self._hash.hexdigest()

    def feed(self, view: memoryview) -> None:
        if self._queue is None:
            self._hash.update(view)
        else:
            self._queue.put(view)

    def finish(self) -> futures.Future[str]:
        """The digest of every byte fed, once they are hashed (no more may be fed)."""
        if self._queue is None:
            done: futures.Future[str] = futures.Future()
            done.set_result(self._hash.hexdigest())
            return done
        self._queue.put(None)
        return self._digest

    def hexdigest(self) -> str:
        return self.finish().result()

    def pending(self, ref: str, use: Callable[[], _T]) -> tuple[_T, Verification]:
        """``use()`` while the bytes fed so far are hashed, and the :class:`Verification` that
        they hash to ``ref``, which may still be running (none are fed after).

        Raises, once the bytes are hashed, CheckpointCorrupt when ``use`` raised and they hash to
        something else; else what ``use`` raised."""
        try:
            value = use()
        except Exception:  # reported only for bytes that verify
            Verification(ref, self.finish()).check()
            raise
        except BaseException:
            self.hexdigest()
            raise
        return value, Verification(ref, self.finish())


class Verification:
    """Whether the bytes of checkpoint ``ref`` that a load handed on hash to ``ref``: ``digest``
    gives their sha256 once hashed (on a helper thread, while the caller goes on)."""

    def __init__(self, ref: str, digest: futures.Future[str]) -> None:
        self.ref, self._digest = ref, digest

    @classmethod
    def passed(cls, ref: str) -> Verification:
        """The verification of bytes already checked to hash to ``ref``."""
        digest: futures.Future[str] = futures.Future()
        digest.set_result(ref)
        return cls(ref, digest)

    def done(self) -> bool:
        """Whether :meth:`check` would return or raise at once."""
        return self._digest.done()

    def wait(self) -> None:
        """Wait until the bytes are hashed."""
        futures.wait([self._digest])

    def check(self) -> None:
        """Wait until the bytes are hashed; raise CheckpointCorrupt when they hash to something
        other than ``ref``."""
        actual = self._digest.result()
        if actual != self.ref:
            raise CheckpointCorrupt(self.ref, actual)


def _forget_helper_pool() -> None:
    global _helper_pool, _helper_lock
    _helper_pool, _helper_lock = None, threading.Lock()  # a forked child has no helper thread


os.register_at_fork(after_in_child=_forget_helper_pool)

_BESIDE_BYTES = 1 << 20
"""Writes of at least this many bytes are hashed on the helper thread while they are written, and
loads of at least this many bytes are hashed there while they are decoded."""


class _HashingSink:
    """A binary file-like over ``file`` that hashes (sha256) and counts what is written; a large
    write is hashed beside the write, both done before ``write`` returns (the caller may free the
    data then: ``torch.save`` hands over temporary host copies of CUDA storages)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.hash, self.size = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.size += view.nbytes
        if view.nbytes < _BESIDE_BYTES:
            self.hash.update(view)
            return self.file.write(view)
        return _beside(functools.partial(self.hash.update, view), functools.partial(self.file.write, view))[1]

    def flush(self) -> None:
        pass  # the store flushes and syncs the file itself

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def _write_all(sink: BinaryIO, data: bytes) -> None:
    sink.write(data)


def _load_syncfs() -> Callable[[int], int] | None:
    """Linux's ``syncfs(fd)``: make everything written to the filesystem holding ``fd`` durable
    in one call (None elsewhere, where each file and directory is fsynced)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syncfs
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int]
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


_syncfs = _load_syncfs()


def _check_ref(ref: str) -> str:
    if not isinstance(ref, str) or _REF_PATTERN.fullmatch(ref) is None:
        raise ValueError(f"ref must be a sha256 hex digest (64 lowercase hex digits), got {ref!r}")
    return ref


class LoadedBytes:
    """The bytes of a checkpoint a store is loading (``load(ref, use)``, ``load_pending(ref,
    use)``), handed to ``use`` while they are hashed: valid during ``use`` only (the store reads
    its next object into the same memory), and not verified until ``load`` returns or the
    :class:`Verification` that ``load_pending`` returns passes.

    ``view``: a read-only view of the bytes. ``path``: where they can be mapped from (a
    process-private memory file holding exactly them, ``/proc/self/fd/N``), or None.
    """

    def __init__(self, view: memoryview, path: str | None = None) -> None:
        self.view, self.path = view, path

    def decode(self) -> Any:
        """:func:`decode_state` of the bytes. From a memory file, by mapping it
        (``torch.load(mmap=True)``): no tensor is copied, each is a copy-on-write view of the
        file, which stays in memory while one is referenced (the store then reads its next
        object into a new file); :meth:`TrainingSession.load
        <gpu_worker.session.TrainingSession.load>` copies them into the trainer's own.

        Raises CheckpointError when the bytes are not a checkpoint."""
        if self.path is None:
            return decode_state(self.view)
        return _decode_mapped(self.path, f"checkpoint state ({self.view.nbytes} bytes)")


def use_pending(ref: str, data: bytes | memoryview, use: Callable[[LoadedBytes], _T]) -> tuple[_T, Verification]:
    """``use(LoadedBytes(data))`` and the :class:`Verification` that ``data`` hashes to ``ref``:
    how stores load a checkpoint held in memory (``load_pending(ref, use)``). Data of at least
    1 MiB is hashed on a helper thread while ``use`` runs on this one and after it returns, so
    the load costs the longer of the two, not their sum (100 MB: 0.056 s to hash here), or
    only ``use`` when the caller goes on before checking. ``data`` must not change until the
    verification is done.

    Raises, once ``data`` is hashed, CheckpointCorrupt when ``use`` raised and it hashes to
    something else; else what ``use`` raised.
    """
    view = memoryview(data).cast("B").toreadonly()
    hasher = _Hasher(view.nbytes)
    hasher.feed(view)
    return hasher.pending(ref, functools.partial(use, LoadedBytes(view)))


def _memory_files() -> bool:
    """Whether anonymous memory files can be made and mapped by path (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


_READ_CHUNK = 8 << 20
"""A load reads this many bytes at a time, each hashed while the next is read."""


class _MemoryFile:
    """A process-private anonymous memory file (``memfd``) of ``size`` bytes that a store reads
    objects into, mapped shared here; :meth:`LoadedBytes.decode` maps it again, privately
    (``/proc/self/fd/N``). Linux only."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("stagetree-load", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size, self.pid, self.inode = size, os.getpid(), os.fstat(self.fd).st_ino
        self.path = f"/proc/self/fd/{self.fd}"

    def resize(self, size: int) -> bool:
        """Make the file ``size`` bytes long, keeping its pages up to the shorter length (they
        need not be faulted in again): whether it could be done. Not while a view of its shared
        mapping is referenced (then it is left as it is); call only when no private mapping of
        it is left either (:meth:`mapped_privately`), since a shorter file would cut those."""
        try:
            self.map.close()
        except BufferError:
            return False
        self.size = -1  # no mapping until the new one is made
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.size = size
        return True

    def mapped_privately(self) -> bool:
        """Whether a private mapping of this file is left in this process (tensors decoded from
        it still referenced): its pages must not change then. Read from ``/proc/self/maps``."""
        inode = str(self.inode).encode()
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] == inode and fields[1][3:4] == b"p" \
                        and fields[5].startswith(b"/memfd:stagetree-load"):
                    return True
        return False

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view of it is still referenced: closed when it is not
            pass
        os.close(self.fd)


class LoadMemory:
    """The memory a checkpoint store reads objects into to load them (``load_pending``), kept
    for the next load so that it is not faulted in again at every load (100 MB: 9 ms to read
    into it against 80 ms into new memory here): from 1 MiB on Linux a process-private memory
    file (:class:`_MemoryFile`), which :meth:`LoadedBytes.decode` maps instead of copying every
    tensor out of it (a new file is made while tensors mapped from the last one are still
    referenced), else a buffer. The bytes are hashed chunk by chunk on a helper thread as they
    are read (:class:`_Hasher`), while ``use`` runs and after it returns. Loads run one at a
    time (:meth:`turn`), and the next one waits until the last one's bytes are hashed.

    A store uses it as::

        with memory.turn():
            with <translating the source's errors>:
                read = memory.read(size, source.readinto)
            return memory.use(ref, read, use)
    """

    def __init__(self) -> None:
        self._buffer = bytearray()  # small objects
        self._file: _MemoryFile | None = None  # large ones, on Linux
        self._lock = threading.Lock()
        self._hashing: tuple[int, Verification] | None = None  # (pid, the last load's)

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the memory for one load: wait for the load before (in this process; a forked
        child has no helper thread) and until its bytes are hashed."""
        with self._lock:
            if self._hashing is not None and self._hashing[0] == os.getpid():
                self._hashing[1].wait()  # the last load's bytes are still hashed from this memory
            yield

    def read(self, size: int, readinto: Callable[[memoryview], int | None],
             parts: Sequence[tuple[int, Callable[[memoryview], int]]] = ()) -> tuple[LoadedBytes, _Hasher]:
        """Read an object of ``size`` bytes with ``readinto`` (a file's or a response's: fills
        the view it is given, returns how many bytes it wrote, 0 at the end) into this memory,
        :data:`_READ_CHUNK` bytes at a time, each fed to a hasher as the next is read. Returns
        the bytes read (fewer than ``size`` when the source ended early: their hash then shows
        it) and the hasher. Call within :meth:`turn`; raises what ``readinto`` raises.

        ``parts``: ``(offset, fill)`` of the object's later ranges, in increasing offsets, each
        up to the next one's offset (the last up to ``size``): ``readinto`` then reads the bytes
        before the first, while each ``fill`` (called once, on a thread of its own) fills the
        view of its range and returns how many bytes it wrote (an object store's ranged GETs).
        Each range is hashed, in order, once it and those before it are read; a range read
        short ends the bytes read. Every ``fill`` has returned before this does; raises what
        the first failed one raised (or ``readinto``)."""
        view, mapped = self._view(size)
        hasher = _Hasher(size)
        ends = [offset for offset, _ in parts] + [size]
        pool = futures.ThreadPoolExecutor(len(parts), thread_name_prefix="stagetree-range") if parts else None
        filled = [] if pool is None else [pool.submit(fill, view[offset:ends[i + 1]])
                                          for i, (offset, fill) in enumerate(parts)]
        got = 0
        try:
            while got < ends[0] and (n := readinto(view[got:min(ends[0], got + _READ_CHUNK)])):
                hasher.feed(view[got:got + n])
                got += n
            for (offset, _), part in zip(parts, filled):
                if got != offset:  # a range before it ended early
                    break
                n = part.result()
                hasher.feed(view[got:got + n])
                got += n
            for part in filled:
                part.result()  # the first failure, even of a range after a short one
        except BaseException:
            hasher.hexdigest()
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True)  # no thread writes into this memory once it is handed on
        return LoadedBytes(view[:got].toreadonly(), mapped if got == size else None), hasher

    def use(self, ref: str, read: tuple[LoadedBytes, _Hasher], use: Callable[[LoadedBytes], _T]
            ) -> tuple[_T, Verification]:
        """``use`` of the bytes :meth:`read` read, and the :class:`Verification` that they hash
        to ``ref`` (:meth:`_Hasher.pending`), which the next load waits for. Call within
        :meth:`turn`."""
        loaded, hasher = read
        value, verification = hasher.pending(ref, functools.partial(use, loaded))
        self._hashing = (os.getpid(), verification)
        return value, verification

    def _view(self, size: int) -> tuple[memoryview, str | None]:
        """Writable memory for an object of ``size`` bytes, and the path of the memory file it
        is (None for a buffer): the last one's, made ``size`` bytes long (a checkpoint is
        decoded from the whole file, and one study's checkpoints differ in size: with and
        without momentum buffers, say), unless tensors mapped from it are referenced."""
        if size < _BESIDE_BYTES or not _memory_files():
            if len(self._buffer) < size:
                self._buffer = bytearray(size)
            return memoryview(self._buffer)[:size], None
        last = self._file
        if last is None or last.pid != os.getpid() or last.mapped_privately() \
                or (last.size != size and not last.resize(size)):
            if last is not None and last.pid == os.getpid():
                last.close()  # its pages stay while mapped
            last = self._file = _MemoryFile(size)
        return memoryview(last.map), last.path


class LocalCheckpointStore:
    """CheckpointStore in a local directory: the object ``ref`` lives at ``root/ref[:2]/ref``.

    Writes go to a temporary file under ``root`` (hashed as they are written),
    are renamed into place under their hash with ``os.replace`` (atomic) and made
    durable (fsync of file and directory, or one syncfs for a group:
    :meth:`put_written`), and the object is re-read and verified before ``put``
    returns. A crash at any moment leaves either no object or a complete one,
    plus at most a stray ``root/.tmp-*`` file that is never read as an object;
    a power loss before the sync may leave a renamed object incomplete, which its
    sha256 shows on the next read (it is then recomputed, never loaded).

    ``memory``: the :class:`LoadMemory` its loads read into (default: its own).
    """

    def __init__(self, root: Path | str, memory: LoadMemory | None = None) -> None:
        self.root = Path(root)
        # what loads read into, reused (see load_pending); a cache shares its store's
        self._memory = LoadMemory() if memory is None else memory

    def __reduce__(self) -> tuple[type[LocalCheckpointStore], tuple[Path]]:
        return LocalCheckpointStore, (self.root,)  # the load memory and its lock stay here

    def path(self, ref: str) -> Path:
        """Return the file path of object ``ref`` (ValueError on a malformed ref)."""
        _check_ref(ref)
        return self.root / ref[:2] / ref

    def put(self, data: bytes) -> CheckpointRef:
        """Store ``data`` and return its ref; a no-op when it is already stored intact.

        An object present under the same ref with wrong bytes is overwritten.
        Raises CheckpointCorrupt when the written object does not read back
        with the right hash, StorageError on I/O failure such as a full disk (no
        temporary file is left).
        """
        return self.put_many([data])[0]

    def put_many(self, datas: Sequence[bytes]) -> list[CheckpointRef]:
        """Store several objects with one group commit (:meth:`put_written` writing each one's
        bytes). Returns their refs in order; raises as :meth:`put` (then none is to be
        trusted)."""
        return self.put_written([functools.partial(_write_all, data=data) for data in datas])

    def put_written(self, writers: Sequence[Callable[[BinaryIO], object]]) -> list[CheckpointRef]:
        """Store the objects that ``writers`` write (each called once with a binary file-like
        sink: ``write`` and ``flush``), with one group commit: each object is hashed as it is
        written to a temporary file (no copy of it held in memory) and renamed into place under
        its sha256, then all are made durable together (one ``syncfs`` of the filesystem on
        Linux, a fraction of an fsync per object when a worker's queue holds several; ``fsync``
        of each file and its directory for a single object or elsewhere); each written object is
        hashed again from its stored file (a read-only map) while the sync runs, and checked
        against the hash of what was written. Large writes are hashed while they are written (a
        helper thread: on a free core, hashing and I/O overlap). An object already stored intact
        is left as it is (its temporary file removed) but made durable with the group: it may
        have been renamed into place by an earlier call that failed before its sync (a retry
        after a writer raised). Returns the refs in order; raises as :meth:`put`, and what a writer
        raises (no temporary file is left)."""
        refs: list[CheckpointRef] = []
        written: list[Path] = []
        written_bytes = 0  # what is hashed again below
        kept: list[Path] = []  # stored intact before this call, perhaps not yet durable
        sync_each = len(writers) == 1 or _syncfs is None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for write in writers:
                fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
                try:
                    with os.fdopen(fd, "wb") as tmp:
                        sink = _HashingSink(tmp)
                        write(sink)
                        ref = sink.hexdigest()
                        target = self.path(ref)
                        if target in written or self._intact(target, ref):
                            refs.append(CheckpointRef(ref=ref, size=sink.size))
                            if target not in written:
                                kept.append(target)
                            raise _Stored
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp_name, target)
                except _Stored:
                    Path(tmp_name).unlink(missing_ok=True)
                    continue
                except BaseException:
                    Path(tmp_name).unlink(missing_ok=True)
                    raise
                refs.append(CheckpointRef(ref=ref, size=sink.size))
                written.append(target)
                written_bytes += sink.size
            # the stored files are hashed again while they are made durable (a kept one's fsync
            # returns at once: it is clean unless an earlier call failed before its sync)
            def verify() -> dict[Path, str]:
                return {t: file_sha256(t) for t in written}

            sync = functools.partial(self._sync, [*written, *kept], sync_each)
            if written_bytes >= _BESIDE_BYTES:
                stored_hash = _beside(verify, sync)[0]
            else:  # small: a helper thread's hand-over would cost more than it saves
                sync()
                stored_hash = verify()
            actual = [stored_hash.get(self.path(r.ref), r.ref) for r in refs]
        except OSError as exc:
            size = sum(r.size for r in refs)
            raise StorageError(f"writing {len(writers)} checkpoint(s) ({size} bytes written) under {self.root} "
                               f"failed: {exc}") from exc
        for r, got in zip(refs, actual):
            if got != r.ref:
                raise CheckpointCorrupt(r.ref, got)
        return refs

    def _sync(self, paths: list[Path], each: bool) -> None:
        """Make the files ``paths`` durable: an fsync of each and of their directories, or
        (``each`` False) one syncfs of the filesystem."""
        if each:
            for path in paths:
                self._fsync(path)
            for directory in {path.parent for path in paths}:
                self._fsync(directory)
        elif paths:
            self._syncfs()

    def _syncfs(self) -> None:
        assert _syncfs is not None
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(self.root))
        finally:
            os.close(fd)

    def get(self, ref: str) -> bytes:
        """Return the bytes of object ``ref`` after checking their hash.

        Raises CheckpointMissing when absent, CheckpointCorrupt when the bytes
        hash to something else, StorageError when the disk cannot be read.
        """
        with self._reading(ref):
            data = self.path(ref).read_bytes()
        actual = sha256_hex(data)
        if actual != ref:
            raise CheckpointCorrupt(ref, actual)
        return data

    def load(self, ref: str, use: Callable[[LoadedBytes], _T]) -> _T:
        """Return ``use(bytes)`` of object ``ref`` (:class:`LoadedBytes`), once they hash to
        ``ref``: :meth:`load_pending`, checked. Nothing ``use`` returns from bytes that do not
        verify is returned.

        Raises CheckpointMissing when absent, CheckpointCorrupt when the bytes hash to something
        else (whatever ``use`` did with them), StorageError when the disk cannot be read;
        else what ``use`` raises.
        """
        value, verification = self.load_pending(ref, use)
        verification.check()
        return value

    def load_pending(self, ref: str, use: Callable[[LoadedBytes], _T]) -> tuple[_T, Verification]:
        """``use(bytes)`` of object ``ref`` (:class:`LoadedBytes`), and the :class:`Verification`
        that they hash to ``ref``, which may still be running: how a worker loads a checkpoint
        (``use``: :meth:`LoadedBytes.decode`, or that and the trainer's restore), and goes on
        training before the hash ends, publishing nothing derived from the bytes until it is
        checked (:func:`events.execution.run_path`).

        The object is read into memory this store keeps for the next load (:class:`LoadMemory`:
        a memory file that :meth:`LoadedBytes.decode` maps, from 1 MiB on Linux), hashed on a
        helper thread as it is read, while ``use`` runs and after it returns (sha256 of 100 MB:
        0.056 s here), so a load of 100 MB into a trainer returns after about 0.05 s (reading,
        decoding and copying, beside the hash), not their sum with the hash (0.1 s). ``use`` may
        act on the bytes before they verify: what it does must be undone when they do not.
        Loads through one store run one at a time; the next one waits until this one's bytes
        are hashed.

        Raises CheckpointMissing when absent, StorageError when the disk cannot be read;
        else, once the bytes are hashed, CheckpointCorrupt when ``use`` raised and they hash to
        something else, else what ``use`` raised.
        """
        path = self.path(ref)
        with self._memory.turn():
            with self._reading(ref), open(path, "rb", buffering=0) as file:
                read = self._memory.read(os.fstat(file.fileno()).st_size, file.readinto)
            return self._memory.use(ref, read, use)

    @contextmanager
    def _reading(self, ref: str) -> Iterator[None]:
        """Translate what reading object ``ref`` raises: CheckpointMissing when it is absent,
        StorageError when the disk cannot be read (:meth:`get` and :meth:`load_pending`)."""
        try:
            yield
        except FileNotFoundError:
            raise CheckpointMissing(ref) from None
        except OSError as exc:
            raise StorageError(f"reading checkpoint {ref} under {self.root} failed: {exc}") from exc

    def exists(self, ref: str) -> bool:
        """Return whether an object is stored under ``ref`` (its bytes are not checked)."""
        return self.path(ref).is_file()

    def delete(self, ref: str) -> None:
        """Remove object ``ref``; a no-op when it is absent."""
        self.path(ref).unlink(missing_ok=True)

    @staticmethod
    def _intact(path: Path, ref: str) -> bool:
        try:
            return file_sha256(path) == ref
        except FileNotFoundError:
            return False

    @staticmethod
    def _fsync(path: Path) -> None:
        """fsync the file or directory at ``path``."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _canonical(obj: Any) -> Any:
    """A copy of ``obj`` whose pickle depends only on its value and structure.

    Pickle writes a repeated object (same ``id``) as a back-reference, so
    bytes would depend on which equal strings happen to be one object (a
    straight run shares the literal ``"lr"`` between the optimizer and the
    hyper-parameter values, a restored run does not). Hence: every dict,
    list and tuple is a fresh copy (never shared), every str is interned
    (always shared), every tensor is moved to the CPU (tensors already there
    are kept, so storages shared by several tensors stay shared). Dict
    attributes (the ``_metadata`` of a module state dict) are kept.
    """
    import torch  # here, not at the top: reading logs and serving the dashboard need no torch

    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else obj.detach().cpu()
    if type(obj) is str:
        return sys.intern(obj)
    if isinstance(obj, dict):
        copied = type(obj)()
        copied.update((_canonical(key), _canonical(value)) for key, value in obj.items())
        for name, value in getattr(obj, "__dict__", {}).items():
            setattr(copied, _canonical(name), _canonical(value))
        return copied
    if isinstance(obj, (list, tuple)):
        return type(obj)(_canonical(value) for value in obj)
    return obj


@dataclass(frozen=True)
class Snapshot:
    """A copy of a state taken by :class:`SnapshotBuffers` (``state``), the pooled storages it is
    made of (``buffers``), lent until :meth:`SnapshotBuffers.give_back`, and the bytes of every
    storage it copied (``nbytes``; 0 for a state that is not a copy)."""

    state: Any
    buffers: tuple[Any, ...]
    nbytes: int = 0


class SnapshotBuffers:
    """Storages that a worker's snapshots reuse, one snapshot after the next.

    Copying 100 MB of tensors into freshly allocated memory costs about five times the copy
    itself here (the new pages are faulted in one by one: 70 ms against 14 ms); a storage of at
    least ``min_bytes`` is therefore copied into a buffer of the same size kept from an earlier
    snapshot that was given back (allocated when none is free; at most ``keep`` of a size are
    kept). Thread-safe: a worker takes on its training thread and gives back on its writer
    thread once the snapshot is encoded.
    """

    def __init__(self, min_bytes: int = 1 << 20, keep: int = 2) -> None:
        self.min_bytes, self.keep = min_bytes, keep
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def take(self, obj: Any) -> Snapshot:
        """A copy of ``obj`` as :func:`snapshot_state` makes, its large CPU storages in pooled
        buffers (returned in the Snapshot, to give back)."""
        lent: list[Any] = []
        copied = 0

        def copy_storage(source: Any) -> Any:
            nonlocal copied
            nbytes = source.nbytes()
            copied += nbytes
            if nbytes < self.min_bytes:
                return source.clone()
            with self._lock:
                free = self._free.get(nbytes)
                buffer = free.pop() if free else None
            if buffer is None:
                buffer = type(source)(nbytes)
            buffer.copy_(source)
            lent.append(buffer)
            return buffer

        state = _copy_state(obj, {}, copy_storage)
        return Snapshot(state, tuple(lent), copied)

    def give_back(self, snapshot: Snapshot) -> None:
        """Return ``snapshot``'s buffers to the pool: nothing may read ``snapshot.state`` after."""
        with self._lock:
            for buffer in snapshot.buffers:
                free = self._free.setdefault(buffer.nbytes(), [])
                if len(free) < self.keep:
                    free.append(buffer)


def _copy_state(obj: Any, memo: dict[Any, Any], copy_storage: Callable[[Any], Any]) -> Any:
    """The copy of :func:`snapshot_state`: containers copied (dict subclasses with their
    attributes), each plain strided CPU tensor's whole storage copied once by ``copy_storage``
    (tensors sharing a storage share the copy, as ``torch.save`` sees them: by ``_cdata``) and
    viewed with the same dtype, offset, size, stride and ``requires_grad``; anything else
    (other tensors included) by ``copy.deepcopy`` with the shared memo."""
    import torch

    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        plain = (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
                 and not obj.is_quantized and not obj.is_conj() and not obj.is_neg() and not obj.__dict__
                 and not obj._backward_hooks)
        if plain:
            source = obj.untyped_storage()
            key = ("storage", source._cdata)
            if key not in memo:
                memo[key] = copy_storage(source)
            copied = torch.empty(0, dtype=obj.dtype).set_(memo[key], obj.storage_offset(), obj.size(),
                                                          obj.stride())
            if obj.requires_grad:
                copied.requires_grad_(True)
        else:
            copied = copy.deepcopy(obj, memo)
        memo[id(obj)] = copied
        return copied
    if isinstance(obj, dict):
        result = type(obj)()
        result.update((key, _copy_state(value, memo, copy_storage)) for key, value in obj.items())
        for name, value in getattr(obj, "__dict__", {}).items():
            setattr(result, name, _copy_state(value, memo, copy_storage))
        return result
    if type(obj) in (list, tuple):
        return type(obj)(_copy_state(value, memo, copy_storage) for value in obj)
    return copy.deepcopy(obj, memo)


def state_bytes(obj: Any) -> int:
    """The bytes of the distinct tensor storages in a state (as :func:`encode_state` takes:
    dicts, with their attributes, lists and tuples of tensors and plain values), on any device:
    about the size of its encoding, without encoding it (an estimate, short of the format's
    header and the plain values)."""
    import torch

    seen: set[tuple[str, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
            stack.extend(getattr(item, "__dict__", {}).values())
        elif type(item) in (list, tuple):
            stack.extend(item)
    return total


def snapshot_state(obj: Any) -> Any:
    """A copy of a state (as :func:`encode_state` takes) that stays as it is while the original
    changes in place (training goes on): containers copied, every tensor's whole storage copied
    once (tensors sharing a storage share the copy) with its dtype, device, view and
    ``requires_grad``, so ``encode_state(snapshot_state(x)) == encode_state(x)`` bit for bit.
    One memory copy of the tensors, against a full serialization for :func:`encode_state`; the
    encoding can then run on another thread. :class:`SnapshotBuffers` makes the same copy
    into reused memory. Raises what ``copy.deepcopy`` raises for an object it cannot copy.
    """
    return _copy_state(obj, {}, lambda storage: storage.clone())


def encode_state(obj: Any) -> bytes:
    """Serialize a state (tensors, numbers, str, bool, None, dict/list/tuple) with ``torch.save``.

    Tensors are moved to the CPU first, so the bytes do not depend on the
    device, and equal states give equal bytes however their Python objects
    happen to be shared.
    """
    buffer = io.BytesIO()
    write_state(obj, buffer)
    return buffer.getvalue()


def write_state(obj: Any, file: BinaryIO) -> None:
    """Write the bytes of :func:`encode_state` to the binary file-like ``file`` (``write`` and
    ``flush``), as ``torch.save`` makes them (no copy of the whole encoding held in memory)."""
    import torch

    torch.save(_canonical(obj), file)


def decode_state(data: bytes | memoryview) -> Any:
    """Inverse of ``encode_state``: ``torch.load(weights_only=True, map_location="cpu")``.

    ``data``: the bytes, or a view of them (read without a copy of the whole; every storage is
    copied out of it, so the view may be reused afterwards).

    Raises CheckpointError when ``data`` is not a checkpoint or holds objects
    that ``weights_only`` loading refuses.
    """
    import torch

    view = memoryview(data)
    try:
        return torch.load(_ViewReader(view), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"cannot decode checkpoint state ({view.nbytes} bytes): {exc}") from exc


def _decode_mapped(path: str, what: str) -> Any:
    """:func:`decode_state` of the file at ``path`` by mapping it privately (copy-on-write:
    ``torch.load(mmap=True)``), no tensor copied. Raises CheckpointError naming ``what``."""
    import torch

    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"cannot decode {what}: {exc}") from exc


class HeldState:
    """A state encoded once (as :func:`encode_state` encodes it) and kept in host memory, to be
    decoded again and again: each :meth:`decode` gives tensors of their own (changing them
    changes neither the kept state nor what the next :meth:`decode` gives).

    On Linux the encoding is kept in an anonymous memory file and decoded by mapping it
    (``torch.load(mmap=True)``: private, copy-on-write), so a decode copies no tensor until it is
    written: a restore into a model of 100 MB takes 14 to 30 ms here, against 55 ms to decode
    the bytes and 10 ms to copy them in. Elsewhere it is kept as bytes and decoded with
    :func:`decode_state`. Costs the size of the encoding in host memory until :meth:`close`.

    Raises what :func:`write_state` raises for a state it cannot encode; :meth:`decode` raises
    CheckpointError when the kept encoding cannot be decoded.
    """

    def __init__(self, state: Any) -> None:
        self._fd: int | None = None
        self._data = b""
        if _memory_files():
            fd = os.memfd_create("stagetree-state", os.MFD_CLOEXEC)
            try:
                with open(fd, "wb", closefd=False) as file:
                    write_state(state, file)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            self._closing = weakref.finalize(self, os.close, fd)
        else:
            self._data = encode_state(state)

    def decode(self) -> Any:
        """The state, decoded (tensors on the CPU)."""
        if self._fd is None:
            return decode_state(self._data)
        return _decode_mapped(f"/proc/self/fd/{self._fd}", "the held state")

    def close(self) -> None:
        """Let the encoding's memory go (tensors decoded from it stay valid); also when this
        object is collected."""
        if self._fd is not None:
            self._closing()
        self._fd, self._data = None, b""


class _ViewReader(io.RawIOBase):
    """A seekable binary reader over a bytes-like view that copies only what is read:
    ``io.BytesIO`` copies a view (not ``bytes``) whole first, and ``torch.load`` reads each
    storage with ``readinto`` straight into the tensor's memory."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.position = view.cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self.view[self.position:self.position + target.nbytes]
        target[:chunk.nbytes] = chunk
        self.position += chunk.nbytes
        return chunk.nbytes

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.view.nbytes}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position
