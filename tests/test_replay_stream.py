"""``replay verify`` streams the log (issue 15 goal 4): whatever the log's length, it holds a
bounded number of records at once, and what it checks is what the whole-log fold gives."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from events import topics
from events.codec import encode
from events.hp import Constant, MultiStep
from events.log import EmbeddedLog, Record, event_key
from projections.state import State
from projections.store import READ_BATCH, fold_records, snapshot
from replay.audit import YOUNG_COLLECTION_EVERY, Stream, fold, open_source, rare_collections, verify
from scheduler.simulation import Simulation


def _write_log(path: Path, events: int) -> int:
    """A real log of at least ``events`` events: the reducer and scheduler with simulated instant
    workers (as benchmarks/replay.py), trials extended every 10 steps. Returns its length."""
    sim = Simulation(workers=2)
    configs = [{"lr": MultiStep(0.1, (m,), 0.5), "bs": Constant(b)} for m in (20, 40) for b in (32, 64)]
    step = 10
    while len(sim.events) < events:
        for i, hp in enumerate(configs):
            sim.submit(f"t{i}", hp, step)
        sim.run()
        step += 10
    with EmbeddedLog(path / "log", sync=False) as log:
        log.append_many(topics.PLAN, [(event_key(e), encode(e)) for e in sim.events])
        return log.end_offset(topics.PLAN)


class _Tracked(Record):
    """A record whose release can be observed (Record has slots, hence no weak references)."""

    __slots__ = ("__weakref__",)


class _Held:
    """Counts the records a reader handed out that are still alive, and the most at once."""

    def __init__(self) -> None:
        self.alive = self.peak = self.read = 0

    def _released(self) -> None:
        self.alive -= 1

    def wrap(self, read: Callable[[int], Iterator[Record]]) -> Callable[[int], Iterator[Record]]:
        def tracked(partition: int) -> Iterator[Record]:
            for r in read(partition):
                record = _Tracked(r.stream, r.offset, r.key, r.value, r.chain, r.partition)
                weakref.finalize(record, self._released)
                self.alive += 1
                self.read += 1
                self.peak = max(self.peak, self.alive)
                yield record
        return tracked


def test_verify_holds_a_bounded_number_of_records(tmp_path: Path) -> None:
    n = _write_log(tmp_path, 4 * READ_BATCH)
    source = open_source(tmp_path)
    held = _Held()
    stream = source.streams[topics.PLAN]
    source.streams[topics.PLAN] = Stream(stream.name, stream.partitions, held.wrap(stream._read))

    result = verify(source)

    assert result.ok, result.first_failure
    assert result.events == n >= 4 * READ_BATCH
    assert held.read == 2 * n  # the decisions' prefixes, then the fold, which checks the chain as it goes
    # a batch being folded and the next one being read: never the whole log
    assert held.peak <= 2 * READ_BATCH + 1 < n
    assert held.alive == 0


def test_streamed_fold_equals_the_fold_of_the_whole_log(tmp_path: Path) -> None:
    n = _write_log(tmp_path, 2 * READ_BATCH + 7)
    stream = open_source(tmp_path).streams[topics.PLAN]
    records = list(stream)
    assert len(records) == len(stream) == n
    whole = State()
    fold_records(whole, records)  # one call over the whole log
    assert snapshot(fold(stream)) == snapshot(whole)


def test_a_fold_collects_garbage_rarely_and_puts_the_thresholds_back(tmp_path: Path) -> None:
    """While verify (and the fold in it) run, the youngest generation's threshold is raised; it
    is put back when the outermost user ends (nested, in another thread, or on an exception)."""
    _write_log(tmp_path, READ_BATCH)
    source = open_source(tmp_path)
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []

    def on_event(record: Record, event: object, state: State) -> None:
        seen.append(gc.get_threshold())

    fold(source.streams[topics.PLAN], on_event)
    assert verify(source).ok
    assert gc.get_threshold() == before
    assert seen and set(seen) == {(YOUNG_COLLECTION_EVERY, before[1], before[2])}

    def boom(record: Record, event: object, state: State) -> None:
        raise RuntimeError("a defect in a callback")

    try:
        fold(source.streams[topics.PLAN], boom)
    except RuntimeError:
        pass
    assert gc.get_threshold() == before

    inner_done = threading.Event()
    with rare_collections():
        thread = threading.Thread(target=lambda: (fold(source.streams[topics.PLAN]), inner_done.set()))
        thread.start()
        thread.join()
        assert inner_done.is_set()
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY  # the other user ended first: still raised
    assert gc.get_threshold() == before
