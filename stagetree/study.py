"""The client SDK: a Study submits trials as events and awaits their metrics.

``study.submit(hp, steps)`` returns an asyncio future with the metrics at ``steps``
(Hippo §5.4/5.6: every request is a coroutine; submissions made in the same event-loop turn
are batched into one append). Trials are identified by a stable hash of the study and the
hyper-parameter configuration, so submitting the same configuration with more steps extends
the trial (a promotion), and a re-run of a study (``--resume``) finds its earlier results.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol, cast

from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from events import topics, tracing
from events.decisions import Decision, ReleasedResult
from events.hp import HPConfig, as_hp, canonical_json
from events.models import TRIAL_PLAN_SEPARATOR, Event, TrialCancelled, TrialSubmitted, TunerDecided
from gpu_worker.trainer import Trainer
from projections import search_plan
from projections.state import State
from stagetree.errors import MetricNotReported, TrialFailed  # noqa: F401 (TrialFailed: its old home)


class Runtime(Protocol):
    """What a Study needs from a deployment (embedded coordinator, or Kafka client)."""

    @property
    def state(self) -> State: ...

    def append(self, events: list[Event]) -> None: ...

    def watch(self, trial_id: str, steps: int) -> asyncio.Future[dict[str, float]]: ...

    def prefix(self, plan_key: str) -> dict[str, Any]: ...

    def fail(self, exc: BaseException) -> None: ...


def plan_key_of(trainer: Trainer, seed: int) -> str:
    """The plan key: sha256 of the trainer's fingerprint (name, version, constants, data order)
    and the seed, 16 hex characters. Studies with equal plan keys share one search plan."""
    return hashlib.sha256(f"{trainer.fingerprint()}:{seed}".encode()).hexdigest()[:16]


def validate_config(trainer: Trainer, hp: Mapping[str, Any]) -> HPConfig:
    """Validate ``hp`` into a configuration of hyper-parameter functions for ``trainer``.

    Every name in ``trainer.hyperparameters`` must be given (all trials of a plan name the same
    hyper-parameters, so their values can be compared step by step). Numbers become Constant;
    dicts are parsed as JSON functions.

    Raises:
        ValueError: a name the trainer does not know, a missing name, or an invalid function.
    """
    if not isinstance(hp, Mapping):
        raise ValueError(f"`hp` is {hp!r}, but must be a mapping of hyper-parameter names to functions")
    known = set(trainer.hyperparameters)
    unknown = sorted(set(hp) - known)
    if unknown:
        raise ValueError(f"unknown hyper-parameter {unknown[0]!r} for trainer {trainer.name!r}; known: {sorted(known)}")
    missing = sorted(known - set(hp))
    if missing:
        raise ValueError(f"hyper-parameter {missing[0]!r} of trainer {trainer.name!r} has no value in {dict(hp)!r}")
    out: HPConfig = {}
    for name in sorted(hp):
        try:
            out[name] = as_hp(hp[name])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"hyper-parameter {name!r}: {exc}") from None
    return out


MAX_STEPS = 2**63 - 1


class Study:
    """One HPO study: a trainer, a seed, a name, and the runtime it submits to.

    Args:
        runtime: the deployment that records events and answers trials.
        name: study id; the same name resumes the same study.
        trainer: the study's Trainer (its ``hyperparameters`` are the names a config must give).
        seed: model-initialisation and data-order seed (part of the plan key).
        merge: False gives every trial a search plan of its own (the papers' trial-based
            baseline, ``--no-merge``); results are the same, shared prefixes are retrained.
        metric: the metric the study's tuner reads, or None. The first answer that does not
            report it fails the runtime (every waiting future) with
            :class:`~stagetree.errors.MetricNotReported`, kept in :attr:`failure`, rather than
            after every trial has trained.
    """

    def __init__(self, runtime: Runtime, name: str, trainer: Trainer, seed: int = 0, *, merge: bool = True,
                 metric: str | None = None) -> None:
        if not name:
            raise ValueError(f"`name` is {name!r}, but must be a non-empty string")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"`seed` is {seed!r}, but must be an int in [0, 2**63)")
        self.runtime = runtime
        self.name = name
        self.trainer = trainer
        self.seed = seed
        self.merge = merge
        self.metric = metric
        self.failure: MetricNotReported | None = None
        """Set when an answer lacked :attr:`metric`."""
        self.plan_key = plan_key_of(trainer, seed)
        self._pending: list[Event] = []
        self._flush_scheduled = False
        self._trial_traces: dict[str, dict[str, str]] = {}  # trial id -> context of its trace root
        self.decisions: list[Decision] = []
        """The tuner decisions taken through :meth:`decide`, in order."""
        self._released: list[ReleasedResult] = []
        self.replaying = False
        """True in a replay of the log (``replay verify``): the tuner writes nothing outside it
        (an Optuna searcher keeps its Optuna study in memory), and its requests, which are never
        published, open no ``trial.submit`` span."""
        self.writes_tuner_state = True
        """Whether the tuner may keep state of its own outside the log (an Optuna searcher's
        study in the user's Optuna ``storage``). False in a replay of the log, in the simulator
        (whose results are made up, and whose two modes must see the same draws), and in a run
        that continues a study the log holds (``--resume``: its tuner decides again from the
        start, and a storage holding the earlier run's trials would make it decide otherwise):
        the state is then kept in memory."""
        self.continues = False
        """True in a run that continues a study the log holds (``--resume``, or a Kafka-mode run
        of a study already started): its tuner decides again from the start, keeping its state in
        memory (:attr:`writes_tuner_state` is False), and an Optuna searcher brings the user's
        ``storage`` up to date when the tuner ends (the earlier run's trials finished, the rest
        added)."""
        self.release_script: deque[tuple[str, int]] | None = None
        """Set by a replay of the log (``replay verify``): the order results were released in to
        the live tuner, which an arrival-order :class:`~stagetree.tuners.ResultInbox` follows
        instead of the answer order (an input of the decisions, recorded in the log)."""

    # ------------------------------------------------------------------ validation

    def config(self, hp: Mapping[str, Any]) -> HPConfig:
        """Validate ``hp`` for this study's trainer (see :func:`validate_config`)."""
        return validate_config(self.trainer, hp)

    def trial_id(self, config: HPConfig) -> str:
        """Stable id of ``config`` in this study: 16 hex characters of sha256(study, config)."""
        return hashlib.sha256(self.name.encode() + b"\0" + canonical_json(config)).hexdigest()[:16]

    def _plan_for(self, trial_id: str) -> str:
        return self.plan_key if self.merge else f"{self.plan_key}{TRIAL_PLAN_SEPARATOR}{trial_id}"

    @staticmethod
    def _check_steps(steps: Any) -> int:
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps <= MAX_STEPS:
            raise ValueError(f"`steps` is {steps!r}, but must be a positive int below 2**63")
        return steps

    # ------------------------------------------------------------------ requests

    def submit(self, hp: Mapping[str, Any], steps: int) -> asyncio.Future[dict[str, float]]:
        """Request the metrics of ``hp`` trained for ``steps`` steps; returns a future of them.

        Must be called with a running event loop. Submissions in one loop turn are appended as
        one batch. A trial already answered at ``steps`` resolves at once without a new event.

        Raises:
            ValueError: invalid ``hp`` or ``steps`` (nothing is recorded).
        """
        steps = self._check_steps(steps)
        config = self.config(hp)
        trial_id = self.trial_id(config)
        trial = self.runtime.state.trials.get(trial_id)
        event = None
        if trial is None or steps not in trial.results:
            try:  # the event's own checks (a value that cannot be computed for the steps asked)
                event = TrialSubmitted(producer=f"sdk:{self.name}", study_id=self.name, trial_id=trial_id,
                                       plan_key=self._plan_for(trial_id), seed=self.seed, hp=cast(Any, config),
                                       steps=steps)
            except ValidationError as exc:  # pydantic's wrapping (title, input, a URL) left out
                raise ValueError("; ".join(str(e["ctx"]["error"]) if "error" in e.get("ctx", {}) else e["msg"]
                                           for e in exc.errors())) from None
        future = self.runtime.watch(trial_id, steps)  # after the checks: a refused submit leaves no waiter
        if event is not None:
            previous = self._trial_traces.get(trial_id)
            header = None
            if not self.replaying:  # a replay (replay verify) publishes nothing: no span may say it did
                with tracing.span("trial.submit", parent=previous, new_trace=previous is None,
                                  kind=SpanKind.PRODUCER, attributes=tracing.messaging(
                                      "publish", topics.PLAN, event.event_id, trial_id=trial_id, study_id=self.name,
                                      steps=steps)):
                    header = tracing.carrier()
            if header is not None:
                self._trial_traces.setdefault(trial_id, header)
                event = event.model_copy(update={"trace": header})
            self._enqueue(event)
        if self.metric is not None:
            future.add_done_callback(lambda done: self._check_metric(done, trial_id, steps))
        return future

    def _check_metric(self, future: asyncio.Future[dict[str, float]], trial_id: str, steps: int) -> None:
        """Fail the runtime when an answer lacks :attr:`metric` (a failed trial has no answer)."""
        if future.cancelled() or future.exception() is not None or self.failure is not None:
            return
        metrics = future.result()
        if self.metric not in metrics:
            self.failure = MetricNotReported(
                f"the tuner's `metric` is {self.metric!r}, but trainer {self.trainer.name!r} does not report it "
                f"(trial {trial_id} at {steps} steps reported {sorted(metrics)})")
            self.runtime.fail(self.failure)

    def cancel(self, hp: Mapping[str, Any]) -> None:
        """Withdraw the trial of ``hp``: requests that no other trial waits on are dropped."""
        trial_id = self.trial_id(self.config(hp))
        queued = any(isinstance(e, TrialSubmitted) and e.trial_id == trial_id for e in self._pending)
        if trial_id not in self.runtime.state.trials and not queued:
            raise ValueError(f"`hp` {dict(hp)!r} names no submitted trial of study {self.name!r}")
        self._enqueue(TrialCancelled(producer=f"sdk:{self.name}", study_id=self.name, trial_id=trial_id,
                                     plan_key=self._plan_for(trial_id)))

    async def eval(self, hp: Mapping[str, Any], step: int) -> dict[str, float]:
        """Metrics of ``hp`` at ``step``: answered from stored metrics when the plan has them
        (any trial's, Hippo §5.4 ``study.eval``), else trained like :meth:`submit`."""
        step = self._check_steps(step)
        config = self.config(hp)
        plan = self.runtime.state.plans.get(self._plan_for(self.trial_id(config)))
        if plan is not None:
            placement = search_plan.place(plan, config, step)
            if placement.node_id is not None and step in plan.nodes[placement.node_id].metrics:
                return dict(plan.nodes[placement.node_id].metrics[step])
        return await self.submit(hp, step)

    # ------------------------------------------------------------------ decisions

    def decide(self, decision: Decision, tuner: str) -> Decision:
        """Record a tuner decision (:mod:`events.decisions`): a TunerDecided event queued before
        the requests it causes (submit after deciding), with the offset of the last event the
        runtime had folded (``decided_at``) and the results released since the previous decision
        (:meth:`release`). ``tuner`` is the tuner's name. Returns ``decision``.

        A tuner decides only from results it was handed (no clocks, no unrecorded randomness),
        so ``replay verify --study`` recomputes each decision from the log prefix it records.
        """
        event = TunerDecided(producer=f"sdk:{self.name}", study_id=self.name, tuner=tuner, plan_key=self.plan_key,
                             decision=decision, released=self._released,
                             **self.runtime.prefix(self.plan_key))
        self._released = []
        self.decisions.append(decision)
        self._enqueue(event)
        return decision

    def release(self, trial_id: str, steps: int) -> None:
        """Note that the result of ``trial_id`` at ``steps`` was handed to the tuner (by a
        :class:`~stagetree.tuners.ResultInbox`); the next decision records it in ``released``."""
        self._released.append(ReleasedResult(trial_id=trial_id, steps=steps))

    def _enqueue(self, event: Event) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        try:
            self.flush()
        except Exception as exc:
            # An append that failed in a loop callback fails the runtime: every waiting future
            # (and every later one) gets the error, so the study ends with it.
            self.runtime.fail(exc)

    def flush(self) -> None:
        """Append what is queued now (submissions are otherwise batched per loop turn); call it
        after the tuner returns, so its last decision precedes StudyFinished."""
        batch, self._pending = self._pending, []
        if batch:
            self.runtime.append(batch)


async def wait_all(futures: list[asyncio.Future[Any]]) -> list[Any]:
    """Wait until every future is done; results in order (Hippo's ``wait_all``)."""
    return list(await asyncio.gather(*futures))


async def wait_any(futures: list[asyncio.Future[Any]]) -> tuple[set[asyncio.Future[Any]], set[asyncio.Future[Any]]]:
    """Wait until at least one future is done; returns (done, pending) (Hippo's ``wait_any``)."""
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    return done, pending
