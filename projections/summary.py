"""The result of a run: ``summary.json``, computed from the projection and the log.

Several studies may share one log (a later ``stagetree run`` in the same run directory) and,
when their plan keys are equal, one search plan (Hippo §7, thesis §4.2.2): a later study's
trials are answered from the metrics and checkpoints earlier studies left. The summary of a
study counts its own trials; the keys about sharing (``studies_sharing_plan``,
``k_wise_merge_rate``, ``steps_from_earlier_studies``, ``executed_steps_since_start``) say how
much the other studies on its plan gave it.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from events import topics
from events.codec import InvalidEvent, decode
from events.hp import config_to_json
from events.log import EventLog
from events.models import (
    COORDINATOR_RESTARTED,
    Event,
    StageFinished,
    StageStopped,
    StudyFinished,
    StudyStarted,
    WorkerLost,
    base_plan_key,
)
from projections.queries import study_needs
from projections.search_plan import merged_unique_steps
from projections.state import State, Trial

_FILE_SAFE = re.compile(r"[A-Za-z0-9._-]+")


FILE_SAFE_LIMIT = 100
"""Characters of a name kept in its file name (a file name holds 255 bytes at most)."""


def file_safe(name: str) -> str:
    """``name`` as one file name: itself when it is one (A-Z a-z 0-9 . _ -, not ``.`` or
    ``..``, at most :data:`FILE_SAFE_LIMIT` characters), else its first 100 characters
    ``_``-separated plus 8 hex characters of its sha256, so two names never share one and none
    leaves its directory (``../x`` is ``x-<hash>``)."""
    if _FILE_SAFE.fullmatch(name) and name not in (".", "..") and len(name) <= FILE_SAFE_LIMIT:
        return name
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name[:FILE_SAFE_LIMIT]).strip("._") or "study"
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def summary_path(run_dir: Path, study_id: str) -> Path:
    """Where a study's summary lives in a run directory: ``summary-<study>.json``, one per study
    (the study's id made one file name by :func:`file_safe`)."""
    return run_dir / f"summary-{file_safe(study_id)}.json"


def elapsed(events: Iterable[Event], study_id: str) -> float:
    """Wall seconds of the incarnations of ``study_id`` in ``events`` (log order, ``ts`` in
    epoch seconds): each StudyStarted of the study runs to its StudyFinished. An incarnation
    without one (a killed run) ends at the last event before its process's successor began (a
    :data:`~events.models.COORDINATOR_RESTARTED` WorkerLost: embedded mode, where the run's
    workers trained up to then), else at the study's own last event (its tuner's decisions and
    requests) before its next StudyStarted or the end of the log: on a deployment, studies run
    side by side, and another study's start or work says nothing of this one's. Other studies
    run later on the same log, and the time between a killed run and its resumption, therefore
    do not count."""
    total, start, last_any, last_own = 0.0, None, None, None

    def close(end: float | None) -> None:
        nonlocal total, start
        if start is not None and end is not None:
            total += max(0.0, end - start)
        start = None

    for event in events:
        own = getattr(event, "study_id", None) == study_id
        if isinstance(event, WorkerLost) and event.reason == COORDINATOR_RESTARTED:
            close(last_any)
        elif own and isinstance(event, StudyStarted):
            close(last_own)
            start = event.ts
        if event.ts:
            last_any = event.ts
            if own:
                last_own = event.ts
        if own and isinstance(event, StudyFinished):
            close(event.ts)
    close(last_own)
    return total


def last_started(events: Iterable[Event]) -> str | None:
    """The id of the study started last among ``events`` (by its StudyStarted's ``ts``; equal
    times by their order here), or None. Not the last StudyStarted read: a Kafka plan topic's
    partitions are read one after another."""
    started = [(e.ts, i, e.study_id) for i, e in enumerate(events) if isinstance(e, StudyStarted)]
    return max(started)[2] if started else None


def plan_events(log: EventLog) -> Iterator[Event]:
    """The decoded events of the plan stream of ``log``, in offset order (undecodable records,
    the audit's business, skipped). A partitioned stream's partitions are interleaved by the
    events' timestamps, each partition kept in its own order (one plan is in one partition, so
    what happened to one plan keeps its order)."""

    def decoded(partition: int) -> Iterator[Event]:
        for record in log.read(topics.PLAN, partition=partition):
            try:
                yield decode(record.value)
            except InvalidEvent:
                continue

    yield from heapq.merge(*(decoded(p) for p in range(log.partition_count(topics.PLAN))), key=lambda e: e.ts)


def elapsed_before(log: EventLog, study_id: str) -> float:
    """:func:`elapsed` over the plan stream of ``log`` (seconds)."""
    return elapsed(plan_events(log), study_id)


def studies_sharing_plan(state: State, study_id: str) -> list[str]:
    """Sorted ids of the studies with a trial on ``study_id``'s plan key(s), ``study_id``
    included (Hippo §7: studies of one model, data and seed share a search plan). Trial-mode
    keys compare by their base key, so a ``--no-merge`` study is listed although it shares no
    step."""
    bases = _bases(state, study_id)
    return sorted({t.study_id for t in state.trials.values() if base_plan_key(t.plan_key) in bases} | {study_id})


def k_wise_merge_rate(state: State, study_ids: Iterable[str]) -> float | None:
    """The k-wise merge rate (q in Hippo §8.2, m_k in the thesis): total steps of the K studies'
    trials (each at its maximum steps, as ``total_steps``) / unique steps of the union of all
    their prefixes, merged per base plan key (steps / steps). None when they have no trials."""
    total, unique = union_steps(state, study_ids)
    return total / unique if unique else None


def union_steps(state: State, study_ids: Iterable[str]) -> tuple[int, int]:
    """``(total, unique)`` steps of the studies' trials: the sum of their steps, and the steps of
    the union of their prefixes merged per base plan key (studies on different plans, another
    trainer or seed, share nothing), the same whatever mode they ran in. Raises ValueError
    for a single string instead of a collection."""
    if isinstance(study_ids, (str, bytes)):
        raise ValueError(f"`study_ids` is {study_ids!r}, but must be a collection of study ids, not one string")
    ids = set(study_ids)
    groups: dict[str, list[Trial]] = defaultdict(list)
    for trial in state.trials.values():
        if trial.study_id in ids:
            groups[base_plan_key(trial.plan_key)].append(trial)
    total = sum(t.steps for trials in groups.values() for t in trials)
    unique = sum(merged_unique_steps([(t.hp, t.steps) for t in trials]) for trials in groups.values())
    return total, unique


def _covered(ranges: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of ``[lo, hi)`` covered by the union of ``ranges`` (steps)."""
    covered, reach = 0, lo
    for a, b in sorted(ranges):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            covered += b - a
            reach = b
    return covered


def sharing_steps(state: State, events: Iterable[Event], study_id: str) -> tuple[int, int]:
    """``(steps_from_earlier_studies, executed_steps_since_start)`` of ``study_id`` (steps).

    ``events`` is the plan stream in log order. The study's first StudyStarted splits it: the
    StageFinished events before it on the study's plans give, per node, the step ranges already
    trained (nodes are never split, so a node's step s is the same prefix for every trial through
    it); ``steps_from_earlier_studies`` is how many steps of :func:`projections.queries.study_needs` they cover (a
    union, so a range trained twice counts once). ``executed_steps_since_start`` sums
    ``to_step - from_step`` of the StageFinished events on the study's plans after it (retrained
    steps count again). Without a StudyStarted of the study, nothing is earlier: (0, all).
    """
    earlier, since, _ = _since_start(state, events, study_id)
    return earlier, since


def _since_start(state: State, events: Iterable[Event], study_id: str) -> tuple[int, int, float]:
    """:func:`sharing_steps` and, in the same pass over ``events``, the worker-seconds held by
    stages on the study's plans while it ran (seconds): the ``seconds`` of their StageFinished
    and StageStopped events from a StudyStarted of the study to its next StudyFinished (a
    resumed study: each of its runs). Without a StudyStarted of the study: all of them."""
    keys = {t.plan_key for t in state.trials.values() if t.study_id == study_id}
    trained: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    started, running, since, held, every = False, False, 0, 0.0, 0.0
    for event in events:
        if isinstance(event, StudyStarted) and event.study_id == study_id:
            started = running = True
        elif isinstance(event, StudyFinished) and event.study_id == study_id:
            running = False
        elif isinstance(event, (StageFinished, StageStopped)) and event.plan_key in keys:
            every += event.seconds
            held += event.seconds if running else 0.0
            if not isinstance(event, StageFinished):
                continue
            if started:
                since += event.to_step - event.from_step
            else:
                trained[(event.plan_key, event.node_id)].append((event.from_step, event.to_step))
    if not started:
        return 0, sum(b - a for ranges in trained.values() for a, b in ranges), every  # all of it is "since"
    earlier = sum(_covered(trained.get(key, []), lo, hi) for key, (lo, hi) in study_needs(state, study_id).items())
    return earlier, since, held


def _bases(state: State, study_id: str) -> set[str]:
    bases = {base_plan_key(t.plan_key) for t in state.trials.values() if t.study_id == study_id}
    started = state.studies.get(study_id, {}).get("plan_key")
    if started:
        bases.add(base_plan_key(started))
    return bases


def build_summary(state: State, study_id: str, *, mode: str, workers: int, best_trial: str | None,
                  best_metric: float | None, end_to_end_seconds: float,
                  events: Iterable[Event] | None = None, best_step: int | None = None) -> dict[str, Any]:
    """The ``summary.json`` document of a study (keys as in the README).

    ``best_metric`` is the tuner's metric of ``best_trial`` at ``best_step`` (steps), the step of
    the evaluation the tuner chose (StudyFinished): a trial's ``metrics`` are those at its final
    step, which may be a later one (MLtunerTuner answers with the best evaluation along its main
    line). ``best_step`` is None when there is no answer or the log predates the field.

    ``total_steps`` sums each trial's maximum steps asked; ``unique_steps`` counts the steps of
    the union of the trials' prefixes as if merged (so p is the same in both modes);
    ``executed_steps`` counts the steps workers actually trained in finished stages;
    ``merge_rate`` = total / unique (Hippo §6.2); ``worker_seconds`` sums the time each worker
    was held by a stage (the papers' GPU-hours, in seconds); ``idle_worker_seconds`` =
    max(0, workers x end_to_end_seconds - the worker-seconds stages held on the study's plans
    while it ran) is the worker time no stage held while the study ran: waiting for a dispatch,
    a tail with fewer ready stages than workers, and, with a causal-order tuner
    (``causal=True``), the time finished results waited for causally earlier ones (NASPipe's
    bubble). Executed steps and worker-seconds count the study's own plans, so studies on other
    plans of the same log do not mix in; but a plan shared with other studies (Hippo §7) counts
    every study's steps and seconds on it. Idle worker-seconds do not: they subtract only the
    seconds held from the study's StudyStarted to its StudyFinished (those of studies running
    beside it included, not an earlier or later study's), which need the plan stream
    ``events``; without it, the plans' worker-seconds.

    Checkpoints (of the whole run directory or deployment, every study's): ``checkpoint_bytes``
    the bytes of the checkpoint objects kept at the end, ``peak_checkpoint_bytes`` the most ever
    kept at once, ``checkpoints_evicted`` how many a checkpoint budget evicted.

    Sharing between studies (thesis §4.2.2): ``studies_sharing_plan`` lists the studies with
    trials on the study's plan key (itself included, see :func:`studies_sharing_plan`);
    ``k_wise_merge_rate`` is q of those K studies (Hippo §8.2, :func:`k_wise_merge_rate`; with
    K = 1 it equals ``merge_rate``); ``steps_from_earlier_studies`` counts the study's unique
    steps already trained before its first StudyStarted, and ``executed_steps_since_start`` the
    steps trained on its plans after it (:func:`sharing_steps`). Those two need the plan stream
    ``events`` in log order; without it they are None.
    """
    study = state.studies.get(study_id, {})
    trials = sorted((t for t in state.trials.values() if t.study_id == study_id), key=lambda t: t.trial_id)
    total = sum(t.steps for t in trials)
    plan_keys = {t.plan_key for t in trials}
    plans = [state.plans[k] for k in sorted(plan_keys)]
    unique = merged_unique_steps([(t.hp, t.steps) for t in trials]) if trials else 0
    sharing = studies_sharing_plan(state, study_id)
    worker_seconds = sum(p.worker_seconds for p in plans)
    earlier, since, held = (_since_start(state, events, study_id) if events is not None
                            else (None, None, worker_seconds))
    return {
        "name": study.get("name", study_id),
        "mode": mode,
        "workers": workers,
        "trials": [
            {
                "trial_id": t.trial_id,
                "hp": config_to_json(t.hp),
                "steps": t.steps,
                "metrics": t.results.get(t.steps),
                "status": t.status,
                **({"error": t.error} if t.status == "failed" else {}),
            }
            for t in trials
        ],
        "best_trial": best_trial,
        "best_metric": best_metric,
        "best_step": best_step,
        "total_steps": total,
        "unique_steps": unique,
        "executed_steps": sum(p.executed_steps for p in plans),
        "merge_rate": total / unique if unique else None,
        "worker_seconds": worker_seconds,
        "end_to_end_seconds": end_to_end_seconds,
        "idle_worker_seconds": max(0.0, workers * end_to_end_seconds - held),
        "checkpoint_bytes": state.stats.checkpoint_bytes,
        "peak_checkpoint_bytes": state.stats.peak_checkpoint_bytes,
        "checkpoints_evicted": state.stats.evictions,
        "studies_sharing_plan": sharing,
        # One study alone: its trials are the K = 1 union, merged as for ``merge_rate`` (merging
        # the same trials again costs as much as the whole summary).
        "k_wise_merge_rate": (total / unique if unique else None) if sharing == [study_id]
        else k_wise_merge_rate(state, sharing),
        "steps_from_earlier_studies": earlier,
        "executed_steps_since_start": since,
    }


def trial_based_estimate(state: State, study_id: str, summary: dict[str, Any]) -> dict[str, Any]:
    """What the study's results so far would have cost trial-based (``--no-merge``), estimated
    from the merged run, and the worker-seconds merging saved.

    ``delivered_steps``: the steps a trial-based run trains to give the same results, each
    trial trained alone up to the largest step it has metrics for (steps); at the end of a
    study it equals ``total_steps`` for the trials that finished.
    ``trial_based_worker_seconds`` = delivered_steps x worker_seconds / executed_steps: the
    run's own held seconds per trained step (training, checkpoints, evaluation), applied to
    every delivered step; ``saved_worker_seconds`` = that - what the study cost at the same
    rate: its plans' worker_seconds, or, on a plan other studies share, the steps trained on it
    since the study started (``executed_steps_since_start``; the work of studies running beside
    it included) x that rate, so the steps an earlier study had trained count as saved. Both are
    None before any stage finished. An estimate: ``benchmarks/merge_savings.py`` measures both
    runs.
    """
    delivered = sum(max(t.results, default=0) for t in state.trials.values() if t.study_id == study_id)
    executed, held = summary.get("executed_steps") or 0, summary.get("worker_seconds") or 0.0
    if not executed:
        return {"delivered_steps": delivered, "trial_based_worker_seconds": None, "saved_worker_seconds": None}
    rate = held / executed
    since = summary.get("executed_steps_since_start")
    shared = len(summary.get("studies_sharing_plan") or []) > 1 and since is not None
    cost = since * rate if shared else held
    return {"delivered_steps": delivered, "trial_based_worker_seconds": delivered * rate,
            "saved_worker_seconds": delivered * rate - cost}
