"""Tuner decisions: what a tuner decided about a trial, and the evidence it decided on.

One small set of frozen pydantic models shared by every tuner (issue 12), discriminated by
``kind``; each names the trial, the step it was decided at and the evidence. They travel in a
:class:`~events.models.TunerDecided` event, which the SDK appends before the requests the
decision causes, with the log offset its tuner had seen (``decided_at``), so ``replay verify``
recomputes every decision from exactly that prefix (DESIGN.md invariant 3).

=============  ==============================================================================
kind           decision
=============  ==============================================================================
``draw``       a new configuration: the ``index``-th of the tuner's searcher (a space, a
               sampler with its ``seed``, an MLtuner round), trained to ``to_step``
``promote``    a trial goes on to ``to_step`` because it ranked high enough (a rung of
               successive halving, MLtuner's chosen branch becoming the main line)
``continue``   a trial goes on to ``to_step`` because no rule stopped it (median rule, PBT
               member not exploited, MLtuner's main line or a round's next trial length)
``stop``       a trial gets no more steps (``reason``: rank, median, failed, diverged, ...)
``exploit``    a PBT member is replaced by ``new_trial_id``: the ``donor``'s configuration up to
               ``step``, explored from there (``explored``: the values at ``step``)
``keep``       MLtuner keeps its main line (a round found no converging branch)
``retune``     MLtuner starts a tuning round on its main line (progress stalled)
``answer``     the tuner's answer: the best trial
=============  ==============================================================================

Evidence is one of :class:`Ranking` (a trial's place among the results compared),
:class:`MedianRule`, :class:`Quantiles` (PBT), :class:`Progress` (MLtuner's summariser),
:class:`Patience` (MLtuner's main line) and :class:`Pruned` (an Optuna pruner). Metric values
are as reported (not negated for ``mode="min"``); None is a null (non-finite) metric or a failed
trial. Units: steps.

Append-only: a new kind, evidence or field gets a default; old logs never change meaning.
:meth:`describe` gives the sentence ``replay explain`` and the report print, e.g. ``step 40:
stopped by SuccessiveHalving, rung 2: rank 9 of 16 by val_acc 0.9610, top 4 kept (threshold
0.9777)``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, TypeAdapter

Steps = Annotated[int, Field(ge=0, le=2**63 - 1)]
TrialId = Annotated[str, Field(min_length=1, pattern=r"^[^\x00-\x1f\x7f]+$")]
Value = float | None
Direction = Literal["max", "min"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _value(v: float | None) -> str:
    return "none" if v is None else f"{v:.4f}"


# --------------------------------------------------------------------------- evidence


class Ranking(_Frozen):
    """A trial's place among the results a decision compared (a rung, a milestone, the final
    results): ``rank`` (1 = best; failed trials last, ties by trial id) of ``of``, of which the
    best ``kept`` go on; ``threshold`` is the worst kept value (None when none is kept)."""

    rule: Literal["rank"] = "rank"
    metric: str
    mode: Direction
    value: Value
    rank: PositiveInt
    of: PositiveInt
    kept: NonNegativeInt
    threshold: Value = None

    def describe(self) -> str:
        kept = f"top {self.kept} kept"
        if self.threshold is not None:
            kept += f" (threshold {_value(self.threshold)})"
        return f"rank {self.rank} of {self.of} by {self.metric} {_value(self.value)}, {kept}"


class MedianRule(_Frozen):
    """The median stopping rule at one step (Golovin et al. 2017): the trial's ``best`` value so
    far against the ``median`` of the ``others`` results at that step (None with none)."""

    rule: Literal["median"] = "median"
    metric: str
    mode: Direction
    best: Value
    median: Value
    others: NonNegativeInt
    min_trials: PositiveInt
    grace_steps: NonNegativeInt

    def describe(self) -> str:
        if self.others < self.min_trials:
            return (f"best {self.metric} {_value(self.best)} so far; {self.others} other results, fewer than "
                    f"{self.min_trials} needed to stop")
        return (f"best {self.metric} {_value(self.best)} so far vs the median {_value(self.median)} of "
                f"{self.others} others")


class Quantiles(_Frozen):
    """A PBT member's place in its generation: ``rank`` of ``of`` results so far; the top and
    bottom ``cut`` members (``quantile`` of them) are the donors and the exploiters."""

    rule: Literal["quantile"] = "quantile"
    metric: str
    mode: Direction
    value: Value
    rank: PositiveInt
    of: PositiveInt
    cut: NonNegativeInt
    quantile: float

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.of} by {self.metric} {_value(self.value)}; top and bottom {self.cut} "
                f"(quantile {self.quantile:g})")


class Progress(_Frozen):
    """MLtuner's progress summary of a branch run for ``length`` steps in tuning round
    ``round``: its ``label`` (converging, unstable, diverged) and ``speed`` (``metric`` drop per
    step; RELATED_SPEC §3.2)."""

    rule: Literal["progress"] = "progress"
    metric: str
    round: NonNegativeInt
    length: PositiveInt
    label: str
    speed: float

    def describe(self) -> str:
        return f"round {self.round}: {self.label} over {self.length} steps, {self.metric} speed {self.speed:.6g}/step"


class Patience(_Frozen):
    """MLtuner's main line at an evaluation: ``value`` now, the ``best`` so far, and ``stale``
    evaluations in a row without improvement out of the ``patience`` allowed."""

    rule: Literal["patience"] = "patience"
    metric: str
    mode: Direction
    value: Value
    best: Value
    stale: NonNegativeInt
    patience: PositiveInt

    def describe(self) -> str:
        return (f"{self.metric} {_value(self.value)}, best {_value(self.best)}, {self.stale} of {self.patience} "
                "evaluations without improvement")


class Pruned(_Frozen):
    """An Optuna pruner's verdict on the trial's ``value`` reported at the step (``pruner``: its
    class; ``prune``: whether it said to stop). Used by stagetree.integration.optuna."""

    rule: Literal["pruner"] = "pruner"
    pruner: str
    metric: str
    mode: Direction
    value: Value
    prune: bool

    def describe(self) -> str:
        verdict = "prune" if self.prune else "go on"
        return f"{self.pruner} says {verdict} at {self.metric} {_value(self.value)}"


Evidence = Annotated[Ranking | MedianRule | Quantiles | Progress | Patience | Pruned, Field(discriminator="rule")]


# --------------------------------------------------------------------------- decisions


class _Decision(_Frozen):
    """Fields every decision has: the trial it is about and the step it was decided at."""

    trial_id: TrialId
    step: Steps

    def trials(self) -> dict[str, str]:
        """Every trial the decision names -> its role in it ("trial", "donor", "new", "branch_of")."""
        return {self.trial_id: "trial"}

    def describe(self, tuner: str = "the tuner") -> str:
        raise NotImplementedError


class Draw(_Decision):
    """A new configuration: the ``index``-th (from 0) of ``sampler`` (a space, a sampler seeded
    with ``seed``; None when it draws no random numbers), requested to ``to_step``. MLtuner's
    branches name the main line they branch from at ``step`` (``branch_of``) and their
    ``round``; Hyperband names the ``bracket``."""

    kind: Literal["draw"] = "draw"
    to_step: PositiveInt
    sampler: str
    index: NonNegativeInt
    seed: int | None = None
    branch_of: TrialId | None = None
    round: NonNegativeInt | None = None
    bracket: NonNegativeInt | None = None

    def trials(self) -> dict[str, str]:
        return {self.trial_id: "trial", **({self.branch_of: "branch_of"} if self.branch_of else {})}

    def describe(self, tuner: str = "the tuner") -> str:
        where = f"configuration {self.index} of {self.sampler}" + (f" (seed {self.seed})" if self.seed is not None
                                                                     else "")
        if self.branch_of is not None:
            where += f", a branch of {self.branch_of} at step {self.step} in round {self.round}"
        if self.bracket is not None:
            where += f", bracket {self.bracket}"
        return f"step {self.step}: drawn by {tuner}: {where}; requested to step {self.to_step}"


class Promote(_Decision):
    """The trial goes on from ``step`` to ``to_step`` because it ranked high enough at ``rung``
    (0 = the first; Hyperband: of ``bracket``), or (MLtuner) its branch became the main line."""

    kind: Literal["promote"] = "promote"
    to_step: PositiveInt
    rung: NonNegativeInt | None = None
    bracket: NonNegativeInt | None = None
    evidence: Evidence

    def describe(self, tuner: str = "the tuner") -> str:
        return f"step {self.step}: promoted by {tuner}{_rung(self.rung, self.bracket)}: {self.evidence.describe()}; " \
               f"to step {self.to_step}"


class Continue(_Decision):
    """The trial goes on from ``step`` to ``to_step``: no rule stopped it."""

    kind: Literal["continue"] = "continue"
    to_step: PositiveInt
    evidence: Evidence | None = None

    def describe(self, tuner: str = "the tuner") -> str:
        why = f": {self.evidence.describe()}" if self.evidence is not None else ""
        return f"step {self.step}: continued by {tuner}{why}; to step {self.to_step}"


StopReason = Literal["rank", "median", "failed", "diverged", "slower", "not-converging", "patience", "max_steps",
                     "pruned"]


class Stop(_Decision):
    """The trial gets no more steps after ``step``. ``reason``: "rank" (not kept at ``rung``),
    "median" (median rule), "failed" (its training failed: a loss), "diverged" / "slower" /
    "not-converging" (MLtuner branches), "patience" / "max_steps" (MLtuner's main line),
    "pruned" (an Optuna pruner)."""

    kind: Literal["stop"] = "stop"
    reason: StopReason
    rung: NonNegativeInt | None = None
    bracket: NonNegativeInt | None = None
    evidence: Evidence | None = None

    def describe(self, tuner: str = "the tuner") -> str:
        why = self.evidence.describe() if self.evidence is not None else ""
        reason = {"rank": "", "median": "median rule", "failed": "its training failed", "pruned": ""}.get(
            self.reason, self.reason)
        parts = ", ".join(p for p in (reason, why) if p)
        return f"step {self.step}: stopped by {tuner}{_rung(self.rung, self.bracket)}" + (f": {parts}" if parts else "")


class Exploit(_Decision):
    """PBT: the member ``trial_id`` is replaced by ``new_trial_id``, the ``donor``'s configuration
    up to ``step`` and explored from there (``explored``: each mutated hyper-parameter's value at
    ``step``), requested to ``to_step``; random choices drawn with ``seed``."""

    kind: Literal["exploit"] = "exploit"
    donor: TrialId
    new_trial_id: TrialId
    to_step: PositiveInt
    seed: int
    evidence: Quantiles
    donor_value: Value
    explored: dict[str, float | int]

    def trials(self) -> dict[str, str]:
        return {self.trial_id: "trial", self.donor: "donor", self.new_trial_id: "new"}

    def describe(self, tuner: str = "the tuner") -> str:
        explored = ", ".join(f"{k} = {v:g}" for k, v in sorted(self.explored.items()))
        return (f"step {self.step}: exploited by {tuner}: {self.evidence.describe()}; takes donor {self.donor} "
                f"({self.evidence.metric} {_value(self.donor_value)}) as new member {self.new_trial_id}, explored "
                f"{explored} (seed {self.seed}); to step {self.to_step}")


class Keep(_Decision):
    """MLtuner keeps its main line ``trial_id`` at ``step``: tuning ``round`` found no better one."""

    kind: Literal["keep"] = "keep"
    round: NonNegativeInt
    reason: str

    def describe(self, tuner: str = "the tuner") -> str:
        return f"step {self.step}: main line kept by {tuner}: round {self.round}: {self.reason}"


class Retune(_Decision):
    """MLtuner starts tuning ``round`` from its main line ``trial_id`` at ``step``."""

    kind: Literal["retune"] = "retune"
    round: NonNegativeInt
    evidence: Patience

    def describe(self, tuner: str = "the tuner") -> str:
        return f"step {self.step}: re-tuned by {tuner} (round {self.round}): {self.evidence.describe()}"


class Answer(_Decision):
    """The tuner's answer: ``trial_id`` at ``step`` is the best result."""

    kind: Literal["answer"] = "answer"
    evidence: Ranking

    def describe(self, tuner: str = "the tuner") -> str:
        return f"step {self.step}: chosen as the answer by {tuner}: {self.evidence.describe()}"


def _rung(rung: int | None, bracket: int | None) -> str:
    return (f", bracket {bracket}" if bracket is not None else "") + (f", rung {rung}" if rung is not None else "")


Decision = Annotated[Draw | Promote | Continue | Stop | Exploit | Keep | Retune | Answer, Field(discriminator="kind")]
"""Any tuner decision (a pydantic discriminated union on ``kind``)."""

DECISION_ADAPTER: TypeAdapter[Any] = TypeAdapter(Decision)


def decision_from_json(obj: Any) -> Draw | Promote | Continue | Stop | Exploit | Keep | Retune | Answer:
    """Validate a decision's JSON form (``model_dump(mode="json")``). Raises pydantic's
    ValidationError naming the field."""
    return DECISION_ADAPTER.validate_python(obj)  # type: ignore[no-any-return]


class ReleasedResult(_Frozen):
    """A result handed to an asynchronous tuner: the trial's metrics at ``steps``."""

    trial_id: TrialId
    steps: Steps
