"""What the experiment-tracker exports read from a run: per trial its hyper-parameters, its
metrics by step, and the stages it shares with other trials.

``read_run`` does the I/O (a run directory, JSONL export or ``kafka://`` source, folded as
``replay verify`` folds it); everything below it is a pure query over the projected
:class:`~projections.state.State` (it imports only ``events`` and ``projections``), so it can move
under ``projections/`` with the other read-side queries.

A trial's *path* is the chain of search-plan segments it trains through (Hippo §3.2): node
``n`` over ``[start, end)``, from the root to the node of its last request. Its metrics by step
are every evaluation on that path at steps ``start..end`` of each segment, so in a merged run a
trial also shows the evaluations other trials asked for on the prefix they share with it (the
same model state, by DESIGN.md invariant 1); its final metrics are those of ``summary.json``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from events import topics
from events.codec import InvalidEvent, decode
from events.hp import config_to_json, hp_from_json
from events.models import MetricsReported, StudyStarted, TrialSubmitted
from projections.state import State, Trial

Segment = tuple[str, str, int, int]
"""``(plan_key, node_id, start, end)``: a trial trains node ``node_id`` over steps [start, end)."""


@dataclass(frozen=True)
class SharedStage:
    """Steps ``[from_step, to_step)`` of node ``node_id`` that a trial shares with ``trials``
    (the other trials whose paths train them too)."""

    node_id: str
    from_step: int
    to_step: int
    trials: tuple[str, ...]


@dataclass
class TrialView:
    """One trial, as the exports show it.

    ``hp``: the hyper-parameter sequences as JSON (``config_to_json``); ``metrics``: step ->
    ``{name: value}`` (steps ascending; a value is None where the trainer reported a non-finite
    number); ``final``: the metrics at ``steps`` (``summary.json``'s); ``path``: the segments it
    trains through, root first; ``shared``: the stages of its path other trials train too;
    ``times``: step -> epoch seconds of the evaluation (informational, from the log);
    ``submitted``: epoch seconds of its first submission.
    """

    trial_id: str
    study_id: str
    plan_key: str
    status: str
    steps: int
    hp: dict[str, Any]
    metrics: dict[int, dict[str, float | None]]
    final: dict[str, float | None] | None
    path: list[Segment]
    shared: list[SharedStage]
    times: dict[int, float] = field(default_factory=dict)
    submitted: float | None = None

    @property
    def shared_steps(self) -> int:
        """Steps of the trial's path some other trial trains too (steps)."""
        return sum(s.to_step - s.from_step for s in self.shared)


@dataclass
class RunView:
    """A study of a run: its trials by id, the metric it optimizes and where it came from."""

    source: str
    study_id: str
    mode: str
    metric: str | None
    metric_mode: str | None
    trials: list[TrialView]


class RunReadError(ValueError):
    """The run cannot be read, or holds no such study (the message names them)."""


def trial_path(state: State, trial: Trial) -> list[Segment]:
    """The segments ``(plan_key, node_id, start, end)`` a trial trains through, from
    its terminal node ``trial.requests[trial.steps]`` (else its largest request) up to the root;
    each node covers [node.start_step, end), end being the child's start (or the trial's steps).
    Empty when the trial has no request or its plan is unknown."""
    if not trial.requests:
        return []
    plan = state.plans.get(trial.plan_key)
    if plan is None:
        return []
    terminal = trial.requests.get(trial.steps) or trial.requests[max(trial.requests)]
    out, end, node = [], trial.steps, plan.nodes.get(terminal)
    seen: set[str] = set()
    while node is not None and node.node_id not in seen:
        seen.add(node.node_id)
        out.append((plan.plan_key, node.node_id, node.start_step, end))
        end = node.start_step
        node = plan.nodes.get(node.parent_id) if node.parent_id else None
    return out


def path_metrics(state: State, path: list[Segment]) -> dict[int, dict[str, float | None]]:
    """Every evaluation on ``path``: step -> metrics of the node trained there (steps
    ``start..end`` inclusive of each segment; at a boundary both nodes hold the same state)."""
    out: dict[int, dict[str, float | None]] = {}
    for plan_key, node_id, start, end in path:
        node = state.plans[plan_key].nodes[node_id]
        for step, metrics in node.metrics.items():
            if start <= step <= end and step not in out:
                out[step] = dict(sorted(metrics.items()))
    return dict(sorted(out.items()))


def shared_stages(paths: dict[str, list[Segment]]) -> dict[str, list[SharedStage]]:
    """For each trial, the parts of its path other trials train too: per node, the steps where
    two or more trials' segments overlap, split where the set of trials changes."""
    by_node: dict[tuple[str, str], list[tuple[int, int, str]]] = defaultdict(list)
    for trial_id, path in paths.items():
        for plan_key, node_id, start, end in path:
            if end > start:
                by_node[(plan_key, node_id)].append((start, end, trial_id))
    out: dict[str, list[SharedStage]] = {trial_id: [] for trial_id in paths}
    for (_, node_id), segments in sorted(by_node.items()):
        cuts = sorted({s for a, b, _ in segments for s in (a, b)})
        for lo, hi in zip(cuts, cuts[1:]):
            here = tuple(sorted(t for a, b, t in segments if a <= lo and hi <= b))
            for trial_id in here if len(here) > 1 else ():
                stages = out[trial_id]
                others = tuple(t for t in here if t != trial_id)
                if stages and stages[-1].node_id == node_id and stages[-1].to_step == lo and stages[-1].trials == others:
                    stages[-1] = SharedStage(node_id, stages[-1].from_step, hi, others)
                else:
                    stages.append(SharedStage(node_id, lo, hi, others))
    for stages in out.values():
        stages.sort(key=lambda s: (s.from_step, s.node_id))
    return out


def study_view(state: State, study_id: str, *, source: str = "", times: dict[tuple[str, str, int], float] | None = None,
               submitted: dict[str, float] | None = None) -> RunView:
    """The :class:`RunView` of ``study_id`` in ``state``. Sharing is counted among the study's own
    trials. ``times`` maps ``(plan_key, node_id, step)`` to an evaluation's epoch seconds and
    ``submitted`` trial ids to theirs (both optional, from the log).

    Raises:
        RunReadError: ``state`` holds no trial of ``study_id``.
    """
    trials = sorted((t for t in state.trials.values() if t.study_id == study_id), key=lambda t: t.trial_id)
    if not trials:
        known = sorted({t.study_id for t in state.trials.values()})
        raise RunReadError(f"study {study_id!r} has no trials in {source or 'the run'} (studies: {known})")
    study = state.studies.get(study_id, {})
    paths = {t.trial_id: trial_path(state, t)[::-1] for t in trials}  # root first
    shared = shared_stages(paths)
    views = []
    for t in trials:
        path = paths[t.trial_id]
        metrics = path_metrics(state, path)
        when: dict[int, float] = {}
        for plan_key, node_id, start, end in path:
            for step in metrics:
                if start <= step <= end and step not in when and times and (plan_key, node_id, step) in times:
                    when[step] = times[(plan_key, node_id, step)]
        views.append(TrialView(t.trial_id, t.study_id, t.plan_key, t.status, t.steps, config_to_json(t.hp), metrics,
                               t.results.get(t.steps), path, shared[t.trial_id], dict(sorted(when.items())),
                               (submitted or {}).get(t.trial_id)))
    return RunView(source, study_id, study.get("mode", "merged"), study.get("metric"), study.get("metric_mode"), views)


def flat_hp(hp: dict[str, Any]) -> dict[str, str | int | float]:
    """A trial's sequences as flat parameters for a tracker: ``name`` -> the readable sequence
    (``MultiStep(init=0.1, milestones=[20], gamma=0.1)``) and ``name.field[.field...]`` -> each
    number of its JSON (lists as their JSON text), e.g. ``lr.init`` = 0.1, ``lr.then.value``."""
    out: dict[str, str | int | float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif isinstance(value, list):
            out[prefix] = orjson.dumps(value).decode()
        else:
            out[prefix] = value

    for name in sorted(hp):
        out[name] = str(hp_from_json(hp[name]))
        walk(name, hp[name])
    return out


def read_run(source: str | Path, study: str | None = None) -> RunView:
    """Read a run (a run directory, a JSONL export or ``kafka://HOST:PORT[/TOPIC]``) and return
    the view of ``study`` (default: the study of its ``summary.json``, else the last one started).

    Raises:
        RunReadError: the source cannot be read, or names no such study.
    """
    from replay.audit import AuditError, fold, open_source

    try:
        opened = open_source(source)
    except AuditError as exc:
        raise RunReadError(str(exc)) from None
    records = opened.streams.get(topics.PLAN, [])
    state = fold(records)
    times: dict[tuple[str, str, int], float] = {}
    submitted: dict[str, float] = {}
    started: list[str] = []
    for record in records:
        try:
            event = decode(record.value)
        except InvalidEvent:
            continue
        if isinstance(event, MetricsReported):
            times.setdefault((event.plan_key, event.node_id, event.step), event.ts)
        elif isinstance(event, TrialSubmitted):
            submitted.setdefault(event.trial_id, event.ts)
        elif isinstance(event, StudyStarted):
            started.append(event.study_id)
    if study is None:
        summary = Path(str(source)) / "summary.json"
        if summary.is_file():
            try:
                study = orjson.loads(summary.read_bytes()).get("name")
            except (orjson.JSONDecodeError, AttributeError):
                raise RunReadError(f"{str(summary)!r} is not a JSON object") from None
        study = study or (started[-1] if started else None)
    if study is None:
        raise RunReadError(f"{str(source)!r} holds no study")
    return study_view(state, study, source=str(source), times=times, submitted=submitted)
