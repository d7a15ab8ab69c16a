"""events.shared_log.SharedEmbeddedLog: a run directory's embedded log for several processes.

The EventLog contract suite of test_log.py runs against it (handles of one process, the first
the owner); then what only it has: handles in threads, forked children and other processes all
append through one owner with dense offsets and one hash chain; the owner hands the log over when
it closes; a forked child never writes with its parent's database.
"""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import test_log  # the EventLog contract suite (tests/ is on sys.path)
from test_log import event_log, stream  # noqa: F401 (its fixtures, on the backend below)

from events.log import CHAIN_START, EmbeddedLog, chain_next
from events.shared_log import SharedEmbeddedLog

REPO = Path(__file__).resolve().parents[1]


class SharedBackend(test_log.Backend):
    name = "shared"
    chain_bytes = 32

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> SharedEmbeddedLog:
        return SharedEmbeddedLog(self.path, timeout_s=30)


class TestSharedEmbeddedLogContract(test_log.TestEventLogContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> SharedBackend:
        return SharedBackend(tmp_path / "log")


def _chain_ok(path: Path, name: str) -> list[bytes]:
    """The stream's values, after checking its offsets are dense and its hash chain recomputes."""
    with EmbeddedLog(path, read_only=True) as log:
        records = list(log.read(name))
    head = CHAIN_START
    for i, r in enumerate(records):
        assert r.offset == i
        head = chain_next(head, name, r.offset, r.key, r.value)
        assert r.chain == head, f"chain breaks at offset {i}"
    return [r.value for r in records]


def _append_in_child(log: SharedEmbeddedLog, tag: str, n: int) -> None:
    for i in range(n):
        log.append("s", tag, f"{tag}-{i}".encode())
    log.close()


CLIENT = """
import pickle, sys
log = pickle.loads(bytes.fromhex(sys.argv[1]))
for i in range(int(sys.argv[3])):
    log.append("s", sys.argv[2], f"{sys.argv[2]}-{i}".encode())
log.close()
"""


def test_threads_forks_and_processes_append_through_one_owner(tmp_path: Path) -> None:
    path = tmp_path / "log"
    owner = SharedEmbeddedLog(path)
    owner.append("s", "first", b"first")
    assert owner.is_owner
    peer = SharedEmbeddedLog(path)  # same process, another handle: a client of the owner
    threads = [threading.Thread(target=lambda t=t: [peer.append("s", f"t{t}", f"t{t}-{i}".encode()) for i in range(30)])
               for t in range(3)]
    fork = multiprocessing.get_context("fork").Process(target=_append_in_child, args=(owner, "fork", 30))
    spawned = [subprocess.Popen([sys.executable, "-c", CLIENT, pickle.dumps(owner).hex(), f"p{i}", "30"], cwd=REPO)
               for i in range(2)]
    fork.start()
    for t in threads:
        t.start()
    for i in range(30):
        owner.append("s", "owner", f"owner-{i}".encode())
    for t in threads:
        t.join()
    fork.join(60)
    assert fork.exitcode == 0
    assert all(p.wait(60) == 0 for p in spawned)
    assert not peer.is_owner and owner.is_owner
    assert owner.end_offset("s") == 1 + 30 * 7
    peer.close()
    owner.close()

    values = _chain_ok(path, "s")
    for tag in ("owner", "t0", "t1", "t2", "fork", "p0", "p1"):
        mine = [v for v in values if v.startswith(f"{tag}-".encode())]
        assert mine == [f"{tag}-{i}".encode() for i in range(30)]  # each writer's order kept, none lost or doubled


def test_the_owner_hands_the_log_over_when_it_closes(tmp_path: Path) -> None:
    path = tmp_path / "log"
    first, second = SharedEmbeddedLog(path), SharedEmbeddedLog(path)
    assert first.append("s", "k", b"a") == 0 and first.is_owner
    assert second.append("s", "k", b"b") == 1 and not second.is_owner
    first.close()
    assert second.append("s", "k", b"c") == 2 and second.is_owner  # took the log over
    third = SharedEmbeddedLog(path)
    assert [r.value for r in third.read("s")] == [b"a", b"b", b"c"] and not third.is_owner
    second.close()
    third.close()
    assert _chain_ok(path, "s") == [b"a", b"b", b"c"]
    with pytest.raises(Exception, match="closed"):
        first.append("s", "k", b"d")


def test_bad_items_append_nothing(tmp_path: Path) -> None:
    with SharedEmbeddedLog(tmp_path / "log") as log:
        log.append("s", "k", b"a")
        with pytest.raises(TypeError, match="item 1 of the append to 's': value is int, but must be bytes"):
            log.append_many("s", [("k", b"b"), ("k", 5)])  # type: ignore[list-item]
        assert [r.value for r in log.read("s")] == [b"a"]


def test_a_forked_child_of_the_owner_is_a_client(tmp_path: Path) -> None:
    path = tmp_path / "log"
    owner = SharedEmbeddedLog(path)
    owner.append("s", "k", b"parent")
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()

    def child() -> None:
        result.put((owner.is_owner, owner.append("s", "k", b"child"), owner.is_owner))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(60)
    assert result.get(timeout=5) == (False, 1, False)
    assert owner.is_owner and [r.value for r in owner.read("s")] == [b"parent", b"child"]
    owner.close()
