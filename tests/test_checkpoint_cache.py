"""The node-local checkpoint cache in front of a real MinIO (gpu_worker/checkpoint_cache.py).

The store of record is MinIO; the cache keeps copies of what this node saved or downloaded and
loads them instead of downloading; a damaged copy is a StorageError of this node (retried from MinIO),
never a corrupt checkpoint; the copies stay within their budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from events.models import CheckpointSaved, CheckpointSource, Event, StageDispatched, StageFailed, StageSpec
from gpu_worker import checkpoint
from gpu_worker.checkpoint import (
    CheckpointCorrupt,
    CheckpointMissing,
    LoadedBytes,
    StorageError,
    decode_state,
    encode_state,
    sha256_hex,
)
from gpu_worker.checkpoint_cache import TALLY, CachedCheckpointStore, CachedCopyCorrupt, cached
from gpu_worker.executor import PathExecutor
from gpu_worker.object_store import S3CheckpointStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import DigitsTrainer  # noqa: E402
from test_executor import CONFIG, flip_byte  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class CountedGets(S3CheckpointStore):
    """The real S3 store, counting the loads that reach MinIO (no behaviour changed)."""

    gets: list[str]

    def load_pending(self, ref: str, use: Callable[[LoadedBytes], Any]) -> Any:
        self.gets.append(ref)
        return super().load_pending(ref, use)

    def get(self, ref: str) -> bytes:
        self.gets.append(ref)
        return super().get(ref)


@pytest.fixture
def remote(minio_store_factory: Callable[[], S3CheckpointStore]) -> CountedGets:
    store = minio_store_factory()
    store.__class__ = CountedGets
    assert isinstance(store, CountedGets)
    store.gets = []
    return store


def copies(root: Path) -> dict[str, int]:
    """The copies under ``root`` by ref, with their sizes (temporary files would show too; the
    tally of their bytes does not)."""
    return {p.name: p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != TALLY}


@pytest.mark.parametrize("size", [10, 3 << 20], ids=["small", "beside"])
def test_a_saved_checkpoint_is_kept_here_and_loaded_from_the_copy(remote: CountedGets, tmp_path: Path,
                                                                 size: int) -> None:
    """``put_many`` stores in MinIO (verified there), then writes a copy named by the ref; a load
    and a get read the copy, not MinIO, and hash it; ``exists`` asks MinIO; ``delete`` removes
    both."""
    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=1 << 30)
    datas = [os.urandom(size), os.urandom(size), b""]
    refs = store.put_many(datas)
    assert [r.ref for r in refs] == [sha256_hex(d) for d in datas]
    assert [remote.get(r.ref) for r in refs] == datas  # stored and verified in MinIO
    remote.gets.clear()
    store.copies_written()
    assert copies(tmp_path / "cache") == {r.ref: r.size for r in refs}
    value, verification = store.load_pending(refs[0].ref, lambda b: bytes(b.view))
    verification.check()
    assert value == datas[0]
    assert store.load(refs[1].ref, lambda b: bytes(b.view)) == datas[1]
    assert store.get(refs[2].ref) == b""
    assert remote.gets == []  # every read came from the copies
    assert store.exists(refs[0].ref)
    store.delete(refs[0].ref)
    assert not store.exists(refs[0].ref) and not store.path(refs[0].ref).exists()
    with pytest.raises(CheckpointMissing):
        store.load(refs[0].ref, lambda b: bytes(b.view))
    assert remote.gets == [refs[0].ref]


@pytest.mark.parametrize("size", [10, 3 << 20], ids=["small", "beside"])
def test_a_download_is_kept_here_and_a_second_process_shares_the_copies(
        remote: CountedGets, tmp_path: Path, minio_env: dict[str, str], size: int) -> None:
    """A checkpoint saved by another node has no copy here: it is downloaded, and a copy of
    what was downloaded is kept (hashed as it is written), which the next load reads (so does a
    ``get``, which keeps a copy too). One saved by another process of this node (a second worker
    sharing the directory) is read from its copy."""
    cache = tmp_path / "cache"
    data, other = os.urandom(size), os.urandom(size)
    elsewhere, fetched = remote.put(data), remote.put(other)
    store = CachedCheckpointStore(remote, cache, budget_bytes=1 << 30)
    assert store.load(elsewhere.ref, lambda b: bytes(b.view)) == data
    assert store.get(fetched.ref) == other
    assert remote.gets == [elsewhere.ref, fetched.ref]
    store.copies_written()
    assert copies(cache) == {elsewhere.ref: size, fetched.ref: size}
    assert store.load(elsewhere.ref, lambda b: bytes(b.view)) == data
    assert store.load(fetched.ref, lambda b: bytes(b.view)) == other
    assert remote.gets == [elsewhere.ref, fetched.ref]  # both read from their copies
    code = ("import sys; from gpu_worker.object_store import open_checkpoint_store; "
            "from gpu_worker.checkpoint_cache import cached; "
            "s = cached(open_checkpoint_store(sys.argv[1]), sys.argv[2], 1 << 30); "
            "print(s.put(b'saved by the other worker').ref); s.copies_written()")
    ref = subprocess.run([sys.executable, "-c", code, remote.url, str(cache)], env={**os.environ, **minio_env},
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=300).stdout.strip()
    assert store.load(ref, lambda b: bytes(b.view)) == b"saved by the other worker"
    assert remote.gets == [elsewhere.ref, fetched.ref]  # read from the other process's copy


def test_a_download_whose_memory_was_read_into_again_before_its_copy_gets_no_copy(
        remote: CountedGets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of a download is read from the memory file the store read it into, which the
    store's next load reuses: when the next load came first (the copier held at a gate, as a
    busy CPU holds a thread of lowest priority), what the copier reads hashes to another ref and
    no copy is kept under the first one; the next download's copy is kept."""
    from gpu_worker import checkpoint_cache

    gate = threading.Event()
    write = checkpoint_cache._Downloaded.write

    def held(self: Any, file: Any) -> str:
        assert gate.wait(60)
        return write(self, file)

    monkeypatch.setattr(checkpoint_cache._Downloaded, "write", held)
    first, second = os.urandom(3 << 20), os.urandom(3 << 20)  # one memory file, read into twice
    refs = [remote.put(first).ref, remote.put(second).ref]
    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=1 << 30)
    assert store.load(refs[0], lambda b: bytes(b.view)) == first
    assert store.load(refs[1], lambda b: bytes(b.view)) == second
    gate.set()
    store.copies_written()
    assert copies(tmp_path / "cache") == {refs[1]: 3 << 20}
    assert store.load(refs[0], lambda b: bytes(b.view)) == first  # downloaded again
    assert remote.gets == [refs[0], refs[1], refs[0]]
    store.copies_written()  # nothing of this store's is written once the test has ended


def test_a_download_whose_use_fails_keeps_no_copy_and_no_descriptor(remote: CountedGets, tmp_path: Path) -> None:
    """When ``use`` raises on downloaded bytes, the error is the caller's, no copy is queued and
    the descriptor taken on the load memory for the copy is closed."""
    data = os.urandom(3 << 20)
    ref = remote.put(data).ref
    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=1 << 30)
    assert store.load(ref, lambda b: bytes(b.view)) == data  # the load memory exists from here on
    store.copies_written()
    store.path(ref).unlink()
    memory = remote._memory._file
    assert memory is not None

    def descriptors() -> int:
        """This process's descriptors of the load memory's file."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.stat(f"/proc/self/fd/{fd}").st_ino == memory.inode
            except OSError:  # closed meanwhile
                pass
        return count

    held = descriptors()  # the store's own (and its map's duplicate)

    def fail(loaded: LoadedBytes) -> None:
        raise ValueError("the trainer refused it")

    with pytest.raises(ValueError, match="refused"):
        store.load(ref, fail)
    store.copies_written()
    assert descriptors() == held
    assert copies(tmp_path / "cache") == {}


def test_a_damaged_copy_is_deleted_and_reported_as_this_nodes_storage_fault(
        remote: CountedGets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that does not hash to its ref: the load's verification raises CachedCopyCorrupt
    (a StorageError, not CheckpointCorrupt) and deletes it, as does a load whose ``use`` failed
    on it; the next load reads MinIO and verifies. A truncated copy likewise."""
    monkeypatch.setattr(checkpoint, "_BESIDE_BYTES", 1)  # hashed beside use, as from 1 MiB
    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=1 << 30)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    ref = store.put(encode_state(state)).ref
    store.copies_written()
    path = store.path(ref)
    good = path.read_bytes()

    path.write_bytes(flip_byte(good))
    value, verification = store.load_pending(ref, lambda b: bytes(b.view))  # use succeeds on the bytes
    with pytest.raises(CachedCopyCorrupt) as caught:
        verification.check()
    assert isinstance(caught.value, StorageError) and not isinstance(caught.value, CheckpointCorrupt)
    assert caught.value.ref == ref and caught.value.actual == sha256_hex(flip_byte(good))
    assert not path.exists() and remote.gets == []
    assert torch.equal(store.load(ref, LoadedBytes.decode)["w"], state["w"])  # from MinIO
    assert remote.gets == [ref]
    store.copies_written()
    assert path.read_bytes() == good  # the download's copy

    path.write_bytes(b"not a checkpoint")  # use raises on these bytes
    with pytest.raises(CachedCopyCorrupt):
        store.load_pending(ref, LoadedBytes.decode)
    assert not path.exists()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CachedCopyCorrupt):
        store.load(ref, lambda b: bytes(b.view))
    assert torch.equal(decode_state(store.get(ref))["w"], state["w"])
    assert remote.gets == [ref, ref]
    store.copies_written()
    assert path.read_bytes() == good


def test_the_copies_stay_within_the_budget_least_recently_used_evicted_first(remote: CountedGets,
                                                                            tmp_path: Path) -> None:
    """Beyond ``budget_bytes`` the least recently used copies go (a load renews one) down to
    EVICT_TO of the budget; every checkpoint stays in MinIO."""
    cache = tmp_path / "cache"
    store = CachedCheckpointStore(remote, cache, budget_bytes=10_000)
    refs = [store.put(os.urandom(3000)).ref for _ in range(3)]
    store.copies_written()
    assert set(copies(cache)) == set(refs)
    os.utime(store.path(refs[0]), (1, 1))  # long ago ...
    os.utime(store.path(refs[1]), (2, 2))
    os.utime(store.path(refs[2]), (3, 3))
    store.load(refs[0], lambda b: None)  # ... but used now
    fourth = store.put(os.urandom(3000)).ref  # 12,000 bytes: down to at most 9,000
    store.copies_written()
    assert set(copies(cache)) == {refs[0], refs[2], fourth}
    fifth = store.put(os.urandom(3000)).ref
    store.copies_written()
    assert set(copies(cache)) == {refs[0], fourth, fifth}
    assert sum(copies(cache).values()) <= 10_000
    assert all(store.exists(r) for r in [*refs, fourth, fifth])
    assert store.get(refs[1]) and remote.gets == [refs[1]]  # evicted: downloaded
    store.copies_written()  # nothing of this store's is written once the test has ended


SHARING_WRITER = """
import os, sys
from gpu_worker.checkpoint import LocalCheckpointStore
from gpu_worker.checkpoint_cache import CachedCheckpointStore
cache = CachedCheckpointStore(LocalCheckpointStore(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
for _ in range(15):
    cache.put(os.urandom(90_000))
    cache.copies_written()
"""


def test_processes_sharing_a_cache_keep_it_within_the_budget_together(tmp_path: Path) -> None:
    """Two worker processes of one node, one cache directory: each writes 15 copies of 90 kB
    (1.35 MB, under the 2 MB budget alone; 2.7 MB together). Their copies stay within the
    budget: the bytes are tallied in one file under a lock, not by each process on its own
    (which let the directory grow to the budget once per process: 1.64x with 2 workers)."""
    cache, budget = tmp_path / "cache", 2_000_000
    procs = [subprocess.Popen([sys.executable, "-c", SHARING_WRITER, str(tmp_path / f"store-{i}"), str(cache),
                               str(budget)], cwd=Path(__file__).resolve().parents[1]) for i in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    held = copies(cache)
    assert 0 < sum(held.values()) <= budget and not any(name.startswith(".tmp-") for name in held)
    # never under what is held (a copy the other process's count already saw is added again when
    # its writer counts it: above, which only brings the next count sooner)
    assert sum(held.values()) <= int((cache / TALLY).read_text()) <= budget


def test_a_checkpoint_larger_than_the_budget_allows_gets_no_copy(remote: CountedGets, tmp_path: Path) -> None:
    """A checkpoint over EVICT_TO of the budget would evict itself once written: neither its
    save nor its download writes a copy (nor a temporary file); both still work."""
    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=10_000)
    data = os.urandom(9_500)
    ref = store.put(data).ref
    store.copies_written()
    assert store.load(ref, lambda b: bytes(b.view)) == data
    assert store.get(ref) == data
    store.copies_written()
    assert copies(tmp_path / "cache") == {} and remote.gets == [ref, ref]


def test_a_failed_upload_keeps_no_copy(remote: CountedGets, tmp_path: Path, minio_env: dict[str, str]) -> None:
    """When the store of record refuses a save, nothing is kept here (not even a temporary
    file): a copy is only ever of a stored checkpoint."""
    from gpu_worker.object_store import open_checkpoint_store

    absent = open_checkpoint_store(f"s3://{remote.bucket}/x", {**minio_env, "STAGETREE_S3_SECRET_KEY": "wrong"})
    store = CachedCheckpointStore(absent, tmp_path / "cache", budget_bytes=1 << 30)
    with pytest.raises(StorageError):
        store.put_many([os.urandom(2 << 20), b"small"])
    assert copies(tmp_path / "cache") == {}


def test_the_cache_is_checked_and_only_fronts_a_remote_store(remote: CountedGets, tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True, "1GB"):
        with pytest.raises(ValueError, match=r"`budget_bytes` of the checkpoint cache is .*must be an int > 0"):
            CachedCheckpointStore(remote, tmp_path, bad)  # type: ignore[arg-type]
    local = checkpoint.LocalCheckpointStore(tmp_path / "local")
    assert cached(local, tmp_path / "cache", None) is local  # its objects are local already
    assert cached(remote, None, None) is remote
    wrapped = cached(remote, tmp_path / "cache", None)
    assert isinstance(wrapped, CachedCheckpointStore) and wrapped.budget_bytes == 10 << 30


def dispatch(i: int, stages: list[tuple[str, int, int]], source: CheckpointSource | None = None) -> StageDispatched:
    return StageDispatched(dispatch_id=f"d{i}", worker_id="w0", plan_key="p", seed=3, decided_at=i, source=source,
                           stages=[StageSpec(node_id=n, hp=CONFIG, from_step=a, to_step=b, evaluate=False)
                                   for n, a, b in stages])


def test_a_worker_loads_a_sibling_source_from_the_copy_and_a_damaged_copy_hands_the_path_back(
        remote: CountedGets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker saving to MinIO through the cache: the sibling branch of its path loads its
    source from the copy (no download) and saves what a worker without a cache saves. With the
    copy damaged, the stage fails as "storage" (the path is handed back; the checkpoint is not
    dropped from the plan) and the path dispatched again downloads it and saves the same; the
    next dispatch from it reads the copy of that download."""
    monkeypatch.setattr(checkpoint, "_BESIDE_BYTES", 1)  # the source is used while it is hashed

    def run(worker: PathExecutor, d: StageDispatched) -> list[Event]:
        events: list[Event] = []
        worker.run(d, events.extend)
        return events

    def saved(events: list[Event]) -> dict[str, str]:
        return {e.node_id: e.ref for e in events if isinstance(e, CheckpointSaved)}

    plain = PathExecutor(DigitsTrainer(), "w0", remote, torch.device("cpu"))
    straight = saved(run(plain, dispatch(0, [("n0", 0, 2), ("n1", 2, 5)])))
    source = CheckpointSource(node_id="n0", step=2, ref=straight["n0"])
    expected = saved(run(plain, dispatch(1, [("m1", 2, 5)], source)))

    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=1 << 30)
    worker = PathExecutor(DigitsTrainer(), "w0", store, torch.device("cpu"))
    assert saved(run(worker, dispatch(2, [("n0", 0, 2), ("n1", 2, 5)]))) == straight
    store.copies_written()
    remote.gets.clear()
    assert saved(run(worker, dispatch(3, [("m1", 2, 5)], source))) == expected
    assert remote.gets == []  # the source came from the copy

    path = store.path(straight["n0"])
    path.write_bytes(flip_byte(path.read_bytes()))
    failed = [e for e in run(worker, dispatch(4, [("m1", 2, 5)], source)) if isinstance(e, StageFailed)]
    assert [(f.kind, f.ref) for f in failed] == [("storage", None)]
    assert "cached copy" in failed[0].error and not path.exists()
    assert saved(run(worker, dispatch(5, [("m1", 2, 5)], source))) == expected
    assert remote.gets == [straight["n0"]]
    store.copies_written()
    assert path.exists()  # a copy of the download
    assert saved(run(worker, dispatch(6, [("m1", 2, 5)], source))) == expected
    assert remote.gets == [straight["n0"]]  # read from it
    store.copies_written()  # nothing of this store's is written once the test has ended


def test_a_temporary_file_left_by_a_killed_writer_goes_when_the_copies_are_counted(remote: CountedGets,
                                                                                   tmp_path: Path) -> None:
    """A writer killed mid-copy leaves a ``.tmp-*`` file, never a copy under a ref; once it is
    older than STRAY_TEMP_S the next count deletes it (a fresh one may be another process's
    copy being written, and stays)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".tmp-stray").write_bytes(b"half a checkpoint")
    (cache / ".tmp-fresh").write_bytes(b"being written")
    os.utime(cache / ".tmp-stray", (1, 1))
    store = CachedCheckpointStore(remote, cache, budget_bytes=1 << 30)
    ref = store.put(b"a checkpoint").ref  # the first copy counts the copies
    store.copies_written()
    assert sorted(copies(cache)) == sorted([".tmp-fresh", ref])


def test_copies_are_written_after_the_save_returns_and_their_backlog_is_bounded(
        remote: CountedGets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save returns once the store of record has it, while its copy waits for the copier (here
    held at a gate, as a slow disk would hold it) and a load of it takes the bytes waiting;
    copies waiting hold at most
    COPY_BACKLOG_BYTES of checkpoints (one always may): a save beyond gets no copy, and is
    stored all the same. The copier runs at the lowest CPU priority."""
    from gpu_worker import checkpoint_cache

    gate = threading.Event()
    priorities: list[int] = []
    datas = [os.urandom(3000), os.urandom(3000), os.urandom(1000)]
    write_all = checkpoint_cache._write_all

    def held_write(file: Any, data: bytes) -> None:
        if not any(data is d for d in datas):  # another store's copy (an earlier test's copier)
            write_all(file, data)
            return
        priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert gate.wait(60)
        file.write(data)

    monkeypatch.setattr(checkpoint_cache, "_write_all", held_write)
    monkeypatch.setattr(checkpoint_cache, "COPY_BACKLOG_BYTES", 5000)
    store = CachedCheckpointStore(remote, tmp_path / "cache", budget_bytes=1 << 30)
    first = store.put(datas[0]).ref  # returns while its copy waits at the gate
    second = store.put(datas[1]).ref  # 6,000 bytes would wait: no copy
    third = store.put(datas[2]).ref  # 4,000: copied
    assert not set(copies(tmp_path / "cache")) & {first, second, third}  # a temporary file at most
    remote.gets.clear()
    assert store.load(third, lambda b: bytes(b.view)) == remote.get(third)  # from the bytes waiting
    assert remote.gets == [third]  # (the get above)
    gate.set()
    store.copies_written()
    assert set(copies(tmp_path / "cache")) == {first, third}
    assert all(remote.exists(r) for r in (first, second, third))
    assert priorities == [19, 19]
