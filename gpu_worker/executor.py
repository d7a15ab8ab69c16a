"""Executing a dispatched path: load the source checkpoint, train its stages, report results.

The executor only does what the dispatch says (DESIGN.md: decisions live in the scheduler).
For each stage it trains ``[from_step, to_step)`` with the stage's hyper-parameter functions,
keeping the weights in memory from one stage to the next (Hippo §4.3 batching), evaluates at
``to_step`` when asked, writes the central checkpoint (verified by sha256 *before* the
CheckpointSaved event is emitted: invariant 4), and emits the stage's end (its metrics, the
checkpoint and StageFinished with the measured seconds) as one atomic batch. Clocks are read
here, at the edge, and the measurements travel in the events.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, TypeVar

import torch
from opentelemetry.trace import SpanKind

from events import topics, tracing
from events.execution import (
    Control,
    Emit,
    EndBatches,
    Saved,
    SaveHandle,
    SourceCheck,
    StageFault,
    describe_error,
    run_path,
)
from events.models import Event, StageDispatched, StageSpec
from gpu_worker.checkpoint import (
    STORAGE_ATTEMPTS,
    STORAGE_BACKOFF_S,
    CheckpointCorrupt,
    CheckpointMissing,
    CheckpointStore,
    HeldState,
    LoadedBytes,
    Snapshot,
    SnapshotBuffers,
    StorageError,
    Verification,
    encode_state,
    retry_storage,
    state_bytes,
    write_state,
)
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer

T = TypeVar("T")


def resolve_device(spec: str = "auto", index: int = 0) -> torch.device:
    """``"auto"``: ``cuda:<index mod device count>`` when CUDA is present, else ``cpu``;
    otherwise the torch device named by ``spec`` (``cpu``, ``cuda:1``, ...).

    Raises:
        ValueError: ``spec`` is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (other torch device
            types, ``mps``, ``meta``, ``cpu:1``, are not ones a worker trains on), or names a CUDA
            device that is absent (no CUDA, or ``N`` >= the number of CUDA devices).
    """
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device(f"cuda:{index % torch.cuda.device_count()}")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"`device` is {spec!r}, but must be auto, cpu or cuda:N ({exc})") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise ValueError(f"`device` is {spec!r}, but must be auto, cpu or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"`device` is {spec!r}, but CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"`device` is {spec!r}, but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


class _Write:
    """A :class:`~events.execution.SaveHandle` over the writer thread's future."""

    def __init__(self, future: Future[tuple[str, int]]) -> None:
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> tuple[str, int]:
        return self.future.result()


class _Writer:
    """The thread storing a worker's checkpoints in the background: it takes every snapshot
    queued when it wakes (at most ``batch``) and stores them with one group commit (``write``:
    a result or the StageFault of each, in order), so a path of short stages is not held by one
    fsync per checkpoint and its training thread neither serializes nor hashes; then hands each
    snapshot to ``done`` (its memory may be reused).

    The snapshots waiting for it are bounded: :meth:`wait_for_room` holds the training thread
    while those queued and in flight hold more than ``backlog_bytes`` with the next one (the
    last one's size), unless none is, so a worker whose stages end faster than its store writes
    (a GPU's short stages, an object store) does not pile copies of its state up in memory."""

    def __init__(self, write: Callable[[list[Snapshot]], list[tuple[str, int] | StageFault]],
                 done: Callable[[Snapshot], None], name: str, batch: int = 32,
                 backlog_bytes: int = 1 << 30) -> None:
        self.write, self.done, self.batch, self.backlog_bytes = write, done, batch, backlog_bytes
        self.queue: queue.SimpleQueue[tuple[Snapshot, Future[tuple[str, int]]]] = queue.SimpleQueue()
        self._room = threading.Condition()
        self._pending = 0  # bytes of the snapshots submitted and not yet written
        self._last = 0  # bytes of the last snapshot submitted: what the next one will likely hold
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def wait_for_room(self) -> None:
        """Return once a snapshot as large as the last one fits in ``backlog_bytes`` beside the
        snapshots not yet written (at once when none is): call before taking a snapshot."""
        with self._room:
            self._room.wait_for(lambda: self._pending == 0 or self._pending + self._last <= self.backlog_bytes)

    def submit(self, snapshot: Snapshot) -> Future[tuple[str, int]]:
        future: Future[tuple[str, int]] = Future()
        with self._room:
            self._pending += snapshot.nbytes
            self._last = snapshot.nbytes
        self.queue.put((snapshot, future))
        return future

    def _run(self) -> None:
        while True:
            jobs = [self.queue.get()]
            while len(jobs) < self.batch:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            snapshots = [snapshot for snapshot, _ in jobs]
            futures = [future for _, future in jobs]
            del jobs
            outcome: list[tuple[str, int] | StageFault] | BaseException
            try:
                outcome = self.write(snapshots)
            except BaseException as exc:  # handed to every waiting stage (a StageFault: "storage")
                outcome = exc
            # The snapshots are let go before any waiting stage is told: once the last write of
            # a path is done its worker may exit, and a thread still freeing tensors then
            # aborts the process ("terminate called without an active exception").
            written = sum(snapshot.nbytes for snapshot in snapshots)
            for snapshot in snapshots:
                self.done(snapshot)
            del snapshots
            with self._room:
                self._pending -= written
                self._room.notify_all()
            for i, future in enumerate(futures):
                result = outcome if isinstance(outcome, BaseException) else outcome[i]
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            del futures, outcome


def _groups(items: list[int], sizes: list[int], limit: int) -> Iterator[list[int]]:
    """``items`` in order, in consecutive groups whose ``sizes[i]`` sum to at most ``limit``
    bytes (an item larger than that alone)."""
    group: list[int] = []
    held = 0
    for i in items:
        if group and held + sizes[i] > limit:
            yield group
            group, held = [], 0
        group.append(i)
        held += sizes[i]
    if group:
        yield group


class _Unencodable(Exception):
    """Writing snapshot ``index`` raised ``cause`` in the trainer's state (not the store)."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.index, self.cause = index, cause


def _fault(exc: CheckpointCorrupt | CheckpointMissing | StorageError, ref: str) -> StageFault:
    """The StageFault of a source checkpoint ``ref`` that could not be loaded."""
    if isinstance(exc, CheckpointCorrupt):
        return StageFault("checkpoint_corrupt", str(exc), ref)
    if isinstance(exc, CheckpointMissing):
        return StageFault("checkpoint_missing", str(exc), ref)
    return StageFault("storage", str(exc))


class _SourceCheck:
    """The :class:`~events.execution.SourceCheck` of a source loaded before its bytes were hashed."""

    def __init__(self, verification: Verification) -> None:
        self.verification = verification

    def result(self) -> None:
        try:
            self.verification.check()
        except (CheckpointCorrupt, StorageError) as exc:  # StorageError: a damaged cached copy
            raise _fault(exc, self.verification.ref) from exc


class PathExecutor:
    """Runs dispatched paths for one worker on one device.

    Args:
        trainer: the study's trainer instance (rebuilt from the seed for every source).
        worker_id: the id written into the events.
        store: where checkpoints are read and written.
        device: the torch device to train on.
        clock: monotonic seconds (measured durations), wall: epoch seconds (event ``ts``).
        storage_attempts: tries of a checkpoint read or write that fails with StorageError (a
            full disk, an unreachable object store) before the path is handed back.
        storage_backoff_s: seconds before the second try, doubled for each further one.
        sleep: how to wait between tries (seconds).
        write_backlog_bytes: bytes of snapshots (copies of the state) that may wait for the writer
            before a stage's save waits for it (one always may): bounds a worker's memory when
            its stages end faster than its store writes (default 1 GiB).

    The session survives between dispatches: when a path starts from the checkpoint this
    worker just saved, the weights in memory are used without reloading (same bytes, same
    result, as invariant 1 guarantees).

    It is the :class:`~events.execution.PathBackend` of the one event sequence of a dispatch
    (:func:`events.execution.run_path`): a stage's StageStarted alone, and its end
    (MetricsReported when it evaluates, CheckpointSaved, StageFinished) as one atomic batch after
    the checkpoint is written and verified.
    """

    PUT_MANY_BYTES = 64 << 20
    """Bytes of snapshots encoded at once for a store's ``put_many`` (a group always holds one):
    the memory that storing several checkpoints together may add to the writer's backlog."""

    def __init__(self, trainer: Trainer, worker_id: str, store: CheckpointStore, device: torch.device,
                 *, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time,
                 storage_attempts: int = STORAGE_ATTEMPTS, storage_backoff_s: float = STORAGE_BACKOFF_S,
                 sleep: Callable[[float], None] = time.sleep, write_backlog_bytes: int = 1 << 30) -> None:
        if isinstance(storage_attempts, bool) or not isinstance(storage_attempts, int) or storage_attempts < 1:
            raise ValueError(f"`storage_attempts` is {storage_attempts!r}, but must be an int >= 1")
        self.trainer = trainer
        self.worker_id = worker_id
        self.store = store
        self.device = device
        self.clock = clock
        self.wall = wall
        self.storage_attempts = storage_attempts
        self.storage_backoff_s = storage_backoff_s
        self.sleep = sleep
        self._session: TrainingSession | None = None
        self._latest: SaveHandle | None = None  # the last checkpoint of the weights in memory
        self._dirty = False  # trained since that checkpoint (or fresh)
        self._seed = 0
        self._built: int | None = None  # the seed the trainer was last built with, while reusable
        self._build_s = 0.0  # seconds the trainer's last build took
        self._fresh_builds = 0  # fresh starts that built the trainer
        self._keep_initial = True  # False once restoring the kept state proved slower than building
        # (seed, encoded state at step 0 after the build, build seconds): a fresh start again
        self._initial: tuple[int, Future[HeldState], float] | None = None
        self._live: SaveHandle | None = None  # the write holding the live state (a path's end)
        self._buffers = SnapshotBuffers()
        self._writer = _Writer(self._put_many, self._buffers.give_back, f"checkpoint-writer-{worker_id}",
                               backlog_bytes=write_backlog_bytes)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint-reader-{worker_id}")

    def stamp(self, event: Event) -> Event:
        """Set producer, timestamp and (when tracing) the current span's context on ``event``."""
        return event.model_copy(update={"producer": f"worker:{self.worker_id}", "ts": self.wall(),
                                        "trace": tracing.carrier()})

    def _stored(self, operation: Callable[[], T]) -> T:
        """``operation()`` (a store read or write), tried ``storage_attempts`` times while it
        raises StorageError, waiting ``storage_backoff_s`` and then twice as long each time."""
        return retry_storage(operation, attempts=self.storage_attempts, backoff_s=self.storage_backoff_s,
                             sleep=self.sleep)

    # ------------------------------------------------------------------ PathBackend (events.execution)

    def begin(self, d: StageDispatched) -> SourceCheck | None:
        """Hold the weights ``d`` starts from; the weights this worker just saved are reused
        without reloading (same bytes, same result, invariant 1).

        A source checkpoint is read and decoded on the reader thread (``store.load_pending``:
        hashed while read, decoded and after, where the store offers it) while the trainer is
        built here. The trainer is not built again when this worker built it with the same seed
        and nothing since left it unusable (a failure, :meth:`abandon`), unless the write of a
        path's end still holds its live state (:meth:`save`): ``TrainingSession.load(
        rebuild=False)``, the same result without the build, here. Either way the bytes of a
        large checkpoint may still be hashed when this returns (100 MB: 0.056 s of sha256
        here): the returned check, which :func:`~events.execution.run_path` waits for before
        the first stage stores or publishes anything, while that stage trains. When they do not
        verify the stage fails as checkpoint_corrupt and the trainer, which holds them, is built
        again for the next path. Returns None when the source is verified already.

        A fresh start likewise restores the state the trainer had right after its build with
        the seed (encoded on the reader thread, kept in host memory: the size of a checkpoint at
        step 0), kept from a build that took at least ``REUSE_MIN_BUILD_S`` and was not the
        worker's first (which also pays for imports and caches: 1.3 s for a trainer that builds
        in 0.2 ms after); once a restore is slower than the build was, builds go on."""
        self._seed = d.seed
        if d.source is not None and self._session is not None and self._held() == (d.seed, d.source.ref):
            return None
        check: SourceCheck | None = None
        reuse = self._built == d.seed and (self._live is None or self._live.done())
        self._session, self._latest, self._dirty, self._built, self._live = None, None, False, None, None
        session = TrainingSession(self.trainer, d.seed, self.device)
        if d.source is None:
            self._start_fresh(session, reuse)
            self._dirty = True  # fresh weights are stored nowhere
        else:
            ref = d.source.ref
            try:
                if reuse:  # into the trainer while the bytes are hashed (it is dropped if they do not verify)
                    verification = self._stored(functools.partial(
                        self._load, ref, functools.partial(self._restore, session)))[1]
                else:  # read and decoded on the reader thread while the trainer is built here
                    fetched = self._reader.submit(self._stored, functools.partial(self._load, ref, LoadedBytes.decode))
                    try:
                        session.load(lambda: fetched.result()[0])
                    except Exception:
                        if fetched.done() and fetched.exception() is None:
                            fetched.result()[1].check()  # damaged bytes are the cause
                        raise
                    verification = fetched.result()[1]
                    del fetched  # the decoded state: it may map the store's memory
                if verification.done():  # small objects are hashed as they are read
                    verification.check()
                else:  # the first stage trains meanwhile (events.execution.run_path)
                    check = _SourceCheck(verification)
            except (CheckpointCorrupt, CheckpointMissing, StorageError) as exc:
                raise _fault(exc, ref) from exc
            self._latest = Saved(ref, 0)
        if session.build_seconds is not None:
            self._build_s = session.build_seconds
        self._session, self._built = session, d.seed
        return check

    REUSE_MIN_BUILD_S = 0.01
    """A trainer whose build takes at least this long (seconds) is kept for the next path
    (a tiny model builds faster than its state decodes or copies): its state at step 0 is kept
    for the next fresh start with the seed, and a path's end writes a copy of its state rather
    than the live one (:meth:`save`), so the next path need not wait for that write."""

    def _start_fresh(self, session: TrainingSession, reuse: bool) -> None:
        """Start ``session`` at step 0: restore the initial state kept from the trainer's build
        with this seed (see :meth:`begin`), else build the trainer and maybe keep its state."""
        initial, self._initial = self._initial, None
        if reuse and initial is not None and initial[0] == session.seed:
            try:
                held = initial[1].result()  # encoded by now, unless the path before was very short
                t0 = self.clock()
                session.load(held.decode, rebuild=False)
                if self.clock() - t0 <= initial[2]:
                    self._initial = initial
                else:
                    self._keep_initial = False  # building is faster
                return
            except Exception:  # the state did not encode or decode: the build below starts anew
                pass  # (an unencodable state fails the stage when it is saved)
        session.start_fresh()
        self._fresh_builds += 1
        built = session.build_seconds or 0.0
        if self._keep_initial and self._fresh_builds > 1 and built >= self.REUSE_MIN_BUILD_S:
            snapshot = session.snapshot(self._buffers)
            self._initial = (session.seed, self._reader.submit(self._hold, snapshot), built)

    def _hold(self, snapshot: Snapshot) -> HeldState:
        """A fresh start's state kept (on the reader thread), its snapshot's buffers given back."""
        try:
            return HeldState(snapshot.state)
        finally:
            self._buffers.give_back(snapshot)

    def _load(self, ref: str, use: Callable[[LoadedBytes], T]) -> tuple[T, Verification]:
        """``use`` of the bytes of checkpoint ``ref``, and the :class:`Verification` that they
        hash to ``ref``, which may still be running (``store.load_pending``: hashed while read,
        used and after, where the store offers it; else verified before ``use``)."""
        load_pending = getattr(self.store, "load_pending", None)
        if load_pending is not None:
            return load_pending(ref, use)  # type: ignore[no-any-return]
        load = getattr(self.store, "load", None)
        value = load(ref, use) if load is not None else use(LoadedBytes(memoryview(self.store.get(ref))))
        return value, Verification.passed(ref)

    @staticmethod
    def _restore(session: TrainingSession, loaded: LoadedBytes) -> None:
        session.load(loaded.decode, rebuild=False)

    def _held(self) -> tuple[int, str] | None:
        """``(seed, ref)`` when the weights in memory are exactly a stored checkpoint."""
        if self._session is None or self._dirty or self._latest is None or not self._latest.done():
            return None
        try:
            return self._seed, self._latest.result()[0]
        except StageFault:
            return None

    def _require(self) -> TrainingSession:
        if self._session is None:
            raise RuntimeError("no weights in hand: begin() was not called or the path failed")
        return self._session

    def step(self) -> int:
        return self._require().step

    def train(self, spec: StageSpec, until: int, interrupt: Callable[[], bool]) -> None:
        session = self._require()
        if until > session.step:
            self._dirty = True  # the weights in memory are no longer a stored checkpoint
        session.train(spec.hp, until, interrupt)

    def evaluate(self, spec: StageSpec, step: int) -> dict[str, float]:
        return self._require().evaluate()

    def save(self, waited: bool = False) -> SaveHandle | None:
        """Snapshot the weights in memory unless they are a stored checkpoint already (a memory
        copy of the tensors, here on the training thread: ``TrainingSession.snapshot``), and store
        the snapshot on the writer thread: encoded, hashed, written and verified by sha256 before
        the handle completes (and before the event that names it), while the next stage trains.
        ``waited`` (a path's end) of a trainer that builds in under ``REUSE_MIN_BUILD_S``: the
        live weights are handed to the writer without the copy. Nothing trains them before the
        write is verified: the next path reuses them only as the checkpoint this write verified,
        and builds a trainer or loads its own otherwise (:meth:`begin`). A trainer that takes
        longer to build is copied (a memory copy, against a build), so the next path may load
        into it at once. Before a copy, waits until the writes already queued leave room for it
        (``write_backlog_bytes``)."""
        if not self._dirty:
            return None
        session = self._require()
        live = waited and self._build_s < self.REUSE_MIN_BUILD_S
        if live:
            snapshot = Snapshot(session.state(), ())
        else:
            self._writer.wait_for_room()  # the writes before leave room for this copy
            snapshot = session.snapshot(self._buffers)
        self._dirty = False
        self._latest = _Write(self._writer.submit(snapshot))
        if live:
            self._live = self._latest  # the trainer's tensors: not loaded into before it is done
        return self._latest

    def _put_many(self, snapshots: list[Snapshot]) -> list[tuple[str, int] | StageFault]:
        """Store snapshots (on the writer thread): streamed into the store, hashed as they are
        written, with one group commit where the store has ``put_written``; else encoded and
        stored with ``put_many`` (an object store's uploads in flight together), in groups whose
        encoded copies hold at most ``PUT_MANY_BYTES`` (or one snapshot), or one by one with
        ``put`` (one encoded copy in memory at a time). Retried while the store fails; then a
        StageFault of kind "storage" (raised: it is every snapshot's). A snapshot whose state
        does not encode gets a StageFault of kind "error" (the trainer's) and the others are
        stored."""
        results: dict[int, tuple[str, int] | StageFault] = {}

        def unencodable(i: int, exc: Exception) -> None:
            results[i] = StageFault("error", describe_error(exc))

        def encoded(i: int) -> bytes | None:
            """Snapshot ``i``'s bytes, or None once its state did not encode (its fault noted)."""
            try:
                return encode_state(snapshots[i].state)
            except Exception as exc:
                unencodable(i, exc)
                return None

        def writer(i: int) -> Callable[[BinaryIO], None]:
            def write(sink: BinaryIO) -> None:
                try:
                    write_state(snapshots[i].state, sink)
                except OSError:  # the sink's: the store's fault
                    raise
                except Exception as exc:
                    raise _Unencodable(i, exc) from exc
            return write

        put_written = getattr(self.store, "put_written", None)
        try:
            while len(results) < len(snapshots):
                left = [i for i in range(len(snapshots)) if i not in results]
                if put_written is not None:
                    try:
                        refs = self._stored(functools.partial(put_written, [writer(i) for i in left]))
                    except _Unencodable as exc:  # store the others again without it
                        unencodable(exc.index, exc.cause)
                        continue
                elif (put_many := getattr(self.store, "put_many", None)) is not None:
                    sizes = [s.nbytes or state_bytes(s.state) for s in snapshots]  # a live state: no copy
                    for group in _groups(left, sizes, self.PUT_MANY_BYTES):
                        datas = {i: data for i in group if (data := encoded(i)) is not None}
                        if not datas:
                            continue
                        refs = self._stored(functools.partial(put_many, list(datas.values())))
                        results.update((i, (r.ref, r.size)) for i, r in zip(datas, refs))
                        del datas  # let the encoded copies go before the next group's
                    continue
                else:  # one encoded copy in memory at a time (an object store's put)
                    for i in left:
                        data = encoded(i)
                        if data is not None:
                            stored = self._stored(functools.partial(self.store.put, data))
                            data = None  # let it go before the next one is encoded
                            results[i] = (stored.ref, stored.size)
                    continue
                results.update((i, (r.ref, r.size)) for i, r in zip(left, refs))
        except (StorageError, CheckpointCorrupt) as exc:  # the store's fault, not the trial's
            raise StageFault("storage", f"{type(exc).__name__}: {exc}") from exc
        return [results[i] for i in range(len(snapshots))]

    def abandon(self) -> None:
        """Drop the weights in memory (a failed path, a drain): the next path builds the trainer
        again (after a failure its state outside the state dict is not to be trusted)."""
        self._session, self._latest, self._dirty, self._built = None, None, False, None

    def now(self) -> float:
        return self.clock()

    def run(self, d: StageDispatched, emit: Emit, control: Control | None = None,
            should_stop: Callable[[], bool] | None = None, ends: EndBatches | None = None) -> bool:
        """Execute every stage of ``d`` in order, emitting event batches through ``emit``: the
        one event sequence of :func:`events.execution.run_path` (``ends``: the worker's end
        batches, kept between paths; with them a path's end does not wait for its writes).

        Never raises for a failing stage: a corrupt or missing source checkpoint, an exception
        from the trainer, or a store that keeps failing becomes a StageFailed event and ends the
        path. With tracing on, the work is recorded as spans in the trace the dispatch carries.
        ``should_stop``: a drain (see ``run_path``); returns False when the rest of the path was
        left to hand back.
        """
        with tracing.span("dispatch.process", parent=d.trace, kind=SpanKind.CONSUMER,
                          attributes=tracing.messaging("process", topics.DISPATCH, d.event_id,
                                                       dispatch_id=d.dispatch_id, worker_id=self.worker_id)):
            return run_path(d, self, emit, self.worker_id, self.stamp, control, should_stop, ends)
