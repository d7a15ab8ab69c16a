"""The shared base of stagetree's tuners: results, the :class:`Tuner` base class, argument checks.

A tuner drives a :class:`~stagetree.study.Study`: it submits trials, awaits their metrics and
decides what to train next. Every decision depends only on metrics (never on timing or
unrecorded randomness), so a re-run over the same log takes the same decisions. Units:
``steps`` are optimizer updates of the trainer. One module per algorithm sits on this base
(Optuna's layout for samplers); :mod:`stagetree.tuners` re-exports them all.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

from events.decisions import Answer, Decision, Draw, Promote, Ranking, Stop
from events.hp import HPConfig
from gpu_worker.trainer import Trainer
from stagetree.study import Study, TrialFailed
from stagetree.tuners._settings import tuner_settings

Mode = Literal["max", "min"]


@dataclass
class TrialResult:
    """One configuration's outcome: the metrics at the largest steps it was trained to, or, when
    its training failed (the trainer raised), no metrics and the ``error``."""

    trial_id: str
    hp: HPConfig
    steps: int
    metrics: dict[str, float]
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class TunerResult:
    """What a tuner found: the best trial, every trial's last result, and the tuner's decisions
    in the order it took them (typed, :mod:`events.decisions`; each is also a TunerDecided event
    in the log). ``best.steps`` is the step of the evaluation chosen (the summary's
    ``best_step``): a trial's last for most tuners, possibly an earlier one for MLtunerTuner."""

    best: TrialResult | None
    metric: str
    mode: Mode
    trials: list[TrialResult] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    @property
    def answer(self) -> StudyAnswer:
        """The answer as a StudyFinished event and a summary record it: the best trial, its
        ``metric`` there (None when it has none, or it is not finite) and that step."""
        best = self.best
        if best is None:
            return StudyAnswer(None, None, None)
        value = best.metrics.get(self.metric)
        return StudyAnswer(best.trial_id, float(value) if value is not None else None, best.steps)


class StudyAnswer(NamedTuple):
    """A study's answer: ``best_trial``, ``best_metric`` and ``best_step`` (steps) of its
    StudyFinished event and its summary; all None when the tuner has none."""

    best_trial: str | None
    best_metric: float | None
    best_step: int | None


class Tuner(ABC):
    """Base of tuners: a search space (any iterable of configurations, e.g. a
    :class:`GridSearchSpace` or a :class:`RandomSearchSpace`), the metric to optimise and its
    direction.

    **A failed trial is a loss**, in every tuner: a trial whose training failed (the trainer
    raised) has no metrics; it is stopped where it failed and never continues, and it is never
    promoted, kept, chosen as a donor or given as the answer. Where a tuner keeps a fraction of
    the trials of a rung (SuccessiveHalving, Hyperband, EarlyStopTuner, ASHA) it counts as one
    of the rung's trials, ranked below every result; statistics over results (MedianStopping's
    median, PBT's quantiles) use only the results that exist. The study goes on; its summary
    lists the trial as "failed" with the error.

    Raises:
        ValueError: ``mode`` not "max" or "min", an empty ``metric``, or a sized ``space`` (a
            grid, a random space, a list) that holds no configuration.
    """

    rules: ClassVar[int] = 1
    """The version of the tuner's decision rules, recorded in its :meth:`settings`: a change to
    a tuner that makes it decide otherwise on the same results bumps it (keeping the old rule
    selectable by an argument where it can be, as PBT's ``synch=False``), so that a log decided
    under other rules is told apart from one whose decisions were edited."""

    _arguments: dict[str, Any]
    """The ``__init__`` arguments the tuner was built with, by name (as passed)."""

    recorded_elsewhere: ClassVar[frozenset[str]] = frozenset()
    """``__init__`` arguments that :meth:`settings` leaves out because another part of them
    records them (OptunaSearch's sampler, seed and storage: its space's settings)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Tuner:
        self = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(self, *args, **kwargs)
        except TypeError:  # __init__ raises its own error; copies and unpickling pass no arguments
            bound = None
        self._arguments = {} if bound is None else dict(list(bound.arguments.items())[1:])
        return self

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"`mode` is {mode!r}, but must be 'max' or 'min'")
        if not metric:
            raise ValueError(f"`metric` is {metric!r}, but must name a metric")
        if isinstance(space, Iterator):  # read once (a generator): read here, so that checking the
            space = list(space)  # study file (which reads every configuration) leaves it to the tuner
        if isinstance(space, Sized) and len(space) == 0:  # a grid or random space, or a list
            dropped = " (its filter drops every configuration)" if getattr(space, "filter", None) else ""
            raise ValueError(f"`space` holds no configuration{dropped}, but must hold at least one")
        self.space = space
        self.metric = metric
        self.mode: Mode = mode

    @abstractmethod
    async def run(self, study: Study) -> TunerResult:
        """Tune ``study`` and return the result."""

    def check(self, trainer: Trainer) -> None:
        """Check the arguments that need the study's trainer, before anything is recorded (the
        study file's load, and the start of :meth:`run`); the base has none.

        Raises:
            ValueError: an argument the trainer cannot take (naming the field and the value).
        """
        del trainer  # the base's arguments do not depend on it

    def settings(self) -> dict[str, Any]:
        """What the tuner's decisions depend on besides the results, as JSON data (recorded in
        the study's StudyStarted as ``tuner_settings``): ``tuner`` (the class name), ``rules``
        (:attr:`rules`), ``space`` (a digest of its configurations, or an adaptive space's own
        settings) and every other ``__init__`` argument: as the attribute of the same name where
        the tuner keeps one, else as it was passed (or its default), but those in
        :attr:`recorded_elsewhere` (:func:`stagetree.tuners._settings.tuner_settings`)."""
        return tuner_settings(self)

    # ------------------------------------------------------------------ decisions

    @property
    def name(self) -> str:
        """The tuner's name in its decisions: the class name."""
        return type(self).__name__

    def decide(self, study: Study, decision: Decision) -> Decision:
        """Record ``decision`` in the study's log (:meth:`Study.decide`) before the requests it
        causes, and tell the space (an adaptive space such as an Optuna one learns from the
        tuner's decisions: ``space.decided(study, decision)``); returns it."""
        study.decide(decision, self.name)
        decided = getattr(self.space, "decided", None)
        if decided is not None:
            decided(study, decision)
        return decision

    def configurations(self, study: Study, count: int | None = None) -> list[HPConfig]:
        """The first ``count`` (default: all) configurations of the space for ``study``. A space
        with ``configurations(study, tuner, count)`` makes them for the study (an Optuna space
        asks its sampler); any other iterable is read in order."""
        make = getattr(self.space, "configurations", None)
        if make is not None:
            return list(make(study, self, count))
        return list(itertools.islice(iter(self.space), count))

    def value(self, result: TrialResult) -> float | None:
        """The metric's value in ``result`` as reported (None: failed, or a null metric)."""
        if result.failed:
            return None
        value = result.metrics.get(self.metric)
        return None if value is None else float(value)

    def rankings(self, results: list[TrialResult], kept: int) -> dict[str, Ranking]:
        """The evidence of a cut of ``results`` keeping the best ``kept``, per trial id: its rank
        (:meth:`rank` order) and the worst kept value."""
        ranked = self.rank(results)
        winners = [r for r in ranked[:kept] if not r.failed]
        threshold = self.value(winners[-1]) if winners else None
        return {r.trial_id: Ranking(metric=self.metric, mode=self.mode, value=self.value(r), rank=i + 1,
                                    of=len(ranked), kept=len(winners), threshold=threshold)
                for i, r in enumerate(ranked)}

    def ranking(self, results: list[TrialResult], trial_id: str, kept: int) -> Ranking:
        """:meth:`rankings` of one trial."""
        return self.rankings(results, kept)[trial_id]

    def draw(self, study: Study, configs: Iterable[HPConfig], to_step: int, *, indexes: list[int] | None = None,
             bracket: int | None = None) -> list[HPConfig]:
        """Record a ``draw`` decision for each configuration, in order: the ``indexes``-th of the
        tuner's space (default: its position in ``configs``), with the space's name (its
        ``sampler_name``, else its class) and ``seed``; returns the configurations as a list."""
        configs = list(configs)
        sampler = getattr(self.space, "sampler_name", type(self.space).__name__)
        seed = getattr(self.space, "seed", None)
        for i, config in enumerate(configs):
            self.decide(study, Draw(trial_id=study.trial_id(study.config(config)), step=0, to_step=to_step,
                                    sampler=sampler, index=i if indexes is None else indexes[i],
                                    seed=seed if isinstance(seed, int) else None, bracket=bracket))
        return configs

    def cut(self, study: Study, results: list[TrialResult], count: int, rung: int, to_step: int, *,
            bracket: int | None = None) -> list[TrialResult]:
        """A synchronous rung: promote the best ``count`` results that did not fail to ``to_step``
        and stop the others, each decision with its :class:`Ranking` (in rank order); returns
        the promoted results."""
        ranked = self.rank(results)
        kept = [r for r in ranked[:count] if not r.failed]
        evidence = self.rankings(ranked, count)
        for r in ranked:
            if r in kept:
                self.decide(study, Promote(trial_id=r.trial_id, step=r.steps, to_step=to_step, rung=rung,
                                           bracket=bracket, evidence=evidence[r.trial_id]))
            else:
                self.decide(study, Stop(trial_id=r.trial_id, step=r.steps, reason="failed" if r.failed else "rank",
                                        rung=rung, bracket=bracket, evidence=evidence[r.trial_id]))
        return kept

    def score(self, metrics: Mapping[str, float | None]) -> float:
        """The metric as a quantity to maximise; a null (non-finite) value ranks last.

        Raises:
            KeyError: the metric was not reported (the message lists what was).
        """
        if self.metric not in metrics:
            raise KeyError(f"metric {self.metric!r} not reported; reported: {sorted(metrics)}")
        value = metrics[self.metric]
        if value is None:
            return float("-inf")
        return float(value) if self.mode == "max" else -float(value)

    def result_score(self, result: TrialResult) -> float:
        """:meth:`score` of a result; a failed trial scores below everything (``-inf`` for
        results whose metric is null, then failed trials)."""
        return -math.inf if result.failed else self.score(result.metrics)

    def rank(self, results: list[TrialResult]) -> list[TrialResult]:
        """Best first, failed trials last; ties broken by trial id so the order is deterministic."""
        return sorted(results, key=lambda r: (r.failed, -self.result_score(r), r.trial_id))

    def keep(self, results: list[TrialResult], count: int) -> list[TrialResult]:
        """The best ``count`` results that did not fail (what a rung keeps or promotes)."""
        return [r for r in self.rank(results)[:count] if not r.failed]

    async def _train(self, study: Study, configs: list[HPConfig], steps: int) -> list[TrialResult]:
        """Train ``configs`` to ``steps`` at once; a failed trial is a result with its error."""
        outcomes = await asyncio.gather(*[study.submit(c, steps) for c in configs], return_exceptions=True)
        results = []
        for config, outcome in zip(configs, outcomes):
            trial_id = study.trial_id(study.config(config))
            if isinstance(outcome, TrialFailed):
                results.append(TrialResult(trial_id, config, steps, {}, error=outcome.error or "failed"))
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results.append(TrialResult(trial_id, config, steps, outcome))
        return results

    def _result(self, study: Study, final: list[TrialResult], everything: dict[str, TrialResult]) -> TunerResult:
        """The result: the best of ``final`` (recorded as the ``answer`` decision), every trial's
        last result, and the study's decisions."""
        best = next((r for r in self.rank(final) if not r.failed), None)
        if best is not None:
            self.decide(study, Answer(trial_id=best.trial_id, step=best.steps,
                                      evidence=self.ranking(final, best.trial_id, 1)))
        finished = getattr(self.space, "finished", None)
        if finished is not None:
            finished(study, final)
        return TunerResult(best, self.metric, self.mode, sorted(everything.values(), key=lambda r: r.trial_id),
                           list(study.decisions))


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum`` (a bool is not); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` is {value!r}, but must be an int >= {minimum}")
    return value


def check_causal(causal: Any) -> bool:
    if not isinstance(causal, bool):
        raise ValueError(f"`causal` is {causal!r}, but must be True or False")
    return causal


def check_reduction(reduction: Any) -> int:
    """The reduction factor (eta) of successive halving: an int >= 2."""
    return positive_int("reduction", reduction, 2)


def check_range(min_steps: Any, max_steps: Any) -> tuple[int, int]:
    """``(min_steps, max_steps)``: positive ints, ``min_steps <= max_steps``."""
    positive_int("min_steps", min_steps)
    positive_int("max_steps", max_steps)
    if min_steps > max_steps:
        raise ValueError(f"`min_steps` is {min_steps}, but must be <= max_steps {max_steps}")
    return min_steps, max_steps


def stable_seed(*parts: str) -> int:
    """A seed in [0, 2**63) from sha256 of ``parts`` (study names, trial ids, steps): the same on
    every run and platform, so a tuner's random choices are a function of what the log holds."""
    return int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:8], "big") >> 1
