"""The scheduler service: after every fold, append the scheduler's decisions to the log.

Used by the embedded coordinator, the cluster simulator and ``stagetree serve``'s scheduler
role on Kafka alike. Each decision (``decide``, a pure function of the projection) is
committed, then folded, so the next decision sees that path as running. Embedded, committing
appends it as a StageDispatched to ``stagetree.plan`` and copies it to ``stagetree.dispatch``;
on Kafka the scheduler role commits it in one transaction with the worker's copy
(``stagetree.serve``). Other producers may append between a decision and its record; the
event's ``decided_at`` (``decided_at_partitions``) names the prefix it was decided from, and a
decision the reducer rejects on the newer state (its worker was lost meanwhile, say) is
dead-lettered and simply decided again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry.trace import SpanKind

from events import topics, tracing
from events.log import EventLog, append_events
from events.models import StageDispatched, TrialSubmitted
from projections.store import Projector
from scheduler.decide import check_policy, decide

Deliver = Callable[[StageDispatched], None]
Commit = Callable[[StageDispatched], bool]
"""Appends a decision and folds up to it; returns whether the reducer accepted it."""


class SchedulerService:
    """Runs scheduling passes for ``projector``'s state, appending to ``log``.

    Args:
        log: where decisions are appended (the projector's log).
        projector: folds the plan stream; its listeners also see the decisions.
        deliver: optional callback per appended decision (the embedded coordinator's pipes).
        max_rejections: consecutive rejected decisions tolerated in one pass before giving up
            until the next trigger (a rejection means the state moved on under the decision).
        policy: the scheduling policy, one of ``scheduler.decide.POLICIES`` (HIPPO_SPEC §3.7;
            default Hippo's critical path); recorded in every decision.
        clock: the time stamped on decisions, in seconds since the epoch (the simulator passes
            its virtual clock).
        commit: appends a decision and folds up to it, returning whether the reducer accepted
            it (default: append to ``log`` and catch the projector up); ``projector`` may then be
            anything with a ``state`` (the view decided from) and ``listeners``, e.g. a
            :class:`projections.partitions.PartitionedFold`.
        producer: the ``producer`` stamped on decisions.

    Raises:
        ValueError: ``policy`` is not one of ``scheduler.decide.POLICIES``.
    """

    def __init__(self, log: EventLog | None, projector: Projector, deliver: Deliver | None = None,
                 max_rejections: int = 3, policy: str = "critical-path",
                 clock: Callable[[], float] = time.time, commit: Commit | None = None,
                 producer: str = "scheduler") -> None:
        self.log = log
        self.projector = projector
        self.deliver = deliver
        self.max_rejections = max_rejections
        self.policy = check_policy(policy)
        self.clock = clock
        self.commit = commit if commit is not None else self._append
        self.producer = producer
        self.trial_traces: dict[str, dict[str, str]] = {}  # trial id -> trace header of its latest submission
        projector.listeners.append(self._remember_trace)

    def _remember_trace(self, offset: int, event: object) -> None:
        if isinstance(event, TrialSubmitted) and event.trace:
            self.trial_traces[event.trial_id] = event.trace

    def run_pass(self) -> list[StageDispatched]:
        """Decide and commit until no worker is idle or nothing is ready; returns the decisions."""
        out: list[StageDispatched] = []
        rejections = 0
        while True:
            started_ns = time.time_ns()
            decision = decide(self.projector.state, self.policy)
            if decision is None:
                return out
            decision = decision.model_copy(update={"ts": self.clock(), "producer": self.producer})
            if tracing.enabled():
                decision = self._traced(decision, started_ns)
            if not self.commit(decision):
                rejections += 1
                if rejections >= self.max_rejections:
                    return out
                continue
            rejections = 0
            out.append(decision)
            if self.deliver is not None:
                self.deliver(decision)

    def _append(self, decision: StageDispatched) -> bool:
        """Embedded: append to ``stagetree.plan`` and its copy to ``stagetree.dispatch``, fold."""
        assert self.log is not None, "a SchedulerService without a log needs a `commit`"
        (offset,) = append_events(self.log, topics.PLAN, [(decision.plan_key, decision)])
        append_events(self.log, topics.DISPATCH, [(decision.worker_id, decision)])
        self.projector.catch_up()
        return offset not in self.projector.state.rejected

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
