"""``stagetree export mlflow RUN_DIR [--tracking-uri URI] [--experiment NAME]``: a study as MLflow runs.

One MLflow run per trial (run name = trial id) in the experiment named after the study:

* **params**: the trial's hyper-parameters flattened by :func:`stagetree.export.run.flat_hp`
  (``lr`` = the sequence as text, ``lr.init``, ``lr.milestones``, ... each number);
* **metrics**: every evaluated metric by step (``step`` = the global step; MLflow keeps float64,
  so the values read back exactly; a non-finite value, null in the log, is left out);
* **tags**: ``stagetree.study``, ``stagetree.trial_id``, ``stagetree.plan_key``,
  ``stagetree.mode``, ``stagetree.steps``, ``stagetree.status`` (and a failed trial's
  ``stagetree.error``: why it failed), ``stagetree.source``, the
  trial's path through the search plan (``stagetree.path``: ``n0[0,10) n2[10,20)``), how many of
  its steps other trials train too (``stagetree.shared_steps``), with whom
  (``stagetree.shared_with``) and one tag per shared stage
  (``stagetree.shared.<node>.<from>-<to>`` = the other trials' ids);
* **experiment tags**: ``stagetree.study``, ``stagetree.source``, ``stagetree.tuner`` (the
  tuner the study recorded) and ``stagetree.log_anchor`` (the exported log's anchor, which
  ``stagetree replay verify --anchor`` checks later; set again by each export);
* status FINISHED (done), FAILED (failed), KILLED (cancelled) or RUNNING (pending); start and
  end times from the log's timestamps.

The tracking URI defaults to MLflow's own default (``$MLFLOW_TRACKING_URI``, else the local
SQLite store ``./mlflow.db`` that ``mlflow ui`` opens): MLflow 3 refuses its older ``./mlruns``
file store unless ``MLFLOW_ALLOW_FILE_STORE=true``. Exporting the same study again replaces its
earlier runs (those tagged with the same study and trial ids are deleted first). Needs
``pip install 'stagetree[mlflow]'``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from stagetree.export.run import RunView, TrialView, flat_hp
from stagetree.integration import require

require("mlflow", "mlflow", "stagetree export mlflow")
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

STATUS = {"done": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
MAX_TAG = 5000  # characters of a tag value MLflow stores everywhere


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TAG else text[: MAX_TAG - 20] + " ...(clipped)"


def experiment_tags(view: RunView) -> dict[str, str]:
    """The tags of the study's experiment: ``stagetree.study``, ``stagetree.source``, and when
    known ``stagetree.tuner`` (the tuner the study recorded, in one line) and
    ``stagetree.log_anchor`` (the anchor of the exported log: kept in the tracker, apart from
    the log, ``stagetree replay verify --anchor`` proves later that the log still holds it)."""
    tags = {"stagetree.study": view.study_id, "stagetree.source": view.source}
    if view.tuner is not None:
        tags["stagetree.tuner"] = _clip(view.tuner)
    if view.anchor is not None:
        tags["stagetree.log_anchor"] = view.anchor
    return tags


def trial_tags(view: RunView, trial: TrialView) -> dict[str, str]:
    """The tags of a trial's run (see the module doc)."""
    others = sorted({t for s in trial.shared for t in s.trials})
    tags = {
        "stagetree.study": view.study_id,
        "stagetree.trial_id": trial.trial_id,
        "stagetree.plan_key": trial.plan_key,
        "stagetree.mode": view.mode,
        "stagetree.steps": str(trial.steps),
        "stagetree.status": trial.status,
        "stagetree.source": view.source,
        "stagetree.path": " ".join(f"{node}[{a},{b})" for _, node, a, b in trial.path),
        "stagetree.shared_steps": str(trial.shared_steps),
        "stagetree.shared_with": _clip(",".join(others)),
    }
    for s in trial.shared:
        tags[f"stagetree.shared.{s.node_id}.{s.from_step}-{s.to_step}"] = _clip(",".join(s.trials))
    if trial.error is not None:
        tags["stagetree.error"] = _clip(trial.error)
    return tags


def export_mlflow(view: RunView, tracking_uri: str | None = None, experiment: str | None = None) -> dict[str, Any]:
    """Log ``view`` to MLflow; returns ``{"experiment_id", "runs": {trial_id: run_id},
    "metrics": values logged, "replaced": earlier runs deleted, "tracking_uri"}``.

    Raises:
        mlflow.exceptions.MlflowException: the tracking store refused something.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    name = experiment or view.study_id
    found = client.get_experiment_by_name(name)
    tags = experiment_tags(view)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(name, tags=tags)
    if found is not None:  # an export again: its tags say what was exported last
        for key, value in tags.items():
            client.set_experiment_tag(experiment_id, key, value)
    runs, logged, replaced = {}, 0, 0
    for trial in view.trials:
        earlier = client.search_runs(
            [experiment_id], filter_string=(f"tags.`stagetree.study` = '{_quote(view.study_id)}' and "
                                            f"tags.`stagetree.trial_id` = '{_quote(trial.trial_id)}'"))
        for old in earlier:
            client.delete_run(old.info.run_id)
            replaced += 1
        start_ms = int((trial.submitted or 0.0) * 1000)
        run = client.create_run(experiment_id, start_time=start_ms, run_name=trial.trial_id,
                                tags=trial_tags(view, trial))
        run_id = run.info.run_id
        params = [Param(k, str(v)) for k, v in flat_hp(trial.hp).items()]
        for chunk in _chunks(params, 100):
            client.log_batch(run_id, params=list(chunk))
        last = start_ms
        metrics = []
        for step, values in trial.metrics.items():
            last = int(trial.times.get(step, last / 1000) * 1000)
            metrics += [Metric(k, float(v), last, step) for k, v in values.items() if v is not None]
        for chunk in _chunks(metrics, 1000):
            client.log_batch(run_id, metrics=list(chunk))
        logged += len(metrics)
        if trial.status in STATUS:
            client.set_terminated(run_id, STATUS[trial.status], end_time=last)
        runs[trial.trial_id] = run_id
    return {"experiment_id": experiment_id, "runs": runs, "metrics": logged, "replaced": replaced,
            "tracking_uri": client.tracking_uri}


def _quote(text: str) -> str:
    """``text`` inside a single-quoted MLflow filter string."""
    return text.replace("\\", "\\\\").replace("'", "\\'")
