"""The plan stream split into partitions: one fold per partition, one merged view for global
decisions.

On Kafka, ``stagetree.plan`` has several partitions, each holding the whole history of the
plans whose keys hash to it (DESIGN.md "The event log"). Each partition is folded by the same
reducer into a :class:`~projections.state.State` of its own, exactly as the embedded log's one
stream is. Nothing of one plan depends on another partition, except the workers: a worker runs
a path of one plan at a time, and its arrival and loss (WorkerJoined, WorkerLost) are written
to every partition (:data:`events.log.BROADCAST`), so each partition releases the stages it
was running there.

Scheduling is global (Hippo: each idle worker gets the critical path over *all* plans), so it
reads :func:`merge` of the partitions' states, a pure function of them: the plans, trials,
studies, dispatches and tuner decisions of every partition (disjoint: a plan key lives in one
partition), and each worker as the partitions agree on it:

* alive only when every partition has folded its latest arrival and none its loss (a worker
  whose WorkerJoined some partition has not read yet is not offered work);
* busy when any partition has a dispatch of it training (a path it trained whose end it is still
  writing, PathTrained, does not keep it busy).

Checkpoint objects and their bytes are summed over the partitions, so a checkpoint budget is
one budget for the deployment (``peak_checkpoint_bytes`` of the view is the sum of the
partitions' peaks: an upper bound of the deployment's).

A decision taken from the merged view records the offset of every partition's last folded
record (``State.offsets`` -> ``DecisionEvent.decided_at_partitions``); ``replay verify`` folds each
partition up to exactly those offsets, merges, and decides again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from events.log import EventLog, Record
from events.models import Event
from projections.state import State, Stats, StoredObject, Worker
from projections.store import Listener, ProjectionStore, Projector


def merge(states: Mapping[int, State]) -> State:
    """The global view of a partitioned plan stream (see the module docstring): a State that
    shares the partitions' plan, trial, study and dispatch objects and tuner decisions (read it,
    never fold into it). A single partition 0 is returned as it is (an unpartitioned stream: ``offsets`` None).

    Raises:
        ValueError: no states.
    """
    if not states:
        raise ValueError("`states` is empty: a plan stream has at least one partition")
    if set(states) == {0}:
        return states[0]
    view = State()
    parts = [states[p] for p in sorted(states)]
    for part in parts:
        view.plans.update(part.plans)
        view.trials.update(part.trials)
        view.dispatches.update(part.dispatches)
        view.studies.update(part.studies)
        for ref, obj in part.objects.items():
            mine = view.objects.get(ref)
            view.objects[ref] = obj if mine is None else StoredObject(obj.size, mine.references + obj.references)
        for trial_id, decided in part.decided.items():  # in the study's partition (the trial's, when merged)
            view.decided.setdefault(trial_id, []).extend(decided)
    for worker_id in sorted({w for part in parts for w in part.workers}):
        seen = [part.workers.get(worker_id) for part in parts]
        known = [w for w in seen if w is not None]
        busy = next((w.dispatch_id for w in known if w.dispatch_id is not None), None)
        view.workers[worker_id] = Worker(worker_id, known[0].device,
                                         alive=len(known) == len(parts) and all(w.alive for w in known),
                                         dispatch_id=busy, writing=[d for w in known for d in w.writing])
    view.stats = Stats(
        executed_steps=sum(p.stats.executed_steps for p in parts),
        worker_seconds=sum(p.stats.worker_seconds for p in parts),
        stages_finished=sum(p.stats.stages_finished for p in parts),
        dispatches=sum(p.stats.dispatches for p in parts),
        answers=sum(p.stats.answers for p in parts),
        checkpoint_bytes=sum(p.stats.checkpoint_bytes for p in parts),
        peak_checkpoint_bytes=sum(p.stats.peak_checkpoint_bytes for p in parts),  # an upper bound
        evictions=sum(p.stats.evictions for p in parts),
    )
    view.offsets = {p: states[p].offset for p in sorted(states)}
    return view


class PartitionedFold:
    """One :class:`~projections.store.Projector` per partition of the plan stream of ``log``
    (in memory, no dead letters: a reader's fold, the SDK's and the scheduler's), and their
    merged :attr:`state`.

    Args:
        log: the transport (read by :meth:`catch_up`).
        partitions: partition count of the plan stream.
        secret: HMAC key of the partitions' hash chains (None: sha256).
        traced: each apply a span in its event's trace (as :class:`~projections.store.Projector`'s;
            False: a replay of a finished log).
    """

    def __init__(self, log: EventLog, partitions: int, *, secret: bytes | None = None, traced: bool = True) -> None:
        if partitions < 1:
            raise ValueError(f"`partitions` is {partitions!r}, but must be >= 1")
        self.log = log
        self.projectors = {p: Projector(log, dead_letters=False, secret=secret, partition=p, traced=traced)
                           for p in range(partitions)}
        self._view: State | None = None

    @property
    def listeners(self) -> _Listeners:
        """Listeners called with ``(offset, event)`` for every applied event of any partition."""
        return _Listeners(self.projectors)

    @property
    def state(self) -> State:
        """The merged view (recomputed after a fold that consumed anything)."""
        if self._view is None:
            self._view = merge({p: pr.state for p, pr in self.projectors.items()})
        return self._view

    def offsets(self) -> dict[int, int]:
        """The last folded offset of every partition (-1: none)."""
        return {p: pr.state.offset for p, pr in self.projectors.items()}

    def prefix(self, partition: int) -> dict[str, Any]:
        """The prefix a decision taken now from the merged view records, as the fields of a
        :class:`~events.models.DecisionEvent` written to ``partition``: ``decided_at``, that
        partition's last folded offset, and (several partitions) ``decided_at_partitions``."""
        out: dict[str, Any] = {"decided_at": self.projectors[partition].state.offset}
        if len(self.projectors) > 1:
            out["decided_at_partitions"] = self.offsets()
        return out

    def fold(self, records: Iterable[Record]) -> list[tuple[int, int, Event]]:
        """Fold ``records`` (any partitions; in offset order within each); returns the applied
        ``(partition, offset, event)`` triples."""
        by_partition: dict[int, list[Record]] = defaultdict(list)
        for record in records:
            by_partition[record.partition].append(record)
        applied = []
        for partition, batch in by_partition.items():
            projector = self.projectors[partition]
            before = projector.state.offset
            applied += [(partition, o, e) for o, e in projector.fold(batch)]
            if projector.state.offset != before:
                self._view = None
        return applied

    def catch_up(self, upto: Mapping[int, int] | None = None) -> list[tuple[int, int, Event]]:
        """Read and fold every partition up to its end now, or (``upto``) the partitions named
        up to and including the offset given for each (a decision's recorded prefix)."""
        applied = []
        for partition, projector in self.projectors.items():
            if upto is not None and partition not in upto:
                continue
            stop = None if upto is None else upto[partition] + 1
            before = projector.state.offset
            applied += [(partition, o, e) for o, e in projector.catch_up(stop)]
            if projector.state.offset != before:
                self._view = None
        return applied


class _Listeners:
    """``append`` adds a listener to every partition's projector."""

    def __init__(self, projectors: Mapping[int, Projector]) -> None:
        self._projectors = projectors

    def append(self, listener: Listener) -> None:
        for projector in self._projectors.values():
            projector.listeners.append(listener)



class PartitionStores:
    """The durable projections of the plan partitions one ``stagetree serve`` instance owns:
    one RocksDB store per partition (``state_dir/plan-<p>``; state and offset in one batch),
    opened when the partition is assigned and closed when it is revoked.

    :meth:`open` loads the store and folds what the partition holds after the store's offset
    (a partition that was folded by another instance, or while this one was down, reads the
    records it missed), then :meth:`fold` folds the records the instance's agent receives; a
    record at or before the store's offset is skipped, so redelivery is harmless.

    Args:
        log: the transport (reads on :meth:`open`; dead letters).
        state_dir: the instance's state directory.
        secret: HMAC key of the hash chains (None: sha256).
    """

    def __init__(self, log: EventLog, state_dir: str | Path, *, secret: bytes | None = None) -> None:
        self.log = log
        self.state_dir = Path(state_dir)
        self.secret = secret
        self.owned: dict[int, Projector] = {}

    def path(self, partition: int) -> Path:
        """The store directory of ``partition``."""
        return self.state_dir / f"plan-{partition}"

    def open(self, partition: int) -> Projector:
        """Open the store of ``partition`` and fold what it missed (blocking: reads Kafka)."""
        projector = self.owned.get(partition)
        if projector is None:
            store = ProjectionStore(self.path(partition))
            projector = Projector(self.log, store=store, secret=self.secret, partition=partition)
            projector.catch_up()
            self.owned[partition] = projector
        return projector

    def fold(self, record: Record) -> bool:
        """Fold a record the agent received; False when its partition is not owned here."""
        projector = self.owned.get(record.partition)
        if projector is None:
            return False
        projector.fold([record])
        return True

    def close(self, partition: int) -> None:
        """Close the store of ``partition`` (revoked); a no-op when it is not open."""
        projector = self.owned.pop(partition, None)
        if projector is not None and projector.store is not None:
            projector.store.close()

    def close_all(self) -> None:
        for partition in list(self.owned):
            self.close(partition)
