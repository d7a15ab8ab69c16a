"""Read-side queries over the projected search plan: the one way to read paths and sharing.

Everything here is a pure function of a :class:`~projections.state.State` (or one
:class:`~projections.state.Plan`): the summary, the HTML report, ``replay explain``, the
dashboard and the CLI ask these questions instead of walking the plan themselves. One
trial's story (``replay explain``): :func:`find_trial`, :func:`divergences`, :func:`on_path`,
:func:`checkpoints_on_path`, :func:`metrics_on_path`, :func:`decisions_about`.

Terms (DESIGN.md): a *segment* ``(plan_key, node_id, start, end)`` is the step range
``[start, end)`` of one node that a request trains through; the *path* of a request
``(node, steps)`` is its segments from the node up to the root, where the node covers
``[node.start_step, steps)`` and every ancestor ``[its start, its child's start)``. Two trials
*share* the steps where their paths' segments on the same node overlap (nodes are never split,
so step ``s`` of a node is the same prefix for every trial through it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import NamedTuple

from events.hp import first_divergence
from events.models import TrialSubmitted, base_plan_key
from projections.state import Checkpoint, Decided, Dispatch, Node, Plan, State, Trial


class Segment(NamedTuple):
    """Steps ``[start, end)`` of ``node_id`` in plan ``plan_key`` (steps)."""

    plan_key: str
    node_id: str
    start: int
    end: int

    @property
    def steps(self) -> int:
        return self.end - self.start


@functools.cache  # a plan's node ids: few, and the scheduler orders by them at every pass
def node_number(node_id: str) -> int:
    """The ordinal of a node id (``"n12"`` -> 12): nodes are numbered in the order the plan
    appended them (:meth:`Plan.new_node_id`). Raises ValueError for another form."""
    if not node_id.startswith("n") or not node_id[1:].isdigit():
        raise ValueError(f"`node_id` is {node_id!r}, but node ids are n<number>")
    return int(node_id[1:])


_RUNNING = "queries.running"  # state.cache key: (dispatches seen, ids of those running then)


def running_dispatches(state: State) -> list[Dispatch]:
    """The dispatches whose status is "running", by dispatch id (as strings sort).

    Kept in ``state.cache`` and brought up to date from what changed: dispatches are only ever
    added, and a status only ever leaves "running", so the earlier running ones still running
    and the dispatches added since are all there is to look at (not every dispatch of the run).
    """
    seen, running = state.cache.get(_RUNNING, (0, []))
    if seen > len(state.dispatches):
        seen, running = 0, []
    dispatches = state.dispatches
    still = [i for i in running if dispatches[i].status == "running"]
    added = [i for i in islice(dispatches, seen, None) if dispatches[i].status == "running"]
    running = sorted(still + added) if added else still
    state.cache[_RUNNING] = (len(dispatches), running)
    return [dispatches[i] for i in running]


def handed_on(state: State, d: Dispatch) -> bool:
    """Whether the worker of the running dispatch ``d`` has trained it to its end and is free
    while its end batches are written (PathTrained: ``d`` is in its :attr:`Worker.writing`)."""
    worker = state.workers.get(d.worker_id)
    return worker is not None and d.dispatch_id in worker.writing


def writable_steps(state: State) -> list[tuple[int, int]]:
    """The global steps ``[first, last]`` (inclusive, sorted, merged) at which a worker may still
    store a checkpoint for a dispatch of ``state``: the stages its worker has not reported
    finished (``Dispatch.finished`` on: a worker's end batches come in stage order, each naming
    its checkpoint only once it is written) of every dispatch that is running, or was lost (its
    worker declared lost, or joined again, may be a live process that trains the path on: the
    fold accepts the CheckpointSaved events it writes then). A dispatch done, failed or
    preempted wrote its last checkpoint before the event that ended it.

    A stage's range includes its first step: a path that starts fresh stores the weights it
    starts from when it is stopped before training a step."""
    ranges = sorted((a, b) for d in state.dispatches.values() if d.status in ("running", "lost")
                    for _, a, b in d.stages[d.finished:])
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def ancestors(plan: Plan, node: Node) -> Iterator[Node]:
    """``node``, its parent, ..., the root."""
    current: Node | None = node
    while current is not None:
        yield current
        current = plan.nodes[current.parent_id] if current.parent_id is not None else None


def path(plan: Plan, node_id: str, steps: int) -> list[Segment]:
    """The segments a request ``(node_id, steps)`` trains through, from ``node_id`` up to the
    root (see the module docstring). Raises KeyError for an unknown node."""
    out = []
    end = steps
    for node in ancestors(plan, plan.nodes[node_id]):
        out.append(Segment(plan.plan_key, node.node_id, node.start_step, end))
        end = node.start_step
    return out


def terminal(trial: Trial) -> tuple[str, int] | None:
    """``(node_id, steps)`` of a trial's largest request, or None before it has one."""
    if not trial.requests:
        return None
    steps = trial.steps if trial.steps in trial.requests else max(trial.requests)
    return trial.requests[steps], steps


def trial_path(state: State, trial: Trial) -> list[Segment]:
    """The segments of the trial's largest request (empty without one, or for an unknown plan)."""
    end = terminal(trial)
    plan = state.plans.get(trial.plan_key)
    if end is None or plan is None or end[0] not in plan.nodes:
        return []
    return path(plan, *end)


def needed(plan: Plan, targets: Iterable[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """The steps requests need, per node: ``node_id -> (start, end)`` with ``end`` the largest
    step any of ``targets`` (``(node_id, steps)`` requests) trains on or below that node."""
    end: dict[str, int] = {}
    for node_id, steps in targets:
        for segment in path(plan, node_id, steps):
            if end.get(segment.node_id, -1) < segment.end:
                end[segment.node_id] = segment.end
    return {n: (plan.nodes[n].start_step, stop) for n, stop in end.items()}


def unique_steps(plan: Plan, targets: Iterable[tuple[str, int]]) -> int:
    """Steps of the union of the requests' paths: the unique training steps after merging
    (the denominator of the merge rate p, Hippo §6.2). ``targets``: ``(node_id, steps)``."""
    return sum(stop - start for start, stop in needed(plan, targets).values())


def study_needs(state: State, study_id: str | None) -> dict[tuple[str, str], tuple[int, int]]:
    """The steps the study's trials need (None: every study's), per ``(plan_key, node_id)``:
    ``(start, end)`` over each trial's maximum request; their lengths sum to the study's unique
    steps (thesis §4.2.1)."""
    targets: dict[str, list[tuple[str, int]]] = {}
    for trial in state.trials.values():
        if (study_id is None or trial.study_id == study_id) and trial.steps in trial.requests:
            targets.setdefault(trial.plan_key, []).append((trial.requests[trial.steps], trial.steps))
    return {(key, node_id): span for key, requests in targets.items()
            for node_id, span in needed(state.plans[key], requests).items()}


def trials_through(state: State, plan_key: str, node_id: str, step: int) -> list[str]:
    """Sorted ids of the trials whose path trains ``node_id`` of ``plan_key`` up to ``step``
    or beyond (who a stage ending at ``step`` served)."""
    return sorted(t.trial_id for t in state.trials.values() if t.plan_key == plan_key
                  and any(s.node_id == node_id and step <= s.end for s in trial_path(state, t)))


def sharing(state: State, trial: Trial) -> dict[str, list[Segment]]:
    """For each other trial on the trial's plan, the segments of the trial's path it shares
    (the overlap of both paths on each node); trials sharing nothing are left out."""
    mine = {s.node_id: s for s in trial_path(state, trial)}
    out: dict[str, list[Segment]] = {}
    for other in state.trials.values():
        if other.trial_id == trial.trial_id or other.plan_key != trial.plan_key:
            continue
        common = []
        for s in trial_path(state, other):
            m = mine.get(s.node_id)
            if m is not None and min(m.end, s.end) > max(m.start, s.start):
                common.append(Segment(s.plan_key, s.node_id, max(m.start, s.start), min(m.end, s.end)))
        if common:
            out[other.trial_id] = sorted(common, key=lambda s: s.start)
    return out


# ----------------------------------------------------------------------------- one trial's story (replay explain)


def find_trial(state: State, prefix: str) -> Trial:
    """The trial whose id is ``prefix`` or starts with it.

    Raises:
        KeyError: no trial matches, or several do (the message lists up to 8 of them).
    """
    if not prefix:
        raise KeyError(f"a trial id or a prefix of one must not be empty ({len(state.trials)} trials in the log)")
    if prefix in state.trials:
        return state.trials[prefix]
    matches = sorted(t for t in state.trials if t.startswith(prefix))
    if len(matches) == 1:
        return state.trials[matches[0]]
    if not matches:
        raise KeyError(f"no trial id starts with {prefix!r} ({len(state.trials)} trials in the log)")
    shown = ", ".join(matches[:8]) + (f", ... ({len(matches)} in all)" if len(matches) > 8 else "")
    raise KeyError(f"trial id prefix {prefix!r} is not unique: {shown}")


def divergences(state: State, trial: Trial) -> dict[str, int]:
    """For each other trial of the same plan key whose hyper-parameters agree with the trial's
    at step 0, the first step at which they differ (:func:`events.hp.first_divergence`), capped
    at the smaller of the two trials' steps (a cap means: no difference within them). These are
    the trials it shares a prefix with (in a ``--no-merge`` run too, where nothing is shared)."""
    out = {}
    family = base_plan_key(trial.plan_key)
    for other in state.trials.values():
        if other.trial_id == trial.trial_id or base_plan_key(other.plan_key) != family \
                or other.hp.keys() != trial.hp.keys():
            continue
        step = first_divergence(trial.hp, other.hp, 0, min(trial.steps, other.steps))
        if step > 0:
            out[other.trial_id] = step
    return out


def on_path(segments: Iterable[Segment], node_id: str, from_step: int, to_step: int) -> bool:
    """Whether the stage ``[from_step, to_step)`` of ``node_id`` trains some of ``segments`` (a
    trial's path, :func:`trial_path`), or evaluates at the end of one (``from_step == to_step``)."""
    return any(s.node_id == node_id and (from_step < s.end and to_step > s.start
                                         or from_step == to_step and s.start < from_step <= s.end)
               for s in segments)


def checkpoints_on_path(state: State, trial: Trial) -> list[tuple[str, int, Checkpoint]]:
    """``(node_id, step, checkpoint)`` of the checkpoints on the trial's path (steps in each
    segment's ``(start, end]``), by step."""
    plan = state.plans.get(trial.plan_key)
    if plan is None:
        return []
    out = []
    for seg in trial_path(state, trial):
        for step, ckpt in plan.nodes[seg.node_id].ckpt.items():
            if seg.start < step <= seg.end:
                out.append((seg.node_id, step, ckpt))
    return sorted(out, key=lambda c: c[1])


def metrics_on_path(state: State, trial: Trial) -> list[tuple[int, str, dict[str, float]]]:
    """``(step, node_id, metrics)`` reported on the trial's path (any trial's request there: the
    same prefix), by step."""
    plan = state.plans.get(trial.plan_key)
    if plan is None:
        return []
    out = []
    for seg in trial_path(state, trial):
        for step, metrics in plan.nodes[seg.node_id].metrics.items():
            if seg.start < step <= seg.end:
                out.append((step, seg.node_id, metrics))
    return sorted(out, key=lambda m: m[0])


def decisions_about(state: State, trial_id: str) -> list[Decided]:
    """The tuner decisions naming the trial (TunerDecided events, in log order)."""
    return list(state.decided.get(trial_id, []))


def final_decision(state: State, trial_id: str) -> Decided | None:
    """The last tuner decision about the trial itself (its own role, not as a donor or the main
    line a branch left), or None when no decision names it."""
    return next((d for d in reversed(state.decided.get(trial_id, [])) if d.role in ("trial", "new")), None)


class TrialDecision(NamedTuple):
    """A tuner's decision about a trial: ``kind`` ("promote", "stop" or "exploit"), the ``step``
    of the result it was taken on (steps), ``to_steps`` (the steps asked next, else None), and
    ``source``: where it was read ("tuner": a TunerDecided event; in logs without them,
    "requests": the trial asked for more steps after it had results, see :func:`promotion`;
    "study end": the study finished without asking the trial for more steps)."""

    kind: str
    step: int
    to_steps: int | None
    source: str


def tuner_decisions(state: State, trial_id: str) -> list[TrialDecision]:
    """The tuner's typed decisions (TunerDecided events) about trial ``trial_id`` that change its
    course: promotions, stops and PBT exploits (which stop a member), in log order, each with
    ``source`` "tuner"; empty for a log written before decisions were events."""
    return [TrialDecision(d.decision["kind"], d.decision["step"], d.decision.get("to_step"), "tuner")
            for d in state.decided.get(trial_id, ()) if d.role == "trial"
            and d.decision["kind"] in ("promote", "stop", "exploit")]


def decision_marks(state: State, trial_id: str) -> list[tuple[str, int]]:
    """``(kind, step)`` of :func:`tuner_decisions`: what the report marks on the trial's
    learning curve."""
    return [(d.kind, d.step) for d in tuner_decisions(state, trial_id)]


def promotion(state: State, event: TrialSubmitted) -> tuple[str, int, int] | None:
    """``(trial_id, from_step, to_steps)`` when ``event``, about to be folded into ``state``, asks
    a trial that already has results for more steps than the largest of them (a rung's promotion
    in successive halving, the next interval of median stopping or PBT); None for a new trial, a
    request asked again, or requests submitted together before any result (steps)."""
    trial = state.trials.get(event.trial_id)
    if trial is None or not trial.results or event.steps in trial.requests or event.steps <= max(trial.results):
        return None
    return trial.trial_id, max(trial.results), event.steps


def study_decisions(state: State, study_id: str, promotions: Mapping[str, Iterable[tuple[int, int]]]
                    ) -> dict[str, list[TrialDecision]]:
    """The decisions of the tuner about each trial of ``study_id`` (trial id -> decisions in
    order): the one read of them (the dashboard's "final decision" column and the marks on its
    curves).

    Read from what the log holds: the tuner's typed decisions (TunerDecided events: promotions,
    stops, PBT exploits, each with ``source`` "tuner") when the study recorded any; for a log
    written before decisions were events, inferred: ``promotions`` maps a trial id to the
    ``(from_step, to_steps)`` pairs :func:`promotion` found while folding, in log order; a trial
    that is done when its study has finished, with fewer steps than the study's largest request,
    was stopped at its last result. A failed or cancelled trial ends without a decision.
    """
    trials = [t for t in state.trials.values() if t.study_id == study_id]
    if any(d.study_id == study_id for t in trials for d in state.decided.get(t.trial_id, ())):
        return {t.trial_id: tuner_decisions(state, t.trial_id) for t in trials}
    finished = bool((state.studies.get(study_id) or {}).get("finished"))
    largest = max((t.steps for t in trials), default=0)
    out = {}
    for trial in trials:
        decisions = [TrialDecision("promote", a, b, "requests") for a, b in promotions.get(trial.trial_id, ())]
        if finished and trial.status == "done" and trial.requests and trial.steps < largest:
            decisions.append(TrialDecision("stop", trial.steps, None, "study end"))
        out[trial.trial_id] = decisions
    return out
