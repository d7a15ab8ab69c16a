"""Search spaces and tuners (Hippo §5.3, §5.5), built on asyncio.

A tuner drives a :class:`~stagetree.study.Study`: it submits trials, awaits their metrics and
decides what to train next. Every decision depends only on metrics (never on timing or
unrecorded randomness), so a re-run over the same log takes the same decisions.
Units: ``steps`` are optimizer updates of the trainer.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from events.hp import HPConfig, HPFunction, Piecewise, as_hp
from stagetree.spaces import Choice, IntUniform, LogUniform, Milestones, RandomSearchSpace, Sampled, Uniform
from stagetree.study import Study, TrialFailed

__all__ = [
    "ASHA", "PBT", "Choice", "EarlyStopTuner", "GridSearch", "GridSearchSpace", "Hyperband", "IntUniform", "LogUniform",
    "MLtunerTuner", "MedianStopping", "Milestones", "RandomSearchSpace", "ResultInbox", "Sampled", "Schedule",
    "SuccessiveHalving", "TrialResult", "Tuner", "TunerResult", "Uniform", "continue_with", "rungs", "stable_seed",
]

Mode = Literal["max", "min"]


def candidates_of(field: str, hp_dict: Mapping[str, Any]) -> dict[str, list[HPFunction]]:
    """``hp_dict``'s candidate lists as hyper-parameter functions (numbers become Constant).

    Raises:
        ValueError: a list that is empty or not a list, or an invalid candidate, naming
            ``field[name]`` and the value.
    """
    out: dict[str, list[HPFunction]] = {}
    for name, values in hp_dict.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"`{field}[{name!r}]` is {values!r}, but must be a non-empty list of candidates")
        try:
            out[name] = [as_hp(v) for v in values]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`{field}[{name!r}]`: {exc}") from None
    return out


class GridSearchSpace:
    """The Cartesian product of candidate sequences per hyper-parameter (Hippo §5.3).

    Args:
        hp_dict: name -> list of candidates (HPFunction, number, or JSON dict).
        filter: optional predicate on a configuration; False drops it (conditional spaces).

    Raises:
        ValueError: an empty candidate list, or an invalid candidate (naming the name).
    """

    def __init__(self, hp_dict: Mapping[str, Sequence[Any]], filter: Callable[[HPConfig], bool] | None = None) -> None:
        if not hp_dict:
            raise ValueError("`hp_dict` is {}, but must name at least one hyper-parameter")
        self.candidates: dict[str, list[Any]] = dict(candidates_of("hp_dict", hp_dict))
        self.filter = filter

    def __iter__(self) -> Iterator[HPConfig]:
        names = list(self.candidates)
        for combo in itertools.product(*(self.candidates[n] for n in names)):
            config = dict(zip(names, combo))
            if self.filter is None or self.filter(config):
                yield config

    def __len__(self) -> int:
        return sum(1 for _ in self)


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
    in the order it took them (tuples such as ``("promote", trial_id, from_steps, to_steps)``,
    ``("stop", trial_id, steps)``, ``("exploit", trial_id, donor_id, steps, new_trial_id)``)."""

    best: TrialResult | None
    metric: str
    mode: Mode
    trials: list[TrialResult] = field(default_factory=list)
    decisions: list[tuple[Any, ...]] = field(default_factory=list)


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
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"`mode` is {mode!r}, but must be 'max' or 'min'")
        if not metric:
            raise ValueError(f"`metric` is {metric!r}, but must name a metric")
        self.space = space
        self.metric = metric
        self.mode: Mode = mode

    @abstractmethod
    async def run(self, study: Study) -> TunerResult:
        """Tune ``study`` and return the result."""

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

    def _result(self, final: list[TrialResult], everything: dict[str, TrialResult]) -> TunerResult:
        best = next((r for r in self.rank(final) if not r.failed), None)
        return TunerResult(best, self.metric, self.mode, sorted(everything.values(), key=lambda r: r.trial_id))


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` is {value!r}, but must be a positive int")
    return value


class GridSearch(Tuner):
    """Train every configuration of the space to ``steps`` steps and pick the best."""

    def __init__(self, space: GridSearchSpace, steps: int, metric: str, mode: Mode = "max") -> None:
        super().__init__(space, metric, mode)
        self.steps = _check_positive("steps", steps)

    async def run(self, study: Study) -> TunerResult:
        results = await self._train(study, list(self.space), self.steps)
        return self._result(results, {r.trial_id: r for r in results})


def rungs(min_steps: int, max_steps: int, reduction: int) -> list[int]:
    """Rung budgets of successive halving: min_steps * reduction**k, capped by max_steps (last).

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2`` (with
            ``reduction <= 1`` the rungs would never reach ``max_steps``).
    """
    _check_range(min_steps, max_steps)
    _check_reduction(reduction)
    out = [min_steps]
    while out[-1] * reduction < max_steps:
        out.append(out[-1] * reduction)
    if out[-1] != max_steps:
        out.append(max_steps)
    return out


class SuccessiveHalving(Tuner):
    """Synchronous successive halving (SHA; Jamieson & Talwalkar 2016, as used in Hippo §6).

    Every configuration trains to ``min_steps``; at each rung the best 1/``reduction`` (at least
    one) continue to ``reduction`` times more steps, up to ``max_steps``. A promotion is a new
    request on the same trial, so it resumes from the trial's own checkpoint.

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2``.
    """

    def __init__(self, space: GridSearchSpace, metric: str, mode: Mode = "max", *, min_steps: int,
                 max_steps: int, reduction: int = 4) -> None:
        super().__init__(space, metric, mode)
        self.min_steps = _check_positive("min_steps", min_steps)
        self.max_steps = _check_positive("max_steps", max_steps)
        if min_steps > max_steps:
            raise ValueError(f"`min_steps` is {min_steps}, but must be <= max_steps {max_steps}")
        if isinstance(reduction, bool) or not isinstance(reduction, int) or reduction < 2:
            raise ValueError(f"`reduction` is {reduction!r}, but must be an int >= 2")
        self.reduction = reduction

    def rungs(self) -> list[int]:
        return rungs(self.min_steps, self.max_steps, self.reduction)

    async def run(self, study: Study) -> TunerResult:
        alive = list(self.space)
        everything: dict[str, TrialResult] = {}
        results: list[TrialResult] = []
        budgets = self.rungs()
        for k, steps in enumerate(budgets):
            results = await self._train(study, alive, steps)
            everything.update({r.trial_id: r for r in results})
            if k + 1 < len(budgets):
                alive = [r.hp for r in self.keep(results, max(1, len(alive) // self.reduction))]
        return self._result(results, everything)


@dataclass(frozen=True)
class Schedule:
    """Early-stopping milestones: at ``steps``, keep the best ``keep`` trials alive (Hippo §5.5).

    ``Schedule.from_milestones((5, 8), (10, 4))`` trains 8 trials to 5 steps, keeps the best 4
    and trains them to 10.
    """

    milestones: tuple[tuple[int, int], ...]

    @classmethod
    def from_milestones(cls, *milestones: tuple[int, int]) -> Schedule:
        """Raises ValueError unless steps strictly increase and kept counts do not increase."""
        if not milestones:
            raise ValueError("`milestones` is empty, but must hold (steps, keep) pairs")
        for i, pair in enumerate(milestones):
            if len(pair) != 2:
                raise ValueError(f"`milestones[{i}]` is {pair!r}, but must be a (steps, keep) pair")
            _check_positive(f"milestones[{i}].steps", pair[0])
            _check_positive(f"milestones[{i}].keep", pair[1])
            if i and (pair[0] <= milestones[i - 1][0] or pair[1] > milestones[i - 1][1]):
                raise ValueError(f"`milestones[{i}]` is {pair!r}: steps must increase and keep must not")
        return cls(tuple((int(s), int(k)) for s, k in milestones))


class EarlyStopTuner(Tuner):
    """Train the space through a :class:`Schedule`, stopping the worst trials at each milestone
    (Hippo's ``EarlyStopTuner``, Fig. 9). The first milestone's ``keep`` caps how many
    configurations start (in space order)."""

    def __init__(self, schedule: Schedule, space: GridSearchSpace, metric: str, mode: Mode = "max") -> None:
        super().__init__(space, metric, mode)
        self.schedule = schedule

    async def run(self, study: Study) -> TunerResult:
        alive = list(self.space)[: self.schedule.milestones[0][1]]
        everything: dict[str, TrialResult] = {}
        results: list[TrialResult] = []
        for i, (steps, _) in enumerate(self.schedule.milestones):
            results = await self._train(study, alive, steps)
            everything.update({r.trial_id: r for r in results})
            if i + 1 < len(self.schedule.milestones):
                alive = [r.hp for r in self.keep(results, self.schedule.milestones[i + 1][1])]
        return self._result(results, everything)


# ----------------------------------------------------------------------------- asynchronous tuners


def stable_seed(*parts: str) -> int:
    """A seed in [0, 2**63) from sha256 of ``parts`` (study names, trial ids, steps): the same on
    every run and platform, so a tuner's random choices are a function of what the log holds."""
    return int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:8], "big") >> 1


P = TypeVar("P")


@dataclass
class _Entry(Generic[P]):
    future: asyncio.Future[dict[str, float]]
    trial_id: str
    steps: int
    group: int
    index: int
    payload: P


class ResultInbox(Generic[P]):
    """Hands an asynchronous tuner the results of its requests one at a time, in an order that a
    replay of the log reproduces.

    * Arrival order (``causal=False``): of the results already answered, the one answered
      first in the log (``Trial.answered``, the ordinal the reducer gives each answer), ties by
      submission order.
      Decisions follow the order stages happened to finish, so they depend on the number of
      workers and their timing, but replaying the log feeds the tuner the same order.
    * Causal order (``causal=True``, after NASPipe's causal synchronous parallelism, OSDI'22
      §4): requests belong to *groups* (the results a decision compares, e.g. one rung of ASHA)
      and within a group results are handed over in submission order. A result waits only for
      the earlier results of its own group that are still running. Submission order within a
      group is itself decided in causal order, so every decision, and the study's answer, is
      the same whatever the number of workers and their timing. The price is idle workers while
      a finished result waits for an earlier one (see ``idle_worker_seconds`` in the summary).
    """

    def __init__(self, study: Study, causal: bool = False) -> None:
        self.study = study
        self.causal = causal
        self._entries: list[_Entry[P]] = []
        self._count = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, future: asyncio.Future[dict[str, float]], trial_id: str, steps: int, group: int,
            payload: P) -> None:
        """Register a submitted request; ``group`` orders it in causal mode."""
        self._entries.append(_Entry(future, trial_id, steps, group, self._count, payload))
        self._count += 1

    def submit(self, config: HPConfig, steps: int, group: int, payload: P) -> None:
        """Submit ``config`` for ``steps`` to the study and register the request."""
        self.add(self.study.submit(config, steps), self.study.trial_id(self.study.config(config)), steps, group,
                 payload)

    def _answered_at(self, entry: _Entry[P]) -> float:
        trial = self.study.runtime.state.trials.get(entry.trial_id)
        if trial is None or entry.steps not in trial.answered:
            return math.inf
        return trial.answered[entry.steps]

    def _pick(self) -> _Entry[P] | None:
        if self.causal:
            heads: dict[int, _Entry[P]] = {}
            for e in self._entries:  # in submission order: the first of each group is its head
                heads.setdefault(e.group, e)
            done = [e for e in heads.values() if e.future.done()]
            return min(done, key=lambda e: (e.group, e.index)) if done else None
        done = [e for e in self._entries if e.future.done()]
        return min(done, key=lambda e: (self._answered_at(e), e.index)) if done else None

    async def next(self) -> tuple[P, dict[str, float] | TrialFailed | None]:
        """The next ``(payload, outcome)``: the metrics, the :class:`TrialFailed` of a trial whose
        training failed, or None for a cancelled request. Raises IndexError when nothing is
        registered."""
        if not self._entries:
            raise IndexError("no request is waiting")
        while True:
            entry = self._pick()
            if entry is not None:
                self._entries.remove(entry)
                f = entry.future
                if f.cancelled():
                    return entry.payload, None
                if isinstance(f.exception(), TrialFailed):
                    return entry.payload, f.exception()  # type: ignore[return-value]
                return entry.payload, f.result()
            running = [e.future for e in self._entries if not e.future.done()]
            if not running:  # unreachable: a done head or a done result would have been picked
                raise RuntimeError("the inbox has results but none can be handed over")
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)


def _outcome(study: Study, config: HPConfig, steps: int, outcome: dict[str, float] | TrialFailed) -> TrialResult:
    """The result of a request handed over by a :class:`ResultInbox` (not a cancelled one)."""
    trial_id = study.trial_id(study.config(config))
    if isinstance(outcome, TrialFailed):
        return TrialResult(trial_id, config, steps, {}, error=outcome.error or "failed")
    return TrialResult(trial_id, config, steps, outcome)


def _check_causal(causal: Any) -> bool:
    if not isinstance(causal, bool):
        raise ValueError(f"`causal` is {causal!r}, but must be True or False")
    return causal


def _check_reduction(reduction: Any) -> int:
    if isinstance(reduction, bool) or not isinstance(reduction, int) or reduction < 2:
        raise ValueError(f"`reduction` is {reduction!r}, but must be an int >= 2")
    return reduction


def _check_range(min_steps: Any, max_steps: Any) -> tuple[int, int]:
    _check_positive("min_steps", min_steps)
    _check_positive("max_steps", max_steps)
    if min_steps > max_steps:
        raise ValueError(f"`min_steps` is {min_steps}, but must be <= max_steps {max_steps}")
    return min_steps, max_steps


class ASHA(Tuner):
    """Asynchronous successive halving (Li et al., "A System for Massively Parallel
    Hyperparameter Tuning", MLSys 2020, Algorithm 2; the ASHA of Hippo §6.1).

    Every configuration of the space is requested at the first rung at once (the stage-tree
    scheduler decides what trains first, Hippo §4.3). Each time a result at rung ``k`` is handed
    over (:class:`ResultInbox`), the trials in the top ``floor(n_k / reduction)`` of the ``n_k``
    results of rung ``k`` so far that are not promoted yet are promoted: the same trial is
    requested at rung ``k + 1`` and resumes from its own checkpoint. Rungs are
    ``min_steps * reduction**k`` steps, capped by ``max_steps`` (:func:`rungs`). The answer is
    the best result at the highest rung reached.

    Assumes results at one rung are comparable across trials. With ``causal=True`` each rung is
    a causal group: decisions and the answer do not depend on the number of workers.

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, min_steps: int,
                 max_steps: int, reduction: int = 4, causal: bool = False) -> None:
        super().__init__(space, metric, mode)
        self.min_steps, self.max_steps = _check_range(min_steps, max_steps)
        self.reduction = _check_reduction(reduction)
        self.causal = _check_causal(causal)

    def rungs(self) -> list[int]:
        return rungs(self.min_steps, self.max_steps, self.reduction)

    async def run(self, study: Study) -> TunerResult:
        budgets = self.rungs()
        inbox: ResultInbox[tuple[HPConfig, int]] = ResultInbox(study, self.causal)
        for config in self.space:
            inbox.submit(config, budgets[0], 0, (config, 0))
        at_rung: list[list[TrialResult]] = [[] for _ in budgets]
        promoted: list[set[str]] = [set() for _ in budgets]
        everything: dict[str, TrialResult] = {}
        decisions: list[tuple[Any, ...]] = []
        while inbox:
            (config, k), outcome = await inbox.next()
            if outcome is None:
                continue
            result = _outcome(study, config, budgets[k], outcome)
            at_rung[k].append(result)  # a failed trial counts at its rung, ranked last
            everything[result.trial_id] = result
            if k + 1 == len(budgets):
                continue
            for r in self.keep(at_rung[k], len(at_rung[k]) // self.reduction):
                if r.trial_id not in promoted[k]:
                    promoted[k].add(r.trial_id)
                    decisions.append(("promote", r.trial_id, budgets[k], budgets[k + 1]))
                    inbox.submit(r.hp, budgets[k + 1], k + 1, (r.hp, k + 1))
        top = next((results for results in reversed(at_rung) if results), [])
        result = self._result(top, everything)
        result.decisions = decisions
        return result


class Hyperband(Tuner):
    """Hyperband (Li et al., "Hyperband: A Novel Bandit-Based Approach to Hyperparameter
    Optimization", JMLR 2018, Algorithm 1): brackets of successive halving that trade the number
    of configurations against the steps each starts with.

    With ``s_max = floor(log_reduction(max_steps / min_steps))``, bracket ``s`` (``s_max`` down
    to 0) starts ``n_s = ceil((s_max + 1) / (s + 1) * reduction**s)`` configurations at
    ``max_steps / reduction**s`` steps (rounded, at least ``min_steps``) and keeps the best
    ``floor(n / reduction)`` (at least one) at each rung, up to ``max_steps``. Brackets run at
    once. Configurations are dealt to brackets in the order of a stable hash of
    ``(study, trial id)``, cycling through the space when it is smaller than the brackets need
    (a configuration in two brackets is one trial, trained once). The answer is the best final
    result over all brackets. Units: steps.

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, min_steps: int,
                 max_steps: int, reduction: int = 3) -> None:
        super().__init__(space, metric, mode)
        self.min_steps, self.max_steps = _check_range(min_steps, max_steps)
        self.reduction = _check_reduction(reduction)

    def brackets(self) -> list[tuple[int, list[int]]]:
        """``(n configurations, rung steps)`` of each bracket, most exploratory first."""
        s_max = 0
        while self.min_steps * self.reduction ** (s_max + 1) <= self.max_steps:
            s_max += 1
        out = []
        for s in range(s_max, -1, -1):
            n = math.ceil((s_max + 1) * self.reduction**s / (s + 1))
            budgets = [max(self.min_steps, round(self.max_steps / self.reduction ** (s - i))) for i in range(s + 1)]
            out.append((n, budgets))
        return out

    async def run(self, study: Study) -> TunerResult:
        configs = sorted(self.space, key=lambda c: stable_seed(study.name, study.trial_id(study.config(c))))
        jobs = []
        position = 0
        for n, budgets in self.brackets():
            chosen: dict[str, HPConfig] = {}
            for j in range(n):
                if not configs:
                    break
                c = configs[(position + j) % len(configs)]
                chosen.setdefault(study.trial_id(study.config(c)), c)
            position += n
            jobs.append(self._bracket(study, list(chosen.values()), budgets))
        outcomes = await asyncio.gather(*jobs)
        everything: dict[str, TrialResult] = {}
        final: dict[str, TrialResult] = {}
        decisions: list[tuple[Any, ...]] = []
        for b, (last, seen, promoted) in enumerate(outcomes):
            everything.update(seen)
            final.update({r.trial_id: r for r in last})
            decisions += [("promote", b, *p) for p in promoted]
        result = self._result(list(final.values()), everything)
        result.decisions = decisions
        return result

    async def _bracket(self, study: Study, alive: list[HPConfig], budgets: list[int]
                       ) -> tuple[list[TrialResult], dict[str, TrialResult], list[tuple[str, int, int]]]:
        seen: dict[str, TrialResult] = {}
        promoted: list[tuple[str, int, int]] = []
        results: list[TrialResult] = []
        for k, steps in enumerate(budgets):
            if not alive:
                break
            results = await self._train(study, alive, steps)
            seen.update({r.trial_id: r for r in results})
            if k + 1 < len(budgets):
                keep = self.keep(results, max(1, len(alive) // self.reduction))
                promoted += [(r.trial_id, steps, budgets[k + 1]) for r in keep]
                alive = [r.hp for r in keep]
        return results, seen, promoted


class MedianStopping(Tuner):
    """The median stopping rule (Golovin et al., "Google Vizier: A Service for Black-Box
    Optimization", KDD 2017, §3.2.2).

    Every configuration is requested at ``interval`` steps, then every ``interval`` steps up to
    ``max_steps``. When trial ``t``'s result at step ``s`` is handed over, ``t`` is stopped if
    ``s >= grace_steps``, at least ``min_trials`` other trials have reported at ``s``, and ``t``'s
    best result so far is worse than the median of the others' results at ``s``; otherwise it is
    requested at the next step. The answer is the best result at ``max_steps``.

    Units: steps. Assumes the metric improves with training, so results at equal steps compare.
    With ``causal=True`` each evaluation step is a causal group.

    Raises:
        ValueError: non-positive ``interval``/``max_steps``/``min_trials``, negative ``grace_steps``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, max_steps: int,
                 interval: int, grace_steps: int = 0, min_trials: int = 3, causal: bool = False) -> None:
        super().__init__(space, metric, mode)
        self.max_steps = _check_positive("max_steps", max_steps)
        self.interval = _check_positive("interval", interval)
        self.min_trials = _check_positive("min_trials", min_trials)
        if isinstance(grace_steps, bool) or not isinstance(grace_steps, int) or grace_steps < 0:
            raise ValueError(f"`grace_steps` is {grace_steps!r}, but must be an int >= 0")
        self.grace_steps = grace_steps
        self.causal = _check_causal(causal)

    def points(self) -> list[int]:
        """The evaluation steps: every ``interval`` steps, and ``max_steps``."""
        return [*range(self.interval, self.max_steps, self.interval), self.max_steps]

    async def run(self, study: Study) -> TunerResult:
        points = self.points()
        inbox: ResultInbox[tuple[HPConfig, int]] = ResultInbox(study, self.causal)
        for config in self.space:
            inbox.submit(config, points[0], 0, (config, 0))
        reported: list[list[tuple[str, float]]] = [[] for _ in points]
        best_so_far: dict[str, float] = {}
        everything: dict[str, TrialResult] = {}
        final: list[TrialResult] = []
        decisions: list[tuple[Any, ...]] = []
        while inbox:
            (config, i), outcome = await inbox.next()
            if outcome is None:
                continue
            result = _outcome(study, config, points[i], outcome)
            everything[result.trial_id] = result
            if result.failed:
                continue  # stopped where it failed; the medians use results that exist
            score = self.score(result.metrics)
            best = best_so_far[result.trial_id] = max(best_so_far.get(result.trial_id, -math.inf), score)
            others = [v for t, v in reported[i] if t != result.trial_id]
            reported[i].append((result.trial_id, score))
            if i + 1 == len(points):
                final.append(result)
                continue
            if points[i] >= self.grace_steps and len(others) >= self.min_trials and best < statistics.median(others):
                decisions.append(("stop", result.trial_id, points[i]))
                continue
            inbox.submit(config, points[i + 1], i + 1, (config, i + 1))
        out = self._result(final, everything)
        out.decisions = decisions
        return out


def continue_with(fn: HPFunction, then: HPFunction, at: int) -> HPFunction:
    """``fn`` up to step ``at``, then ``then`` in its own frame (starting at 0 at ``at``): a
    Piecewise, flattened when ``fn`` is one already. Raises ValueError unless ``at`` is after
    ``fn``'s last boundary."""
    if isinstance(fn, Piecewise):
        return Piecewise([*fn.functions, then], [*fn.boundaries, at])
    return Piecewise([fn, then], [at])


class PBT(Tuner):
    """Population based training (Jaderberg et al., "Population Based Training of Neural
    Networks", 2017, §3), on the search plan.

    The first ``population`` configurations of the space train in ``interval``-step
    generations up to ``max_steps``. When a member's result at step ``g`` is handed over and it
    is in the bottom ``quantile`` of the results at ``g`` so far (while the top ``quantile`` holds
    at least one other trial), it *exploits*: it takes the configuration of a trial drawn from
    the top ``quantile`` (the donor) and *explores* from step ``g`` on: every hyper-parameter
    named in ``mutations`` is resampled from its candidates with probability
    ``resample_probability``, else moved to a neighbouring candidate (by the value at ``g``).
    The new member is a new trial whose sequences equal the donor's up to ``g``
    (:func:`continue_with`), so the search plan branches a new node at the donor's step ``g``
    and the member starts from the donor's checkpoint there: exploiting copies no weights, and
    a PBT schedule is an ordinary hyper-parameter sequence that report and replay show.

    Random choices come from :func:`stable_seed` of ``(study, trial id, step)``. Units: steps.
    With ``causal=True`` each generation is a causal group. Assumes results at equal steps
    compare across members.

    Raises:
        ValueError: bad counts, a quantile outside (0, 0.5], a probability outside [0, 1], or a
            mutation that names no candidates.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, population: int,
                 interval: int, max_steps: int, mutations: Mapping[str, Sequence[Any]], quantile: float = 0.25,
                 resample_probability: float = 0.25, causal: bool = False) -> None:
        super().__init__(space, metric, mode)
        self.population = _check_positive("population", population)
        self.interval = _check_positive("interval", interval)
        self.max_steps = _check_positive("max_steps", max_steps)
        if not isinstance(quantile, (int, float)) or not 0 < quantile <= 0.5:
            raise ValueError(f"`quantile` is {quantile!r}, but must be in (0, 0.5]")
        if not isinstance(resample_probability, (int, float)) or not 0 <= resample_probability <= 1:
            raise ValueError(f"`resample_probability` is {resample_probability!r}, but must be in [0, 1]")
        if not mutations:
            raise ValueError("`mutations` is empty, but must name at least one hyper-parameter to explore")
        self.mutations = candidates_of("mutations", mutations)
        self.quantile = float(quantile)
        self.resample_probability = float(resample_probability)
        self.causal = _check_causal(causal)

    def generations(self) -> list[int]:
        """The steps at which members are compared: every ``interval`` steps, and ``max_steps``."""
        return [*range(self.interval, self.max_steps, self.interval), self.max_steps]

    def explore(self, config: HPConfig, at: int, rng: np.random.Generator) -> HPConfig:
        """``config`` up to step ``at``, with the mutated hyper-parameters changed from ``at`` on."""
        out = dict(config)
        for name in sorted(self.mutations):
            if name not in config:
                raise ValueError(f"`mutations` names {name!r}, which the configuration {sorted(config)} lacks")
            candidates = self.mutations[name]
            current = config[name].value(at)
            index = next((i for i, c in enumerate(candidates) if c.value(0) == current), None)
            if index is None or rng.random() < self.resample_probability:
                choice = candidates[int(rng.integers(len(candidates)))]
            else:
                step = 1 if rng.random() < 0.5 else -1
                choice = candidates[min(max(index + step, 0), len(candidates) - 1)]
            out[name] = continue_with(config[name], choice, at)
        return out

    async def run(self, study: Study) -> TunerResult:
        gens = self.generations()
        inbox: ResultInbox[tuple[HPConfig, int]] = ResultInbox(study, self.causal)
        for config in itertools.islice(iter(self.space), self.population):
            inbox.submit(config, gens[0], 0, (config, 0))
        at_gen: list[list[TrialResult]] = [[] for _ in gens]
        everything: dict[str, TrialResult] = {}
        final: list[TrialResult] = []
        decisions: list[tuple[Any, ...]] = []
        while inbox:
            (config, g), outcome = await inbox.next()
            if outcome is None:
                continue
            result = _outcome(study, config, gens[g], outcome)
            everything[result.trial_id] = result
            if result.failed:
                continue  # the member ends; quantiles use results that exist
            at_gen[g].append(result)
            if g + 1 == len(gens):
                final.append(result)
                continue
            ranked = self.rank(at_gen[g])
            cut = int(len(ranked) * self.quantile)
            top, bottom = ranked[:cut], ranked[len(ranked) - cut:] if cut else []
            nxt = config
            if cut and any(b.trial_id == result.trial_id for b in bottom) \
                    and all(t.trial_id != result.trial_id for t in top):
                rng = np.random.default_rng(stable_seed(study.name, result.trial_id, str(gens[g])))
                donor = top[int(rng.integers(len(top)))]
                nxt = self.explore(donor.hp, gens[g], rng)
                decisions.append(("exploit", result.trial_id, donor.trial_id, gens[g],
                                  study.trial_id(study.config(nxt))))
            inbox.submit(nxt, gens[g + 1], g + 1, (nxt, g + 1))
        out = self._result(final, everything)
        out.decisions = decisions
        return out


def __getattr__(name: str) -> Any:
    """``MLtunerTuner`` lives in its own module, which imports this one: re-exported lazily."""
    if name == "MLtunerTuner":
        from stagetree.mltuner import MLtunerTuner

        return MLtunerTuner
    raise AttributeError(f"module 'stagetree.tuners' has no attribute {name!r}")
