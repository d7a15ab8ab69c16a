"""Search spaces and tuners (Hippo §5.3, §5.5), built on asyncio.

A tuner drives a :class:`~stagetree.study.Study`: it submits trials, awaits their metrics and
decides what to train next. Every decision depends only on metrics (never on timing or
unrecorded randomness), so a re-run over the same log takes the same decisions.
Units: ``steps`` are optimizer updates of the trainer.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from events.hp import HPConfig, as_hp
from stagetree.study import Study, wait_all

Mode = Literal["max", "min"]


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
        self.candidates: dict[str, list[Any]] = {}
        for name, values in hp_dict.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"`hp_dict[{name!r}]` is {values!r}, but must be a non-empty list of candidates")
            try:
                self.candidates[name] = [as_hp(v) for v in values]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"`hp_dict[{name!r}]`: {exc}") from None
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
    """One configuration's outcome: the metrics at the largest steps it was trained to."""

    trial_id: str
    hp: HPConfig
    steps: int
    metrics: dict[str, float]


@dataclass
class TunerResult:
    """What a tuner found: the best trial and every trial's last result."""

    best: TrialResult | None
    metric: str
    mode: Mode
    trials: list[TrialResult] = field(default_factory=list)


class Tuner(ABC):
    """Base of tuners: a search space, the metric to optimise and its direction."""

    def __init__(self, space: GridSearchSpace, metric: str, mode: Mode = "max") -> None:
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

    def rank(self, results: list[TrialResult]) -> list[TrialResult]:
        """Best first; ties broken by trial id so the order is deterministic."""
        return sorted(results, key=lambda r: (-self.score(r.metrics), r.trial_id))

    async def _train(self, study: Study, configs: list[HPConfig], steps: int) -> list[TrialResult]:
        metrics = await wait_all([study.submit(c, steps) for c in configs])
        return [TrialResult(study.trial_id(c), c, steps, m) for c, m in zip(configs, metrics)]

    def _result(self, final: list[TrialResult], everything: dict[str, TrialResult]) -> TunerResult:
        ranked = self.rank(final)
        return TunerResult(ranked[0] if ranked else None, self.metric, self.mode,
                           sorted(everything.values(), key=lambda r: r.trial_id))


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
    """Rung budgets of successive halving: min_steps * reduction**k, capped by max_steps (last)."""
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
                keep = max(1, len(alive) // self.reduction)
                alive = [r.hp for r in self.rank(results)[:keep]]
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
                alive = [r.hp for r in self.rank(results)[: self.schedule.milestones[i + 1][1]]]
        return self._result(results, everything)
