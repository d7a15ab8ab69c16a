"""The reducer: ``apply(state, event, offset)`` folds one plan-stream event into the projection.

Pure and deterministic: no clock, randomness or I/O; the result depends only on the state and
the event. An event that cannot be applied (unknown node, busy worker, conflicting trial) is
rejected *before* anything changes, with :class:`Rejected`; the projector records the offset and
reason and dead-letters it, so a bad event never corrupts what was already recorded.
Redelivered events (same ``event_id``) are applied once.

Returns the set of touched keys so the store persists only what changed.
"""

from __future__ import annotations

from events.models import (
    CheckpointEvicted,
    CheckpointRequested,
    CheckpointSaved,
    DeadLettered,
    Event,
    LogSealed,
    MetricsReported,
    PathPreempted,
    PathTrained,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageStarted,
    StageStopped,
    StudyFinished,
    StudyStarted,
    TrialCancelled,
    TrialSubmitted,
    TunerDecided,
    WorkerJoined,
    WorkerLost,
)
from projections import search_plan
from projections.state import Checkpoint, Decided, Dispatch, Node, Plan, State, StoredObject, Trial, Worker

Key = tuple[str, ...]


class Rejected(ValueError):
    """The event is well-formed but cannot be applied to this state; nothing was changed."""


def node_key(node: Node) -> Key:
    return ("node", node.plan_key, node.node_id)


def apply(state: State, event: Event, offset: int) -> set[Key]:
    """Fold ``event`` (at stream ``offset``) into ``state``; returns the touched keys.

    Raises:
        Rejected: the event cannot be applied; ``state`` is unchanged (the caller records the
            rejection and consumes the offset).
        Exception: anything else is a defect of the reducer: ``state.offset`` is not advanced,
            so the folder must not commit or skip the event.
    """
    touched: set[Key] = {("meta",)}
    if event.event_id in state.seen:
        state.offset = offset
        return touched
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise Rejected(f"{event.type} events do not belong on the plan stream")
    try:
        if isinstance(event, TunerDecided):
            _tuner_decided(state, event, offset, touched)
        else:
            handler(state, event, touched)
    finally:
        _bump_revisions(state, touched)
    # Only now is the event consumed: a Rejected one is recorded (and its offset consumed) by the
    # folder, and any other exception leaves the offset where it was, so the event is not lost.
    state.offset = offset
    state.seen.add(event.event_id)
    touched.add(("seen", event.event_id))
    return touched


def _bump_revisions(state: State, touched: set[Key]) -> None:
    """Bump :attr:`Plan.revision` of every plan with a touched plan or node record, so what the
    scheduler memoised for the plan's previous revision is never reused, and note the touched
    nodes in :attr:`Plan.changed` (what the scheduler's stage-tree index rebuilds)."""
    bumped: set[str] = set()
    for key in touched:
        kind = key[0]
        if kind == "node" or kind == "plan":
            plan = state.plans.get(key[1])
            if plan is None:
                continue
            if key[1] not in bumped:
                bumped.add(key[1])
                plan.revision += 1
            if kind == "node":
                plan.changed.add(key[2])


# ----------------------------------------------------------------------------- studies


def _study_started(state: State, ev: StudyStarted, touched: set[Key]) -> None:
    prev = state.studies.get(ev.study_id)
    if prev is not None and prev["plan_key"] != ev.plan_key:
        raise Rejected(f"study {ev.study_id!r} already uses plan {prev['plan_key']!r}, not {ev.plan_key!r}")
    runs = (prev or {}).get("runs", 0) + 1
    payload = ev.payload()
    if payload["tuner_settings"] is None:  # absent, as in logs written before the field: their digests hold
        del payload["tuner_settings"]
    state.studies[ev.study_id] = {
        **payload,
        "runs": runs,
        "finished": False,
        "best_trial": None,
        "best_metric": None,
        "end_to_end_seconds": None,
    }
    touched.add(("study", ev.study_id))


def _study_finished(state: State, ev: StudyFinished, touched: set[Key]) -> None:
    study = state.studies.get(ev.study_id)
    if study is None:
        raise Rejected(f"unknown study {ev.study_id!r}")
    study.update(
        finished=True,
        best_trial=ev.best_trial,
        best_metric=ev.best_metric,
        end_to_end_seconds=ev.end_to_end_seconds,
    )
    # "best_step" only when the event has one: the projection of a log written before the field
    # stays byte for byte what it was (exports carry their projection's digest)
    if ev.best_step is not None:
        study["best_step"] = ev.best_step
    else:
        study.pop("best_step", None)
    touched.add(("study", ev.study_id))


# ----------------------------------------------------------------------------- trials


def _trial_submitted(state: State, ev: TrialSubmitted, touched: set[Key]) -> None:
    trial = state.trials.get(ev.trial_id)
    if trial is not None:
        if trial.plan_key != ev.plan_key or trial.hp != ev.hp:  # sequences compare by canonical JSON
            raise Rejected(f"trial {ev.trial_id!r} was submitted before with another plan or hp")
        if trial.status == "cancelled":
            raise Rejected(f"trial {ev.trial_id!r} was cancelled")
    plan = state.plans.get(ev.plan_key)
    if plan is not None and plan.seed != ev.seed:
        raise Rejected(f"plan {ev.plan_key!r} has seed {plan.seed}, not {ev.seed}")
    scratch = plan if plan is not None else Plan(ev.plan_key, ev.seed)
    try:
        placement = search_plan.place(scratch, ev.hp, ev.steps)
    except (ValueError, ArithmeticError) as exc:
        raise Rejected(f"trial {ev.trial_id!r} cannot be placed: {type(exc).__name__}: {exc}") from None
    # Validated: from here on nothing raises.
    if plan is None:
        plan = state.plans[ev.plan_key] = scratch
    touched.add(("plan", plan.plan_key))
    if placement.node_id is None:
        node = search_plan.add_node(plan, placement, ev.hp)
        if node.parent_id is not None:
            touched.add(("node", plan.plan_key, node.parent_id))
    else:
        node = plan.nodes[placement.node_id]
    touched.add(node_key(node))
    if trial is None:
        trial = state.trials[ev.trial_id] = Trial(ev.trial_id, ev.study_id, ev.plan_key, dict(ev.hp), ev.steps)
    touched.add(("trial", trial.trial_id))
    trial.steps = max(trial.steps, ev.steps)
    unanswered = _unanswered(state, trial)
    trial.requests[ev.steps] = node.node_id
    if ev.steps not in trial.results:
        unanswered.add(ev.steps)
    if ev.steps in node.metrics:
        _deliver(state, trial, ev.steps, node.metrics[ev.steps], touched)
    else:
        waiters = node.requests.setdefault(ev.steps, [])
        if trial.trial_id not in waiters:
            waiters.append(trial.trial_id)
            waiters.sort()
        if trial.status == "done":
            trial.status = "pending"


_UNANSWERED = "reducer.unanswered"
"""Key in :attr:`State.cache` of ``trial id -> the steps it asked for that have no result yet``:
derived from :attr:`Trial.requests` and :attr:`Trial.results`, which only the reducer writes and
which only grow, so a trial's completion is known without comparing every step it ever asked
for at each answer (a trial extended by successive requests asks for thousands)."""


def _unanswered(state: State, trial: Trial) -> set[int]:
    """The steps ``trial`` asked for without a result yet (computed once per trial and state
    object, then kept up to date by the reducer)."""
    memo = state.cache.setdefault(_UNANSWERED, {})
    steps: set[int] | None = memo.get(trial.trial_id)
    if steps is None:
        steps = memo[trial.trial_id] = {s for s in trial.requests if s not in trial.results}
    return steps


def _deliver(state: State, trial: Trial, steps: int, metrics: dict[str, float], touched: set[Key]) -> None:
    trial.results[steps] = dict(metrics)
    unanswered = _unanswered(state, trial)
    unanswered.discard(steps)
    state.stats.answers += 1
    trial.answered[steps] = state.stats.answers  # the order answers came in (tuners replay it)
    touched.add(("stats",))
    if trial.status == "pending" and not unanswered:
        trial.status = "done"  # every step asked is answered (an earlier one may come last)


def _trial_cancelled(state: State, ev: TrialCancelled, touched: set[Key]) -> None:
    trial = state.trials.get(ev.trial_id)
    if trial is None:
        raise Rejected(f"unknown trial {ev.trial_id!r}")
    plan = state.plans[trial.plan_key]
    for steps, node_id in trial.requests.items():
        node = plan.nodes[node_id]
        waiters = node.requests.get(steps)
        if waiters and trial.trial_id in waiters:
            waiters.remove(trial.trial_id)
            if not waiters:
                del node.requests[steps]
            touched.add(node_key(node))
    if trial.status == "pending":
        trial.status = "cancelled"
    touched.add(("trial", trial.trial_id))


# ----------------------------------------------------------------------------- dispatch


def _dispatched(state: State, ev: StageDispatched, touched: set[Key]) -> None:
    if ev.dispatch_id in state.dispatches:
        raise Rejected(f"dispatch {ev.dispatch_id!r} exists already")
    worker = state.workers.get(ev.worker_id)
    if worker is None or not worker.alive:
        raise Rejected(f"worker {ev.worker_id!r} is not alive")
    if worker.dispatch_id is not None:
        raise Rejected(f"worker {ev.worker_id!r} is busy with {worker.dispatch_id!r}")
    plan = state.plans.get(ev.plan_key)
    if plan is None:
        raise Rejected(f"unknown plan {ev.plan_key!r}")
    for spec in ev.stages:
        if spec.node_id not in plan.nodes:
            raise Rejected(f"unknown node {spec.node_id!r} in plan {ev.plan_key!r}")
    stages = [(s.node_id, s.from_step, s.to_step) for s in ev.stages]
    for node_id, a, b in stages:
        node = plan.nodes[node_id]
        node.running.append((ev.dispatch_id, a, b))
        touched.add(node_key(node))
    state.dispatches[ev.dispatch_id] = Dispatch(ev.dispatch_id, ev.worker_id, ev.plan_key, stages,
                                                source=ev.source.ref if ev.source is not None else None)
    worker.dispatch_id = ev.dispatch_id
    state.stats.dispatches += 1
    touched |= {("dispatch", ev.dispatch_id), ("worker", worker.worker_id), ("stats",)}


def _stage_started(state: State, ev: StageStarted, touched: set[Key]) -> None:
    if ev.dispatch_id not in state.dispatches:
        raise Rejected(f"unknown dispatch {ev.dispatch_id!r}")


def _keep(state: State, node: Node, step: int, ckpt: Checkpoint, touched: set[Key]) -> None:
    """``node`` keeps ``ckpt`` at ``step`` (replacing what it had there); object references and
    the bytes kept follow."""
    old = node.ckpt.get(step)
    if old is not None and old.ref == ckpt.ref:
        return
    obj = state.objects.get(ckpt.ref)
    if obj is None:
        obj = state.objects[ckpt.ref] = StoredObject(ckpt.size)
    obj.references += 1
    if obj.references == 1:
        state.stats.checkpoint_bytes += obj.size
        state.stats.peak_checkpoint_bytes = max(state.stats.peak_checkpoint_bytes, state.stats.checkpoint_bytes)
    node.ckpt[step] = ckpt
    touched |= {node_key(node), ("object", ckpt.ref), ("stats",)}
    if old is not None:
        _release_object(state, old.ref, touched)


def _drop(state: State, node: Node, step: int, touched: set[Key]) -> None:
    """``node`` no longer keeps a checkpoint at ``step``."""
    old = node.ckpt.pop(step)
    touched.add(node_key(node))
    _release_object(state, old.ref, touched)


def _release_object(state: State, ref: str, touched: set[Key]) -> None:
    obj = state.objects.get(ref)
    if obj is None:  # a projection written before objects were counted
        return
    obj.references -= 1
    if obj.references == 0:
        state.stats.checkpoint_bytes -= obj.size
    touched |= {("object", ref), ("stats",)}


def _checkpoint_saved(state: State, ev: CheckpointSaved, touched: set[Key]) -> None:
    node = state.node(ev.plan_key, ev.node_id)
    if node is None:
        raise Rejected(f"unknown node {ev.node_id!r} in plan {ev.plan_key!r}")
    if ev.step < node.start_step:
        raise Rejected(f"checkpoint step {ev.step} is before node start {node.start_step}")
    _keep(state, node, ev.step, Checkpoint(ev.ref, ev.size), touched)


def _checkpoint_evicted(state: State, ev: CheckpointEvicted, touched: set[Key]) -> None:
    node = state.node(ev.plan_key, ev.node_id)
    if node is None:
        raise Rejected(f"unknown node {ev.node_id!r} in plan {ev.plan_key!r}")
    kept = node.ckpt.get(ev.step)
    if kept is None or kept.ref != ev.ref:
        raise Rejected(f"node {ev.node_id!r} keeps no checkpoint {ev.ref} at step {ev.step}")
    _drop(state, node, ev.step, touched)
    state.stats.evictions += 1


def _metrics_reported(state: State, ev: MetricsReported, touched: set[Key]) -> None:
    node = state.node(ev.plan_key, ev.node_id)
    if node is None:
        raise Rejected(f"unknown node {ev.node_id!r} in plan {ev.plan_key!r}")
    if ev.step in node.metrics:
        return  # first report wins
    node.metrics[ev.step] = dict(ev.metrics)
    for trial_id in node.requests.pop(ev.step, []):
        trial = state.trials[trial_id]
        _deliver(state, trial, ev.step, ev.metrics, touched)
        touched.add(("trial", trial_id))
    touched.add(node_key(node))


def _release(state: State, dispatch: Dispatch, touched: set[Key], status: str) -> None:
    """End ``dispatch``: drop its remaining running ranges and free its worker."""
    plan = state.plans[dispatch.plan_key]
    for node_id, _, _ in dispatch.stages:
        node = plan.nodes[node_id]
        kept = [r for r in node.running if r[0] != dispatch.dispatch_id]
        if kept != node.running:
            node.running = kept
            touched.add(node_key(node))
    dispatch.status = status
    worker = state.workers.get(dispatch.worker_id)
    if worker is not None and worker.dispatch_id == dispatch.dispatch_id:
        worker.dispatch_id = None
        touched.add(("worker", worker.worker_id))
    if worker is not None and dispatch.dispatch_id in worker.writing:
        worker.writing.remove(dispatch.dispatch_id)
        touched.add(("worker", worker.worker_id))
    touched.add(("dispatch", dispatch.dispatch_id))


def _release_worker(state: State, worker: Worker, touched: set[Key]) -> None:
    """Release every running dispatch of ``worker`` (it was lost, or joined again): the path it
    was training and the paths whose ends it was still writing."""
    for dispatch_id in [*([worker.dispatch_id] if worker.dispatch_id is not None else []), *worker.writing]:
        dispatch = state.dispatches[dispatch_id]
        if dispatch.status == "running":
            _release(state, dispatch, touched, "lost")


def _dispatched_stage(state: State, ev: StageFinished | StageFailed | StageStopped) -> Dispatch:
    """The dispatch that ``ev``'s stage belongs to. Raises Rejected when there is none."""
    dispatch = state.dispatches.get(ev.dispatch_id)
    if dispatch is None:
        raise Rejected(f"unknown dispatch {ev.dispatch_id!r}")
    stage = (ev.node_id, ev.from_step, ev.to_step)
    if stage not in dispatch.stages:
        raise Rejected(f"stage {stage} is not part of dispatch {ev.dispatch_id!r}")
    return dispatch


def _stage_finished(state: State, ev: StageFinished, touched: set[Key]) -> None:
    dispatch = _dispatched_stage(state, ev)
    plan = state.plans[dispatch.plan_key]
    node = plan.nodes[ev.node_id]
    steps = ev.to_step - ev.from_step
    state.stats.executed_steps += steps
    state.stats.worker_seconds += ev.seconds
    state.stats.stages_finished += 1
    plan.executed_steps += steps
    plan.worker_seconds += ev.seconds
    touched |= {("stats",), ("plan", plan.plan_key)}
    if steps:
        node.profile_steps += steps
        node.profile_seconds += ev.train_seconds
        plan.profile_revision += 1
    entry = (ev.dispatch_id, ev.from_step, ev.to_step)
    if entry in node.running:
        node.running.remove(entry)
    touched.add(node_key(node))
    if dispatch.status == "running":
        dispatch.finished += 1
        touched.add(("dispatch", dispatch.dispatch_id))
        if dispatch.finished == len(dispatch.stages):
            _release(state, dispatch, touched, "done")


def _stage_stopped(state: State, ev: StageStopped, touched: set[Key]) -> None:
    """A preempted path ended inside (or at the start of) a stage: account what it trained and
    free the worker; the rest of the dispatch is dropped."""
    dispatch = _dispatched_stage(state, ev)
    if not ev.from_step <= ev.step <= ev.to_step:
        raise Rejected(f"step {ev.step} is outside the stage [{ev.from_step}, {ev.to_step}]")
    plan = state.plans[dispatch.plan_key]
    node = plan.nodes[ev.node_id]
    steps = ev.step - ev.from_step
    state.stats.executed_steps += steps
    state.stats.worker_seconds += ev.seconds
    plan.executed_steps += steps
    plan.worker_seconds += ev.seconds
    if steps:
        node.profile_steps += steps
        node.profile_seconds += ev.train_seconds
        plan.profile_revision += 1
    touched |= {("stats",), ("plan", plan.plan_key), node_key(node)}
    if dispatch.status == "running":
        _release(state, dispatch, touched, "preempted")


def _path_trained(state: State, ev: PathTrained, touched: set[Key]) -> None:
    """The worker trained the dispatch's last stage: it is free, while the dispatch runs on until
    its end batches (verified checkpoints, StageFinished) come (see :class:`PathTrained`)."""
    dispatch = state.dispatches.get(ev.dispatch_id)
    if dispatch is None or dispatch.status != "running":
        raise Rejected(f"dispatch {ev.dispatch_id!r} is not running")
    if dispatch.worker_id != ev.worker_id or dispatch.plan_key != ev.plan_key:
        raise Rejected(f"dispatch {ev.dispatch_id!r} is worker {dispatch.worker_id!r}'s, of plan "
                       f"{dispatch.plan_key!r}, not worker {ev.worker_id!r}'s of plan {ev.plan_key!r}")
    worker = state.workers[ev.worker_id]
    if worker.dispatch_id != ev.dispatch_id:
        raise Rejected(f"worker {ev.worker_id!r} is not training dispatch {ev.dispatch_id!r}")
    worker.dispatch_id = None
    worker.writing.append(ev.dispatch_id)
    touched.add(("worker", worker.worker_id))


def _running_dispatch(state: State, ev: PathPreempted | CheckpointRequested) -> Dispatch:
    dispatch = state.dispatches.get(ev.dispatch_id)
    if dispatch is None or dispatch.status != "running":
        raise Rejected(f"dispatch {ev.dispatch_id!r} is not running")
    return dispatch


def _path_preempted(state: State, ev: PathPreempted, touched: set[Key]) -> None:
    dispatch = _running_dispatch(state, ev)
    if ev.until_stage is not None and (ev.until_stage >= len(dispatch.stages) or ev.until_step is None):
        raise Rejected(f"`until_stage` {ev.until_stage} with `until_step` {ev.until_step} is not in "
                       f"dispatch {ev.dispatch_id!r}")
    dispatch.until = (ev.until_stage, ev.until_step) if ev.until_stage is not None and ev.until_step is not None \
        else (-1, -1)
    touched.add(("dispatch", dispatch.dispatch_id))


def _checkpoint_requested(state: State, ev: CheckpointRequested, touched: set[Key]) -> None:
    dispatch = _running_dispatch(state, ev)
    if not any(n == ev.node_id and a < ev.step < b for n, a, b in dispatch.stages):
        raise Rejected(f"step {ev.step} of node {ev.node_id!r} is inside no stage of dispatch {ev.dispatch_id!r}")
    dispatch.requested.append((ev.node_id, ev.step, ev.evaluate))
    touched.add(("dispatch", dispatch.dispatch_id))


def _stage_failed(state: State, ev: StageFailed, touched: set[Key]) -> None:
    dispatch = _dispatched_stage(state, ev)
    stage = (ev.node_id, ev.from_step, ev.to_step)
    plan = state.plans[dispatch.plan_key]
    if ev.kind == "error":
        # The trainer raised: the trials waiting at the ends of the unfinished stages fail.
        for node_id, _, to_step in dispatch.stages[dispatch.stages.index(stage):]:
            node = plan.nodes[node_id]
            for trial_id in node.requests.pop(to_step, []):
                trial = state.trials[trial_id]
                trial.status, trial.error = "failed", ev.error
                touched.add(("trial", trial_id))
            touched.add(node_key(node))
    elif ev.kind == "storage":
        pass  # the store failed, not the trial: the path is simply handed back (released below)
    else:
        # The source checkpoint is corrupt or gone: forget it, so the scheduler recomputes it.
        for node in plan.nodes.values():
            for s in [s for s, c in node.ckpt.items() if c.ref == ev.ref]:
                _drop(state, node, s, touched)
    if dispatch.status == "running":
        _release(state, dispatch, touched, "failed")


def _worker_joined(state: State, ev: WorkerJoined, touched: set[Key]) -> None:
    old = state.workers.get(ev.worker_id)
    if old is not None:
        _release_worker(state, old, touched)
    state.workers[ev.worker_id] = Worker(ev.worker_id, ev.device)
    touched.add(("worker", ev.worker_id))


def _worker_lost(state: State, ev: WorkerLost, touched: set[Key]) -> None:
    worker = state.workers.get(ev.worker_id)
    if worker is None:
        raise Rejected(f"unknown worker {ev.worker_id!r}")
    _release_worker(state, worker, touched)
    worker.alive = False
    touched.add(("worker", worker.worker_id))


# ----------------------------------------------------------------------------- tuner decisions


def _tuner_decided(state: State, ev: TunerDecided, offset: int, touched: set[Key]) -> None:
    """Record the decision under every trial it names (``events.decisions``), with its offset.

    The trial need not exist yet: a decision is appended before the requests it causes (a
    configuration is drawn before it is submitted). Whether it is what the tuner computes from
    the prefix ``decided_at`` is ``replay verify --study``'s business, not the fold's.
    """
    if ev.decided_at >= offset:
        raise Rejected(f"decided at offset {ev.decided_at}, which is not before the decision's own offset {offset}")
    payload = ev.decision.model_dump(mode="json")
    for trial_id, role in ev.decision.trials().items():
        state.decided.setdefault(trial_id, []).append(
            Decided(offset, ev.study_id, ev.tuner, ev.decided_at, role, payload))
        touched.add(("decided", trial_id))


def _log_sealed(state: State, ev: LogSealed, touched: set[Key]) -> None:
    """Seals are checked by ``replay verify``; they change no projected state."""


def _dead_lettered(state: State, ev: DeadLettered, touched: set[Key]) -> None:
    raise Rejected("DeadLettered events belong on the dead-letter stream")


_HANDLERS = {
    StudyStarted: _study_started,
    StudyFinished: _study_finished,
    TrialSubmitted: _trial_submitted,
    TrialCancelled: _trial_cancelled,
    StageDispatched: _dispatched,
    StageStarted: _stage_started,
    CheckpointSaved: _checkpoint_saved,
    MetricsReported: _metrics_reported,
    StageFinished: _stage_finished,
    StageFailed: _stage_failed,
    WorkerJoined: _worker_joined,
    WorkerLost: _worker_lost,
    DeadLettered: _dead_lettered,
    LogSealed: _log_sealed,
    StageStopped: _stage_stopped,
    PathTrained: _path_trained,
    PathPreempted: _path_preempted,
    CheckpointRequested: _checkpoint_requested,
    CheckpointEvicted: _checkpoint_evicted,
    TunerDecided: _tuner_decided,  # takes the offset too: see apply()
}
