"""The path executor (gpu_worker/executor.py): the events of a dispatch and how it meets faults.

Issue 11 item 12: a stage's end (its metrics, checkpoint and StageFinished) is one batch, emitted
only after the checkpoint is written and verified, so no crash can record metrics without the
stage's checkpoint and accounting. Item 16: a store that fails (a full disk) is retried and then
the path is handed back: no trial ever fails for it, and the path is dispatched again.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import BinaryIO, TypeVar

import pytest
import torch

from events.execution import EndBatches
from events.hp import Constant, MultiStep
from events.models import (
    CheckpointSaved,
    CheckpointSource,
    Event,
    MetricsReported,
    PathTrained,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageSpec,
    StageStarted,
    TrialSubmitted,
    WorkerJoined,
    WorkerLost,
)
from gpu_worker import checkpoint
from gpu_worker.checkpoint import (
    CheckpointCorrupt,
    CheckpointRef,
    LoadedBytes,
    LocalCheckpointStore,
    StorageError,
    Verification,
)
from gpu_worker.executor import PathExecutor
from projections.partitions import merge
from projections.queries import handed_on
from projections.reducer import Rejected, apply
from projections.state import State
from scheduler.decide import decide

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from counted_builds import CountedBuilds  # noqa: E402
from digits import DigitsTrainer  # noqa: E402

T = TypeVar("T")
CONFIG = {"lr": MultiStep(0.1, [3], 0.1), "batch_size": Constant(16), "momentum": Constant(0.0)}


class FullDisk(LocalCheckpointStore):
    """A local store whose disk is full for the first ``full`` writes (a fault at the edge)."""

    def __init__(self, root: Path, full: int) -> None:
        super().__init__(root)
        self.full = full

    def put_written(self, writers: Sequence[Callable[[BinaryIO], object]]) -> list[CheckpointRef]:
        if self.full > 0:
            self.full -= 1
            raise StorageError(f"writing checkpoint failed: {OSError(errno.ENOSPC, 'No space left on device')}")
        return super().put_written(writers)


class Cluster:
    """The real reducer and scheduler, and one worker whose events are folded as they come."""

    def __init__(self) -> None:
        self.state = State()
        self.offset = -1
        self.batches: list[list[Event]] = []

    def emit(self, events: list[Event]) -> None:
        self.batches.append(list(events))
        for event in events:
            self.offset += 1
            apply(self.state, event, self.offset)

    def dispatch(self) -> StageDispatched:
        decision = decide(self.state)
        assert decision is not None
        self.emit([decision])
        return decision


@pytest.fixture
def cluster() -> Cluster:
    c = Cluster()
    c.emit([WorkerJoined(worker_id="w0", device="cpu")])
    c.emit([TrialSubmitted(study_id="s", trial_id="short", plan_key="p", seed=3, hp=CONFIG, steps=2),
            TrialSubmitted(study_id="s", trial_id="long", plan_key="p", seed=3, hp=CONFIG, steps=5)])
    return c


def executor(store: LocalCheckpointStore, sleeps: list[float] | None = None) -> PathExecutor:
    return PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu"), storage_backoff_s=0.5,
                        sleep=(sleeps.append if sleeps is not None else lambda s: None))


def test_the_end_of_a_stage_is_one_batch_after_its_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    d = cluster.dispatch()
    assert [(s.from_step, s.to_step) for s in d.stages] == [(0, 2), (2, 5)]
    before = len(cluster.batches)
    executor(LocalCheckpointStore(tmp_path)).run(d, cluster.emit)
    batches = cluster.batches[before:]
    kinds = [[type(e) for e in batch] for batch in batches]
    # Each stage's end is one batch [metrics, checkpoint, finish], in stage order, after its
    # start; a checkpoint is written while the next stage trains, so the next start may come
    # before the previous end.
    assert sorted(kinds, key=len) == [[StageStarted]] * 2 + [[MetricsReported, CheckpointSaved, StageFinished]] * 2
    ends = [b[-1] for b in batches if isinstance(b[-1], StageFinished)]
    assert [(e.from_step, e.to_step) for e in ends] == [(0, 2), (2, 5)]
    starts = [i for i, b in enumerate(batches) if isinstance(b[0], StageStarted)]
    finishes = [i for i, b in enumerate(batches) if isinstance(b[-1], StageFinished)]
    assert starts[0] < finishes[0] and starts[1] < finishes[1]
    assert cluster.state.trials["short"].status == cluster.state.trials["long"].status == "done"
    assert cluster.state.stats.executed_steps == 5


def test_a_full_disk_is_retried_with_backoff(cluster: Cluster, tmp_path: Path) -> None:
    sleeps: list[float] = []
    store = FullDisk(tmp_path, full=2)
    executor(store, sleeps).run(cluster.dispatch(), cluster.emit)
    assert sleeps == [0.5, 1.0]  # two failed tries, the third wrote
    assert not any(isinstance(e, StageFailed) for batch in cluster.batches for e in batch)
    assert cluster.state.trials["long"].status == "done"


def test_a_disk_that_stays_full_hands_the_path_back_and_fails_no_trial(cluster: Cluster, tmp_path: Path) -> None:
    store = FullDisk(tmp_path, full=3)
    first = cluster.dispatch()
    executor(store).run(first, cluster.emit)
    failed = [e for batch in cluster.batches for e in batch if isinstance(e, StageFailed)]
    assert [(f.kind, f.from_step, f.to_step) for f in failed] == [("storage", 0, 2)]
    assert "No space left" in failed[0].error
    # No metrics were recorded for a stage whose checkpoint could not be written.
    assert not any(isinstance(e, MetricsReported) for batch in cluster.batches for e in batch)
    assert {t.status for t in cluster.state.trials.values()} == {"pending"}
    assert cluster.state.workers["w0"].dispatch_id is None
    # The same path is dispatched again and, the disk freed, trains.
    again = cluster.dispatch()
    assert again.dispatch_id != first.dispatch_id and again.stages == first.stages
    executor(store).run(again, cluster.emit)
    assert {t.status for t in cluster.state.trials.values()} == {"done"}


def test_the_local_store_reports_an_io_failure_as_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    store = LocalCheckpointStore(blocker / "checkpoints")  # a real OS error: the root is under a file
    with pytest.raises(StorageError, match="writing 1 checkpoint"):
        store.put(b"state")


class Unserializable(DigitsTrainer):
    """A trainer whose state holds an object that pickle refuses (a lambda)."""

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "schedule": lambda step: step}


def test_a_state_that_does_not_serialize_fails_its_stage_as_the_trainers_error(cluster: Cluster,
                                                                              tmp_path: Path) -> None:
    """The snapshot is encoded on the writer thread; a failure there is still the trainer's error
    (a StageFailed of kind "error"), never a crash of the worker or a storage fault."""
    d = cluster.dispatch()
    worker = PathExecutor(Unserializable(), "w0", LocalCheckpointStore(tmp_path), torch.device("cpu"))
    assert worker.run(d, cluster.emit)
    failed = [e for batch in cluster.batches for e in batch if isinstance(e, StageFailed)]
    assert [(f.kind, f.from_step, f.to_step) for f in failed] == [("error", 0, 2)]
    assert "pickle" in failed[0].error.lower() or "lambda" in failed[0].error
    assert not any(isinstance(e, CheckpointSaved) for batch in cluster.batches for e in batch)


def test_a_path_from_its_source_checkpoint_saves_what_the_straight_path_saves(tmp_path: Path) -> None:
    """A worker that did not save the source reads and verifies it (beside the trainer's build)
    and goes on bit for bit; a damaged or missing source fails the stage with its kind."""
    store = LocalCheckpointStore(tmp_path)

    def dispatch(i: int, stages: list[tuple[str, int, int]], source: CheckpointSource | None) -> StageDispatched:
        return StageDispatched(dispatch_id=f"d{i}", worker_id="w0", plan_key="p", seed=3, decided_at=i, source=source,
                               stages=[StageSpec(node_id=n, hp=CONFIG, from_step=a, to_step=b, evaluate=False)
                                       for n, a, b in stages])

    def run(d: StageDispatched) -> list[Event]:
        events: list[Event] = []
        executor(store).run(d, events.extend)
        return events

    straight = {e.node_id: e.ref for e in run(dispatch(0, [("n0", 0, 2), ("n1", 2, 5)], None))
                if isinstance(e, CheckpointSaved)}
    source = CheckpointSource(node_id="n0", step=2, ref=straight["n0"])
    resumed = run(dispatch(1, [("n1", 2, 5)], source))
    assert [e.ref for e in resumed if isinstance(e, CheckpointSaved)] == [straight["n1"]]
    path = store.path(straight["n0"])
    path.write_bytes(flip_byte(path.read_bytes()))
    failed = [e for e in run(dispatch(2, [("n1", 2, 5)], source)) if isinstance(e, StageFailed)]
    assert [(f.kind, f.ref) for f in failed] == [("checkpoint_corrupt", straight["n0"])]
    path.unlink()
    failed = [e for e in run(dispatch(3, [("n1", 2, 5)], source)) if isinstance(e, StageFailed)]
    assert [(f.kind, f.ref) for f in failed] == [("checkpoint_missing", straight["n0"])]


def flip_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]


class PutOnly:
    """A store with only the protocol's put: the worker encodes each checkpoint to bytes and puts
    it."""

    def __init__(self, root: Path) -> None:
        self.local = LocalCheckpointStore(root)

    def put(self, data: bytes) -> CheckpointRef:
        return self.local.put(data)

    def get(self, ref: str) -> bytes:
        return self.local.get(ref)

    def exists(self, ref: str) -> bool:
        return self.local.exists(ref)

    def delete(self, ref: str) -> None:
        self.local.delete(ref)


def test_a_store_without_streamed_writes_gets_the_same_checkpoints(tmp_path: Path) -> None:
    def saved(store: LocalCheckpointStore | PutOnly, trainer: DigitsTrainer) -> list[tuple[str, str]]:
        cluster = Cluster()
        cluster.emit([WorkerJoined(worker_id="w0", device="cpu")])
        cluster.emit([TrialSubmitted(study_id="s", trial_id="t", plan_key="p", seed=3, hp=CONFIG, steps=5)])
        d = cluster.dispatch()
        PathExecutor(trainer, "w0", store, torch.device("cpu")).run(d, cluster.emit)
        return [(e.node_id, e.ref) if isinstance(e, CheckpointSaved) else (e.kind, e.error[:40])
                for batch in cluster.batches for e in batch if isinstance(e, (CheckpointSaved, StageFailed))]

    streamed = saved(LocalCheckpointStore(tmp_path / "local"), DigitsTrainer())
    assert streamed and saved(PutOnly(tmp_path / "put-only"), DigitsTrainer()) == streamed
    (failed,) = saved(PutOnly(tmp_path / "unserializable"), Unserializable())
    assert failed[0] == "error"


class PutMany(PutOnly):
    """A store with ``put_many`` too (as the MinIO store, whose uploads are then in flight
    together), whose first ``put_many`` waits until ``gate`` is set; ``calls``: the sizes of the
    objects each call stored."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.calls: list[list[int]] = []

    def put_many(self, datas: Sequence[bytes]) -> list[CheckpointRef]:
        self.gate.wait(60)
        self.calls.append([len(d) for d in datas])
        return self.local.put_many(datas)


def test_checkpoints_queued_for_a_store_with_put_many_go_together_in_groups_bounded_in_bytes(tmp_path: Path
                                                                                             ) -> None:
    """While the first write waits, the next stages' checkpoints queue; the writer then hands
    them to ``put_many`` together, encoding at most ``PUT_MANY_BYTES`` of them at once (here two
    snapshots), and the checkpoints are those of a worker that streams its writes."""
    stages = [(f"n{k}", k, k + 1) for k in range(5)]
    local = Gated(tmp_path / "streamed")
    streamed = saved_by(PathExecutor(DigitsTrainer(), "w0", local, torch.device("cpu")), local, dispatch_of(0, stages))
    unbounded = PutMany(tmp_path / "unbounded")
    assert saved_by(PathExecutor(DigitsTrainer(), "w0", unbounded, torch.device("cpu")), unbounded,
                    dispatch_of(0, stages)) == streamed
    assert sum(map(len, unbounded.calls)) == 5 and max(map(len, unbounded.calls)) >= 2, unbounded.calls
    size = min(min(call) for call in unbounded.calls)  # an encoded snapshot: its tensors' bytes and a header
    bounded = PutMany(tmp_path / "bounded")
    worker = PathExecutor(DigitsTrainer(), "w0", bounded, torch.device("cpu"))
    worker.PUT_MANY_BYTES = 2 * size  # two snapshots' tensors fit, three do not
    assert saved_by(worker, bounded, dispatch_of(0, stages)) == streamed
    assert sum(map(len, bounded.calls)) == 5 and max(map(len, bounded.calls)) == 2, bounded.calls
    # the path's last state is handed over live (no copy: a quick build), and counts all the same
    one = PutMany(tmp_path / "one")
    worker = PathExecutor(DigitsTrainer(), "w0", one, torch.device("cpu"))
    worker.PUT_MANY_BYTES = size
    assert saved_by(worker, one, dispatch_of(0, stages)) == streamed
    assert [len(call) for call in one.calls] == [1] * 5, one.calls


# ----------------------------------------------------------------------------- PathTrained (issue 15 goal 2)


class Gated(FullDisk):
    """A local store whose writes wait until ``gate`` is set (a slow disk, a large checkpoint),
    then fail while the disk is full (``full`` tries, as FullDisk)."""

    def __init__(self, root: Path, full: int = 0) -> None:
        super().__init__(root, full)
        self.gate = threading.Event()

    def put_written(self, writers: Sequence[Callable[[BinaryIO], object]]) -> list[CheckpointRef]:
        self.gate.wait(60)
        return super().put_written(writers)


OTHER = {**CONFIG, "lr": Constant(0.3)}  # no prefix in common with CONFIG: a path of its own


def events_of(batches: list[list[Event]], kind: type[Event], dispatch_id: str | None = None) -> list[Event]:
    return [e for b in batches for e in b
            if isinstance(e, kind) and (dispatch_id is None or getattr(e, "dispatch_id", None) == dispatch_id)]


def test_a_paths_end_frees_its_worker_while_its_writes_are_verified(cluster: Cluster, tmp_path: Path) -> None:
    """The path's last stage trained: PathTrained frees the worker at once, its stages stay
    running (nothing is dispatched twice), and the end batches follow once the writes are done,
    each still [metrics, checkpoint, finish]; the worker-seconds end at the hand-off."""
    store = Gated(tmp_path)
    ends = EndBatches(cluster.emit)
    d = cluster.dispatch()
    t0 = time.perf_counter()
    assert executor(store).run(d, cluster.emit, ends=ends)
    handed_off = time.perf_counter() - t0
    assert [type(e) for b in cluster.batches[-3:] for e in b] == [StageStarted, StageStarted, PathTrained]
    assert len(ends) == 2 and not ends.ready()
    state = cluster.state
    assert state.workers["w0"].dispatch_id is None and state.workers["w0"].writing == [d.dispatch_id]
    assert state.dispatches[d.dispatch_id].status == "running" and handed_on(state, state.dispatches[d.dispatch_id])
    assert all(node.running for node in state.plans["p"].nodes.values())
    assert decide(state) is None  # both requests are on their way: nothing to train twice
    time.sleep(0.3)  # the disk is slow
    store.gate.set()
    ends.release(True)
    tail = cluster.batches[-2:]
    assert [[type(e) for e in b] for b in tail] == [[MetricsReported, CheckpointSaved, StageFinished]] * 2
    assert [(b[-1].from_step, b[-1].to_step) for b in tail] == [(0, 2), (2, 5)]
    assert tail[1][-1].seconds < handed_off  # not the 0.3 s the write waited
    assert state.dispatches[d.dispatch_id].status == "done"
    assert state.workers["w0"].writing == [] and not any(n.running for n in state.plans["p"].nodes.values())
    assert state.trials["short"].status == state.trials["long"].status == "done"
    assert state.stats.executed_steps == 5


def test_the_next_path_trains_while_the_path_before_is_written(cluster: Cluster, tmp_path: Path) -> None:
    store = Gated(tmp_path)
    ends = EndBatches(cluster.emit)
    worker = executor(store)
    first = cluster.dispatch()
    worker.run(first, cluster.emit, ends=ends)
    cluster.emit([TrialSubmitted(study_id="s", trial_id="other", plan_key="p", seed=3, hp=OTHER, steps=4)])
    second = cluster.dispatch()  # to the same worker, whose first path is still being written
    assert second.worker_id == "w0" and cluster.state.dispatches[first.dispatch_id].status == "running"
    store.gate.set()
    assert worker.run(second, cluster.emit, ends=ends)
    ends.release(True)
    # the first path's ends went out while the second trained or when it ended, in stage order
    finished = [(e.dispatch_id, e.from_step) for e in events_of(cluster.batches, StageFinished)]
    assert finished.index((first.dispatch_id, 0)) < finished.index((first.dispatch_id, 2))
    assert {f for f in finished if f[0] == second.dispatch_id} == {(second.dispatch_id, 0)}
    assert {t.trial_id: t.status for t in cluster.state.trials.values()} == \
        {"short": "done", "long": "done", "other": "done"}
    assert not events_of(cluster.batches, StageFailed)


def test_a_path_waits_for_its_writes_once_their_snapshots_fill_the_backlog(tmp_path: Path) -> None:
    """Stages that end faster than the store writes (a GPU, an object store) do not pile copies of
    the state up in memory: once the snapshots waiting for the writer hold ``write_backlog_bytes``
    (one is always let through), the next stage's save waits for a write to end. The path then
    goes on, and saves what a worker without the bound saves."""
    stages = [(f"n{k}", k, k + 1) for k in range(4)]
    other = Gated(tmp_path / "a")  # a worker without the bound trains the whole path while its writes wait
    unbounded = saved_by(PathExecutor(DigitsTrainer(), "w0", other, torch.device("cpu")), other, dispatch_of(0, stages))
    store = Gated(tmp_path / "b")
    worker = PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu"), write_backlog_bytes=1)
    events: list[Event] = []
    ends = EndBatches(events.extend)
    path = threading.Thread(target=worker.run, args=(dispatch_of(0, stages), events.extend), kwargs={"ends": ends})
    path.start()
    deadline = time.monotonic() + 60
    while len(events_of([events], StageStarted)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    path.join(0.5)  # the second stage's save waits for the first write, which waits for the gate
    assert path.is_alive() and [e.node_id for e in events_of([events], StageStarted)] == ["n0", "n1"]
    store.gate.set()
    path.join(60)
    ends.release(True)
    assert not path.is_alive() and not events_of([events], StageFailed)
    assert [e.node_id for e in events_of([events], StageStarted)] == ["n0", "n1", "n2", "n3"]
    assert {e.node_id: e.ref for e in events if isinstance(e, CheckpointSaved)} == unbounded


def dispatch_of(i: int, stages: list[tuple[str, int, int]], source: CheckpointSource | None = None,
                hp: dict[str, Constant | MultiStep] = CONFIG, seed: int = 3) -> StageDispatched:
    return StageDispatched(dispatch_id=f"d{i}", worker_id="w0", plan_key="p", seed=seed, decided_at=i, source=source,
                           stages=[StageSpec(node_id=n, hp=hp, from_step=a, to_step=b, evaluate=True)
                                   for n, a, b in stages])


def saved_by(worker: PathExecutor, store: Gated | PutMany, *paths: StageDispatched) -> dict[str, str]:
    """Run ``paths`` on ``worker`` one after another, each end handed on (PathTrained); open
    ``store``'s gate, and return the checkpoint of each node."""
    events: list[Event] = []
    ends = EndBatches(events.extend)
    for d in paths:
        worker.run(d, events.extend, ends=ends)
    store.gate.set()
    ends.release(True)
    assert not events_of([events], StageFailed)
    return {e.node_id: e.ref for e in events if isinstance(e, CheckpointSaved)}


def sibling_paths(store: Gated) -> tuple[StageDispatched, dict[str, str], StageDispatched, dict[str, str]]:
    """A path of two stages, a sibling of its second stage loaded from its first stage's
    checkpoint, and the checkpoints a worker that builds saves for each (``store``'s gate
    opened)."""
    store.gate.set()
    first = dispatch_of(0, [("n0", 0, 2), ("n1", 2, 5)])
    straight = saved_by(PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu")), store, first)
    sibling = dispatch_of(1, [("m1", 2, 5)], CheckpointSource(node_id="n0", step=2, ref=straight["n0"]),
                          {**CONFIG, "lr": MultiStep(0.1, [3], 0.5)})
    return first, straight, sibling, saved_by(PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu")),
                                              store, sibling)


def reusing_worker(store: Gated, trainer: CountedBuilds | None = None) -> tuple[CountedBuilds, PathExecutor]:
    """A worker over a trainer that counts its builds (``trainer``, else a new one); its fresh
    starts build and a path's end writes the live weights (``REUSE_MIN_BUILD_S`` infinite)."""
    trainer = trainer if trainer is not None else CountedBuilds()
    worker = PathExecutor(trainer, "w0", store, torch.device("cpu"))
    worker.REUSE_MIN_BUILD_S = float("inf")
    return trainer, worker


def test_a_worker_loads_a_siblings_source_into_the_trainer_it_built_unless_a_write_holds_it(tmp_path: Path) -> None:
    """A worker whose trainer is built with the dispatch's seed loads another stage's checkpoint
    into it without building it again, and saves what a worker that builds saves. While the
    write of a path's end still holds the trainer's live weights (PathTrained went out), it
    builds a new trainer instead, and that write stores what the path trained."""
    store = Gated(tmp_path)
    first, straight, sibling, expected = sibling_paths(store)
    assert expected["m1"] != straight["n1"]
    trainer, worker = reusing_worker(store)
    assert saved_by(worker, store, first) == straight and trainer.builds == 1
    assert saved_by(worker, store, sibling) == expected and trainer.builds == 1  # loaded into the built trainer
    store.gate.clear()  # the end of the next path is written slowly
    assert saved_by(worker, store, first.model_copy(update={"dispatch_id": "d2"}), sibling) == {**straight, **expected}
    assert trainer.builds == 3  # a fresh start, then a new trainer beside the one being written
    worker.abandon()  # as after a failed path
    assert saved_by(worker, store, sibling) == expected and trainer.builds == 4


@pytest.mark.parametrize("hashed_beside", [False, True], ids=["small", "hashed-beside"])
def test_a_damaged_source_loaded_into_the_built_trainer_fails_its_stage_and_the_trainer_is_built_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed_beside: bool) -> None:
    """A load into the trainer already built runs while the bytes are hashed (``hashed_beside``:
    as from 1 MiB, here from 1 byte: read into a memory file, hashed on a helper thread while
    decoded and copied into the trainer). A flipped byte fails the stage as checkpoint_corrupt,
    and the trainer, which took the damaged weights, is built again for the next path, which
    saves what a worker that builds saves."""
    if hashed_beside:
        monkeypatch.setattr(checkpoint, "_BESIDE_BYTES", 1)
    store = Gated(tmp_path)
    first, straight, sibling, expected = sibling_paths(store)
    trainer, worker = reusing_worker(store)
    assert saved_by(worker, store, first) == straight and trainer.builds == 1
    path = store.path(straight["n0"])
    good = path.read_bytes()
    path.write_bytes(flip_byte(good))
    events: list[Event] = []
    worker.run(sibling, events.extend)
    assert [(f.kind, f.ref) for f in events_of([events], StageFailed)] == [("checkpoint_corrupt", straight["n0"])]
    assert trainer.builds == 1  # it was loaded into the built trainer
    path.write_bytes(good)
    assert saved_by(worker, store, sibling) == expected and trainer.builds == 2


class HashedLate(Gated):
    """A local store whose loads hand their bytes on before they are hashed (as a large
    object's are), and whose hashes end only when ``hashed`` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hashed = threading.Event()

    def load_pending(self, ref: str, use: Callable[[LoadedBytes], T]) -> tuple[T, Verification]:
        value, verification = super().load_pending(ref, use)
        digest: Future[str] = Future()

        def hash_late() -> None:
            self.hashed.wait(60)
            try:
                verification.check()
                digest.set_result(ref)
            except CheckpointCorrupt as exc:
                digest.set_result(exc.actual)

        threading.Thread(target=hash_late, daemon=True).start()
        return value, Verification(ref, digest)


class HashedInTheStage(CountedBuilds):
    """Sets ``store.hashed`` at its stage's last step, recording the events emitted by then."""

    def __init__(self, store: HashedLate, events: list[Event], last_step: int, fails: bool = False) -> None:
        super().__init__()
        self.store, self.events, self.last_step, self.fails = store, events, last_step, fails
        self.seen: list[Event] | None = None

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        if step + 1 == self.last_step:
            self.seen = list(self.events)
            self.store.hashed.set()
            if self.fails:
                raise RuntimeError("a step failed on the weights it was given")
        super().train_step(indices, step)


@pytest.mark.parametrize("reuse", [False, True], ids=["built-again", "into-the-built-trainer"])
def test_a_source_whose_hash_ends_while_the_first_stage_trains_publishes_nothing_before_it(
        tmp_path: Path, reuse: bool) -> None:
    """A source handed on before its bytes are hashed (a large object, whose sha256 runs on
    while the first stage trains) saves what a worker that waited saves, and nothing but the
    first StageStarted goes out before the hash ends. Damaged, the stage trains, then fails as
    checkpoint_corrupt (also when a step raised meanwhile: the damage may be the cause): no
    metrics, checkpoint or StageFinished go out, nothing it trained is stored, and the trainer
    is built again for the next path."""
    store = HashedLate(tmp_path)
    store.hashed.set()
    first, straight, sibling, expected = sibling_paths(store)
    sibling = sibling.model_copy(update={"stages": [s.model_copy(update={"evaluate": True}) for s in sibling.stages]})
    events: list[Event] = []
    trainer = HashedInTheStage(store, events, sibling.stages[0].to_step)
    worker = reusing_worker(store, trainer)[1]
    if reuse:
        assert saved_by(worker, store, first) == straight and trainer.builds == 1
    events.clear()
    store.hashed.clear()
    worker.run(sibling, events.extend)
    assert trainer.seen is not None and [type(e) for e in trainer.seen] == [StageStarted]
    assert {e.node_id: e.ref for e in events if isinstance(e, CheckpointSaved)} == expected
    assert [type(e) for e in events] == [StageStarted, MetricsReported, CheckpointSaved, StageFinished]
    builds = trainer.builds
    path = store.path(straight["n0"])
    good = path.read_bytes()
    path.write_bytes(flip_byte(good))
    stored = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    for fails in (False, True):
        store.hashed.clear()
        trainer.fails, trainer.seen = fails, None
        events.clear()
        worker.run(sibling.model_copy(update={"dispatch_id": f"damaged-{fails}"}), events.extend)
        assert trainer.seen is not None and [type(e) for e in trainer.seen] == [StageStarted]  # it trained
        assert [type(e) for e in events] == [StageStarted, StageFailed]
        assert [(f.kind, f.ref) for f in events_of([events], StageFailed)] == [("checkpoint_corrupt", straight["n0"])]
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == stored
    path.write_bytes(good)
    trainer.fails = False
    events.clear()
    worker.run(sibling.model_copy(update={"dispatch_id": "repaired"}), events.extend)
    assert {e.node_id: e.ref for e in events if isinstance(e, CheckpointSaved)} == expected
    # loaded into the trainer built before, then built again after each failure
    assert trainer.builds == builds + 2


class BuildFailsForSeed(CountedBuilds):
    """A trainer whose build raises for seed ``failing`` (a data set that one seed's split
    cannot find, say)."""

    failing: int | None = None

    def build(self, seed: int, device: torch.device) -> None:
        if seed == self.failing:
            raise FileNotFoundError(f"no data for seed {seed}")
        super().build(seed, device)


@pytest.mark.parametrize("source", [False, True], ids=["fresh", "from-a-checkpoint"])
def test_a_build_that_raises_fails_its_stage_as_the_trainers_error_and_the_worker_goes_on(
        tmp_path: Path, source: bool) -> None:
    """The trainer's build raising (at a fresh start, or beside a source's load) is the
    trainer's error like a step's: one StageFailed of kind "error" for the first stage, naming
    the exception, and the worker runs its next path, which saves what a worker that never
    failed saves."""
    store = Gated(tmp_path)
    store.gate.set()
    first = dispatch_of(0, [("n0", 0, 2)], seed=4)
    expected = saved_by(PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu")), store, first)
    failing = dispatch_of(1, [("n1", 2, 4)], CheckpointSource(node_id="n0", step=2, ref=expected["n0"]), seed=4) \
        if source else first.model_copy(update={"dispatch_id": "d1"})
    trainer = BuildFailsForSeed()
    trainer.failing = 4
    worker = PathExecutor(trainer, "w0", store, torch.device("cpu"))
    events: list[Event] = []
    assert worker.run(failing, events.extend)
    assert [(type(e), getattr(e, "kind", None)) for e in events] == [(StageFailed, "error")]
    assert events[0].node_id == failing.stages[0].node_id and "no data for seed 4" in events[0].error
    trainer.failing = None
    assert saved_by(worker, store, first.model_copy(update={"dispatch_id": "d2"})) == expected


def test_a_fresh_start_restores_the_state_the_trainer_was_built_with(tmp_path: Path) -> None:
    """A worker whose trainer takes long to build keeps its state at step 0 (from its second
    build: the first also pays for imports) and restores it at the next fresh starts with the
    same seed instead of building again: the same checkpoints as
    workers that build, for paths of other hyper-parameters too; another seed builds. Its
    path's end writes a copy, so the next path loads into the trainer while that write goes on."""
    store = Gated(tmp_path)
    paths = [dispatch_of(0, [("a0", 0, 2), ("a1", 2, 4)]), dispatch_of(1, [("b0", 0, 3)], hp=OTHER),
             dispatch_of(2, [("a0", 0, 2), ("a1", 2, 4)]), dispatch_of(5, [("b0", 0, 3)], hp=OTHER),
             dispatch_of(3, [("c0", 0, 3)], hp=OTHER, seed=4)]
    expected = [saved_by(PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu")), store, d) for d in paths]
    assert expected[0] == expected[2] and expected[1] == expected[3] and expected[1]["b0"] != expected[4]["c0"]
    trainer = CountedBuilds()
    trainer.build_s = 0.3  # longer than decoding its state, even on a busy machine
    worker = PathExecutor(trainer, "w0", store, torch.device("cpu"))
    assert [saved_by(worker, store, d) for d in paths] == expected
    assert trainer.builds == 3  # seed 3 twice (a worker's first build is not kept), seed 4 once
    # a path's end writes a copy of such a trainer's state: the next path loads into it at once
    sibling = dispatch_of(4, [("s1", 2, 4)], CheckpointSource(node_id="a0", step=2, ref=expected[0]["a0"]), OTHER)
    expected_sibling = saved_by(PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu")), store, sibling)
    store.gate.clear()
    assert saved_by(worker, store, paths[0], sibling) == {**expected[0], **expected_sibling}
    assert trainer.builds == 4  # seed 3 again (seed 4's state was kept), then none


def test_a_worker_lost_after_its_path_trained_releases_that_path_too(cluster: Cluster, tmp_path: Path) -> None:
    store = Gated(tmp_path)
    first = cluster.dispatch()
    executor(store).run(first, cluster.emit, ends=EndBatches(cluster.emit))
    cluster.emit([TrialSubmitted(study_id="s", trial_id="other", plan_key="p", seed=3, hp=OTHER, steps=4)])
    second = cluster.dispatch()
    cluster.emit([WorkerLost(worker_id="w0", reason="kill -9 while its first path was written")])
    state = cluster.state
    assert state.dispatches[first.dispatch_id].status == state.dispatches[second.dispatch_id].status == "lost"
    assert state.workers["w0"].writing == [] and not any(n.running for n in state.plans["p"].nodes.values())
    cluster.emit([WorkerJoined(worker_id="w0", device="cpu")])
    again = cluster.dispatch()  # the critical path again: the first path, whose checkpoints never came
    assert again.stages == first.stages and again.source is None
    store.gate.set()


def test_a_write_that_fails_after_its_path_trained_hands_back_that_path_only(cluster: Cluster,
                                                                              tmp_path: Path) -> None:
    store = Gated(tmp_path, full=3)  # every try of the first write fails, once the disk answers
    ends = EndBatches(cluster.emit)
    worker = executor(store)
    first = cluster.dispatch()
    worker.run(first, cluster.emit, ends=ends)
    cluster.emit([TrialSubmitted(study_id="s", trial_id="other", plan_key="p", seed=3, hp=OTHER, steps=4)])
    second = cluster.dispatch()
    store.gate.set()
    assert worker.run(second, cluster.emit, ends=ends)
    ends.release(True)
    failed = events_of(cluster.batches, StageFailed)
    assert [(f.dispatch_id, f.kind, f.from_step) for f in failed] == [(first.dispatch_id, "storage", 0)]
    assert not events_of(cluster.batches, StageFinished, first.dispatch_id)  # its later ends were dropped
    state = cluster.state
    assert state.dispatches[first.dispatch_id].status == "failed" and state.workers["w0"].writing == []
    assert state.trials["other"].status == "done"  # the path after it trained on its own weights
    assert state.trials["short"].status == state.trials["long"].status == "pending"  # no trial failed
    again = cluster.dispatch()
    assert again.stages == first.stages
    worker.run(again, cluster.emit, ends=ends)
    ends.release(True)
    assert {t.status for t in state.trials.values()} == {"done"}


def test_path_trained_is_refused_unless_its_worker_is_training_that_path(cluster: Cluster) -> None:
    d = cluster.dispatch()
    cluster.emit([WorkerJoined(worker_id="w1", device="cpu")])
    base = {"dispatch_id": d.dispatch_id, "plan_key": "p"}
    for event, reason in [
        (PathTrained(dispatch_id="d9", worker_id="w0", plan_key="p"), "is not running"),
        (PathTrained(**{**base, "plan_key": "q"}, worker_id="w0"), "of plan 'p'"),
        (PathTrained(**base, worker_id="w1"), "worker 'w0'"),
    ]:
        before = cluster.state.workers["w0"].to_json(), cluster.state.dispatches[d.dispatch_id].to_json()
        with pytest.raises(Rejected, match=reason):
            apply(cluster.state, event, 100)
        assert (cluster.state.workers["w0"].to_json(), cluster.state.dispatches[d.dispatch_id].to_json()) == before
    cluster.emit([PathTrained(**base, worker_id="w0")])
    with pytest.raises(Rejected, match="is not training"):  # twice
        apply(cluster.state, PathTrained(**base, worker_id="w0"), 100)


def test_a_worker_that_trained_a_path_of_one_partition_is_free_for_another() -> None:
    """On a partitioned plan stream (Kafka) a worker may train a path of one partition while the
    end of its path of another is written: the merged view offers it work once PathTrained is
    folded, counts it busy while any partition has it training, and its broadcast loss releases
    both paths."""
    parts = {0: State(), 1: State()}
    offsets = {0: -1, 1: -1}

    def fold(partition: int, *events: Event) -> None:
        for event in events:
            offsets[partition] += 1
            apply(parts[partition], event, offsets[partition])

    for p in parts:
        fold(p, WorkerJoined(worker_id="w0", device="cpu"))
    fold(0, TrialSubmitted(study_id="s", trial_id="a", plan_key="p", seed=3, hp=CONFIG, steps=2))
    fold(1, TrialSubmitted(study_id="t", trial_id="b", plan_key="q", seed=3, hp=CONFIG, steps=2))
    first = decide(merge(parts))
    assert first is not None and first.worker_id == "w0"
    home = 0 if first.plan_key == "p" else 1
    fold(home, first)
    assert decide(merge(parts)) is None  # busy
    fold(home, PathTrained(dispatch_id=first.dispatch_id, worker_id="w0", plan_key=first.plan_key))
    view = merge(parts)
    assert view.idle_workers() == ["w0"] and view.workers["w0"].writing == [first.dispatch_id]
    second = decide(view)
    assert second is not None and second.worker_id == "w0" and second.plan_key != first.plan_key
    fold(1 - home, second)
    view = merge(parts)
    assert view.idle_workers() == [] and view.workers["w0"].dispatch_id == second.dispatch_id
    for p in parts:  # WorkerLost is written to every partition
        fold(p, WorkerLost(worker_id="w0", reason="kill -9"))
    view = merge(parts)
    assert {d.dispatch_id: d.status for d in view.dispatches.values()} == \
        {first.dispatch_id: "lost", second.dispatch_id: "lost"}
    assert not view.workers["w0"].alive and view.workers["w0"].writing == []
