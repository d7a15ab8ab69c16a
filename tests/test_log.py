"""The log transport contract (events/log.py ``EventLog``), run against every backend.

The suite is written against a ``backend`` fixture that knows how to open (and reopen) a log
by name; ``event_log`` is an open log of that backend. Two backends run it:

* ``embedded``: :class:`events.log.EmbeddedLog` (RocksDB) in a temporary directory;
* ``kafka``: :class:`events.kafka_log.KafkaLog` on the local broker that ``infra/up.sh`` starts
  (once per session; the bootstrap servers come from ``.infra/env``). Kafka topics outlive the
  test, so every test gets topic names of its own: tests name streams through the ``stream``
  fixture (``stream("s")``), which gives the embedded log the name itself and Kafka a name under
  a per-test prefix; the prefix's topics are deleted after the test.

Tests of properties only one backend has (RocksDB's single-writer LOCK, a per-record hash chain,
all-or-none batches under kill -9) ask the backend whether it has them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import orjson
import pytest

from events import topics
from events.codec import encode
from events.hp import Constant
from events.log import CHAIN_START, EmbeddedLog, EventLog, LogError, LogLocked, Record, chain_next, event_key
from events.models import StudyStarted
from projections.store import ProjectionStore, Projector, snapshot
from scheduler.simulation import Simulation

REPO = Path(__file__).resolve().parents[1]
INFRA_ENV = REPO / ".infra" / "env"


class Backend:
    """How the suite opens logs of one transport. ``open()`` twice gives the same log."""

    name: str
    single_writer_lock: bool = False
    chain_bytes: int = 0
    """Length of ``Record.chain`` (32: the transport keeps a per-record hash chain; 0: it does not)."""
    atomic_batches_under_kill: bool = False
    """Whether an ``append_many`` interrupted by kill -9 of the writer is all there or absent."""

    def open(self) -> EventLog:
        raise NotImplementedError

    def stream(self, name: str) -> str:
        """The backend's name for the test's stream ``name``."""
        return name

    def writer_args(self, stream: str) -> list[str]:
        """Arguments of the WRITER script: which transport to open, and where."""
        raise NotImplementedError


class EmbeddedBackend(Backend):
    name = "embedded"
    single_writer_lock = True
    chain_bytes = 32
    atomic_batches_under_kill = True

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> EmbeddedLog:
        return EmbeddedLog(self.path)

    def writer_args(self, stream: str) -> list[str]:
        return ["embedded", str(self.path), stream]


class KafkaBackend(Backend):
    name = "kafka"

    def __init__(self, bootstrap_servers: str, prefix: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.prefix = prefix

    def open(self) -> EventLog:
        from events.kafka_log import KafkaLog

        return KafkaLog(self.bootstrap_servers, client_id="stagetree-test")

    def stream(self, name: str) -> str:
        return self.prefix + name

    def writer_args(self, stream: str) -> list[str]:
        return ["kafka", self.bootstrap_servers, stream]

    def delete_topics(self) -> None:
        """Delete every topic under this test's prefix (best effort)."""
        from kafka_cluster import delete_topics

        delete_topics(self.bootstrap_servers, self.prefix)  # a topic already gone is no failure here


def _loopback(bootstrap_servers: str) -> str:
    """``bootstrap_servers`` if every host in it is this machine; the tests connect nowhere else."""
    for server in bootstrap_servers.split(","):
        host = server.strip().rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"STAGETREE_BOOTSTRAP_SERVERS in {INFRA_ENV} names {host!r}, not a loopback host")
    return bootstrap_servers


@pytest.fixture(scope="session")
def kafka_bootstrap(infra_env: dict[str, str]) -> str:
    """The local broker's bootstrap servers (the session's ``infra_env`` started it)."""
    return _loopback(infra_env["STAGETREE_BOOTSTRAP_SERVERS"])


# The first infra/up.sh on a machine builds MinIO from source (many minutes), inside the setup of
# whichever Kafka test runs first: those tests get the infra tests' long timeout.
INFRA_TIMEOUT = pytest.mark.timeout(3600)


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=INFRA_TIMEOUT)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "embedded":
        yield EmbeddedBackend(tmp_path / "log")
    elif request.param == "kafka":
        bootstrap = request.getfixturevalue("kafka_bootstrap")
        # Topic names: [A-Za-z0-9._-]; no "_", which Kafka treats as colliding with ".".
        test = re.sub(r"[^A-Za-z0-9-]+", "-", request.node.originalname.removeprefix("test_"))[:60]
        kafka = KafkaBackend(bootstrap, f"stagetree.test.log.{uuid.uuid4().hex[:10]}.{test}.")
        yield kafka
        kafka.delete_topics()
    else:  # pragma: no cover
        raise AssertionError(request.param)


@pytest.fixture
def stream(backend: Backend) -> Callable[[str], str]:
    """``stream("s")``: the name of the test's stream ``s`` in the backend under test."""
    return backend.stream


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
    def test_empty_stream(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        s = stream("s")
        assert event_log.end_offset(s) == 0
        assert list(event_log.read(s)) == []
        assert list(event_log.read(s, 5)) == []

    def test_append_returns_dense_offsets_from_zero(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        s = stream("s")
        offsets = [event_log.append(s, f"k{i}", f"v{i}".encode()) for i in range(25)]
        assert offsets == list(range(25))
        assert event_log.end_offset(s) == 25
        assert values(event_log.read(s)) == [(i, f"k{i}", f"v{i}".encode()) for i in range(25)]

    def test_records_carry_stream_name(self, backend: Backend, event_log: EventLog,
                                       stream: Callable[[str], str]) -> None:
        plan = stream(topics.PLAN)
        event_log.append(plan, "k", b"v")
        (record,) = event_log.read(plan)
        assert (record.stream, record.offset, record.key, record.value) == (plan, 0, "k", b"v")
        assert len(record.chain) == backend.chain_bytes

    def test_streams_are_independent(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        # Interleaved appends; names chosen so one is a prefix of the other.
        a, ab, b = stream("a"), stream("ab"), stream("b")
        got = []
        for i in range(10):
            got.append(("a", event_log.append(a, "x", b"a%d" % i)))
            if i % 2:
                got.append(("ab", event_log.append(ab, "y", b"ab%d" % i)))
        assert [o for s, o in got if s == "a"] == list(range(10))
        assert [o for s, o in got if s == "ab"] == list(range(5))
        assert event_log.end_offset(a) == 10
        assert event_log.end_offset(ab) == 5
        assert event_log.end_offset(b) == 0
        assert [r.value for r in event_log.read(a)] == [b"a%d" % i for i in range(10)]
        assert [r.value for r in event_log.read(ab)] == [b"ab%d" % i for i in (1, 3, 5, 7, 9)]
        assert all(r.stream == a for r in event_log.read(a))

    def test_order_per_key_is_append_order(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        # Keys interleaved within and across batches: every key's records come back in the
        # order they were appended (the stream is totally ordered, so per key too).
        s = stream(topics.PLAN)
        appended: list[tuple[str, bytes]] = []
        for round_ in range(6):
            batch = [(f"plan-{(round_ + j) % 3}", b"%d.%d" % (round_, j)) for j in range(round_ + 1)]
            if round_ % 2:
                event_log.append_many(s, batch)
            else:
                for key, value in batch:
                    event_log.append(s, key, value)
            appended += batch
        records = list(event_log.read(s))
        assert [(r.key, r.value) for r in records] == appended
        for key in ("plan-0", "plan-1", "plan-2"):
            assert [r.value for r in records if r.key == key] == [v for k, v in appended if k == key]

    def test_read_from_offset_and_stop(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        s = stream("s")
        event_log.append_many(s, [(f"k{i}", bytes([i])) for i in range(20)])
        assert [r.offset for r in event_log.read(s, 7)] == list(range(7, 20))
        assert [r.offset for r in event_log.read(s, 7, 12)] == list(range(7, 12))
        assert [r.offset for r in event_log.read(s, 0, 0)] == []
        assert [r.offset for r in event_log.read(s, 12, 7)] == []
        assert [r.offset for r in event_log.read(s, 19)] == [19]
        assert [r.offset for r in event_log.read(s, 20)] == []
        assert [r.offset for r in event_log.read(s, 25)] == []
        assert [r.offset for r in event_log.read(s, 15, 1000)] == list(range(15, 20))
        assert [r.value for r in event_log.read(s, 3, 5)] == [bytes([3]), bytes([4])]

    def test_nested_reads(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        # Two reads iterated together (e.g. a merge of two streams) do not disturb each other.
        a, b = stream("a"), stream("b")
        event_log.append_many(a, [("k", b"a%d" % i) for i in range(5)])
        event_log.append_many(b, [("k", b"b%d" % i) for i in range(5)])
        pairs = [(x.value, y.value) for x, y in zip(event_log.read(a), event_log.read(b, 1))]
        assert pairs == [(b"a%d" % i, b"b%d" % (i + 1)) for i in range(4)]
        assert [r.offset for r in event_log.read(a, 2)] == [2, 3, 4]

    def test_read_negative_start_is_an_error(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        with pytest.raises(ValueError, match="start"):
            list(event_log.read(stream("s"), -1))

    def test_keys_and_values_preserved_exactly(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        s = stream("s")
        items = [
            ("", b""),
            ("plan/with/slashes", b"\x00\x01\xff binary \x00"),
            ("ключ-ü-☃", "värde ☃".encode()),
            ("k" * 1000, b"v" * 100_000),
            ("a\x1fb", b'{"json": true}'),
        ]
        offsets = event_log.append_many(s, items)
        assert offsets == list(range(len(items)))
        assert [(r.key, r.value) for r in event_log.read(s)] == items
        assert all(isinstance(r.value, bytes) for r in event_log.read(s))

    def test_append_many_is_ordered_and_continues_offsets(self, event_log: EventLog,
                                                          stream: Callable[[str], str]) -> None:
        s = stream("s")
        assert event_log.append(s, "k", b"first") == 0
        assert event_log.append_many(s, [("k", b"x%d" % i) for i in range(5)]) == [1, 2, 3, 4, 5]
        assert event_log.append_many(s, []) == []
        assert event_log.end_offset(s) == 6
        assert event_log.append(s, "k", b"last") == 6
        assert [r.value for r in event_log.read(s)] == [b"first"] + [b"x%d" % i for i in range(5)] + [b"last"]

    def test_append_many_is_atomic(self, event_log: EventLog, stream: Callable[[str], str]) -> None:
        # A batch with an item that cannot be encoded as a record (a non-str key) must leave
        # nothing behind and must not consume offsets.
        s = stream("s")
        event_log.append(s, "k", b"before")
        with pytest.raises(TypeError, match="item 1 .* key is NoneType None"):
            event_log.append_many(s, [("k", b"ok1"), (None, b"bad"), ("k", b"ok2")])  # type: ignore[list-item]
        assert event_log.end_offset(s) == 1
        assert [r.value for r in event_log.read(s)] == [b"before"]
        assert event_log.append(s, "k", b"after") == 1
        assert [r.value for r in event_log.read(s)] == [b"before", b"after"]

    def test_reopen_keeps_everything_and_continues_offsets(self, backend: Backend,
                                                           stream: Callable[[str], str]) -> None:
        a, b = stream("a"), stream("b")
        log = backend.open()
        log.append_many(a, [("k", b"a%d" % i) for i in range(10)])
        log.append_many(b, [("k", b"b%d" % i) for i in range(3)])
        log.close()

        log = backend.open()
        try:
            assert log.end_offset(a) == 10
            assert log.end_offset(b) == 3
            assert [r.value for r in log.read(a)] == [b"a%d" % i for i in range(10)]
            assert log.append(a, "k", b"a10") == 10
            assert log.append_many(b, [("k", b"b3"), ("k", b"b4")]) == [3, 4]
        finally:
            log.close()

        log = backend.open()
        try:
            assert [r.offset for r in log.read(a)] == list(range(11))
            assert [r.value for r in log.read(b)] == [b"b%d" % i for i in range(5)]
        finally:
            log.close()

    def test_read_is_a_snapshot_of_the_end_at_call_time(self, event_log: EventLog,
                                                        stream: Callable[[str], str]) -> None:
        s = stream("s")
        event_log.append_many(s, [("k", b"%d" % i) for i in range(3)])
        it = event_log.read(s)
        first = next(it)
        event_log.append(s, "k", b"3")
        rest = list(it)
        assert [first.offset] + [r.offset for r in rest] in ([0, 1, 2], [0, 1, 2, 3])
        assert [r.offset for r in event_log.read(s)] == [0, 1, 2, 3]


class RenamedStreams:
    """An :class:`EventLog` that gives ``log``'s streams the backend's names (``stream``), so code
    that names the real streams (the projector reads ``topics.PLAN``) runs on per-test topics."""

    def __init__(self, log: EventLog, stream: Callable[[str], str]) -> None:
        self.log, self.stream = log, stream

    def append(self, stream: str, key: str, value: bytes) -> int:
        return self.log.append(self.stream(stream), key, value)

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        return self.log.append_many(self.stream(stream), items)

    def read(self, stream: str, start: int = 0, stop: int | None = None, partition: int = 0) -> Iterator[Record]:
        return self.log.read(self.stream(stream), start, stop, partition=partition)

    def end_offset(self, stream: str, partition: int = 0) -> int:
        return self.log.end_offset(self.stream(stream), partition)

    def partition_count(self, stream: str) -> int:
        return self.log.partition_count(self.stream(stream))

    def close(self) -> None:
        self.log.close()


def small_study() -> Simulation:
    """A merged study of three trials sharing prefixes, run to the end by two simulated workers."""
    sim = Simulation(workers=2)
    sim.emit(StudyStarted(study_id="sim", name="sim", plan_key="plan", mode="merged", workers=2, seed=0,
                          trainer="Sim@1", metric="step", metric_mode="max"))
    sim.submit("t1", {"lr": Constant(0.1)}, 60)
    sim.submit("t2", {"lr": Constant(0.1)}, 90)
    sim.submit("t3", {"lr": Constant(0.2)}, 30)
    sim.run()
    return sim


plan_key_of = event_key


class TestDuplicateDelivery:
    def test_duplicate_delivery_applied_once(self, event_log: EventLog, stream: Callable[[str], str],
                                             tmp_path: Path) -> None:
        # A producer that crashed after appending a batch but before learning it was acknowledged
        # appends the same encoded events again (same event_ids); two events are also delivered
        # again much later (StudyStarted would count a second run if applied twice). Folding the
        # log must give the state of applying each event once.
        sim = small_study()
        encoded = [(plan_key_of(e), encode(e)) for e in sim.events]
        assert len(encoded) >= 15
        retry = encoded[5:12]  # TrialSubmitted, StageDispatched x2, CheckpointSaved, MetricsReported, ...
        log = RenamedStreams(event_log, stream)
        log.append_many(topics.PLAN, encoded[:12])
        log.append_many(topics.PLAN, retry)  # the retried batch, byte for byte
        log.append_many(topics.PLAN, encoded[12:])
        log.append_many(topics.PLAN, [encoded[2], encoded[9]])
        total = len(encoded) + len(retry) + 2
        assert log.end_offset(topics.PLAN) == total

        store = ProjectionStore(tmp_path / "state")
        try:
            projector = Projector(log, store=store)
            applied = projector.catch_up()
            assert len(applied) == total  # delivered, but the duplicates are no-ops
            assert projector.state.rejected == {}
            assert log.end_offset(topics.DEADLETTER) == 0
            assert projector.state.offset == total - 1
            once = snapshot(sim.state)
            without_meta = {k: v for k, v in store.records().items() if k != b"meta"}
            assert without_meta == {k: v for k, v in once.items() if k != b"meta"}
            assert orjson.loads(store.records()[b"meta"])["offset"] == total - 1
        finally:
            store.close()


class TestSingleWriter:
    def test_second_open_in_same_process_raises_log_locked(self, backend: Backend, event_log: EventLog,
                                                           stream: Callable[[str], str]) -> None:
        if not backend.single_writer_lock:
            pytest.skip(f"{backend.name} has no single-writer lock")
        s = stream("s")
        event_log.append(s, "k", b"v")
        with pytest.raises(LogLocked):
            backend.open()
        # The failed open did not disturb the holder.
        assert event_log.append(s, "k", b"w") == 1
        assert [r.value for r in event_log.read(s)] == [b"v", b"w"]

    def test_second_open_in_another_process_raises_log_locked(self, backend: Backend, event_log: EventLog,
                                                              stream: Callable[[str], str]) -> None:
        if not isinstance(backend, EmbeddedBackend):
            pytest.skip(f"{backend.name} has no single-writer lock")
        event_log.append(stream("s"), "k", b"v")
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

    def test_close_releases_the_lock(self, backend: Backend, stream: Callable[[str], str]) -> None:
        s = stream("s")
        log = backend.open()
        log.append(s, "k", b"v")
        log.close()
        log = backend.open()
        try:
            assert log.end_offset(s) == 1
        finally:
            log.close()


WRITER = """
import sys
import tempfile
kind, where, stream = sys.argv[1:4]
if kind == "embedded":
    from events.log import EmbeddedLog
    log = EmbeddedLog(where)
else:
    from events.kafka_log import KafkaLog
    log = KafkaLog(where, client_id="stagetree-test-writer")
i = 0
while True:
    if i % 3 == 2:
        offs = log.append_many(stream, [("k%d" % (i + j), b"value-%d" % (i + j)) for j in range(3)])
    else:
        offs = [log.append(stream, "k%d" % i, b"value-%d" % i)]
    for o in offs:
        sys.stdout.write("%d\\n" % o)
    sys.stdout.flush()
    i += len(offs)
"""


def acknowledged_then_killed(code: str, args: Sequence[str], count: int, timeout_s: float = 60) -> list[str]:
    """Run ``code`` with ``args`` in a fresh interpreter, read ``count`` lines it prints (each an
    acknowledgement), kill it with SIGKILL, and return every line it printed (those it flushed
    between the last read and the kill too)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        while len(lines) < count:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"writer exited early: rc={proc.poll()} {proc.stderr.read() if proc.stderr else ''}")
            lines.append(line)
            assert time.monotonic() < deadline, "writer too slow"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        lines += proc.stdout.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
    assert proc.returncode == -signal.SIGKILL
    return [line for line in lines if line.strip()]


def settled_end(log: EventLog, stream: str, quiet_s: float = 0.5, timeout_s: float = 30) -> int:
    """``end_offset(stream)`` once it has not moved for ``quiet_s`` (a killed Kafka producer's last
    request may still be in the broker's socket buffer; the embedded log settles at once)."""
    deadline = time.monotonic() + timeout_s
    end = log.end_offset(stream)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = log.end_offset(stream)
        if now == end:
            return end
        end = now
    raise AssertionError(f"end offset of {stream} still moving after {timeout_s} s")


class TestDurability:
    def test_acknowledged_appends_survive_kill_9(self, backend: Backend, stream: Callable[[str], str]) -> None:
        # Embedded: kill -9 of the process that owns the RocksDB log. Kafka: kill -9 of a producer
        # process; a fresh KafkaLog (a new connection) must read every acknowledged offset.
        s = stream("s")
        acked = [int(line) for line in acknowledged_then_killed(WRITER, backend.writer_args(s), 200)]
        assert acked == list(range(len(acked)))

        log = backend.open()
        try:
            end = settled_end(log, s)
            records = list(log.read(s))
            assert end >= len(acked)
            assert [r.offset for r in records] == list(range(end))  # dense, nothing torn
            if backend.atomic_batches_under_kill:
                # From offset 2 on the writer appends batches of 3: a batch is all there or absent.
                assert end < 2 or (end - 2) % 3 == 0, end
            for r in records:  # every acknowledged offset, and nothing but the writer's records in order
                assert (r.key, r.value) == (f"k{r.offset}", b"value-%d" % r.offset)
            # The reopened log continues after everything that survived.
            assert log.append(s, "k", b"after-crash") == end
        finally:
            log.close()


STREAMS_WRITER = """
import sys
import tempfile
from events.log import EmbeddedLog
log = EmbeddedLog(sys.argv[1])
i = 0
while True:
    # Worker reports, then a decision on two streams, made durable by the group commit (the
    # coordinator's pattern); every tenth decision waits for its fsync.
    (offs,) = log.append_streams([("plan", [("k%d" % i, b"report-%d" % i)])], durable=False)
    log.sync_soon()
    plan, dispatch = log.append_streams([("plan", [("k%d" % i, b"decision-%d" % i)]),
                                         ("dispatch", [("w", b"decision-%d" % i)])], durable=i % 10 == 0)
    log.sync_soon()
    sys.stdout.write("%d %d %d\\n" % (offs[0], plan[0], dispatch[0]))
    sys.stdout.flush()
    i += 1
"""


def test_one_write_on_two_streams_is_atomic_and_appends_without_fsync_survive_kill_9(tmp_path: Path) -> None:
    """The embedded log's ``append_streams``: a decision's plan and dispatch records are one
    write (after a kill -9 both are there or neither), and records appended with
    ``durable=False`` and left to the syncer thread (``sync_soon``) are kept too (a kill -9 loses
    nothing written to the operating system, even while the syncer fsyncs); offsets stay dense
    per stream and the hash chain verifies."""
    acked = [tuple(int(x) for x in line.split())
             for line in acknowledged_then_killed(STREAMS_WRITER, [str(tmp_path / "log")], 100)]
    assert acked == [(2 * i, 2 * i + 1, i) for i in range(len(acked))]
    log = EmbeddedLog(tmp_path / "log")
    try:
        plan, dispatch = list(log.read("plan")), list(log.read("dispatch"))
        assert [r.offset for r in plan] == list(range(len(plan))) and len(plan) >= 2 * len(acked)
        decisions = [r.value for r in plan if r.value.startswith(b"decision")]
        assert decisions == [r.value for r in dispatch]  # a decision is on both streams or on neither
        assert [r.value for r in plan[: 2 * len(acked)]] == [
            b"%s-%d" % (kind, i) for i in range(len(acked)) for kind in (b"report", b"decision")]
        for stream, records in (("plan", plan), ("dispatch", dispatch)):
            head = CHAIN_START
            for r in records:
                head = chain_next(head, stream, r.offset, r.key, r.value)
                assert r.chain == head
        assert log.append("plan", "k", b"after") == len(plan)  # the log continues after what survived
    finally:
        log.close()

def test_the_group_commit_syncs_beside_appends_from_other_threads_and_close_waits_for_it(tmp_path: Path) -> None:
    """``sync_soon`` starts one syncer thread that fsyncs the write-ahead log while two threads
    go on appending (each with its own stream); every record is kept, dense and chained; close
    stops the thread; a log opened with ``sync=False`` starts none; a read-only one refuses."""
    import threading

    log = EmbeddedLog(tmp_path / "log")
    errors: list[BaseException] = []

    def writer(stream: str) -> None:
        try:
            for i in range(300):
                log.append_streams([(stream, [(f"k{i}", b"v-%d" % i)])], durable=False)
                log.sync_soon()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    syncers = [t for t in threading.enumerate() if t.name.startswith("log-syncer-")]
    assert not errors and len(syncers) == 1, (errors, syncers)
    log.close()
    assert not syncers[0].is_alive()
    reopened = EmbeddedLog(tmp_path / "log")
    try:
        for stream in ("a", "b"):
            records = list(reopened.read(stream))
            assert [(r.offset, r.value) for r in records] == [(i, b"v-%d" % i) for i in range(300)]
            head = CHAIN_START
            for r in records:
                head = chain_next(head, stream, r.offset, r.key, r.value)
                assert r.chain == head
    finally:
        reopened.close()
    lazy = EmbeddedLog(tmp_path / "lazy", sync=False)
    lazy.append("a", "k", b"v")
    lazy.sync_soon()
    assert not any(t.name == "log-syncer-lazy" for t in threading.enumerate())
    lazy.close()
    with pytest.raises(LogError, match="read-only"):
        EmbeddedLog(tmp_path / "log", read_only=True).sync_soon()



class TestFollower:
    """A follower (``EmbeddedLog(path, follow=True)``, a RocksDB secondary instance) beside the
    one writer process: it takes no lock, sees nothing until it catches up, then every
    acknowledged record in order, and keeps following across the writer's exit and restart."""

    def test_follower_sees_a_running_writers_appends_after_each_catch_up(self, tmp_path: Path) -> None:
        path = tmp_path / "log"
        first = EmbeddedLog(path)
        first.append("s", "k0", b"value-0")
        first.close()
        proc = subprocess.Popen([sys.executable, "-c", WRITER, "embedded", str(path), "s"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        follower = EmbeddedLog(path, follow=True)
        snapshot_reader = EmbeddedLog(path, read_only=True)
        seen: list[Record] = []
        ends = []
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            while len(seen) < 300:
                assert time.monotonic() < deadline, f"followed only {len(seen)} records; writer rc={proc.poll()}"
                follower.catch_up()
                ends.append(follower.end_offset("s"))
                seen += follower.read("s", len(seen))
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            acked = [int(x) for x in proc.stdout.read().split()]
            follower.catch_up()
            seen += follower.read("s", len(seen))
            assert snapshot_reader.end_offset("s") == 1  # a read-only open sees the log as it was
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            snapshot_reader.close()
            for pipe in (proc.stdout, proc.stderr):
                if pipe:
                    pipe.close()
        assert len({e for e in ends}) > 2, ends  # it saw the log grow, several times
        assert [r.offset for r in seen] == list(range(len(seen)))
        assert acked and max(acked) < len(seen)  # every acknowledged record was followed
        assert seen[0].value == b"value-0"
        assert all(r.value == b"value-%d" % (r.offset - 1) for r in seen[1:])  # the writer numbers from 0 again

        # The writer restarts (a resumed run): the follower, still open, goes on after its records.
        writer = EmbeddedLog(path)
        try:
            writer.append("s", "k", b"after-restart")
            follower.catch_up()
            assert [r.value for r in follower.read("s", len(seen))] == [b"after-restart"]
        finally:
            writer.close()
            secondary = follower._secondary
            follower.close()
        assert secondary is not None and not Path(secondary).exists()

    def test_follower_never_writes(self, tmp_path: Path) -> None:
        path = tmp_path / "log"
        EmbeddedLog(path).close()
        follower = EmbeddedLog(path, follow=True)
        try:
            with pytest.raises(LogError, match="read-only"):
                follower.append("s", "k", b"v")
            writer = EmbeddedLog(path)  # the follower holds no lock
            writer.close()
        finally:
            follower.close()
        with pytest.raises(LogError, match="no log"):
            EmbeddedLog(tmp_path / "missing", follow=True)
        with EmbeddedLog(path, read_only=True) as reader, pytest.raises(LogError, match="follow=True"):
            reader.catch_up()


# ---------------------------------------------------------------- what only the Kafka transport has


@pytest.fixture
def kafka(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[KafkaBackend]:
    """The local broker, with a per-test topic prefix whose topics are deleted afterwards."""
    test = re.sub(r"[^A-Za-z0-9-]+", "-", request.node.originalname.removeprefix("test_"))[:60]
    backend = KafkaBackend(kafka_bootstrap, f"stagetree.test.log.{uuid.uuid4().hex[:10]}.{test}.")
    yield backend
    backend.delete_topics()


def partition_counts(bootstrap: str, topic: str) -> int:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic=topic, timeout=30).topics[topic]
    assert meta.error is None, meta.error
    return len(meta.partitions)


@INFRA_TIMEOUT
class TestKafkaTransport:
    def test_topics_are_created_with_explicit_partition_counts(self, kafka: KafkaBackend) -> None:
        from events.kafka_log import KafkaLog, partition_for

        wide, plain = kafka.stream("wide"), kafka.stream("plain")
        with KafkaLog(kafka.bootstrap_servers, partitions={wide: 3}) as log:
            # Each key goes to its partition (Kafka's murmur2 partitioner), in order within it.
            items = [(f"plan-{i % 4}", b"%d" % i) for i in range(12)]
            offsets = log.append_many(wide, items)
            assert log.append(plain, "plan", b"x") == 0
            log.ensure_topic(plain)  # idempotent
            assert log.partition_count(wide) == 3 and log.partition_count(plain) == 1
            for key in {k for k, _ in items}:
                p = partition_for(key, 3)
                mine = [v for k, v in items if k == key]
                assert [r.value for r in log.read(wide, partition=p) if r.key == key] == mine
                assert all(r.partition == p for r in log.read(wide, partition=p))
            assert offsets == [sum(1 for k, _ in items[:i] if partition_for(k, 3) == partition_for(key, 3))
                               for i, (key, _) in enumerate(items)]
        assert partition_counts(kafka.bootstrap_servers, wide) == 3
        assert partition_counts(kafka.bootstrap_servers, plain) == 1

    def test_the_plan_stream_is_created_with_plan_partitions(self, kafka: KafkaBackend) -> None:
        from events.kafka_log import KafkaLog

        prefix = kafka.stream("deployment.")
        with KafkaLog(kafka.bootstrap_servers, topic_prefix=prefix, plan_partitions=5) as log:
            log.ensure_topic(topics.PLAN)
            log.ensure_topic(topics.HEARTBEAT)
        with KafkaLog(kafka.bootstrap_servers, topic_prefix=prefix, plan_partitions=2) as log:
            assert log.partition_count(topics.PLAN) == 5  # an existing topic keeps its count
        assert partition_counts(kafka.bootstrap_servers, prefix + topics.PLAN) == 5
        assert partition_counts(kafka.bootstrap_servers, prefix + topics.HEARTBEAT) == 1

    def test_missing_topic_without_create_topics(self, kafka: KafkaBackend) -> None:
        from events.kafka_log import KafkaLog, KafkaLogError

        s = kafka.stream("s")
        with KafkaLog(kafka.bootstrap_servers, create_topics=False) as log:
            assert log.end_offset(s) == 0
            assert list(log.read(s)) == []
            with pytest.raises(KafkaLogError, match=re.escape(s)) as info:
                log.append(s, "k", b"v")
            assert info.value.topic == s
        with KafkaLog(kafka.bootstrap_servers) as log:  # reading did not create it either
            assert not log._exists(s)

    def test_read_only_log_is_a_plain_consumer(self, kafka: KafkaBackend) -> None:
        from events.kafka_log import KafkaLog

        s = kafka.stream("s")
        with KafkaLog(kafka.bootstrap_servers) as writer:
            writer.append_many(s, [("k", b"a"), ("k", b"b")])
        with KafkaLog(kafka.bootstrap_servers, read_only=True) as reader:
            assert reader._producer is None  # never asked the broker for a producer id
            assert [r.value for r in reader.read(s)] == [b"a", b"b"]
            with pytest.raises(LogError, match="read-only"):
                reader.append(s, "k", b"c")
            with pytest.raises(LogError, match="read-only"):
                reader.ensure_topic(kafka.stream("other"))
            assert reader._producer is None
            assert reader.end_offset(kafka.stream("other")) == 0  # reading a missing topic creates nothing
        with KafkaLog(kafka.bootstrap_servers) as log:
            assert log.end_offset(s) == 2 and not log._exists(kafka.stream("other"))

    def test_delete_topics_deletes_only_the_topics_its_prefixes_name(self, kafka: KafkaBackend) -> None:
        from events.kafka_log import KafkaLog

        with KafkaLog(kafka.bootstrap_servers) as log:
            for name in ("app-1-a", "app-1-b", "app-10-a", "other"):
                log.append(kafka.stream(name), "k", b"v")
            with pytest.raises(ValueError, match=r"`prefixes` is \('',\)"):
                log.delete_topics("")
            with pytest.raises(ValueError, match="`prefixes` is"):
                log.delete_topics()
            with pytest.raises(ValueError, match="`timeout_s` is 0"):
                log.delete_topics(kafka.stream("app-1-"), timeout_s=0)
            with KafkaLog(kafka.bootstrap_servers, read_only=True) as reader:
                with pytest.raises(LogError, match="read-only"):
                    reader.delete_topics(kafka.stream("app-1-"))
            assert log.delete_topics(kafka.stream("app-1-"), kafka.stream("none-")) == []
            listed = set(log._get_admin().list_topics(timeout=30).topics)
            assert {kafka.stream(n) for n in ("app-10-a", "other")} <= listed
            assert not {kafka.stream(n) for n in ("app-1-a", "app-1-b")} & listed
            assert log.delete_topics(kafka.stream("app-1-")) == []  # nothing left: nothing fails

    def test_oversized_record_appends_nothing(self, kafka: KafkaBackend) -> None:
        from events.kafka_log import KafkaLog, KafkaLogError

        s = kafka.stream("s")
        with KafkaLog(kafka.bootstrap_servers) as log:
            log.append(s, "k", b"before")
            with pytest.raises(KafkaLogError, match=r"item 1 .*message\.max\.bytes"):
                log.append_many(s, [("k", b"ok"), ("k", b"x" * 2_000_000), ("k", b"ok")])
            assert [r.value for r in log.read(s)] == [b"before"]

    def test_failed_delivery_names_the_topic_and_the_log_stays_usable(self, kafka: KafkaBackend) -> None:
        from confluent_kafka.admin import AdminClient

        from events.kafka_log import DeliveryFailed, KafkaLog

        gone, other = kafka.stream("gone"), kafka.stream("other")
        with KafkaLog(kafka.bootstrap_servers, timeout_s=3) as log:
            assert log.append(gone, "k", b"v") == 0
            admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
            admin.delete_topics([gone], operation_timeout=30)[gone].result(timeout=60)
            with pytest.raises(DeliveryFailed, match=re.escape(gone)) as info:
                log.append_many(gone, [("k", b"lost-1"), ("k", b"lost-2")])
            assert info.value.topic == gone
            assert info.value.offsets == []
            assert log.append(other, "k", b"still works") == 0

    def test_security_settings_pass_through_and_are_never_shown(self, kafka: KafkaBackend,
                                                               caplog: pytest.LogCaptureFixture) -> None:
        from events.kafka_log import KafkaLog

        secret = "s3cret-" + uuid.uuid4().hex
        s = kafka.stream("s")
        caplog.set_level("DEBUG")
        # The local broker is PLAINTEXT, so SASL settings are accepted and unused (librdkafka warns).
        with KafkaLog(kafka.bootstrap_servers, security={"sasl.mechanism": "PLAIN", "sasl.username": "stagetree",
                                                         "sasl.password": secret}) as log:
            assert log.append(s, "k", b"v") == 0
            assert secret not in repr(log) and secret not in str(log)
        assert caplog.records, "the transport logs through logging"
        assert secret not in caplog.text

    @pytest.mark.parametrize("setting", ["enable.idempotence", "acks", "isolation.level", "enable.auto.commit",
                                         "bootstrap.servers", "transactional.id"])
    def test_security_cannot_override_the_guarantees(self, setting: str) -> None:
        from events.kafka_log import KafkaLog

        with pytest.raises(ValueError, match=re.escape(repr(setting))):
            KafkaLog("127.0.0.1:9092", security={setting: "x"})

    @pytest.mark.parametrize("name", ["", "with space", "a/b", "x" * 250, ".."])
    def test_bad_stream_name_is_named(self, name: str) -> None:
        from events.kafka_log import KafkaLog

        with KafkaLog("127.0.0.1:9092") as log, pytest.raises(ValueError, match="stream"):
            log.end_offset(name)

    def test_security_from_env(self) -> None:
        from events.kafka_log import security_from_env

        env = {"STAGETREE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "STAGETREE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
               "STAGETREE_KAFKA_SASL_USERNAME": "u", "STAGETREE_KAFKA_SASL_PASSWORD": "p",
               "STAGETREE_KAFKA_SSL_CA_LOCATION": "", "UNRELATED": "x"}
        assert security_from_env(env) == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                          "sasl.username": "u", "sasl.password": "p"}


def test_kafka_topic_prefix_maps_streams_to_topics(kafka: KafkaBackend) -> None:
    """Logical stream names stay the same whatever the prefix; the topics carry it."""
    from events.kafka_log import KafkaLog

    kafka_bootstrap, prefix = kafka.bootstrap_servers, kafka.prefix
    with KafkaLog(kafka_bootstrap, topic_prefix=prefix) as log:
        assert log.topic("stagetree.plan") == prefix + "stagetree.plan"
        assert log.append_many("stagetree.plan", [("k", b"a"), ("k", b"b")]) == [0, 1]
        records = list(log.read("stagetree.plan"))
        assert [(r.stream, r.offset, r.value) for r in records] == [("stagetree.plan", 0, b"a"),
                                                                    ("stagetree.plan", 1, b"b")]
    with KafkaLog(kafka_bootstrap) as plain:
        assert plain.end_offset(prefix + "stagetree.plan") == 2
    # a prefix that is no topic name itself but begins valid ones ('.' was refused as a topic, naming no flag)
    with KafkaLog(kafka_bootstrap, topic_prefix=".") as dot:
        assert dot.topic("stagetree.plan") == ".stagetree.plan"


def test_kafka_records_carry_the_events_trace_context_in_headers(kafka: KafkaBackend) -> None:
    """W3C trace context travels inside the event and, on Kafka, in the record headers too."""
    from confluent_kafka import Consumer, TopicPartition

    from events.codec import encode
    from events.kafka_log import KafkaLog, partition_for
    from events.models import WorkerJoined

    kafka_bootstrap, prefix = kafka.bootstrap_servers, kafka.prefix
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = WorkerJoined(worker_id="w0", device="cpu", trace={"traceparent": parent})
    with KafkaLog(kafka_bootstrap, topic_prefix=prefix) as log:
        log.append_many("stagetree.plan", [("w0", encode(traced)),
                                           ("w0", encode(WorkerJoined(worker_id="w1", device="cpu")))])
        consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"headers-{uuid.uuid4().hex}",
                             "enable.auto.commit": False})
        try:
            consumer.assign([TopicPartition(log.topic("stagetree.plan"), partition_for("w0", 8), 0)])
            msgs = []
            while len(msgs) < 2:
                msgs += [m for m in consumer.consume(2, timeout=5) if m.error() is None]
        finally:
            consumer.close()
    assert msgs[0].headers() == [("traceparent", parent.encode())]
    assert msgs[1].headers() is None


def test_a_byte_flipped_anywhere_in_a_table_file_is_an_error_never_a_shorter_log(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """A flipped byte in the block holding a stream's last records made its end offset 0 (the
    iterator that looks for it stopped there without raising): ``replay verify`` said "ok
    chain" over an empty plan stream and ``log export`` wrote none of it, exit 0; one in the
    first block was a traceback naming a scratch copy, which stayed behind (the bug bash of
    2026-11-28, evening). Wherever the byte is, reading the log back (open, streams, their
    ends, their records) gives every record or raises LogError, and leaves no scratch copy."""
    src = tmp_path / "log"
    with EmbeddedLog(src) as log:
        for i in range(40):
            log.append(topics.PLAN, f"k{i}", orjson.dumps({"i": i, "pad": "x" * 2000}))
        log.append(topics.DISPATCH, "d", b"{}")
        log._db.flush()
    (table,) = src.glob("*.sst")
    good = table.read_bytes()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    outcomes = set()
    for at in range(0, len(good), 509):
        damaged = tmp_path / f"at{at}"
        shutil.copytree(src, damaged)
        data = bytearray(good)
        data[at] ^= 0xFF
        (damaged / table.name).write_bytes(bytes(data))
        try:
            with EmbeddedLog(damaged, read_only=True) as log:
                read = {name: list(log.read(name)) for name in log.streams()}
        except LogError as exc:
            assert str(damaged) in str(exc) and "stagetree-read-" not in str(exc), exc
            outcomes.add("error")
        else:
            assert {name: len(records) for name, records in read.items()} == {topics.PLAN: 40, topics.DISPATCH: 1}, at
            outcomes.add("whole")
        assert not list(scratch.iterdir()), at
        shutil.rmtree(damaged)
    assert "error" in outcomes  # (a byte that nothing read covers would change nothing read)


def test_a_damaged_table_file_is_an_error_naming_the_stream_not_a_shorter_log(tmp_path: Path) -> None:
    """RocksDB's iterator stops at a block it cannot read without raising: the log read 81 of
    178 records, ``replay verify`` called that chain "ok" and ``log export`` wrote a partial log
    and exited 0 (the bug bash of 2026-11-28). A read that ends before the stream's end is an
    error naming the stream, the offset and RocksDB's status; a log whose metadata is damaged is
    named (not a scratch copy's path in a traceback)."""
    log = EmbeddedLog(tmp_path / "log")
    for i in range(40):
        log.append(topics.PLAN, f"k{i}", orjson.dumps({"i": i, "pad": "x" * 2000}))
    log._db.flush()  # into a table file, as a long run's log is
    log.close()
    (table,) = (tmp_path / "log").glob("*.sst")
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF
    table.write_bytes(bytes(data))
    for read_only in (True, False):
        reopened = EmbeddedLog(tmp_path / "log", read_only=read_only)
        try:
            assert reopened.end_offset(topics.PLAN) == 40
            with pytest.raises(LogError, match=r"cannot be read past offset \d+ of stream 'stagetree.plan' \(40 "
                                               r"records\): the store reports Corruption") as caught:
                list(reopened.read(topics.PLAN))
            assert "stagetree-read-" not in str(caught.value)
        finally:
            reopened.close()

    (tmp_path / "log" / "CURRENT").write_text("MANIFEST-999999\n")
    for read_only in (True, False):
        with pytest.raises(LogError, match=r"cannot be opened \(damaged\?\).*MANIFEST-999999") as caught:
            EmbeddedLog(tmp_path / "log", read_only=read_only)
        assert "stagetree-read-" not in str(caught.value)


def test_a_keyed_log_is_written_to_only_with_its_own_key(tmp_path: Path) -> None:
    """A keyed log opened for writing with another key took appends chained with it: the
    chain broke for ever, under either key, and verify called it tampering. The log keeps a
    mark of its key; a log written before the mark is checked by its first record."""
    from rocksdict import Options, Rdict

    path = tmp_path / "log"
    with EmbeddedLog(path, secret=b"right") as log:
        log.append("a", "k", b"one")
    for key in (b"wrong", b"wrong"):  # refused, and refused again: nothing was written
        with pytest.raises(LogError, match="chained with another key than the one it was opened with"):
            EmbeddedLog(path, secret=key)
    with EmbeddedLog(path, secret=b"right") as log:
        log.append("a", "k", b"two")
    with EmbeddedLog(path, read_only=True) as log:  # an audit reads it with any key, and says so
        records = list(log.read("a"))
    head = CHAIN_START
    for r in records:
        head = chain_next(head, r.stream, r.offset, r.key, r.value, b"right")
        assert head == r.chain
    assert [r.value for r in records] == [b"one", b"two"]
    # a log written before the mark: its first record tells the key
    db = Rdict(str(path), Options(raw_mode=True))
    db.delete(b"m:chain-key")
    db.close()
    with pytest.raises(LogError, match="another key"):
        EmbeddedLog(path, secret=b"wrong")
    with EmbeddedLog(path, secret=b"right") as log:
        assert log.end_offset("a") == 2
    db = Rdict(str(path), Options(raw_mode=True))
    assert db.get(b"m:chain-key") is not None  # marked once the key proved right
    db.close()


def test_a_record_acknowledged_without_an_offset_counts_as_not_delivered() -> None:
    """librdkafka reports a record delivered without an offset when it counted it written only
    implicitly (a later batch of its partition succeeded; the broker called its batch a duplicate).
    Such a record was once missing from the log with its append reported done (a first batch
    refused "not leader", the next accepted): the transport takes it as not delivered, so the
    append fails (a transaction is aborted and appended again) instead of returning no offset."""
    from confluent_kafka import KafkaError, Message

    from events.kafka_log import _delivery

    assert _delivery(None, Message(topic="t", partition=0, offset=7)) == (None, 7)
    err, offset = _delivery(None, Message(topic="t", partition=0, offset=-1001))  # librdkafka's "invalid"
    assert offset == -1 and err is not None and "not known to be in the log" in err.str()
    refused = KafkaError(KafkaError._MSG_TIMED_OUT)
    assert _delivery(refused, Message(topic="t", partition=0, offset=3)) == (refused, -1)
