"""The cluster simulator: the real log, reducer, scheduler and tuners, simulated workers on a
virtual clock (``stagetree simulate``).

:class:`SimulatedCluster` is a runtime like the embedded coordinator: studies append events to
an embedded RocksDB log, the projector folds them with the real reducer, and the scheduler
service (any policy) appends its StageDispatched decisions. Only the workers differ: a
:class:`~gpu_worker.simulated.SimulatedWorker` turns each dispatch into the events a GPU worker
would emit, timed by a cost model, and the simulator delivers them when the virtual clock gets
there. The clock jumps from event to event, so a study of hundreds of GPU-hours takes seconds.

The event loop runs the tuners' coroutines until every one is waiting on a result, then
advances the clock to the next simulated worker event; ties are broken by the order the
events were scheduled. Nothing depends on wall-clock time, so a simulation is deterministic:
the same study file gives the same decisions, metrics and timings on every run, and the log
it leaves passes ``stagetree replay verify``.
"""

from __future__ import annotations

import asyncio
import heapq
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from events import topics
from events.log import EmbeddedLog, append_events, event_key
from events.models import (
    Event,
    StageDispatched,
    StageFailed,
    StageFinished,
    StageStopped,
    StudyFinished,
    StudyStarted,
    WorkerJoined,
)
from gpu_worker.simulated import SimulatedWorker, models_of
from gpu_worker.trainer import Trainer
from projections.store import ProjectionStore, Projector, all_keys
from projections.summary import build_summary, union_steps
from scheduler.service import SchedulerService
from stagetree.runtime import RuntimeBase, RuntimeError_, settle
from stagetree.study import Study
from stagetree.tuners import Tuner, TunerResult
from stagetree.tuners._settings import recorded_settings

EPOCH = 1.0e9
"""Virtual time 0 as an event timestamp (seconds since the Unix epoch; any fixed value works)."""


class SimulationError(RuntimeError_):
    """The simulation cannot go on (a tuner waits for a result that nothing will produce)."""


class SimulatedCluster(RuntimeBase):
    """A runtime whose ``workers`` are simulated GPUs on a virtual clock.

    Args:
        run_dir: where the log (``log/``) and, at :meth:`close`, the projection (``state/``)
            are written.
        workers: number of simulated GPUs (``w0`` .. ``w{N-1}``).
        trainer: the studies' trainer; its cost and curve models time and score the stages
            (:func:`gpu_worker.simulated.models_of`).
        policy: the scheduling policy (``critical-path``, ``bfs`` or ``most-children``).

    Attributes:
        now: the virtual clock, seconds since the simulation started.
    """

    failure_type = SimulationError

    def __init__(self, run_dir: str | Path, workers: int, trainer: Trainer, *, policy: str = "critical-path",
                 checkpoint_budget: int | None = None, splits: bool = True) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"`workers` is {workers!r}, but must be an int >= 1")
        self.run_dir = Path(run_dir)
        self.workers = workers
        self.policy = policy
        self.log = EmbeddedLog(self.run_dir / "log")
        super().__init__(Projector(self.log))
        self.projector.catch_up()
        cost, curve = models_of(trainer)
        self.worker = SimulatedWorker(cost, curve)
        self.now = 0.0
        self.scheduler = SchedulerService(self.log, self.projector, deliver=self._deliver, policy=policy,
                                          clock=lambda: EPOCH + self.now, checkpoint_budget=checkpoint_budget,
                                          delete=self._delete, splits=splits)
        self._queue: list[tuple[float, int, list[tuple[str, int, Event]]]] = []
        self._seq = 0
        self._paths: dict[str, _Path] = {}  # running dispatches: what they emit, when
        self.append([WorkerJoined(producer="simulator", worker_id=f"w{i}", device="sim") for i in range(workers)])

    # ------------------------------------------------------------------ the Runtime protocol

    def stamp(self, events: list[Event]) -> list[Event]:  # type: ignore[override]
        """Timestamp events with the virtual clock."""
        ts = EPOCH + self.now
        return [e.model_copy(update={"ts": ts}) for e in events]

    def append(self, events: list[Event]) -> None:
        """Append to the plan stream, fold, schedule, resolve futures (as the coordinator does)."""
        if self.failure is not None:
            raise SimulationError(f"the simulation failed: {self.failure}")
        try:
            append_events(self.log, topics.PLAN, [(event_key(e), e) for e in self.stamp(events)])
            self.projector.catch_up()
            self.scheduler.run_pass()
            self._notify()
        except Exception as exc:
            self._fail(exc)
            raise

    def _deliver(self, decision: Event) -> None:
        """A dispatch starts its path now; a decision about a running path (preempt, save at a
        step) reaches its worker now: the path is executed again with it, from its start (the
        same events up to now, by determinism), and what it emits from now on replaces what was
        queued."""
        if isinstance(decision, StageDispatched):
            path = self._paths[decision.dispatch_id] = _Path(decision, self.now)
        else:
            found = self._paths.get(decision.dispatch_id)  # type: ignore[attr-defined]
            if found is None:
                return  # the path had ended: nothing to do
            path = found
            path.controls.append((self.now - path.started, decision))
        path.generation += 1
        emitted = [(at, event) for at, batch in self.worker.execute(path.dispatch, path.controls) for event in batch]
        for at, event in emitted[path.delivered:]:
            self._seq += 1
            heapq.heappush(self._queue, (path.started + at, self._seq, [(path.dispatch.dispatch_id, path.generation,
                                                                        event)]))

    def _delete(self, refs: list[str]) -> None:
        for ref in refs:
            self.worker.checkpoints.pop(ref, None)

    # ------------------------------------------------------------------ the virtual clock

    def _advance(self) -> None:
        """Deliver every queued event of the earliest time (in the order they were emitted), as
        one batch; events a re-executed path replaced are dropped."""
        at = self._queue[0][0]
        batch: list[Event] = []
        while self._queue and self._queue[0][0] == at:
            _, _, items = heapq.heappop(self._queue)
            for dispatch_id, generation, event in items:
                path = self._paths.get(dispatch_id)
                if path is None or generation != path.generation:
                    continue
                path.delivered += 1
                batch.append(event)
                if isinstance(event, (StageFinished, StageStopped, StageFailed)) and path.ended(event):
                    del self._paths[dispatch_id]
        self.now = max(self.now, at)
        if batch:
            self.append(batch)

    async def run(self, coroutines: list[Awaitable[Any]],
                  on_done: Callable[[int, float], None] | None = None) -> list[Any]:
        """Run ``coroutines`` (tuners) to completion on the virtual clock, then let in-flight
        dispatches finish; returns their results in order.

        ``on_done(i, now)`` is called when coroutine ``i`` finishes.

        Raises:
            SimulationError: every coroutine waits but no simulated event is left.
            Exception: whatever a coroutine raised.
        """
        tasks = [asyncio.ensure_future(c) for c in coroutines]
        finished: set[int] = set()
        while True:
            await settle()
            for i, task in enumerate(tasks):
                if task.done() and i not in finished:
                    finished.add(i)
                    if on_done is not None:
                        on_done(i, self.now)
                    if task.exception() is not None:
                        for t in tasks:
                            t.cancel()
                        raise task.exception()  # type: ignore[misc]
            if len(finished) == len(tasks):
                break
            if not self._queue:
                for t in tasks:
                    t.cancel()
                raise SimulationError("every tuner waits for results, but no simulated worker has work: "
                                      f"{sum(1 for t in self.state.trials.values() if t.status == 'pending')} "
                                      "trials pending")
            self._advance()
        while self._queue:
            self._advance()
        return [t.result() for t in tasks]

    def close(self) -> None:
        """Write the projection to ``state/`` (so ``replay verify`` can compare) and close."""
        store = ProjectionStore(self.run_dir / "state")
        try:
            store.commit(self.state, set(all_keys(self.state)))
        finally:
            store.close()
            self.log.close()


@dataclass
class _Path:
    """A running simulated path: its dispatch, when it started, the decisions about it that
    reached it (seconds after its start), how many of its events were delivered, and the
    generation of its queued events (a re-execution makes the earlier ones stale)."""

    dispatch: StageDispatched
    started: float
    controls: list[tuple[float, Event]] = field(default_factory=list)
    delivered: int = 0
    generation: int = 0

    def ended(self, event: Event) -> bool:
        if isinstance(event, (StageStopped, StageFailed)):
            return True
        last = self.dispatch.stages[-1]
        return isinstance(event, StageFinished) and (event.node_id, event.to_step) == (last.node_id, last.to_step)


@dataclass
class SimStudy:
    """One study of a simulation: a name, a tuner and a seed (the trainer is the cluster's)."""

    name: str
    tuner: Tuner
    seed: int = 0


@dataclass
class SimulationResult:
    """What a simulation measured: one ``summary.json``-style dict per study, and the cluster's
    totals. Seconds are virtual seconds of the simulated GPUs."""

    mode: str
    policy: str
    workers: int
    summaries: list[dict[str, Any]]
    makespan_seconds: float
    worker_seconds: float
    total_steps: int
    unique_steps: int
    executed_steps: int
    results: list[TunerResult] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return self.worker_seconds / 3600.0

    @property
    def end_to_end_hours(self) -> float:
        return self.makespan_seconds / 3600.0

    @property
    def idle_worker_seconds(self) -> float:
        """Worker-seconds no simulated GPU was held by a stage before the last study ended."""
        return max(0.0, self.workers * self.makespan_seconds - self.worker_seconds)


def simulate(trainer: Trainer, studies: list[SimStudy], *, workers: int, merge: bool = True,
             policy: str = "critical-path", run_dir: str | Path | None = None,
             study_file: str = "", checkpoint_budget: int | None = None, splits: bool = True) -> SimulationResult:
    """Simulate ``studies`` running at once on ``workers`` simulated GPUs.

    Args:
        trainer: the trainer of every study (a SimulatedTrainer, or any Trainer with the
            default models).
        studies: the studies; studies with equal trainer and seed share one search plan.
        workers: simulated GPUs.
        merge: False runs the trial-based baseline (every trial its own plan, ``--no-merge``).
        policy: the scheduler's policy.
        run_dir: where to keep the log and projection; None uses a temporary directory that is
            removed afterwards.
        study_file: recorded in StudyStarted (for ``replay`` and ``report``).
        checkpoint_budget: bytes of checkpoints the simulated run may keep (None: unbounded);
            the sizes come from the trainer's cost model (``CostModel.checkpoint_bytes``).
        splits: save at boundaries inside running stages (off: the ablation of the
            split-during-execution rule, ``SchedulerService(splits=False)``).

    Raises:
        ValueError: no studies, duplicate study names, or bad ``workers``.
        SimulationError: a tuner waits forever.
    """
    if not studies:
        raise ValueError("`studies` is empty, but must hold at least one study")
    names = [s.name for s in studies]
    if len(set(names)) != len(names):
        raise ValueError(f"`studies` names {names!r} repeat, but must be unique")
    temp = None
    if run_dir is None:
        temp = tempfile.mkdtemp(prefix="stagetree-sim-")
        run_dir = temp
    try:
        return asyncio.run(_simulate(trainer, studies, workers, merge, policy, Path(run_dir), study_file,
                                     checkpoint_budget, splits))
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


async def _simulate(trainer: Trainer, studies: list[SimStudy], workers: int, merge: bool, policy: str,
                    run_dir: Path, study_file: str, checkpoint_budget: int | None, splits: bool) -> SimulationResult:
    mode: Literal["merged", "trial"] = "merged" if merge else "trial"
    cluster = SimulatedCluster(run_dir, workers, trainer, policy=policy, checkpoint_budget=checkpoint_budget,
                               splits=splits)
    try:
        sdk = [Study(cluster, s.name, trainer, s.seed, merge=merge, metric=s.tuner.metric) for s in studies]
        for study in sdk:  # made-up results: nothing of them in a user's storage, the same draws in both modes
            study.writes_tuner_state = False
        cluster.append([
            StudyStarted(producer="simulator", study_id=s.name, name=s.name, plan_key=study.plan_key, mode=mode,
                         workers=workers, seed=s.seed, trainer=f"{trainer.name}@{trainer.version}",
                         metric=s.tuner.metric, metric_mode=s.tuner.mode, study_file=study_file,
                         tuner_settings=recorded_settings(s.tuner))
            for s, study in zip(studies, sdk)
        ])
        done_at: dict[int, float] = {}
        try:
            results: list[TunerResult] = await cluster.run(
                [s.tuner.run(study) for s, study in zip(studies, sdk)],
                on_done=lambda i, now: done_at.__setitem__(i, now))
        except Exception:
            failure = next((study.failure for study in sdk if study.failure is not None), None)
            if failure is not None:  # a tuner's `metric` the trainer does not report
                raise failure from None
            raise
        for study in sdk:
            study.flush()  # the last decisions (the answers) before StudyFinished
        makespan = cluster.now
        finished: list[Event] = []
        summaries = []
        for i, (s, result) in enumerate(zip(studies, results)):
            finished.append(StudyFinished(producer="simulator", study_id=s.name, **result.answer._asdict(),
                                          end_to_end_seconds=done_at[i], plan_key=sdk[i].plan_key))
        cluster.append(finished)
        for i, s in enumerate(studies):
            ev = finished[i]
            assert isinstance(ev, StudyFinished)
            summary = build_summary(cluster.state, s.name, mode=mode, workers=workers, best_trial=ev.best_trial,
                                    best_metric=ev.best_metric, best_step=ev.best_step,
                                    end_to_end_seconds=done_at[i])
            summary["policy"] = policy
            summary["simulated"] = True
            summaries.append(summary)
        state = cluster.state
        total, unique = union_steps(state, [s.name for s in studies])  # merged per plan: seeds apart share none
        return SimulationResult(
            mode=mode, policy=policy, workers=workers, summaries=summaries, makespan_seconds=makespan,
            worker_seconds=state.stats.worker_seconds, total_steps=total, unique_steps=unique,
            executed_steps=state.stats.executed_steps, results=results)
    finally:
        cluster.close()
