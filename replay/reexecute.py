"""Re-execution audit (``stagetree replay reexecute``): train recorded stages again and compare.

Every finished stage of the log is re-run from its recorded source (the dispatch's source
checkpoint, the checkpoint the same path saved at the stage's start, or a fresh
initialisation) on fresh worker processes, and the resulting checkpoint's sha256 and metrics
are compared with the recorded CheckpointSaved and MetricsReported, bit for bit. Stages are
independent given their sources, so the worker count cannot change any result (each worker
uses one torch thread, as in the original run).
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from events import topics
from events.codec import InvalidEvent, decode
from events.hp import HPConfig
from events.models import CheckpointSaved, MetricsReported, StageDispatched, StageFinished, StudyStarted
from gpu_worker.checkpoint import CheckpointError, CheckpointStore, sha256_hex
from gpu_worker.loader import StudyFileError, load_trainer
from gpu_worker.object_store import open_checkpoint_store
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer
from replay.audit import AuditError, Source


@dataclass(frozen=True)
class RecordedStage:
    """A finished stage as the log recorded it, with what re-running it must reproduce."""

    offset: int  # of its StageFinished
    dispatch_id: str
    plan_key: str
    seed: int
    node_id: str
    hp: HPConfig
    from_step: int
    to_step: int
    source_ref: str | None  # None: fresh initialisation
    expected_ref: str | None  # None: an evaluation-only stage saves no checkpoint
    expected_metrics: dict[str, float | None] | None


@dataclass
class Divergence:
    stage: RecordedStage
    what: str  # "checkpoint" | "metrics" | "source" (its source checkpoint could not be read)
    recorded: Any
    recomputed: Any
    trials: list[str]

    def __str__(self) -> str:
        s = self.stage
        if self.what == "source":
            return (f"stage of node {s.node_id} to step {s.to_step} (plan {s.plan_key}, dispatch {s.dispatch_id}, "
                    f"trials {', '.join(self.trials) or '-'}) not re-executed: {self.recomputed}")
        return (f"{self.what} of node {s.node_id} at step {s.to_step} (plan {s.plan_key}, dispatch {s.dispatch_id}, "
                f"trials {', '.join(self.trials) or '-'}): recorded {self.recorded}, recomputed {self.recomputed}")


@dataclass
class ReexecuteResult:
    stages: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences


def recorded_stages(source: Source) -> list[RecordedStage]:
    """Every finished stage of the plan stream, in log order."""
    dispatches: dict[str, StageDispatched] = {}
    saved: dict[tuple[str, str, int], str] = {}
    metrics: dict[tuple[str, str, int], dict[str, float | None]] = {}
    out: list[RecordedStage] = []
    for r in source.streams.get(topics.PLAN, []):
        try:
            ev = decode(r.value)
        except InvalidEvent:
            continue
        if isinstance(ev, StageDispatched):
            dispatches.setdefault(ev.dispatch_id, ev)
        elif isinstance(ev, CheckpointSaved):
            saved[(ev.dispatch_id, ev.node_id, ev.step)] = ev.ref
        elif isinstance(ev, MetricsReported):
            metrics[(ev.dispatch_id, ev.node_id, ev.step)] = ev.metrics
        elif isinstance(ev, StageFinished) and ev.dispatch_id in dispatches:
            d = dispatches[ev.dispatch_id]
            specs = [(s.node_id, s.from_step, s.to_step) for s in d.stages]
            i = specs.index((ev.node_id, ev.from_step, ev.to_step))
            spec = d.stages[i]
            source_ref = d.source.ref if d.source is not None else None
            for prev in d.stages[:i]:
                ref = saved.get((d.dispatch_id, prev.node_id, prev.to_step))
                if ref is not None and prev.to_step == spec.from_step:
                    source_ref = ref
            key = (d.dispatch_id, spec.node_id, spec.to_step)
            out.append(RecordedStage(
                offset=r.offset, dispatch_id=d.dispatch_id, plan_key=d.plan_key, seed=d.seed, node_id=spec.node_id,
                hp=spec.hp, from_step=spec.from_step, to_step=spec.to_step, source_ref=source_ref,
                expected_ref=saved.get(key) if spec.to_step > spec.from_step else None,
                expected_metrics=metrics.get(key) if spec.evaluate else None,
            ))
    return out


def recorded_study(source: Source) -> tuple[str | None, str | None]:
    """``(study file, trainer)`` recorded by the source's (last) StudyStarted event: the file's
    path and the trainer's ``name@version`` (None where no StudyStarted records one)."""
    study_file = trainer = None
    for r in source.streams.get(topics.PLAN, []):
        try:
            ev = decode(r.value)
        except InvalidEvent:
            continue
        if isinstance(ev, StudyStarted):
            study_file, trainer = ev.study_file or study_file, ev.trainer or trainer
    return study_file, trainer


# --------------------------------------------------------------------------- worker side

_trainer: Trainer | None = None
_load_error: str | None = None  # why the study file did not load in this worker
_store: CheckpointStore | None = None


def _init_worker(study_file: str, checkpoints: str) -> None:
    global _trainer, _load_error, _store
    torch.set_num_threads(1)
    try:
        _trainer = load_trainer(study_file)
    except ValueError as exc:  # StudyFileError: said by _trainer_name, not a broken pool
        _load_error = str(exc)
    _store = open_checkpoint_store(checkpoints)


def _trainer_name() -> tuple[str | None, str | None]:
    """``(name@version, None)`` of this worker's trainer, or ``(None, why the study file did
    not load)``. The study file is loaded in the workers only: a study file runs code (one
    sets module attributes of the trainer's code), which must not change the auditing process."""
    if _trainer is None:
        return None, _load_error
    return f"{_trainer.name}@{_trainer.version}", None


def _run_stage(stage: RecordedStage) -> tuple[str | None, dict[str, float | None] | None, str | None]:
    """``(checkpoint sha256, metrics, None)`` of ``stage`` trained again, or ``(None, None,
    why)`` when its source checkpoint cannot be read (missing, corrupt, the store failing)."""
    assert _trainer is not None and _store is not None  # set by _init_worker
    session = TrainingSession(_trainer, stage.seed, "cpu")
    if stage.source_ref is None:
        session.start_fresh()
    else:
        try:
            data = _store.get(stage.source_ref)
        except CheckpointError as exc:
            return None, None, str(exc)
        session.load(data)
    session.train(stage.hp, stage.to_step)
    metrics: dict[str, float | None] | None = dict(session.evaluate()) if stage.expected_metrics is not None else None
    ref = sha256_hex(session.save()) if stage.expected_ref is not None else None
    return ref, metrics, None


def reexecute(source: Source, *, study_file: str | None = None, workers: int = 1, sample: int | None = None,
              seed: int = 0, progress: Callable[[int], None] | None = None,
              trials_at: Callable[[str, str, int], list[str]] | None = None) -> ReexecuteResult:
    """Re-run recorded stages (all, or a sample of ``sample`` chosen by ``seed``) on ``workers``
    fresh processes and compare checkpoints and metrics bit for bit.

    A stage whose source checkpoint cannot be read is a divergence of its ``source`` (it cannot
    be re-executed: the run's checkpoints no longer reproduce it); the other stages run.

    Raises:
        AuditError: no checkpoint directory, no study file, a study file whose trainer is not
            the recorded one (``name@version``), or bad ``workers``/``sample``.
        StudyFileError: the study file does not exist or does not load (a ValueError).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise AuditError(f"`workers` is {workers!r}, but must be an int >= 1")
    if source.checkpoints is None:
        raise AuditError("re-execution needs the run's checkpoints: pass a run directory or --checkpoints DIR")
    recorded_file, recorded_trainer = recorded_study(source)
    study_file = study_file or recorded_file
    if not study_file:
        raise AuditError("the log records no study file: pass --study FILE")
    stages = recorded_stages(source)
    if sample is not None:
        if sample < 1:
            raise AuditError(f"`sample` is {sample!r}, but must be >= 1")
        stages = sorted(random.Random(seed).sample(stages, min(sample, len(stages))), key=lambda s: s.offset)
    result = ReexecuteResult(len(stages))
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(study_file, str(source.checkpoints))) as pool:
        name, error = pool.submit(_trainer_name).result()  # before any stage runs
        if name is None:
            raise StudyFileError(error or f"study file {study_file!r} did not load")
        if recorded_trainer is not None and name != recorded_trainer:
            raise AuditError(f"study file {study_file!r} has trainer {name}, but the log records "
                             f"{recorded_trainer}: its stages are not the recorded ones")
        for stage, (ref, metrics, unreadable) in zip(stages, pool.map(_run_stage, stages)):
            if progress is not None:
                progress(1)
            trials = trials_at(stage.plan_key, stage.node_id, stage.to_step) if trials_at else []
            if unreadable is not None:
                result.divergences.append(Divergence(stage, "source", stage.source_ref, unreadable, trials))
            elif ref != stage.expected_ref:
                result.divergences.append(Divergence(stage, "checkpoint", stage.expected_ref, ref, trials))
            if unreadable is None and metrics != stage.expected_metrics:
                result.divergences.append(Divergence(stage, "metrics", stage.expected_metrics, metrics, trials))
    return result
