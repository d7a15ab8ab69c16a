"""The scheduler service: after every fold, append the scheduler's decisions to the log.

Used by the embedded coordinator, the cluster simulator and ``stagetree serve``'s scheduler
role on Kafka alike. Each decision (a pure function of the projection) is committed, then
folded, so the next decision sees it. Embedded, committing appends it to ``stagetree.plan``
(a decision for a worker also to ``stagetree.dispatch``); on Kafka the scheduler role commits
it in one transaction with its copy on the worker's own stream (``scheduler.role``). Other
producers may append between a decision and its record; the event's ``decided_at``
(``decided_at_partitions`` on a partitioned stream) names the prefix it was decided from, and a
decision the reducer rejects on the newer state (its worker was lost meanwhile, say) is
dead-lettered and simply decided again.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Iterable

from opentelemetry.trace import SpanKind

from events import topics, tracing
from events.faults import fault_point
from events.log import EmbeddedLog, append_event_streams, event_key
from events.models import CheckpointRequested, CheckpointSaved, Event, StageDispatched, TrialSubmitted
from projections.queries import writable_steps
from projections.store import Projector
from scheduler.decide import best_path, check_policy, decide
from scheduler.eviction import evictions_for_dispatch, fits
from scheduler.inflight import inflight_decisions

Deliver = Callable[[Event], None]
"""Hands a decision for a worker (StageDispatched, PathPreempted, CheckpointRequested) to it."""
Delete = Callable[[list[str]], None]
"""Deletes checkpoint objects (refs) from the checkpoint store."""
Commit = Callable[[list[Event], bool], list[bool]]
"""Appends decisions (one atomic batch; with ``True``, decisions for workers, each also to its
worker) and folds up to them; returns, per decision, whether the reducer accepted it."""


class SchedulerService:
    """Runs scheduling passes for ``projector``'s state, appending to ``log``.

    A pass decides, in order, each decision recorded with the prefix it was decided from:

    1. about running paths (``scheduler.inflight``): preemptions of paths no trial needs any
       more, and checkpoints to save where a new request put a boundary inside a running stage;
    2. then, until no worker is idle or nothing is ready: with a ``checkpoint_budget``, the
       evictions that make room for the next path (``scheduler.eviction``; the objects are
       deleted from the store through ``delete`` once the events are durable), and the dispatch
       itself (``scheduler.decide``).

    Args:
        log: where decisions are appended (the projector's embedded log; None with ``commit``).
        projector: folds the plan stream; its listeners also see the decisions.
        deliver: optional callback per decision addressed to a worker (the embedded
            coordinator's pipes, the simulator's workers).
        max_rejections: consecutive rejected decisions tolerated in one pass before giving up
            until the next trigger (a rejection means the state moved on under the decision).
        policy: the scheduling policy, one of ``scheduler.decide.POLICIES`` (HIPPO_SPEC §3.7;
            default Hippo's critical path); recorded in every decision.
        clock: the time stamped on decisions, in seconds since the epoch (the simulator passes
            its virtual clock).
        checkpoint_budget: bytes of checkpoints the run may keep (None: unbounded).
        delete: deletes evicted objects from the checkpoint store (None: nothing to delete).
        splits: decide CheckpointRequested (saves at a boundary inside a running stage). Off only
            for the ablation of ``benchmarks/checkpoint_budget.py``: a log made without them does
            not verify its in-flight decisions, which assume them.
        commit: appends decisions and folds up to them (see :data:`Commit`); default: append
            to ``log`` and catch the projector up. ``projector`` may then be anything with a
            ``state`` (the view decided from, read again after every commit) and ``listeners``,
            e.g. a :class:`projections.partitions.PartitionedFold`.
        producer: the ``producer`` stamped on decisions.

    Raises:
        ValueError: ``policy`` is not one of ``scheduler.decide.POLICIES``, or the budget is not
            a positive int.
    """

    def __init__(self, log: EmbeddedLog | None, projector: Projector, deliver: Deliver | None = None,
                 max_rejections: int = 3, policy: str = "critical-path",
                 clock: Callable[[], float] = time.time, checkpoint_budget: int | None = None,
                 delete: Delete | None = None, splits: bool = True, commit: Commit | None = None,
                 producer: str = "scheduler") -> None:
        if checkpoint_budget is not None and (isinstance(checkpoint_budget, bool)
                                              or not isinstance(checkpoint_budget, int) or checkpoint_budget < 1):
            raise ValueError(f"`checkpoint_budget` is {checkpoint_budget!r}, but must be a positive int (bytes)")
        self.log = log
        self.projector = projector
        self.deliver = deliver
        self.max_rejections = max_rejections
        self.policy = check_policy(policy)
        self.clock = clock
        self.checkpoint_budget = checkpoint_budget
        self.delete = delete
        self.splits = splits
        self.commit = commit if commit is not None else self._append_and_fold
        self.producer = producer
        self.trial_traces: dict[str, dict[str, str]] = {}  # trial id -> trace header of its latest submission
        self.saved_steps: dict[str, set[int]] = {}
        """ref -> the steps the CheckpointSaved events this service saw folded name it at (complete
        only when the projector folded the log from its start after this service was made, as the
        scheduler role's does): :meth:`collect_garbage` with ``except_in_flight``."""
        projector.listeners.append(self._remember)

    def _remember(self, offset: int, event: object) -> None:
        if isinstance(event, TrialSubmitted) and event.trace:
            self.trial_traces[event.trial_id] = event.trace
        elif isinstance(event, CheckpointSaved):
            self.saved_steps.setdefault(event.ref, set()).add(event.step)

    def _append_and_fold(self, decisions: list[Event], to_workers: bool) -> list[bool]:
        """Embedded: append decisions to the plan stream and, for workers, to the dispatch stream
        (keyed by worker), in one atomic write, and fold them; whether each was accepted.

        The write is made durable by the log's group commit (:meth:`EmbeddedLog.sync_soon`,
        with what was appended before it: the workers' reports), not before the decision goes
        on: the workers it is sent to are this machine's processes, whose work a power loss
        ends too (what they wrote for a decision the log lost is a checkpoint object nothing
        names), and a kill -9 loses no write. What leaves the machine's fate waits for the
        fsync: deleting evicted objects (:meth:`_delete_garbage`) and the run's end."""
        assert self.log is not None, "a SchedulerService without a log needs a `commit`"
        batches: list[tuple[str, list[tuple[str, Event]]]] = [(topics.PLAN, [(event_key(d), d) for d in decisions])]
        if to_workers:
            batches.append((topics.DISPATCH, [(d.worker_id, d) for d in decisions]))  # type: ignore[attr-defined]
        offsets = append_event_streams(self.log, batches, durable=False)[0]
        self.log.sync_soon()
        self.projector.catch_up()
        return [offset not in self.projector.state.rejected for offset in offsets]

    def _append(self, decisions: list[Event], to_workers: bool = False) -> list[bool]:
        """Stamp, commit and fold decisions; hand those for workers that were accepted to
        ``deliver``. Whether each was accepted."""
        now = self.clock()
        decisions = [d.model_copy(update={"ts": now, "producer": self.producer}) for d in decisions]
        accepted = self.commit(decisions, to_workers)
        if to_workers and self.deliver is not None:
            for ok, decision in zip(accepted, decisions):
                if ok:
                    self.deliver(decision)
        return accepted

    def run_pass(self) -> list[StageDispatched]:
        """Decide and append: decisions about running paths, then evictions and dispatches until
        no worker is idle or nothing is ready; returns the dispatches."""
        control = inflight_decisions(self.projector.state, self.checkpoint_budget)
        if not self.splits:
            control = [c for c in control if not isinstance(c, CheckpointRequested)]
        if control:
            self._append(control, to_workers=True)
        out: list[StageDispatched] = []
        rejections = 0
        evicted: set[tuple[str, str, int]] = set()  # (plan, node, step) evicted in this pass
        while True:
            if self.checkpoint_budget is not None:
                evictions = evictions_for_dispatch(self.projector.state, self.checkpoint_budget, self.policy)
                places = {(e.plan_key, e.node_id, e.step) for e in evictions}
                if evictions and not places <= evicted:  # (the same again: the log refused them; go on)
                    evicted |= places
                    fault_point("before-eviction-event")
                    self._append(list(evictions))
                    fault_point("after-eviction-event")
                    self._delete_garbage([e.ref for e in evictions])
                    continue  # asked again of the state they made (new records may have come with it)
            state = self.projector.state
            started_ns = time.time_ns()
            decision = decide(state, self.policy)
            if decision is None:
                return out
            if self.checkpoint_budget is not None:
                path = best_path(state, self.policy)
                if path is not None and not fits(state, self.checkpoint_budget, path):
                    return out  # no room even after evicting: wait for a running path to end
            decision = decision.model_copy(update={"ts": self.clock(), "producer": self.producer})
            if tracing.enabled():
                decision = self._traced(decision, started_ns)
            (accepted,) = self.commit([decision], True)
            if not accepted:
                rejections += 1
                if rejections >= self.max_rejections:
                    return out
                continue
            rejections = 0
            out.append(decision)
            if self.deliver is not None:
                self.deliver(decision)

    def _delete_garbage(self, refs: Iterable[str], except_in_flight: bool = False) -> set[str]:
        """Delete the objects among ``refs`` that no plan place references any more (evicted, and
        not saved again since), now that the decisions that released them are durable; with
        ``except_in_flight``, not those a worker may be writing now (see :meth:`collect_garbage`).
        Returns the unreferenced objects it spared for that reason (none without it).

        Raises what ``delete`` raises (the objects before the one that failed are gone)."""
        state = self.projector.state
        objects = state.objects
        garbage = sorted({r for r in refs if r in objects and objects[r].references == 0})
        spared: set[str] = set()
        if except_in_flight and garbage:
            writable = writable_steps(state)
            firsts = [a for a, _ in writable]

            def written(step: int) -> bool:
                i = bisect_right(firsts, step) - 1
                return i >= 0 and step <= writable[i][1]

            spared = {r for r in garbage if not self.saved_steps.get(r) or any(map(written, self.saved_steps[r]))}
            garbage = [r for r in garbage if r not in spared]
        if garbage and self.delete is not None:
            if self.log is not None:
                self.log.sync()  # the evictions are durable before their objects are gone
            self.delete(garbage)
        return spared

    def collect_garbage(self, refs: Iterable[str] | None = None, *, except_in_flight: bool = False) -> set[str]:
        """Delete every object (of ``refs``; default: every object the state knows) that no plan
        place references: a process killed between an eviction event and its deletion leaves
        its objects behind. Returns the ones spared (``except_in_flight``).

        Without ``except_in_flight`` it is safe only while no worker writes: the embedded
        coordinator calls it at start, before it starts workers.

        With ``except_in_flight`` (the scheduler role on Kafka, when it takes the role over:
        workers of the deployment go on meanwhile), it spares what a worker may be writing.
        The danger is deleting an object that a CheckpointSaved folded after the deletion names
        as stored: a worker's ``put`` of an object that is stored already is a no-op, so its
        CheckpointSaved may follow our ``delete``, and the log would name a missing object. The
        acceptable failure is leaving garbage behind (``replay verify`` names it). The argument:

        * only a worker executing a dispatch writes an object and then a CheckpointSaved that the
          fold accepts (the reducer checks the node and the step, not the dispatch: a worker
          declared lost that is alive after all, paused or cut off, trains its path on and its
          CheckpointSaved events are accepted, as are its end batches that wait for their
          writes after it joined again);
        * every dispatch a worker may be executing is in the state: the caller has fenced every
          earlier holder of the role (a dispatch of an open transaction is aborted with its copy
          on the worker's stream, so no worker sees it) and folded every partition to its end;
          dispatches decided after this call are written to the store after the deletion ended;
        * such a worker can write only at the steps of its dispatch's stages it has not reported
          finished (:func:`projections.queries.writable_steps`: running and lost dispatches);
        * an object's bytes encode its global step (``TrainingSession.save``'s ``"step"``; a
          simulated checkpoint's ref hashes it), and nothing else about its place: the same bytes
          can be saved at another node (a branch at its first step) or in another plan
          (``--no-merge`` plans of one trainer and seed; a new trainer version that trains the
          same). So an object is spared when any step a CheckpointSaved named it at lies in
          those ranges, on any plan, and when this service has seen no CheckpointSaved of it
          (:attr:`saved_steps` is incomplete when the projector was restored from a store).

        A lost dispatch is never known to have ended: the objects at the steps of its unfinished
        stages are spared at every collection, garbage left behind (the accepted failure). Those
        of a running dispatch can go once it has ended (the role asks again: ``scheduler.role``).

        Not covered (as before): an eviction's own deletion in :meth:`run_pass` spares nothing
        (sparing would let the store outgrow the budget while paths run), and a holder fenced
        without knowing it yet (a paused serve) deletes what it evicted when it resumes; a worker
        writing the same bytes then (a lost one, or one of another plan) can make the log name
        a missing object.

        Raises:
            Exception: what ``delete`` raises (the store failed; the objects before the one
                that failed are gone, the others stay).
        """
        return self._delete_garbage(self.projector.state.objects if refs is None else refs, except_in_flight)

    def _traced(self, decision: StageDispatched, started_ns: int) -> StageDispatched:
        """Record the pass and the dispatch in the trace of the first trial the path serves
        (linked to the other trials' traces), and carry the context in the event."""
        plan = self.projector.state.plans[decision.plan_key]
        trials = sorted({t for s in decision.stages for t in plan.nodes[s.node_id].requests.get(s.to_step, [])})
        served = [self.trial_traces[t] for t in trials if t in self.trial_traces]
        parent, links = (served[0], served[1:]) if served else (None, [])
        with tracing.span("schedule", parent=parent, links=links, start_time=started_ns,
                          attributes={"stagetree.dispatch_id": decision.dispatch_id,
                                      "stagetree.trials_served": len(served)}):
            with tracing.span("dispatch", kind=SpanKind.PRODUCER,
                              attributes=tracing.messaging("publish", topics.DISPATCH, decision.event_id,
                                                           dispatch_id=decision.dispatch_id,
                                                           worker_id=decision.worker_id, stages=len(decision.stages))):
                return decision.model_copy(update={"trace": tracing.carrier()})
