"""The log transport contract (events/log.py ``EventLog``), run against every backend.

The suite is written against a ``backend`` fixture that knows how to open (and reopen) a log
by name; ``event_log`` is an open log of that backend. Only the embedded RocksDB log exists
today; a Kafka transport joins by adding a param to ``backend`` and a :class:`Backend` for it.
Tests of properties only one backend has (RocksDB's single-writer LOCK, kill -9 of the writer
process) ask the backend whether it supports them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.log import EmbeddedLog, EventLog, LogLocked, Record

REPO = Path(__file__).resolve().parents[1]


class Backend:
    """How the suite opens logs of one transport. ``open()`` twice gives the same log."""

    name: str
    single_writer_lock: bool = False
    crash_subprocess: bool = False

    def open(self) -> EventLog:
        raise NotImplementedError


class EmbeddedBackend(Backend):
    name = "embedded"
    single_writer_lock = True
    crash_subprocess = True

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> EmbeddedLog:
        return EmbeddedLog(self.path)


@pytest.fixture(params=["embedded"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "embedded":
        return EmbeddedBackend(tmp_path / "log")
    raise AssertionError(request.param)  # pragma: no cover


@pytest.fixture
def event_log(backend: Backend) -> Iterator[EventLog]:
    log = backend.open()
    yield log
    try:
        log.close()
    except Exception:  # already closed by the test
        pass


def values(records: Iterator[Record]) -> list[tuple[int, str, bytes]]:
    return [(r.offset, r.key, r.value) for r in records]


class TestEventLogContract:
    def test_empty_stream(self, event_log: EventLog) -> None:
        assert event_log.end_offset("s") == 0
        assert list(event_log.read("s")) == []
        assert list(event_log.read("s", 5)) == []

    def test_append_returns_dense_offsets_from_zero(self, event_log: EventLog) -> None:
        offsets = [event_log.append("s", f"k{i}", f"v{i}".encode()) for i in range(25)]
        assert offsets == list(range(25))
        assert event_log.end_offset("s") == 25
        assert values(event_log.read("s")) == [(i, f"k{i}", f"v{i}".encode()) for i in range(25)]

    def test_records_carry_stream_name(self, event_log: EventLog) -> None:
        event_log.append("stagetree.plan", "k", b"v")
        (record,) = event_log.read("stagetree.plan")
        assert (record.stream, record.offset, record.key, record.value) == ("stagetree.plan", 0, "k", b"v")
        assert len(record.chain) == 32

    def test_streams_are_independent(self, event_log: EventLog) -> None:
        # Interleaved appends; names chosen so one is a prefix of the other.
        got = []
        for i in range(10):
            got.append(("a", event_log.append("a", "x", b"a%d" % i)))
            if i % 2:
                got.append(("ab", event_log.append("ab", "y", b"ab%d" % i)))
        assert [o for s, o in got if s == "a"] == list(range(10))
        assert [o for s, o in got if s == "ab"] == list(range(5))
        assert event_log.end_offset("a") == 10
        assert event_log.end_offset("ab") == 5
        assert event_log.end_offset("b") == 0
        assert [r.value for r in event_log.read("a")] == [b"a%d" % i for i in range(10)]
        assert [r.value for r in event_log.read("ab")] == [b"ab%d" % i for i in (1, 3, 5, 7, 9)]
        assert all(r.stream == "a" for r in event_log.read("a"))

    def test_read_from_offset_and_stop(self, event_log: EventLog) -> None:
        event_log.append_many("s", [(f"k{i}", bytes([i])) for i in range(20)])
        assert [r.offset for r in event_log.read("s", 7)] == list(range(7, 20))
        assert [r.offset for r in event_log.read("s", 7, 12)] == list(range(7, 12))
        assert [r.offset for r in event_log.read("s", 0, 0)] == []
        assert [r.offset for r in event_log.read("s", 12, 7)] == []
        assert [r.offset for r in event_log.read("s", 19)] == [19]
        assert [r.offset for r in event_log.read("s", 20)] == []
        assert [r.offset for r in event_log.read("s", 25)] == []
        assert [r.offset for r in event_log.read("s", 15, 1000)] == list(range(15, 20))
        assert [r.value for r in event_log.read("s", 3, 5)] == [bytes([3]), bytes([4])]

    def test_read_negative_start_is_an_error(self, event_log: EventLog) -> None:
        with pytest.raises(ValueError, match="start"):
            list(event_log.read("s", -1))

    def test_keys_and_values_preserved_exactly(self, event_log: EventLog) -> None:
        items = [
            ("", b""),
            ("plan/with/slashes", b"\x00\x01\xff binary \x00"),
            ("ключ-ü-☃", "värde ☃".encode()),
            ("k" * 1000, b"v" * 100_000),
            ("a\x1fb", b'{"json": true}'),
        ]
        offsets = event_log.append_many("s", items)
        assert offsets == list(range(len(items)))
        assert [(r.key, r.value) for r in event_log.read("s")] == items
        assert all(isinstance(r.value, bytes) for r in event_log.read("s"))

    def test_append_many_is_ordered_and_continues_offsets(self, event_log: EventLog) -> None:
        assert event_log.append("s", "k", b"first") == 0
        assert event_log.append_many("s", [("k", b"x%d" % i) for i in range(5)]) == [1, 2, 3, 4, 5]
        assert event_log.append_many("s", []) == []
        assert event_log.end_offset("s") == 6
        assert event_log.append("s", "k", b"last") == 6
        assert [r.value for r in event_log.read("s")] == [b"first"] + [b"x%d" % i for i in range(5)] + [b"last"]

    def test_append_many_is_atomic(self, event_log: EventLog) -> None:
        # A batch with an item that cannot be encoded as a record (a non-str key) must leave
        # nothing behind and must not consume offsets.
        event_log.append("s", "k", b"before")
        with pytest.raises(Exception):
            event_log.append_many("s", [("k", b"ok1"), (None, b"bad"), ("k", b"ok2")])  # type: ignore[list-item]
        assert event_log.end_offset("s") == 1
        assert [r.value for r in event_log.read("s")] == [b"before"]
        assert event_log.append("s", "k", b"after") == 1
        assert [r.value for r in event_log.read("s")] == [b"before", b"after"]

    def test_reopen_keeps_everything_and_continues_offsets(self, backend: Backend) -> None:
        log = backend.open()
        log.append_many("a", [("k", b"a%d" % i) for i in range(10)])
        log.append_many("b", [("k", b"b%d" % i) for i in range(3)])
        log.close()

        log = backend.open()
        try:
            assert log.end_offset("a") == 10
            assert log.end_offset("b") == 3
            assert [r.value for r in log.read("a")] == [b"a%d" % i for i in range(10)]
            assert log.append("a", "k", b"a10") == 10
            assert log.append_many("b", [("k", b"b3"), ("k", b"b4")]) == [3, 4]
        finally:
            log.close()

        log = backend.open()
        try:
            assert [r.offset for r in log.read("a")] == list(range(11))
            assert [r.value for r in log.read("b")] == [b"b%d" % i for i in range(5)]
        finally:
            log.close()

    def test_read_is_a_snapshot_of_the_end_at_call_time(self, event_log: EventLog) -> None:
        event_log.append_many("s", [("k", b"%d" % i) for i in range(3)])
        it = event_log.read("s")
        first = next(it)
        event_log.append("s", "k", b"3")
        rest = list(it)
        assert [first.offset] + [r.offset for r in rest] in ([0, 1, 2], [0, 1, 2, 3])
        assert [r.offset for r in event_log.read("s")] == [0, 1, 2, 3]


class TestSingleWriter:
    def test_second_open_in_same_process_raises_log_locked(self, backend: Backend, event_log: EventLog) -> None:
        if not backend.single_writer_lock:
            pytest.skip(f"{backend.name} has no single-writer lock")
        event_log.append("s", "k", b"v")
        with pytest.raises(LogLocked):
            backend.open()
        # The failed open did not disturb the holder.
        assert event_log.append("s", "k", b"w") == 1
        assert [r.value for r in event_log.read("s")] == [b"v", b"w"]

    def test_second_open_in_another_process_raises_log_locked(self, backend: Backend, event_log: EventLog) -> None:
        if not isinstance(backend, EmbeddedBackend):
            pytest.skip(f"{backend.name} has no single-writer lock")
        event_log.append("s", "k", b"v")
        code = textwrap.dedent(f"""
            from events.log import EmbeddedLog, LogLocked
            try:
                EmbeddedLog({str(backend.path)!r})
            except LogLocked as exc:
                print("LOCKED", exc)
            else:
                print("OPENED")
        """)
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("LOCKED"), proc.stdout + proc.stderr
        assert str(backend.path) in proc.stdout

    def test_close_releases_the_lock(self, backend: Backend) -> None:
        log = backend.open()
        log.append("s", "k", b"v")
        log.close()
        log = backend.open()
        try:
            assert log.end_offset("s") == 1
        finally:
            log.close()


WRITER = """
import sys
from events.log import EmbeddedLog
log = EmbeddedLog(sys.argv[1])
i = 0
while True:
    if i % 3 == 2:
        offs = log.append_many("s", [("k%d" % (i + j), b"value-%d" % (i + j)) for j in range(3)])
    else:
        offs = [log.append("s", "k%d" % i, b"value-%d" % i)]
    for o in offs:
        sys.stdout.write("%d\\n" % o)
    sys.stdout.flush()
    i += len(offs)
"""


class TestDurability:
    def test_acknowledged_appends_survive_kill_9(self, backend: Backend) -> None:
        if not isinstance(backend, EmbeddedBackend):
            pytest.skip(f"{backend.name}: the writer is not a local subprocess")
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(backend.path)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        acked: list[int] = []
        deadline = time.monotonic() + 60
        try:
            assert proc.stdout is not None
            while len(acked) < 200:
                line = proc.stdout.readline()
                if not line:
                    pytest.fail(f"writer exited early: rc={proc.poll()} {proc.stderr.read() if proc.stderr else ''}")
                acked.append(int(line))
                assert time.monotonic() < deadline, "writer too slow"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            # Lines flushed between our last read and the kill were acknowledged too.
            acked += [int(x) for x in proc.stdout.read().split()]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
            if proc.stderr:
                proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        assert acked == list(range(len(acked)))

        log = backend.open()
        try:
            records = list(log.read("s"))
            end = log.end_offset("s")
            assert end >= len(acked)
            assert [r.offset for r in records] == list(range(end))  # dense, nothing torn
            # From offset 2 on the writer appends batches of 3: a batch is all there or absent.
            assert end < 2 or (end - 2) % 3 == 0, end
            for r in records:
                assert (r.key, r.value) == (f"k{r.offset}", b"value-%d" % r.offset)
            # The reopened log continues after everything that survived.
            assert log.append("s", "k", b"after-crash") == end
        finally:
            log.close()
