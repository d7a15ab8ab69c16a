"""``stagetree export tensorboard RUN_DIR --out DIR``: a study as TensorBoard event files.

Layout (point ``tensorboard --logdir DIR`` at it): one TensorBoard run per trial,
``DIR/<trial_id>/``, holding

* one scalar per metric per evaluated step (tag = the metric's name, step = the global step),
  written as a float64 tensor so the values read back exactly (TensorBoard's scalars dashboard
  reads them like any scalar);
* the HParams dashboard's session start (the trial's hyper-parameters, flattened by
  :func:`stagetree.export.run.flat_hp`: the sequence as text and each of its numbers) and
  session end (done: success, failed: failure, cancelled: unknown, which is what TensorBoard
  has for it; a pending trial has none, so it shows as running);

and ``DIR`` itself holds the HParams experiment (every hyper-parameter with its type, string
ones with their values, and the metrics). Exporting again into ``DIR`` replaces the event files
an earlier export wrote there (``*.stagetree``); nothing else in ``DIR`` is touched. Wall times
are the log's event timestamps (informational). Needs ``pip install 'stagetree[tensorboard]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stagetree.export.run import RunView, TrialView, flat_hp
from stagetree.integration import require

require("tensorboard", "tensorboard", "stagetree export tensorboard")
from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2  # noqa: E402
from tensorboard.plugins.hparams import metadata as hparams_metadata  # noqa: E402
from tensorboard.plugins.scalar import metadata as scalar_metadata  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

SUFFIX = ".stagetree"
"""File-name suffix of the event files an export writes (and replaces on the next export)."""


def export_tensorboard(view: RunView, out: str | Path) -> dict[str, Any]:
    """Write ``view`` to ``out`` (created if absent); returns ``{"runs": trials written,
    "scalars": scalar values written, "out": out}``.

    Raises:
        ValueError: ``out`` exists and is not a directory.
    """
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--out is {str(root)!r}, which exists and is not a directory")
    hps = {t.trial_id: flat_hp(t.hp) for t in view.trials}
    metric_names = sorted({name for t in view.trials for m in t.metrics.values() for name in m})
    status = {"done": api_pb2.STATUS_SUCCESS, "failed": api_pb2.STATUS_FAILURE, "cancelled": api_pb2.STATUS_UNKNOWN}
    first = min((t.submitted for t in view.trials if t.submitted), default=0.0)

    infos = []
    for name in sorted({k for hp in hps.values() for k in hp}):
        values = [hp[name] for hp in hps.values() if name in hp]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DATA_TYPE_FLOAT64))
        else:
            info = api_pb2.HParamInfo(name=name, type=api_pb2.DATA_TYPE_STRING)
            info.domain_discrete.extend(sorted({str(v) for v in values}))
            infos.append(info)
    experiment = api_pb2.Experiment(
        description=f"stagetree study {view.study_id} ({view.mode}) from {view.source}",
        time_created_secs=first, hparam_infos=infos,
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m), display_name=m) for m in metric_names])
    _write(root, [event_pb2.Event(wall_time=first, step=0, summary=_hparams_summary(
        hparams_metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)))])

    scalars = 0
    for trial in view.trials:
        events, n = _trial_events(trial, hps[trial.trial_id], status)
        _write(root / trial.trial_id, events)
        scalars += n
    ours = {trial.trial_id for trial in view.trials}
    for directory in [d for d in root.iterdir() if d.is_dir() and d.name not in ours]:
        _clear(directory)  # an earlier export's run (another study)
        if not any(directory.iterdir()):
            directory.rmdir()
    return {"runs": len(view.trials), "scalars": scalars, "out": str(root)}


def _hparams_summary(tag: str, data: Any) -> Any:
    """A summary carrying HParams plugin data (its tensor is empty, as TensorBoard's own writer
    makes it)."""
    md = hparams_metadata.create_summary_metadata(data)
    empty = tensor_util.make_tensor_proto(np.zeros((0,), dtype=np.float32))
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=md, tensor=empty)])


def _clear(directory: Path) -> None:
    """Remove the event files an export wrote in ``directory`` (a user's own are left)."""
    for old in directory.glob(f"events.out.tfevents.*{SUFFIX}"):
        old.unlink()


def _write(directory: Path, events: list[Any]) -> None:
    """Replace the export's event file in ``directory`` with ``events``."""
    directory.mkdir(parents=True, exist_ok=True)
    _clear(directory)
    writer = EventFileWriter(str(directory), filename_suffix=SUFFIX)
    try:
        for event in events:
            writer.add_event(event)
    finally:
        writer.close()


def _trial_events(trial: TrialView, hp: dict[str, Any], status: dict[str, int]) -> tuple[list[Any], int]:
    """The events of one trial's run and the number of scalars: session start, the scalars by
    step, session end."""
    start = trial.submitted or 0.0
    session = plugin_data_pb2.SessionStartInfo(group_name=trial.trial_id, start_time_secs=start)
    for name, value in hp.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            session.hparams[name].number_value = value
        else:
            session.hparams[name].string_value = str(value)
    events = [event_pb2.Event(wall_time=start, step=0, summary=_hparams_summary(
        hparams_metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=session)))]
    n = 0
    last = start
    for step, metrics in trial.metrics.items():
        values = []
        for name, value in metrics.items():
            if value is None:
                continue  # non-finite in the log: TensorBoard has no empty value
            md = scalar_metadata.create_summary_metadata(display_name=name, description="")
            values.append(summary_pb2.Summary.Value(tag=name, metadata=md,
                                                    tensor=tensor_util.make_tensor_proto(np.float64(value))))
        last = trial.times.get(step, last)
        if values:
            events.append(event_pb2.Event(wall_time=last, step=step, summary=summary_pb2.Summary(value=values)))
            n += len(values)
    if trial.status in status:
        end = plugin_data_pb2.SessionEndInfo(status=status[trial.status], end_time_secs=last)
        events.append(event_pb2.Event(wall_time=last, step=trial.steps, summary=_hparams_summary(
            hparams_metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))))
    return events, n
