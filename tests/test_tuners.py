"""Tuners (stagetree/tuners.py) against hand-computed expectations.

The tuners drive a real :class:`~stagetree.study.Study`. The training backend under it is a
test double, :class:`FormulaRuntime`: it answers every ``(trial, steps)`` request as soon as
the study's batch is appended, with metrics given by a known formula of the trial's
hyper-parameter values and the steps. It records every appended batch, so the tests can check
exactly which trials each rung or milestone submitted, and at how many steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from events.hp import Constant, MultiStep, Piecewise
from events.models import Event, TrialSubmitted, TunerDecided
from gpu_worker.trainer import Trainer
from projections.state import State
from stagetree.study import Study, TrialFailed
from stagetree.tuners import (
    EarlyStopTuner,
    GridSearch,
    GridSearchSpace,
    Schedule,
    SuccessiveHalving,
    TunerResult,
    rungs,
)

Formula = Callable[[dict[str, float], int], dict[str, float]]


class XYTrainer(Trainer):
    """Never trained: the Study only reads its hyper-parameter names and fingerprint."""

    hyperparameters = ("x", "y")

    def build(self, seed: int, device: torch.device) -> None:  # pragma: no cover
        raise AssertionError("not trained in these tests")

    def train_size(self) -> int:  # pragma: no cover
        return 0

    def setup(self, hp: dict[str, float | int]) -> None:  # pragma: no cover
        pass

    def train_step(self, indices: torch.Tensor, step: int) -> None:  # pragma: no cover
        pass

    def evaluate(self) -> dict[str, float]:  # pragma: no cover
        return {}


class FormulaRuntime:
    """Runtime protocol double: metrics = ``formula(hp values at the last step, steps)``.

    Attributes:
        batches: every appended batch of requests as ``[(x, y, steps), ...]`` in submission order.
        trial_ids: the trial ids of every appended batch.
    """

    def __init__(self, formula: Formula) -> None:
        self.formula = formula
        self.state = State()  # never has results, so the study submits every request
        self.batches: list[list[tuple[float, float, int]]] = []
        self.trial_ids: list[list[str]] = []
        self.decided: list[TunerDecided] = []  # the tuner's decisions, in order
        self._waiters: dict[tuple[str, int], list[asyncio.Future[dict[str, float]]]] = {}

    def append(self, events: list[Event]) -> None:
        self.decided += [e for e in events if isinstance(e, TunerDecided)]
        events = [e for e in events if not isinstance(e, TunerDecided)]
        if not events:
            return
        batch = []
        for event in events:
            assert isinstance(event, TrialSubmitted)
            values = {name: fn.value(event.steps - 1) for name, fn in event.hp.items()}
            batch.append((values["x"], values["y"], event.steps))
            try:
                metrics = self.formula(values, event.steps)
            except FloatingPointError as exc:  # the formula's way to say "the trainer raised"
                for future in self._waiters.pop((event.trial_id, event.steps), []):
                    future.set_exception(TrialFailed(event.trial_id, str(exc)))
                continue
            for future in self._waiters.pop((event.trial_id, event.steps), []):
                future.set_result(dict(metrics))
        self.batches.append(batch)
        self.trial_ids.append([e.trial_id for e in events])

    def watch(self, trial_id: str, steps: int) -> asyncio.Future[dict[str, float]]:
        future: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault((trial_id, steps), []).append(future)
        return future

    def prefix(self, plan_key: str) -> dict[str, int]:
        return {"decided_at": self.state.offset}


def tune(tuner: Any, formula: Formula) -> tuple[TunerResult, FormulaRuntime, Study]:
    runtime = FormulaRuntime(formula)
    study = Study(runtime, "tuners", XYTrainer(), seed=0)
    result = asyncio.run(asyncio.wait_for(tuner.run(study), timeout=30))
    assert not runtime._waiters, "a request was never submitted"
    return result, runtime, study


def xs(batch: list[tuple[float, float, int]]) -> list[float]:
    return sorted(x for x, _, _ in batch)


def steps_of(batch: list[tuple[float, float, int]]) -> set[int]:
    return {s for _, _, s in batch}


def space_x(n: int, **kw: Any) -> GridSearchSpace:
    return GridSearchSpace({"x": list(range(n)), "y": [0]}, **kw)


# ============================================================================ rungs


def test_rungs() -> None:
    assert rungs(30, 480, 4) == [30, 120, 480]
    assert rungs(1, 10, 3) == [1, 3, 9, 10]
    assert rungs(10, 160, 2) == [10, 20, 40, 80, 160]
    assert rungs(5, 5, 2) == [5]
    assert rungs(5, 6, 4) == [5, 6]
    assert rungs(1, 100, 10) == [1, 10, 100]
    assert SuccessiveHalving(space_x(2), "acc", min_steps=30, max_steps=480, reduction=4).rungs() == [30, 120, 480]


def test_rungs_refuse_a_reduction_that_never_reaches_max_steps() -> None:
    """Issue 11 item 7: the public function looped forever with reduction <= 1."""
    for reduction in (1, 0, -2):
        with pytest.raises(ValueError, match=f"`reduction` is {reduction}, but must be an int >= 2"):
            rungs(1, 100, reduction)
    with pytest.raises(ValueError, match="`min_steps` is 10, but must be <= max_steps 5"):
        rungs(10, 5, 2)


# ============================================================================ a failed trial is a loss


def _failing_x0(values: dict[str, float], steps: int) -> dict[str, float]:
    """Configuration x == 0 fails at any steps (its trainer raises); the others score x."""
    if values["x"] == 0:
        raise FloatingPointError("loss diverged")
    return {"acc": values["x"] + values["y"] * 0.01 + steps * 0.001, "loss": 1.0 / (1 + steps + values["x"])}


def _all_tuner_families() -> list[tuple[str, Any]]:
    from stagetree.tuners import ASHA, PBT, Hyperband, MedianStopping, MLtunerTuner

    space = space_x(8)
    return [
        ("GridSearch", GridSearch(space, steps=4, metric="acc")),
        ("SuccessiveHalving", SuccessiveHalving(space, "acc", min_steps=1, max_steps=8, reduction=2)),
        ("EarlyStopTuner", EarlyStopTuner(Schedule.from_milestones((2, 8), (4, 4), (8, 2)), space, "acc")),
        ("Hyperband", Hyperband(space, "acc", min_steps=1, max_steps=9, reduction=3)),
        ("ASHA", ASHA(space, "acc", min_steps=1, max_steps=8, reduction=2)),
        ("ASHA causal", ASHA(space, "acc", min_steps=1, max_steps=8, reduction=2, causal=True)),
        ("MedianStopping", MedianStopping(space, "acc", max_steps=8, interval=2, min_trials=2)),
        ("PBT", PBT(space, "acc", population=8, interval=2, max_steps=8, mutations={"y": [0, 1, 2]})),
        ("MLtunerTuner", MLtunerTuner([{"x": 1, "y": 0}], "acc", tunables={"x": [0, 1, 2, 3]}, max_steps=8,
                                      epoch_steps=2, trial_steps=2, points=2, patience=2)),
    ]


@pytest.mark.parametrize(("family", "tuner"), _all_tuner_families(), ids=[f for f, _ in _all_tuner_families()])
def test_a_failed_trial_is_a_loss_in_every_tuner(family: str, tuner: Any) -> None:
    """Issue 11 item 17, one rule for all tuners: the study goes on, the failed trial has its
    error, is never requested again after failing, and is never the answer."""
    result, runtime, study = tune(tuner, _failing_x0)
    failed = [r for r in result.trials if r.failed]
    assert failed and all(r.error == "loss diverged" and r.metrics == {} for r in failed)
    assert result.best is not None and not result.best.failed and result.best.hp["x"].value(0) != 0
    # Requests of the failing configuration all went out in one batch (several steps at once, or
    # one configuration in two Hyperband brackets), before its failure was known: none after.
    batches = [i for i, batch in enumerate(runtime.batches) if any(x == 0 for x, _, _ in batch)]
    assert len(batches) == 1, f"{family} asked the failed trial again in batches {batches}"


def _null_at_x0(values: dict[str, float], steps: int) -> dict[str, float | None]:
    """Configuration x == 0 reports null metrics (a trainer's NaN or inf, as MetricsReported
    records it); the others score x, as :func:`_failing_x0`."""
    if values["x"] == 0:
        return {"acc": None, "loss": None}
    return _failing_x0(values, steps)


@pytest.mark.parametrize(("family", "tuner"), _all_tuner_families(), ids=[f for f, _ in _all_tuner_families()])
def test_a_null_metric_ranks_last_in_every_tuner(family: str, tuner: Any) -> None:
    """A non-finite metric (null in the log) is no failure: the trial has its results, but it
    ranks below every finite one, so it is never the answer (README "Writing a trainer")."""
    result, _, _ = tune(tuner, _null_at_x0)  # type: ignore[arg-type]
    nulls = [r for r in result.trials if r.hp["x"].value(0) == 0]
    assert nulls and all(not r.failed and r.metrics["acc"] is None for r in nulls), family
    assert result.best is not None and result.best.hp["x"].value(0) != 0 and result.best.metrics["acc"] is not None


# ============================================================================ successive halving


def test_successive_halving_16_configs_reduction_2() -> None:
    # Best is the x closest to 10.3; no ties: |x - 10.3| are all distinct.
    formula = lambda v, s: {"acc": s - (v["x"] - 10.3) ** 2, "loss": (v["x"] - 10.3) ** 2}  # noqa: E731
    tuner = SuccessiveHalving(space_x(16), "acc", "max", min_steps=10, max_steps=160, reduction=2)
    result, runtime, study = tune(tuner, formula)

    assert [len(b) for b in runtime.batches] == [16, 8, 4, 2, 1]
    assert [steps_of(b) for b in runtime.batches] == [{10}, {20}, {40}, {80}, {160}]
    assert xs(runtime.batches[0]) == list(range(16))
    assert xs(runtime.batches[1]) == [7, 8, 9, 10, 11, 12, 13, 14]
    assert xs(runtime.batches[2]) == [9, 10, 11, 12]
    assert xs(runtime.batches[3]) == [10, 11]
    assert xs(runtime.batches[4]) == [10]

    assert result.best is not None
    assert result.best.hp == {"x": Constant(10), "y": Constant(0)}
    assert result.best.steps == 160
    assert result.best.metrics == pytest.approx({"acc": 160 - 0.09, "loss": 0.09})
    assert result.best.trial_id == study.trial_id(study.config({"x": 10, "y": 0}))
    assert (result.metric, result.mode) == ("acc", "max")
    # Every trial's last result: how far each x got.
    last = {r.hp["x"].value(0): r.steps for r in result.trials}
    assert last == {**{x: 10 for x in range(16)}, **{x: 20 for x in (7, 8, 13, 14)}, 9: 40, 12: 40,
                    11: 80, 10: 160}
    assert [r.trial_id for r in result.trials] == sorted(r.trial_id for r in result.trials)


def test_successive_halving_min_mode_gives_the_same_survivors() -> None:
    formula = lambda v, s: {"loss": (v["x"] - 10.3) ** 2 / s}  # noqa: E731
    tuner = SuccessiveHalving(space_x(16), "loss", "min", min_steps=10, max_steps=160, reduction=2)
    result, runtime, _ = tune(tuner, formula)
    assert [xs(b) for b in runtime.batches[2:]] == [[9, 10, 11, 12], [10, 11], [10]]
    assert result.best is not None and result.best.hp["x"] == Constant(10)


def test_successive_halving_promotes_on_the_metrics_at_each_rung() -> None:
    # Large x looks best early, small x is best late: the answer is the best *survivor*.
    formula = lambda v, s: {"acc": v["x"] if s < 40 else -v["x"]}  # noqa: E731
    tuner = SuccessiveHalving(space_x(16), "acc", min_steps=10, max_steps=160, reduction=2)
    result, runtime, _ = tune(tuner, formula)
    assert [xs(b) for b in runtime.batches] == [
        list(range(16)), [8, 9, 10, 11, 12, 13, 14, 15], [12, 13, 14, 15], [12, 13], [12]]
    assert result.best is not None and result.best.hp["x"] == Constant(12)
    assert result.best.metrics == {"acc": -12}


def test_successive_halving_reduction_4_keeps_a_quarter_and_at_least_one() -> None:
    formula = lambda v, s: {"acc": v["x"]}  # noqa: E731
    tuner = SuccessiveHalving(space_x(6), "acc", min_steps=30, max_steps=480, reduction=4)
    _, runtime, _ = tune(tuner, formula)
    # 6 // 4 = 1 survivor after the first rung, then max(1, 1 // 4) = 1.
    assert [(xs(b), steps_of(b)) for b in runtime.batches] == [
        (list(range(6)), {30}), ([5], {120}), ([5], {480})]


def test_promotion_resubmits_the_same_trial() -> None:
    formula = lambda v, s: {"acc": v["x"]}  # noqa: E731
    tuner = SuccessiveHalving(space_x(4), "acc", min_steps=1, max_steps=4, reduction=2)
    _, runtime, study = tune(tuner, formula)
    seen = runtime.trial_ids
    assert [len(ids) for ids in seen] == [4, 2, 1]
    assert set(seen[1]) <= set(seen[0]) and set(seen[2]) <= set(seen[1])
    assert seen[2] == [study.trial_id(study.config({"x": 3, "y": 0}))]


# ============================================================================ grid search


GRID = GridSearchSpace({"x": [0, 1, 2, 3, 4], "y": [0.0, 1.0]})


def test_grid_search_argmax() -> None:
    formula = lambda v, s: {"acc": -((v["x"] - 2) ** 2) + 0.5 * v["y"], "loss": (v["x"] - 3) ** 2 + v["y"]}  # noqa: E731
    result, runtime, _ = tune(GridSearch(GRID, steps=25, metric="acc", mode="max"), formula)
    assert len(runtime.batches) == 1 and len(runtime.batches[0]) == 10
    assert steps_of(runtime.batches[0]) == {25}
    assert result.best is not None
    assert result.best.hp == {"x": Constant(2), "y": Constant(1.0)}
    assert result.best.metrics == {"acc": 0.5, "loss": 2.0}
    assert result.best.steps == 25
    assert len(result.trials) == 10


def test_grid_search_argmin() -> None:
    formula = lambda v, s: {"acc": -((v["x"] - 2) ** 2) + 0.5 * v["y"], "loss": (v["x"] - 3) ** 2 + v["y"]}  # noqa: E731
    result, _, _ = tune(GridSearch(GRID, steps=25, metric="loss", mode="min"), formula)
    assert result.best is not None
    assert result.best.hp == {"x": Constant(3), "y": Constant(0.0)}
    assert result.best.metrics["loss"] == 0.0
    assert (result.metric, result.mode) == ("loss", "min")


def test_grid_search_ties_are_broken_by_trial_id() -> None:
    # x = 2 and x = 3 tie for the best score, for either y.
    formula = lambda v, s: {"acc": -abs(v["x"] - 2.5)}  # noqa: E731
    for mode, sign in (("max", 1), ("min", -1)):
        result, _, study = tune(GridSearch(GRID, steps=5, metric="acc", mode=mode),
                                lambda v, s, sign=sign: {"acc": sign * formula(v, s)["acc"]})
        tied = [study.trial_id(study.config({"x": x, "y": y})) for x in (2, 3) for y in (0.0, 1.0)]
        assert result.best is not None and result.best.trial_id == min(tied)
    # Everything ties: the smallest trial id wins.
    result, _, study = tune(GridSearch(GRID, steps=5, metric="acc"), lambda v, s: {"acc": 1.0})
    assert result.best is not None
    assert result.best.trial_id == min(study.trial_id(c) for c in GRID)


def test_grid_search_uses_the_sequence_not_just_its_start() -> None:
    # The double scores the value at the last trained step: the chain 0 -> 1 at step 10 ends
    # higher than the constant 0.5, although it starts lower.
    chain = Piecewise((Constant(0.0), Constant(1.0)), (10,))
    space = GridSearchSpace({"x": [0], "y": [Constant(0.5), chain]})
    result, _, _ = tune(GridSearch(space, steps=20, metric="y"), lambda v, s: {"y": v["y"]})
    assert result.best is not None and result.best.hp["y"] == chain
    assert result.best.metrics == {"y": 1.0} and len(result.trials) == 2


def test_missing_metric_names_it() -> None:
    with pytest.raises(KeyError, match="val_acc"):
        tune(GridSearch(GRID, steps=5, metric="val_acc"), lambda v, s: {"acc": 1.0})


# ============================================================================ early stopping


def test_early_stop_tuner_8_to_5_then_best_4_to_10() -> None:
    schedule = Schedule.from_milestones((5, 8), (10, 4))
    assert schedule.milestones == ((5, 8), (10, 4))
    # At 5 steps large x looks best; at 10 small x is best among the survivors.
    formula = lambda v, s: {"acc": v["x"] if s == 5 else -v["x"]}  # noqa: E731
    result, runtime, _ = tune(EarlyStopTuner(schedule, space_x(10), "acc"), formula)
    assert [(xs(b), steps_of(b)) for b in runtime.batches] == [
        (list(range(8)), {5}),  # only the first 8 configurations of the space start
        ([4, 5, 6, 7], {10}),
    ]
    assert result.best is not None and result.best.hp["x"] == Constant(4)
    assert result.best.steps == 10 and result.best.metrics == {"acc": -4}
    last = {r.hp["x"].value(0): r.steps for r in result.trials}
    assert last == {0: 5, 1: 5, 2: 5, 3: 5, 4: 10, 5: 10, 6: 10, 7: 10}


def test_early_stop_tuner_three_milestones_min_mode() -> None:
    schedule = Schedule.from_milestones((2, 6), (4, 3), (8, 1))
    formula = lambda v, s: {"loss": abs(v["x"] - 4.2) + s}  # noqa: E731
    result, runtime, _ = tune(EarlyStopTuner(schedule, space_x(6), "loss", "min"), formula)
    assert [(xs(b), steps_of(b)) for b in runtime.batches] == [
        (list(range(6)), {2}), ([3, 4, 5], {4}), ([4], {8})]
    assert result.best is not None and result.best.hp["x"] == Constant(4)
    assert result.best.metrics["loss"] == pytest.approx(8.2)


# ============================================================================ search spaces


def test_grid_search_space_product_and_order() -> None:
    space = GridSearchSpace({"x": [1, 2, 3], "y": [0.1, 0.2]})
    assert len(space) == 6
    configs = list(space)
    assert configs[0] == {"x": Constant(1), "y": Constant(0.1)}
    assert configs[1] == {"x": Constant(1), "y": Constant(0.2)}
    assert configs[-1] == {"x": Constant(3), "y": Constant(0.2)}
    assert [(c["x"].value(0), c["y"].value(0)) for c in configs] == [
        (x, y) for x in (1, 2, 3) for y in (0.1, 0.2)]
    # Numbers become constants; ints stay ints.
    assert configs[0]["x"] != Constant(1.0)
    assert list(space) == configs  # iterable more than once
    big = GridSearchSpace({"a": range(4), "b": [MultiStep(0.1, (5,), 0.1), {"kind": "Constant", "value": 2}],
                           "c": (1, 2, 3)})
    assert len(big) == 24


def test_grid_search_space_filter() -> None:
    space = GridSearchSpace({"x": [1, 2, 3], "y": [0.1, 0.2]}, filter=lambda c: c["x"].value(0) != 2)
    assert len(space) == 4
    assert {c["x"].value(0) for c in space} == {1, 3}
    none = GridSearchSpace({"x": [1]}, filter=lambda c: False)
    assert len(none) == 0 and list(none) == []
    # A conditional space: momentum only matters when the optimizer uses it.
    cond = GridSearchSpace({"x": [0, 1], "y": [0.0, 0.5, 0.9]},
                           filter=lambda c: c["x"].value(0) == 1 or c["y"].value(0) == 0.0)
    assert len(cond) == 4


def test_grid_search_over_an_empty_filtered_space_is_refused() -> None:
    """A filter that drops every configuration is a mistake in the study file: refused when the
    tuner is built (it used to run no trial and end with no best, exit 0)."""
    check_value_error(lambda: GridSearch(GridSearchSpace({"x": [1], "y": [0]}, filter=lambda c: False), 5, "acc"),
                      "`space` holds no configuration (its filter drops every configuration)")


# ============================================================================ invalid arguments


def check_value_error(make: Callable[[], Any], *needles: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


SPACE = space_x(4)


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (lambda: GridSearch(SPACE, steps=0, metric="acc"), ["`steps`", "0"]),
        (lambda: GridSearch(SPACE, steps=-3, metric="acc"), ["`steps`", "-3"]),
        (lambda: GridSearch(SPACE, steps=2.5, metric="acc"), ["`steps`", "2.5"]),
        (lambda: GridSearch(SPACE, steps=True, metric="acc"), ["`steps`", "True"]),
        (lambda: GridSearch(SPACE, steps=5, metric=""), ["`metric`", "''"]),
        (lambda: GridSearch(SPACE, steps=5, metric="acc", mode="maximize"), ["`mode`", "'maximize'"]),
        (lambda: SuccessiveHalving(SPACE, "acc", min_steps=0, max_steps=10), ["`min_steps`", "0"]),
        (lambda: SuccessiveHalving(SPACE, "acc", min_steps=1, max_steps=-10), ["`max_steps`", "-10"]),
        (lambda: SuccessiveHalving(SPACE, "acc", min_steps=20, max_steps=10), ["`min_steps`", "20", "10"]),
        (lambda: SuccessiveHalving(SPACE, "acc", min_steps=1, max_steps=10, reduction=1), ["`reduction`", "1"]),
        (lambda: SuccessiveHalving(SPACE, "acc", min_steps=1, max_steps=10, reduction=2.0), ["`reduction`", "2.0"]),
        (lambda: SuccessiveHalving(SPACE, "acc", min_steps=1, max_steps=10, reduction=True), ["`reduction`", "True"]),
        (lambda: SuccessiveHalving(SPACE, "acc", "best", min_steps=1, max_steps=10), ["`mode`", "'best'"]),
        (lambda: Schedule.from_milestones(), ["`milestones`"]),
        (lambda: Schedule.from_milestones((5,)), ["`milestones[0]`", "(5,)"]),
        (lambda: Schedule.from_milestones((0, 4)), ["milestones[0].steps", "0"]),
        (lambda: Schedule.from_milestones((5, 0)), ["milestones[0].keep", "0"]),
        (lambda: Schedule.from_milestones((5, 8), (5, 4)), ["`milestones[1]`", "(5, 4)"]),
        (lambda: Schedule.from_milestones((5, 8), (3, 4)), ["`milestones[1]`", "(3, 4)"]),
        (lambda: Schedule.from_milestones((5, 4), (10, 8)), ["`milestones[1]`", "(10, 8)"]),
        (lambda: Schedule.from_milestones((5, 8), (10, 2.5)), ["milestones[1].keep", "2.5"]),
        (lambda: EarlyStopTuner(Schedule.from_milestones((5, 8)), SPACE, "acc", mode="up"), ["`mode`", "'up'"]),
        (lambda: GridSearchSpace({}), ["`hp_dict`"]),
        (lambda: GridSearchSpace({"x": []}), ["`hp_dict['x']`", "[]"]),
        (lambda: GridSearchSpace({"x": "abc"}), ["`hp_dict['x']`", "'abc'"]),
        (lambda: GridSearchSpace({"x": 0.1}), ["`hp_dict['x']`", "0.1"]),
        (lambda: GridSearchSpace({"x": [0.1, True]}), ["`hp_dict['x']`", "True"]),
        (lambda: GridSearchSpace({"x": [{"kind": "Nope"}]}), ["`hp_dict['x']`", "Nope"]),
        (lambda: GridSearchSpace({"x": [{"kind": "MultiStep", "init": 0.1, "milestones": [9, 3], "gamma": 0.1}]}),
         ["`hp_dict['x']`", "milestones", "[9, 3]"]),
    ],
)
def test_invalid_tuner_arguments(make: Callable[[], Any], needles: list[str]) -> None:
    check_value_error(make, *needles)


def test_study_rejects_a_space_that_does_not_match_the_trainer() -> None:
    # The space names "lr", which XYTrainer does not know: the first submit says so.
    space = GridSearchSpace({"lr": [0.1], "x": [1], "y": [0]})
    with pytest.raises(ValueError, match="'lr'"):
        tune(GridSearch(space, steps=5, metric="acc"), lambda v, s: {"acc": 1.0})


# ----------------------------------------------------------------------------- settings


def _every_tuner() -> dict[str, Callable[[], Any]]:
    from stagetree.integration.optuna import OptunaSearch
    from stagetree.tuners import (
        ASHA,
        PBT,
        EarlyStopTuner,
        GridSearch,
        Hyperband,
        MedianStopping,
        MLtunerTuner,
        RandomSearchSpace,
        Schedule,
        SuccessiveHalving,
        Uniform,
    )

    def grid() -> GridSearchSpace:
        return GridSearchSpace({"lr": [0.1, 0.01], "bs": [32]})

    return {
        "GridSearch": lambda: GridSearch(grid(), 5, "acc"),
        "SuccessiveHalving": lambda: SuccessiveHalving(grid(), "acc", min_steps=1, max_steps=8, reduction=2),
        "ASHA": lambda: ASHA(grid(), "acc", min_steps=1, max_steps=8),
        "Hyperband": lambda: Hyperband(grid(), "acc", min_steps=1, max_steps=8),
        "MedianStopping": lambda: MedianStopping(grid(), "acc", max_steps=8, interval=2),
        "PBT": lambda: PBT(grid(), "acc", population=2, interval=2, max_steps=8, mutations={"lr": [0.1, 0.01]}),
        "EarlyStopTuner": lambda: EarlyStopTuner(Schedule.from_milestones((5, 2)), grid(), "acc"),
        "MLtunerTuner": lambda: MLtunerTuner([{"lr": 0.1, "bs": 32}], tunables={"lr": [0.1, 0.01]}, max_steps=100,
                                             epoch_steps=10, trial_steps=5),
        "OptunaSearch": lambda: OptunaSearch({"lr": Uniform(0.01, 0.1), "bs": 32}, "acc", n_trials=4, steps=5, seed=3),
        "random": lambda: GridSearch(RandomSearchSpace({"lr": Uniform(0.01, 0.1), "bs": 32}, n=4, seed=1), 5, "acc"),
    }




@pytest.mark.parametrize("name", sorted(_every_tuner()))
def test_settings_are_json_equal_for_equal_tuners_and_name_every_argument(name: str) -> None:
    """What StudyStarted records (``tuner_settings``): JSON, equal for two tuners built alike
    (no address, no state), and holding every ``__init__`` argument of the tuner (a new
    argument kept under another name would go unrecorded: a resume with it changed would not
    be refused)."""
    import inspect

    import orjson

    make = _every_tuner()[name]
    a, b = make(), make()
    settings = a.settings()
    assert orjson.loads(orjson.dumps(settings)) == settings == b.settings()
    assert settings["rules"] == 1 and settings["tuner"] == type(a).__name__ and "space" in settings
    params = set(inspect.signature(type(a).__init__).parameters) - {"self", "space"}
    assert params - set(settings) == type(a).recorded_elsewhere, params - set(settings)
    if name == "OptunaSearch":
        assert settings["space"]["seed"] == 3 and settings["space"]["sampler"] == "TPESampler"


def test_a_user_tuners_argument_kept_under_another_name_is_recorded() -> None:
    """A user's tuner that keeps an argument under another name (``self._threshold``) recorded
    nothing of it, so a resume with it changed was not refused: the settings now take it as it
    was passed (its default when not passed), through copies too."""
    import copy

    from events.settings import difference
    from stagetree.tuners import GridSearch

    class Mine(GridSearch):
        def __init__(self, space: Any, steps: int, metric: str, threshold: float = 0.5, *,
                     extra: Any = None) -> None:
            super().__init__(space, steps, metric)
            self._threshold, self._extra = threshold, extra

    def mine(*args: Any, **kwargs: Any) -> Mine:
        return Mine(GridSearchSpace({"lr": [0.1, 0.01]}), 5, "acc", *args, **kwargs)

    settings = mine(0.7, extra={"b": (1, 2)}).settings()
    assert settings["threshold"] == 0.7 and settings["extra"] == {"b": [1, 2]}
    assert difference(settings, mine(threshold=0.8, extra={"b": (1, 2)}).settings()) == \
        "`threshold`: 0.7 in the log, 0.8 now"
    assert mine(0.5).settings() == mine().settings() and mine().settings()["extra"] is None
    assert copy.deepcopy(mine(0.7)).settings() == mine(0.7).settings()
    with pytest.raises(TypeError):  # a wrong call fails as it did
        mine(0.5, 1, 2)


def test_settings_read_back_equal_to_themselves_whatever_types_made_them() -> None:
    """Settings that never equalled themselves read back (an IntEnum or a str Enum argument, a
    numpy string, a tuple from a user's ``settings()`` override: the log's plain int, str or list
    against the live value's type) refused every resume of an unchanged file; a numpy array, or an
    int beyond 64 bits, was an error naming nothing, the latter after the run directory was made.
    Recording goes through JSON now, enums by name, and they compare equal to themselves."""
    import enum
    import functools
    from pathlib import Path as P

    import numpy as np

    from events.settings import difference
    from stagetree.tuners import GridSearch
    from stagetree.tuners._settings import recorded_settings

    class Level(enum.IntEnum):
        LOW = 1
        HIGH = 2

    class Colour(enum.StrEnum):
        RED = "red"
        BLUE = "blue"

    class Mine(GridSearch):
        def __init__(self, space: Any, steps: int, metric: str, *, level: Any = None, extra: Any = None) -> None:
            super().__init__(space, steps, metric)
            self.level, self.extra = level, extra

        def settings(self) -> dict[str, Any]:
            return {**super().settings(), "milestones": (10, 15)}  # a tuple, as users write them

    def mine(level: Any = Level.LOW, **extra: Any) -> dict[str, Any]:
        return recorded_settings(Mine(GridSearchSpace({"lr": [0.1, 0.01]}), 5, "acc", level=level,
                                      extra={"colour": Colour.RED, "name": np.str_("a"), "n": np.int64(3),
                                             "array": np.array([0.1, 0.2]), "big": 2**70, "path": P("/x"),
                                             "f": functools.partial(max, 1), **extra}))

    settings = mine()
    assert settings["level"] == "Level.LOW" and settings["milestones"] == [10, 15]
    assert settings["extra"] == {"colour": "Colour.RED", "name": "a", "n": 3, "array": [0.1, 0.2],
                                 "big": str(2**70), "path": "/x", "f": {"partial": "max", "args": [1], "keywords": {}}}
    assert difference(settings, mine()) is None
    assert difference(settings, mine(Level.HIGH)) == '`level`: "Level.LOW" in the log, "Level.HIGH" now'
    assert difference(settings, mine(colour=Colour.BLUE)) == \
        '`extra.colour`: "Colour.RED" in the log, "Colour.BLUE" now'


def test_a_space_read_once_is_read_by_the_tuner_and_a_tuple_records_as_a_list() -> None:
    """A generator as the space: checking the study file read it, and the run had 0 trials,
    exit 0. A tuple of the same configurations as a list refused ``--resume``."""
    from events.settings import difference
    from stagetree.tuners import GridSearch
    from stagetree.tuners._settings import recorded_settings

    configs = [{"lr": 0.1}, {"lr": 0.01}]
    once = GridSearch(iter(configs), 5, "acc")
    assert list(once.space) == list(once.space) == configs
    as_list = recorded_settings(GridSearch(configs, 5, "acc"))
    assert difference(as_list, recorded_settings(GridSearch(tuple(configs), 5, "acc"))) is None
    assert difference(as_list, recorded_settings(once)) is None
    assert as_list["space"]["configurations"] == 2


def test_settings_difference_names_the_first_changed_field() -> None:
    from events.settings import difference
    from stagetree.tuners import PBT, SuccessiveHalving

    def sha(**kw: Any) -> dict[str, Any]:
        args: dict[str, Any] = {"min_steps": 1, "max_steps": 8, "reduction": 2} | kw
        return SuccessiveHalving(GridSearchSpace({"lr": [0.1, 0.01]}), "acc", **args).settings()

    assert difference(sha(), sha()) is None
    assert difference(sha(), sha(max_steps=16)) == "`max_steps`: 8 in the log, 16 now"
    other_space = SuccessiveHalving(GridSearchSpace({"lr": [0.1, 0.02]}), "acc", min_steps=1, max_steps=8,
                                    reduction=2).settings()
    assert difference(sha(), other_space).startswith("`space.sha256`: ")  # same count, other configurations
    pbt = PBT(GridSearchSpace({"lr": [0.1]}), "acc", population=2, interval=2, max_steps=8,
              mutations={"lr": [0.1, 0.01]}).settings()
    assert difference(sha(), pbt) == "`causal`: absent in the log, false now"
    changed = dict(pbt, mutations={"lr": [pbt["mutations"]["lr"][0], {"kind": "Constant", "value": 0.02}]})
    assert difference(pbt, changed) == "`mutations.lr[1].value`: 0.01 in the log, 0.02 now"
    assert difference(pbt, dict(pbt, mutations={"lr": [0.1]})) == \
        '`mutations.lr`: [{"kind":"Constant","value":0.1},{"kind":"Constant","value":0.01}] in the log, [0.1] now'
    assert difference({"x": 1}, {"x": 1.0}) == "`x`: 1 in the log, 1.0 now"  # an int and a float differ
