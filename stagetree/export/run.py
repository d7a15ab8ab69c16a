"""What the experiment-tracker exports read from a run: per trial its hyper-parameters, its
metrics by step, and the stages it shares with other trials.

``read_run`` does the I/O (a run directory, JSONL export or ``kafka://`` source, folded as
``replay verify`` folds it); everything else is a pure query over the projected
:class:`~projections.state.State` on :mod:`projections.queries` (paths, sharing), importing only
``events`` and ``projections``.

A trial's *path* is the chain of search-plan segments it trains through (Hippo §3.2,
:func:`projections.queries.trial_path`), here root first. Its metrics by step
are every evaluation on that path at steps ``start..end`` of each segment, so in a merged run a
trial also shows the evaluations other trials asked for on the prefix they share with it (the
same model state, by DESIGN.md invariant 1); its final metrics are those of ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from events import topics
from events.codec import InvalidEvent, decode
from events.hp import config_to_json, hp_from_json
from events.log import Record
from events.models import MetricsReported, StudyStarted, TrialSubmitted
from events.settings import describe
from projections import queries
from projections.queries import Segment
from projections.state import State, Trial
from projections.summary import last_started


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
    final: Mapping[str, float | None] | None
    path: list[Segment]
    shared: list[SharedStage]
    times: dict[int, float] = field(default_factory=dict)
    submitted: float | None = None
    error: str | None = None
    """Why a failed trial failed (the trainer's exception, as the summary gives it); else None."""

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
    tuner: str | None = None
    """The tuner the study recorded, in one line (:func:`events.settings.describe`);
    None when its StudyStarted recorded no settings."""
    anchor: str | None = None
    """The anchor of the source's plan stream when it was read (:mod:`replay.anchor`); None for
    a deployment's topics and for a view made from a state alone."""


class RunReadError(ValueError):
    """The run cannot be read, or holds no such study (the message names them)."""


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


def shared_stages(state: State, trial: Trial) -> list[SharedStage]:
    """The parts of the trial's path other trials of its plan (of any study) train too
    (:func:`projections.queries.sharing`), per node split where the set of those trials
    changes, by start step."""
    by_node: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for other, segments in queries.sharing(state, trial).items():
        for s in segments:
            by_node[s.node_id].append((s.start, s.end, other))
    out: list[SharedStage] = []
    for node_id, spans in by_node.items():
        cuts = sorted({x for a, b, _ in spans for x in (a, b)})
        for lo, hi in zip(cuts, cuts[1:]):
            others = tuple(sorted(t for a, b, t in spans if a <= lo and hi <= b))
            if not others:
                continue
            last = out[-1] if out else None
            if last is not None and last.node_id == node_id and last.to_step == lo and last.trials == others:
                out[-1] = SharedStage(node_id, last.from_step, hi, others)
            else:
                out.append(SharedStage(node_id, lo, hi, others))
    return sorted(out, key=lambda s: (s.from_step, s.node_id))


def study_view(state: State, study_id: str, *, source: str = "", times: dict[tuple[str, str, int], float] | None = None,
               submitted: dict[str, float] | None = None) -> RunView:
    """The :class:`RunView` of ``study_id`` in ``state``. ``times`` maps ``(plan_key, node_id,
    step)`` to an evaluation's epoch seconds and ``submitted`` trial ids to theirs (both
    optional, from the log).

    Raises:
        RunReadError: ``state`` holds no trial of ``study_id``.
    """
    trials = sorted((t for t in state.trials.values() if t.study_id == study_id), key=lambda t: t.trial_id)
    if not trials:
        known = sorted({t.study_id for t in state.trials.values()})
        raise RunReadError(f"study {study_id!r} has no trials in {source or 'the run'} (studies: {known})")
    study = state.studies.get(study_id, {})
    views = []
    for t in trials:
        path = queries.trial_path(state, t)[::-1]  # root first
        metrics = path_metrics(state, path)
        when: dict[int, float] = {}
        for plan_key, node_id, start, end in path:
            for step in metrics:
                if start <= step <= end and step not in when and times and (plan_key, node_id, step) in times:
                    when[step] = times[(plan_key, node_id, step)]
        views.append(TrialView(t.trial_id, t.study_id, t.plan_key, t.status, t.steps, config_to_json(t.hp), metrics,
                               t.results.get(t.steps), path, shared_stages(state, t), dict(sorted(when.items())),
                               (submitted or {}).get(t.trial_id), t.error))
    settings = study.get("tuner_settings")
    return RunView(source, study_id, study.get("mode", "merged"), study.get("metric"), study.get("metric_mode"), views,
                   describe(settings) if settings else None)


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
    """Read a run (a run directory, a JSONL export or ``kafka://HOST:PORT[/PREFIX]``) and return
    the view of ``study`` (default: the study of its ``summary.json``, else the last one started).

    Raises:
        RunReadError: the source cannot be read, or names no such study.
    """
    from replay.anchor import source_anchor
    from replay.audit import AuditError, fold, open_source

    try:
        opened = open_source(source)
    except AuditError as exc:
        raise RunReadError(str(exc)) from None
    records: Iterable[Record] = opened.streams.get(topics.PLAN, [])
    state = fold(records)
    times: dict[tuple[str, str, int], float] = {}
    submitted: dict[str, float] = {}
    started: list[StudyStarted] = []
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
            started.append(event)
    if study is None:
        summary = Path(str(source)) / "summary.json"
        if summary.is_file():
            try:
                study = orjson.loads(summary.read_bytes()).get("name")
            except (orjson.JSONDecodeError, AttributeError):
                raise RunReadError(f"{str(summary)!r} is not a JSON object") from None
        study = study or last_started(started)
    if study is None:
        raise RunReadError(f"{str(source)!r} holds no study")
    anchor = source_anchor(opened)
    view = study_view(state, study, source=str(source), times=times, submitted=submitted)
    return dataclasses.replace(view, anchor=None if anchor is None else str(anchor))
