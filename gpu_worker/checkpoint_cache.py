"""A node-local cache of checkpoints in front of a remote checkpoint store (an object store).

The store of record stays the remote one: a checkpoint is saved there, verified as before
(DESIGN.md invariant 4), and only its events name it. The cache keeps a copy of each checkpoint
a worker of this node saved (written once the save is stored) or downloaded (written from the
memory it was read into, kept only when it hashes to its ref), on a thread of lowest CPU
priority, in a local directory, so that a later load of it by any worker of the node (a sibling
branch of a stage tree, a branch point that workers of several nodes load, a path resumed after
a failure) reads the local copy instead of downloading it: a copy is a cache, never a source of
truth, so it is written without a sync, and a damaged or missing one costs a download, never a
result.

A cached load is read and hashed like a local store's (:meth:`LocalCheckpointStore.load_pending
<gpu_worker.checkpoint.LocalCheckpointStore.load_pending>`: ``use`` runs while the bytes are
hashed). When a cached copy does not hash to its ref, the copy is deleted and
:class:`CachedCopyCorrupt` is raised, a :class:`~gpu_worker.checkpoint.StorageError`: a fault of
this node's disk, not of the checkpoint, so the worker retries (the retry downloads it) or hands
its path back to be dispatched again, and the checkpoint is not dropped from the plan.

The directory holds at most ``budget_bytes`` of copies (each named by its ref, like a local
store's objects): beyond it, the least recently used ones (by modification time, which a hit
renews) are deleted down to :data:`EVICT_TO` of it. Several worker processes of one node may
share a directory: copies are written to a temporary name and renamed into place, the bytes
they hold are tallied in one file of the directory under a lock (:data:`TALLY`), and the process
whose copy takes the tally past the budget scans the directory and evicts, under that lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

from gpu_worker.checkpoint import (
    _BESIDE_BYTES,
    _READ_CHUNK,
    CheckpointCorrupt,
    CheckpointMissing,
    CheckpointRef,
    CheckpointStore,
    LoadedBytes,
    LocalCheckpointStore,
    StorageError,
    Verification,
    _check_ref,
    _write_all,
    sha256_hex,
    use_pending,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

COPY_BACKLOG_BYTES = 256 << 20
"""Bytes of checkpoints that may wait for their copy (their bytes stay in memory until it is
written: a saved checkpoint's, or the memory file a download was read into); a checkpoint that
would go beyond gets no copy (one always may)."""

DEFAULT_BUDGET_BYTES = 10 << 30
"""Bytes of copies a cache holds by default (10 GiB)."""

STRAY_TEMP_S = 3600.0
"""A temporary file of the cache directory older than this (seconds) is a copy whose writer
died: deleted when the copies are counted."""

TALLY = ".held"
"""The file in a cache directory holding the bytes of its copies, as the processes sharing it
count them (under an exclusive lock of it, :meth:`CachedCheckpointStore._count`)."""

EVICT_TO = 0.9
"""When copies exceed the budget, the least recently used are deleted until they hold at most
this share of it (so a full cache scans its directory once per tenth of its budget written,
by whichever processes write, not at every save)."""


class CachedCopyCorrupt(StorageError):
    """The cache's copy of checkpoint ``ref`` at ``path`` hashes to ``actual``: it was deleted.
    A fault of this node's disk (the remote object is not involved): retried, never a reason to
    drop the checkpoint from the plan."""

    def __init__(self, ref: str, path: Path, actual: str) -> None:
        super().__init__(f"the cached copy {path} of checkpoint {ref} is damaged (its bytes hash to {actual}); "
                         "it was deleted and the checkpoint is read from the store")
        self.ref, self.path, self.actual = ref, path, actual

    def __reduce__(self) -> tuple[type, tuple[str, Path, str]]:  # type: ignore[override]
        return type(self), (self.ref, self.path, self.actual)


class _CachedVerification(Verification):
    """The :class:`Verification` of a load from a cached copy: a mismatch deletes the copy and
    raises :class:`CachedCopyCorrupt` instead of CheckpointCorrupt."""

    def __init__(self, inner: Verification, damaged: Callable[[CheckpointCorrupt], CachedCopyCorrupt]) -> None:
        super().__init__(inner.ref, inner._digest)
        self._damaged = damaged

    def check(self) -> None:
        try:
            super().check()
        except CheckpointCorrupt as exc:
            raise self._damaged(exc) from None


class _Downloaded:
    """The bytes of a checkpoint downloaded into a store's load memory (a memory file: ``fd``
    is a descriptor of its own on it, ``size`` bytes long), to be copied into the cache. The
    store reads its next object into the same memory, so by the time the copy is written they
    may be another checkpoint's, or cut short: the copier hashes what it reads and keeps the copy
    only when it hashes to the ref."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    @classmethod
    def of(cls, loaded: LoadedBytes) -> _Downloaded | bytes | None:
        """What to copy of ``loaded`` once ``use`` has it: a descriptor of its memory file, the
        bytes themselves when they are small (under 1 MiB, as a local store reads them: a
        buffer), else None (no memory file to read them from again: no copy)."""
        if loaded.path is not None:
            try:
                return cls(os.open(loaded.path, os.O_RDONLY | os.O_CLOEXEC), loaded.view.nbytes)
            except OSError:
                return None
        return bytes(loaded.view) if loaded.view.nbytes < _BESIDE_BYTES else None

    def close(self) -> None:
        os.close(self.fd)

    def write(self, file: Any) -> str:
        """Write the bytes into ``file`` and return their sha256 hex digest (a read that comes
        short, the memory file cut by the next load, ends them early: the digest shows it)."""
        hasher, buffer, offset = hashlib.sha256(), bytearray(min(self.size, _READ_CHUNK)), 0
        while offset < self.size:
            n = os.preadv(self.fd, [memoryview(buffer)[:min(len(buffer), self.size - offset)]], offset)
            if n <= 0:
                break
            chunk = memoryview(buffer)[:n]
            hasher.update(chunk)
            file.write(chunk)
            offset += n
        return hasher.hexdigest()


class CachedCheckpointStore:
    """A :class:`~gpu_worker.checkpoint.CheckpointStore`: ``store`` (the store of record, e.g.
    :class:`~gpu_worker.object_store.S3CheckpointStore`) behind a cache of copies in the local
    directory ``root`` holding at most ``budget_bytes`` (see the module's docstring).

    ``put``/``put_many`` store in ``store`` (verified there), then the copies are written here
    in the background (no sync: a copy is only a cache; :meth:`copies_written` waits for them);
    ``load_pending``/``load``/``get`` read a copy when there is one, else ``store``, and keep a
    copy of what they downloaded (written likewise, kept when it hashes to its ref); ``exists``
    asks ``store``; ``delete`` deletes both.

    Raises ValueError when ``budget_bytes`` is not a positive int. A copy that cannot be
    written (a full disk) is logged and skipped: the save itself stands. A checkpoint larger
    than :data:`EVICT_TO` of the budget gets no copy (it would evict itself).
    """

    def __init__(self, store: CheckpointStore, root: Path | str, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"`budget_bytes` of the checkpoint cache is {budget_bytes!r}, but must be an int > 0")
        self.store = store
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        # copies are read as the local store reads its objects, into the store of record's load
        # memory when it has one (one memory file kept for loads, not two)
        self._copies = LocalCheckpointStore(self.root, memory=getattr(store, "_memory", None))
        self._lock = threading.Lock()
        self._backlog = 0  # bytes of checkpoints waiting for their copy
        self._copier: futures.ThreadPoolExecutor | None = None
        self._copier_pid = 0
        self._waiting: dict[str, bytes] = {}  # ref -> the bytes of a checkpoint whose copy waits

    def __repr__(self) -> str:
        return f"CachedCheckpointStore({self.store!r}, root={str(self.root)!r}, budget_bytes={self.budget_bytes})"

    def path(self, ref: str) -> Path:
        """The path of the copy of ``ref`` (ValueError on a malformed ref)."""
        return self._copies.path(ref)

    # ------------------------------------------------------------------ writes

    def put(self, data: bytes) -> CheckpointRef:
        """Store ``data`` in the store of record and keep a copy here (:meth:`put_many`)."""
        return self.put_many([data])[0]

    def put_many(self, datas: Sequence[bytes]) -> list[CheckpointRef]:
        """Store ``datas`` in the store of record (its ``put_many`` when it has one); returns the
        refs in order once it has them, and raises what it raises (no copy is then kept). A copy
        of each is then written here on a thread of lowest CPU priority (nice 19), after this
        returns: writing 100 MB into the page cache takes 0.16 to 0.24 s of CPU on this project's
        2-core machine, which would otherwise slow the training beside it (and delay the saved
        event). Copies waiting to be written hold at most :data:`COPY_BACKLOG_BYTES` of
        checkpoints (always one): beyond, a checkpoint gets no copy."""
        put_many = getattr(self.store, "put_many", None)
        refs = list(put_many(datas)) if put_many is not None else [self.store.put(d) for d in datas]
        for data, ref in zip(datas, refs):
            self._copy_later(data, ref.ref, verified=True)
        return refs

    def _copy_later(self, data: bytes | _Downloaded, ref: str, verified: bool = False) -> None:
        """Queue the copy of ``data`` under ``ref`` for the copier thread, unless the backlog is
        full or the copy alone would be evicted (over :data:`EVICT_TO` of the budget).
        ``verified``: bytes known to hash to ``ref`` (a save's, which the store verified, or what
        the store's ``get`` checked): written as they are, and loads take them from memory
        meanwhile; else bytes read back from a download's memory (hashed as they are written,
        kept only when they hash to ``ref``)."""
        size = data.size if isinstance(data, _Downloaded) else len(data)
        with self._lock:
            if size > self.budget_bytes * EVICT_TO or (self._backlog and self._backlog + size > COPY_BACKLOG_BYTES):
                log.debug("checkpoint cache: no copy of %s (%d bytes; %d bytes of copies wait already; budget %d)",
                          ref, size, self._backlog, self.budget_bytes)
                if isinstance(data, _Downloaded):
                    data.close()
                return
            self._backlog += size
            if verified and isinstance(data, bytes):
                self._waiting[ref] = data
            if self._copier is None or self._copier_pid != os.getpid():  # none yet, or a forked child's
                self._copier = futures.ThreadPoolExecutor(1, thread_name_prefix="stagetree-cache",
                                                          initializer=_lowest_priority)
                self._copier_pid = os.getpid()
            self._copier.submit(self._copy, data, ref, size, verified)

    def copies_written(self) -> None:
        """Wait until every copy queued so far is written (or skipped): the one copier thread
        takes them in order, so a task queued now runs after them."""
        with self._lock:
            copier = self._copier if self._copier_pid == os.getpid() else None
        if copier is not None:
            copier.submit(lambda: None).result()

    def _copy(self, data: bytes | _Downloaded, ref: str, size: int, verified: bool) -> None:
        """Write the copy of ``data`` under ``ref`` (the copier thread): to a temporary file,
        renamed into place (atomic: a reader sees no copy or all of it), unless downloaded bytes
        do not hash to ``ref`` (their memory was read into again before this ran: no copy); an
        OSError is logged and the copy skipped. Then count the copies, when due
        (:meth:`_evict`)."""
        tmp: Path | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
            tmp = Path(name)
            with os.fdopen(fd, "wb") as file:
                if isinstance(data, _Downloaded):
                    digest = data.write(file)
                else:
                    _write_all(file, data)
                    digest = ref if verified else sha256_hex(data)
            if digest != ref:
                log.debug("checkpoint cache: no copy of %s (its memory held other bytes by then)", ref)
                tmp.unlink()
                return
            target = self.path(ref)
            target.parent.mkdir(exist_ok=True)
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("checkpoint cache: no copy kept under %s: %s", self.root, exc)
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            return
        finally:
            if isinstance(data, _Downloaded):
                data.close()
            with self._lock:
                self._backlog -= size
                if self._waiting.get(ref) is data:
                    del self._waiting[ref]
        self._count(size)

    def _count(self, size: int) -> None:
        """Add ``size`` bytes (a copy just written) to the tally the processes sharing the
        directory keep in its :data:`TALLY` file, under an exclusive lock of it; when there is
        no tally yet or it passes the budget, count the copies and evict (:meth:`_evict`) under
        that lock, and keep what is left as the tally. Each process counting only its own copies
        let the directory grow to the budget once per process (37 copies, 1.64x a 2 MB budget,
        with 2 workers). A copy replaced or deleted after it was counted leaves the tally above
        the bytes held: the next count, sooner than due, corrects it. An OSError is logged (the
        copy stands; the next count sees it)."""
        try:
            fd = os.open(self.root / TALLY, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            log.warning("checkpoint cache: cannot open the tally under %s: %s", self.root, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released with the descriptor, also by a process that dies
            text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            held = int(text) + size if text.isdigit() else None
            if held is None or held > self.budget_bytes:
                held = self._evict()
            if held is not None:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(held).encode(), 0)
        except OSError as exc:
            log.warning("checkpoint cache: cannot keep the tally under %s: %s", self.root, exc)
        finally:
            os.close(fd)

    def _evict(self) -> int | None:
        """Count the copies in the directory (every process's) and, beyond the budget, delete
        the least recently used down to :data:`EVICT_TO` of it; delete temporary files older
        than :data:`STRAY_TEMP_S` (left by a process killed while it wrote a copy). Returns the
        bytes of copies left (None when the directory could not be read)."""
        copies: list[tuple[float, int, Path]] = []
        stray_before = time.time() - STRAY_TEMP_S
        try:
            for shard in self.root.iterdir():
                if shard.name.startswith(".tmp-"):
                    try:
                        if shard.stat().st_mtime < stray_before:
                            shard.unlink()
                    except FileNotFoundError:
                        pass
                elif shard.is_dir() and len(shard.name) == 2:
                    for entry in os.scandir(shard):
                        try:
                            st = entry.stat()
                        except FileNotFoundError:  # evicted by another process meanwhile
                            continue
                        copies.append((st.st_mtime, st.st_size, Path(entry.path)))
        except OSError as exc:
            log.warning("checkpoint cache: cannot count the copies under %s: %s", self.root, exc)
            return None
        held = sum(size for _, size, _ in copies)
        if held > self.budget_bytes:
            copies.sort(key=lambda c: c[0])
            for _, size, path in copies:
                if held <= self.budget_bytes * EVICT_TO:
                    break
                path.unlink(missing_ok=True)
                held -= size
        return held

    # ------------------------------------------------------------------ reads

    def load_pending(self, ref: str, use: Callable[[LoadedBytes], _T]) -> tuple[_T, Verification]:
        """``use`` of the bytes of checkpoint ``ref`` and the :class:`Verification` that they hash
        to ``ref``, which may still be running: from the bytes of a checkpoint whose copy is
        still waiting to be written, else from the copy here when there is one (a hit renews
        it), else from the store of record (its ``load_pending``, else ``get``), whose bytes
        are then copied here (:meth:`_from_store`).

        Raises what the store's ``load_pending`` raises; :class:`CachedCopyCorrupt` (a
        StorageError) when ``use`` failed on a copy that does not hash to ``ref`` (the copy is
        deleted: a retry reads the store); the returned verification raises it too, in
        place of CheckpointCorrupt."""
        _check_ref(ref)
        with self._lock:
            waiting = self._waiting.get(ref)
        if waiting is not None:  # saved here moments ago: its bytes are still in memory
            return use_pending(ref, waiting, use)
        try:
            value, verification = self._copies.load_pending(ref, use)
        except CheckpointMissing:
            return self._from_store(ref, use)
        except CheckpointCorrupt as exc:  # use failed on damaged bytes
            raise self._damaged(exc) from None
        except StorageError as exc:  # this disk failed: the store still has it
            log.warning("checkpoint cache: %s", exc)
            return self._from_store(ref, use)
        self._renew(ref)
        return value, _CachedVerification(verification, self._damaged)

    def _from_store(self, ref: str, use: Callable[[LoadedBytes], _T]) -> tuple[_T, Verification]:
        """``use`` of checkpoint ``ref`` downloaded from the store of record, and a copy of it
        queued for the copier: from the memory the store read it into (a descriptor of its
        memory file is taken before ``use`` runs; the copy is kept only when what the copier
        reads hashes to ``ref``, since the store may have read its next object there by then),
        or from the bytes ``get`` returned (checked by it)."""
        load_pending = getattr(self.store, "load_pending", None)
        if load_pending is None:
            data = self.store.get(ref)
            self._copy_later(data, ref, verified=True)
            return use(LoadedBytes(memoryview(data))), Verification.passed(ref)
        kept: list[_Downloaded | bytes | None] = []

        def use_and_keep(loaded: LoadedBytes) -> _T:
            kept.append(_Downloaded.of(loaded))
            return use(loaded)

        try:
            value, verification = load_pending(ref, use_and_keep)
        except BaseException:
            for held in kept:
                if isinstance(held, _Downloaded):
                    held.close()
            raise
        if kept and kept[0] is not None:
            self._copy_later(kept[0], ref)
        return value, verification

    def load(self, ref: str, use: Callable[[LoadedBytes], _T]) -> _T:
        """:meth:`load_pending`, checked: ``use`` of bytes that hash to ``ref``."""
        value, verification = self.load_pending(ref, use)
        verification.check()
        return value

    def get(self, ref: str) -> bytes:
        """The bytes of checkpoint ``ref``, checked: the copy here when it verifies (a damaged
        one is deleted), else the store's ``get`` (a copy of them is then written here)."""
        try:
            data = self._copies.get(ref)
        except CheckpointCorrupt as exc:
            self._damaged(exc)
        except (CheckpointMissing, StorageError):
            pass
        else:
            self._renew(ref)
            return data
        data = self.store.get(ref)
        self._copy_later(data, ref, verified=True)
        return data

    def exists(self, ref: str) -> bool:
        """Whether the store of record holds ``ref`` (a copy here does not count)."""
        return self.store.exists(ref)

    def delete(self, ref: str) -> None:
        """Delete ``ref`` from the store of record, then its copy here."""
        self.store.delete(ref)
        self._copies.delete(ref)

    def _renew(self, ref: str) -> None:
        try:
            os.utime(self.path(ref))
        except OSError:
            pass  # evicted meanwhile

    def _damaged(self, exc: CheckpointCorrupt) -> CachedCopyCorrupt:
        """Delete the damaged copy of ``exc.ref``; the error to raise for it."""
        path = self.path(exc.ref)
        path.unlink(missing_ok=True)
        log.warning("checkpoint cache: deleted the damaged copy %s (hashes to %s)", path, exc.actual)
        return CachedCopyCorrupt(exc.ref, path, exc.actual)


def cached(store: Any, root: str | os.PathLike[str] | None, budget_bytes: int | None) -> Any:
    """``store`` behind a :class:`CachedCheckpointStore` in ``root`` when ``root`` is given (a
    local store is returned as it is: its objects are local already)."""
    if not root or isinstance(store, LocalCheckpointStore):
        return store
    return CachedCheckpointStore(store, Path(root), budget_bytes if budget_bytes is not None else DEFAULT_BUDGET_BYTES)


def _lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; Linux: per thread), so that its
    work takes only what training and uploads leave; where that fails, it stays as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
