"""The scheduler role of ``stagetree serve`` on Kafka: global decisions, fenced.

Scheduling is global (Hippo §3.4, thesis §4.3: each idle worker gets the critical path over the
stage trees of *all* plans), so one serve instance at a time decides. The role belongs to the
instance that faust's group assigns the one partition of ``stagetree.heartbeat`` (it also
receives every worker's beats, which the liveness decisions need). Every instance keeps a hot
standby of what the role needs: a :class:`~projections.partitions.PartitionedFold` of every
partition of ``stagetree.plan``, read ``read_committed`` as records arrive.

Taking the role over (:meth:`DecisionAppender.take_over`): start the role's transactional
producer (``<prefix>stagetree.scheduler``), which fences every earlier holder (a transaction it
left open is aborted, its next one fails with :class:`~events.kafka_log.Fenced`), then fold every
partition up to its end. Only then is anything decided, so the successor's fold includes every
decision its predecessor committed, and the prefixes decisions record never go backwards. With a
checkpoint store (a budget), the new holder then deletes, before its first decision, the objects
no plan place references that no worker may be writing
(:meth:`~scheduler.service.SchedulerService.collect_garbage` with ``except_in_flight``): a holder
killed between an eviction's commit and its deletion left them. Those it spared are asked about
again every second while it holds the role, and as it leaves.

Every decision of the role goes through :class:`DecisionAppender`: one transaction per call, the
decision(s) on the plan stream (broadcast types to every partition) with their copies (a
dispatch to the worker's own stream), then folded before the next decision. A decision records
its prefix (:class:`events.models.DecisionEvent`): the offset of every partition's last folded
record. The role decides:

* StageDispatched: :func:`scheduler.decide.decide` on the merged view, one at a time;
* WorkerLost: a worker silent for ``heartbeat_timeout_s`` (this process's clock: the decision
  is recorded, so a replay never reads a clock);
* LogSealed: the hash chain of each partition after its last folded record, every
  ``seal_interval_s`` when something new was folded (``replay verify`` checks the seals);
* DeadLettered: a malformed heartbeat, with the reason.

Other decision types (a tuner's decision, an eviction, a preemption) are appended the same way:
``DecisionAppender.append([decision], copies)``.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from events import topics
from events.codec import encode
from events.kafka_log import (
    CommittedLate,
    Fenced,
    Follower,
    KafkaLog,
    KafkaLogError,
    ProducerFailed,
    TransactionalAppender,
    Write,
    event_writes,
)
from events.log import chain_algorithm
from events.models import DeadLettered, DecisionEvent, Event, LogSealed, StageDispatched, WorkerLost
from projections.partitions import PartitionedFold
from projections.state import State
from scheduler.service import SchedulerService

log = logging.getLogger(__name__)

STALL_HOOK_ENV = "STAGETREE_TEST_STALL_BEFORE_COMMIT"
"""Fault injection for tests: a path. When set and the file does not exist yet, the role writes
the StageDispatched it is appending into it and stops its own process (SIGSTOP) right there:
decided, its records sent to the broker in an open transaction, not committed, as a long
pause or a partition from the group would leave it."""


def role_transactional_id(log: KafkaLog) -> str:
    """The ``transactional.id`` of the scheduler role of the deployment of ``log``."""
    return log.topic("stagetree.scheduler")


class HeartbeatMonitor:
    """Last beat per worker (monotonic seconds, this process's clock)."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"`heartbeat_timeout_s` is {timeout_s!r}, but must be > 0")
        self.timeout_s = timeout_s
        self.last: dict[str, float] = {}

    def beat(self, worker_id: str, now: float) -> None:
        self.last[worker_id] = now

    def silent(self, state: State, now: float) -> list[str]:
        """Alive workers (in ``state``) silent for longer than the timeout; a worker never heard
        from gets the timeout as grace from the first check. A worker stays silent until a beat
        arrives or ``state`` shows it gone (the decision was folded)."""
        out = []
        for worker_id, worker in sorted(state.workers.items()):
            if not worker.alive:
                self.last.pop(worker_id, None)
                continue
            seen = self.last.setdefault(worker_id, now)
            if now - seen > self.timeout_s:
                out.append(worker_id)
        return out


def _stall_hook(events: Sequence[Event]) -> Callable[[], None] | None:
    """The fault injection of :data:`STALL_HOOK_ENV` for a transaction of ``events``, or None."""
    path = os.environ.get(STALL_HOOK_ENV)
    if not path or Path(path).exists() or not any(isinstance(e, StageDispatched) for e in events):
        return None

    def stall() -> None:
        Path(path).write_bytes(b"\n".join(encode(e) for e in events))
        # Stop this thread first: a SIGSTOP sent to the process (os.kill) is taken by whichever
        # thread the kernel picks (the main one, when it can), and this thread runs on until that
        # one is scheduled and stops the others: on a loaded machine, long enough to commit the
        # transaction this hook was to leave open. Sent to this thread, it stops before the call
        # returns (and the whole process with it).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    return stall


class DecisionAppender:
    """Appends a role's decisions: one Kafka transaction per :meth:`append`, with the role's
    ``transactional.id``, then folds up to them.

    Args:
        log: the deployment's transport.
        transactional_id: the role's id (:func:`role_transactional_id`).
        fold: the role's fold of every plan partition, fed by ``follower``.
        follower: reads every plan partition.
    """

    def __init__(self, log: KafkaLog, transactional_id: str, fold: PartitionedFold, follower: Follower) -> None:
        self.log = log
        self.fold = fold
        self.follower = follower
        self.partitions = len(fold.projectors)
        self.transactions = TransactionalAppender(log, transactional_id)

    def take_over(self) -> float:
        """Fence every earlier holder of the role, then fold every partition to its end; returns
        the seconds it took. Raises KafkaLogError when the cluster does not answer."""
        started = time.monotonic()
        self.transactions.start()
        self.catch_up()
        return time.monotonic() - started

    def catch_up(self) -> None:
        """Fold every partition up to its end as the broker has it now.

        Raises:
            KafkaLogError: the cluster did not answer."""
        ends = self.follower.end_offsets()
        while not self.follower.reached(ends):
            self.fold.fold(self.follower.poll(0.05))

    def prefix(self) -> dict[str, object]:
        """The fields a decision taken now from the fold records as its prefix."""
        offsets = self.fold.offsets()
        if self.partitions == 1:
            return {"decided_at": offsets[0]}
        return {"decided_at_partitions": offsets}

    def append(self, decisions: Sequence[Event], copies: Sequence[Write] = ()) -> list[tuple[int, int]]:
        """Append ``decisions`` to the plan stream (WorkerJoined/WorkerLost to every partition)
        and ``copies`` (e.g. a dispatch on the worker's stream) in one transaction, then fold
        until the fold has applied them; returns the ``(partition, offset)`` of each plan
        record.

        Raises:
            Fenced: a successor holds the role now; nothing was appended.
            TransactionAborted, KafkaLogError: nothing was appended; decide again and retry
                (CommittedLate: an earlier decision whose commit had timed out is in the log
                after all, and folded now; a KafkaLogError whose commit timed out may be too).
        """
        writes = event_writes(topics.PLAN, decisions, self.partitions)
        try:
            positions = self.transactions.append([*writes, *copies], before_commit=_stall_hook(decisions))
        except CommittedLate:  # an earlier decision whose commit timed out is in the log after all:
            self.catch_up()  # fold it before anything is decided again
            raise
        plan = positions[: len(writes)]
        self.wait_folded(plan)
        return plan

    def wait_folded(self, positions: Sequence[tuple[int, int]], timeout_s: float | None = None) -> None:
        """Poll and fold until every ``(partition, offset)`` is folded.

        Raises:
            KafkaLogError: not within ``timeout_s`` (default: the log's timeout).
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.log.timeout_s)
        projectors = self.fold.projectors
        while any(projectors[p].state.offset < o for p, o in positions):
            if time.monotonic() > deadline:
                raise KafkaLogError(f"kafka: the role's own records {list(positions)} were not readable within "
                                    f"{self.log.timeout_s:g} s")
            self.fold.fold(self.follower.poll(0.02))

    def close(self) -> None:
        self.transactions.close()


class SchedulerRole:
    """The scheduler role's loop (run in a thread of its own by ``stagetree serve``).

    Args:
        log: a transport for this thread alone.
        instance: this serve instance's name (the ``producer`` of its decisions: ``serve:<instance>``).
        heartbeat_timeout_s: silence after which a worker is declared lost.
        secret: HMAC key of the seals' chains (None: sha256).
        policy: scheduling policy (``scheduler.decide.POLICIES``).
        seal_interval_s: how often new records are sealed.
        grace_s: after taking the role, how long no worker is judged (beats replayed to the new
            holder's group member arrive first); default ``heartbeat_timeout_s``.
        clock: monotonic seconds (the liveness clock).
        checkpoint_budget: bytes of checkpoints the deployment may keep (None: unbounded);
            evicted objects are deleted from ``store`` (a CheckpointStore) once their
            CheckpointEvicted events are committed.
        regrant_after_s: an instance fenced while the group still grants it the role waits this
            long for the group to take the grant away (a zombie learns it was replaced when its
            consumer rejoins); if the same grant still stands then, it takes the role over
            again. Without this, a fence nobody follows up (a broker restart can end a
            transaction that way) would leave the deployment with no scheduler. Default: twice
            the group's session timeout (16 s).

    :meth:`grant` and :meth:`revoke` (faust's rebalance callbacks) and :meth:`beat` may be called
    from other threads; everything else runs in :meth:`run`'s thread.
    """

    def __init__(self, log: KafkaLog, *, instance: str, heartbeat_timeout_s: float = 10.0,
                 secret: bytes | None = None, policy: str = "critical-path", seal_interval_s: float = 0.5,
                 grace_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 checkpoint_budget: int | None = None, store: Any = None, regrant_after_s: float = 16.0) -> None:
        self.log = log
        self.regrant_after_s = regrant_after_s
        self.instance = instance
        self.producer = f"serve:{instance}"
        self.secret = secret
        self.policy = policy
        self.seal_interval_s = seal_interval_s
        self.grace_s = heartbeat_timeout_s if grace_s is None else grace_s
        self.clock = clock
        self.checkpoint_budget = checkpoint_budget
        self.store = store
        self.monitor = HeartbeatMonitor(heartbeat_timeout_s)
        self.stop = threading.Event()
        self._granted = 0  # generation of the latest grant; 0: not granted
        self._held = 0  # the grant generation this instance holds the role under (0: none)
        self._refused = 0  # a generation under which this instance was fenced
        self._refused_at = 0.0  # when (monotonic seconds)
        self._lock = threading.Lock()
        self._heard = -1  # the last offset of the heartbeat partition read (faust's thread)
        self._pending_since: float | None = None  # when beats were first seen unread (clock)
        self._outage = False  # the cluster failed to answer since its heartbeat partition's end was read
        self._error_seen: float | None = None  # the follower's last error already counted as an outage
        self._beats: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        self._bad_beats: queue.SimpleQueue[DeadLettered] = queue.SimpleQueue()
        self.acquired_at: float | None = None  # epoch seconds of the latest take-over
        self.judging_from = 0.0
        self._fresh = False
        self._spared: set[str] = set()  # unreferenced objects a collection left (a worker may write them)
        self.ready = threading.Event()  # set once the standby fold has caught up the first time

    # ------------------------------------------------------------------ called from faust's thread

    def grant(self) -> None:
        """This instance was assigned the heartbeat partition: it should hold the role."""
        with self._lock:
            self._granted = abs(self._granted) + 1

    def revoke(self) -> None:
        """The heartbeat partition was revoked: stop deciding."""
        with self._lock:
            self._granted = -abs(self._granted)

    def beat(self, worker_id: str, offset: int = -1) -> None:
        """A beat of ``worker_id`` was read at ``offset`` of the heartbeat partition."""
        self._beats.put((worker_id, self.clock()))
        self.heard(offset)

    def bad_beat(self, letter: DeadLettered, offset: int = -1) -> None:
        self._bad_beats.put(letter)
        self.heard(offset)

    def heard(self, offset: int) -> None:
        """The heartbeat partition was read up to ``offset`` (included)."""
        with self._lock:
            self._heard = max(self._heard, offset)

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Follow every plan partition until :attr:`stop`; decide while holding the role."""
        partitions = self.log.partition_count(topics.PLAN)
        self.fold = PartitionedFold(self.log, partitions, secret=self.secret)
        self.unsealed = {p: False for p in range(partitions)}  # a record but a seal folded since the last seal made
        self.last_seal = {p: -1 for p in range(partitions)}  # offset of the last seal folded
        for p, projector in self.fold.projectors.items():
            projector.listeners.append(lambda offset, event, p=p: self._saw(p, offset, event))
        self.follower = Follower(self.log, {(topics.PLAN, p): 0 for p in range(partitions)}, wait_ms=10)
        self.decisions = DecisionAppender(self.log, role_transactional_id(self.log), self.fold, self.follower)
        self.scheduler = SchedulerService(None, self.fold, commit=self._commit, policy=self.policy,  # type: ignore[arg-type]
                                          producer=self.producer, checkpoint_budget=self.checkpoint_budget,
                                          delete=self._delete if self.store is not None else None)
        ends = self.follower.end_offsets()
        last_seal = last_pass = last_collect = 0.0
        try:
            while not self.stop.is_set():
                try:
                    folded = self.fold.fold(self.follower.poll(0.05 if not self._held else 0.01))
                    if not self.ready.is_set() and self.follower.reached(ends):
                        self.ready.set()
                    while not self._beats.empty():
                        worker_id, at = self._beats.get()
                        self.monitor.beat(worker_id, at)
                    if not self._sync_role():
                        continue
                    self._dead_letters()
                    self._liveness()
                    now = time.monotonic()
                    # A pass after anything new, and every second anyway (a pass that failed or
                    # whose decision was rejected is retried without waiting for news).
                    if folded or self._fresh or now - last_pass >= 1.0:
                        self._fresh = False
                        last_pass = now
                        self.scheduler.run_pass()
                    if self._spared and now - last_collect >= 1.0:
                        last_collect = now
                        self._collect_garbage(self._spared)
                    if now - last_seal >= self.seal_interval_s:
                        last_seal = now
                        self._seal()
                except Fenced as exc:
                    log.warning("serve %s: the scheduler role was taken over by another instance: %s",
                                self.instance, exc)
                    self._drop_role(fenced=True)
                except ProducerFailed as exc:
                    # A zombie's commit can end this way too: treated as a fence (the grant is
                    # refused until regrant_after_s shows the group still wants this instance).
                    log.warning("serve %s: the role's producer failed; it is treated as fenced: %s",
                                self.instance, exc)
                    self._drop_role(fenced=True)
                except CommittedLate as exc:  # a seal or dead letter met it: fold the late decision first
                    log.warning("serve %s: %s", self.instance, exc)
                    self._fresh = True
                    try:
                        self.decisions.catch_up()
                    except KafkaLogError:  # the broker away again: the loop's next fold reads it
                        self.stop.wait(0.5)
                except KafkaLogError as exc:
                    log.warning("serve %s: a decision was not appended (decided again next): %s", self.instance, exc)
                    self._fresh = True
                    self.stop.wait(0.5)
                except Exception:  # never let the role die silently: log, wait, decide again
                    log.exception("serve %s: the scheduler role failed; retrying", self.instance)
                    self._fresh = True
                    self.stop.wait(1.0)
            if self._held:
                self._last_seal()
        finally:
            self.decisions.close()
            self.follower.close()

    def _last_seal(self) -> None:
        """Leaving while holding the role: fold what arrived (up to a few seconds) and seal it,
        so a deployment shut down after its workers verifies to its end."""
        try:
            ends = self.follower.end_offsets()
            deadline = time.monotonic() + 5
            while not self.follower.reached(ends) and time.monotonic() < deadline:
                self.fold.fold(self.follower.poll(0.05))
            if self._spared:
                self._collect_garbage(self._spared)
            self._seal()
        except KafkaLogError as exc:
            log.warning("serve %s: the last seal was not appended: %s", self.instance, exc)

    def _saw(self, partition: int, offset: int, event: Event) -> None:
        if isinstance(event, LogSealed):  # seals need no seal; everything else does
            self.last_seal[partition] = offset
        else:
            self.unsealed[partition] = True

    def _sync_role(self) -> bool:
        """Take the role over or drop it as the latest grant says; whether it is held now."""
        with self._lock:
            granted = self._granted
        if self._refused and granted == self._refused and time.monotonic() - self._refused_at > self.regrant_after_s:
            log.warning("serve %s: fenced %.0f s ago, but the group still grants this instance the scheduler "
                        "role: taking it over again", self.instance, time.monotonic() - self._refused_at)
            self._refused = 0
        if granted <= 0 or granted == self._refused:
            if self._held:
                self._drop_role(fenced=False)
            return False
        if self._held == granted:
            return True
        seconds = self.decisions.take_over()
        self._collect_garbage()  # before the first decision: see the module docstring
        self._held = granted
        self._fresh = True
        self.acquired_at = time.time()
        self.monitor = HeartbeatMonitor(self.monitor.timeout_s)
        self.judging_from = self.clock() + self.grace_s
        print(f"stagetree serve {self.instance}: scheduler role taken over at {self.acquired_at:.3f} "
              f"(earlier holders fenced, {len(self.fold.projectors)} partitions caught up in {seconds:.2f} s)",
              file=sys.stderr, flush=True)
        return True

    def _drop_role(self, *, fenced: bool) -> None:
        if fenced:
            self._refused = self._held
            self._refused_at = time.monotonic()
        self._held = 0
        self.decisions.close()
        why = " (fenced: a successor, or the transaction coordinator, ended its transaction)" if fenced else ""
        print(f"stagetree serve {self.instance}: scheduler role given up at {time.time():.3f}{why}",
              file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ decisions

    def _commit(self, decisions: list[Event], to_workers: bool) -> list[bool]:
        """The scheduler service's commit: the decisions, stamped with the prefix they were
        decided from, in one transaction with (``to_workers``) each one's copy on its worker's
        stream; whether the reducer accepted each."""
        prefix = self.decisions.prefix()
        stamped = [d.model_copy(update=prefix) if isinstance(d, DecisionEvent) else d for d in decisions]
        copies = [Write(topics.dispatch_stream(d.worker_id), d.worker_id, encode(d))  # type: ignore[attr-defined]
                  for d in stamped] if to_workers else []
        positions = self.decisions.append(stamped, copies)
        return [offset not in self.fold.projectors[partition].state.rejected for partition, offset in positions]

    def _delete(self, refs: list[str]) -> None:
        for ref in refs:
            self.store.delete(ref)

    def _collect_garbage(self, refs: set[str] | None = None) -> None:
        """Delete the unreferenced objects (of ``refs``; default: all) that no worker may be
        writing (:meth:`SchedulerService.collect_garbage` with ``except_in_flight``, after a
        take-over: the fold holds every dispatch a worker may be executing); remember the rest
        in ``_spared``, and everything asked about when the store failed (asked again later)."""
        if self.store is None:
            return
        asked = set(self.fold.state.objects) if refs is None else set(refs)
        try:
            spared = self.scheduler.collect_garbage(asked, except_in_flight=True)
        except Exception as exc:  # the store failed: the objects stay, and are asked about again
            log.warning("serve %s: unreferenced checkpoint objects were not deleted (tried again): %s",
                        self.instance, exc)
            objects = self.fold.state.objects
            spared = {r for r in asked if r in objects and objects[r].references == 0}
        if refs is None and spared:
            log.info("serve %s: %d unreferenced checkpoint objects are kept while a worker may write them",
                     self.instance, len(spared))
        self._spared = spared

    def _unreachable(self) -> list[str]:
        """Alive workers whose id cannot name a dispatch stream (no ``stagetree worker`` joins
        with one, but any producer may write a WorkerJoined): nothing can reach them."""
        out = []
        for worker_id, worker in sorted(self.fold.state.workers.items()):
            if worker.alive:
                try:
                    topics.dispatch_stream(worker_id)
                except ValueError:
                    out.append(worker_id)
        return out

    def _liveness(self) -> None:
        unreachable = self._unreachable()
        if unreachable:
            prefix = self.decisions.prefix()
            self.decisions.append([WorkerLost(producer=self.producer, ts=time.time(), worker_id=w,
                                              reason="its id cannot name a dispatch stream on Kafka",
                                              **prefix)  # type: ignore[arg-type]
                                   for w in unreachable])
            self._fresh = True
        if self.follower.last_error is not None:
            # beats cannot have arrived while the cluster was unreachable: judge nobody on it
            self.judging_from = max(self.judging_from, self.follower.last_error + self.grace_s)
            if self.follower.last_error != self._error_seen:
                self._error_seen, self._outage = self.follower.last_error, True
        if self.clock() < self.judging_from:
            return
        lost = self.monitor.silent(self.fold.state, self.clock())
        if not lost:
            self._pending_since = None
            return
        if not self._beats_all_read():
            return
        prefix = self.decisions.prefix()
        events: list[DecisionEvent] = [
            WorkerLost(producer=self.producer, ts=time.time(), worker_id=w,
                       reason=f"no heartbeat for {self.monitor.timeout_s:g} s", **prefix)  # type: ignore[arg-type]
            for w in lost]
        copies = [Write(topics.dispatch_stream(e.worker_id), e.worker_id, encode(e)) for e in events
                  if isinstance(e, WorkerLost)]
        self.decisions.append(events, copies)
        self._fresh = True

    def _beats_all_read(self) -> bool:
        """Whether a silence is evidence about the workers rather than about the cluster: asks
        the broker for the heartbeat partition's end. Unreachable: nobody's beats can arrive, so
        nobody is judged until ``grace_s`` after the last failed attempt, and the first answer
        after an outage starts a whole ``grace_s`` again: the workers' clients reconnect, and
        their producers may need a new producer id (the broker's transaction coordinators load
        first) before a beat is written, while the heartbeat partition already answers. A broker
        restart under load showed beats resuming more than a second after the partition's return,
        past a grace counted from the last failure. Beats written but not read yet (this
        instance's group consumer is reconnecting or rejoining): judged once they are read, or
        after one heartbeat timeout at most (a record that is not a beat may hold an offset)."""
        try:
            end = self.follower.end_offsets([(topics.HEARTBEAT, 0)], timeout_s=2.0)[(topics.HEARTBEAT, 0)]
        except KafkaLogError as exc:
            log.info("serve %s: no worker is judged while the cluster does not answer: %s", self.instance, exc)
            self.judging_from = self.clock() + self.grace_s
            self._outage = True
            return False
        if self._outage:  # the cluster answers again: every worker gets a whole grace to be heard
            self._outage = False
            self._pending_since = None
            self.judging_from = max(self.judging_from, self.clock() + self.grace_s)
            return False
        with self._lock:
            heard = self._heard
        now = self.clock()
        if heard + 1 >= end:
            self._pending_since = None
            return True
        if self._pending_since is None:
            self._pending_since = now
        return now - self._pending_since > self.monitor.timeout_s

    def _dead_letters(self) -> None:
        letters = []
        while not self._bad_beats.empty():
            letters.append(self._bad_beats.get())
        if letters:
            self.decisions.transactions.append([Write(topics.DEADLETTER, "heartbeat", encode(x)) for x in letters])

    def _seal(self) -> None:
        """Append a LogSealed per partition where a record other than a seal was folded since
        its last seal was made, or anything (a rejected record) after the last seal folded: the
        chain after its last folded record, all in one transaction.

        What a seal covers is decided when it is made: records other processes append before
        it lands are folded after it, so they are sealed by the next one (a seal that lands
        after nothing but seals needs none)."""
        algorithm = chain_algorithm(self.secret)
        partitioned = len(self.fold.projectors) > 1
        sealing = [p for p, projector in self.fold.projectors.items()
                   if self.unsealed[p] or projector.state.offset > self.last_seal[p]]
        writes = []
        for p in sealing:
            state = self.fold.projectors[p].state
            seal = LogSealed(producer=self.producer, ts=time.time(), stream=topics.PLAN, offset=state.offset,
                             chain=state.chain, algorithm=algorithm, partition=p if partitioned else None)
            writes.append(Write(topics.PLAN, "seal", encode(seal), p))
            self.unsealed[p] = False
        if writes:
            try:
                positions = self.decisions.transactions.append(writes)
            except BaseException:
                for p in sealing:
                    self.unsealed[p] = True
                raise
            self.decisions.wait_folded(positions)
