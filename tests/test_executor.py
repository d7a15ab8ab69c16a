"""The path executor (gpu_worker/executor.py): the events of a dispatch and how it meets faults.

Issue 11 item 12: a stage's end (its metrics, checkpoint and StageFinished) is one batch, emitted
only after the checkpoint is written and verified, so no crash can record metrics without the
stage's checkpoint and accounting. Item 16: a store that fails (a full disk) is retried and then
the path is handed back: no trial ever fails for it, and the path is dispatched again.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from events.hp import Constant, MultiStep
from events.models import (
    CheckpointSaved,
    CheckpointSource,
    Event,
    MetricsReported,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageSpec,
    StageStarted,
    TrialSubmitted,
    WorkerJoined,
)
from gpu_worker.checkpoint import CheckpointRef, LocalCheckpointStore, StorageError
from gpu_worker.executor import PathExecutor
from projections.reducer import apply
from projections.state import State
from scheduler.decide import decide

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import DigitsTrainer  # noqa: E402

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
    """A store with only the protocol's put (as the MinIO store): the worker encodes each
    checkpoint to bytes and puts it."""

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
