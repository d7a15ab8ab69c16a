"""ASHA, Hyperband, MedianStopping and PBT against hand-computed expectations, the causal-order
mode, and replaying finished studies' logs.

Every study runs on the real system through the cluster simulator (stagetree/simulate.py): the
real embedded log, reducer, scheduler and Study SDK, with simulated workers on a virtual clock.
Metrics come from a :class:`~gpu_worker.simulated.FormulaCurve`, a formula of the
hyper-parameter values, so each expectation below is worked out by hand from the tuner's rule.
Stage costs grow with ``x``, so with several workers results finish out of submission order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from events.hp import Constant, Piecewise
from gpu_worker.simulated import CostModel, FormulaCurve, SimulatedTrainer
from projections.store import ProjectionStore
from replay.tuner import check_study
from stagetree.simulate import SimStudy, SimulationResult, simulate
from stagetree.tuners import (
    ASHA,
    PBT,
    GridSearch,
    GridSearchSpace,
    Hyperband,
    MedianStopping,
    SuccessiveHalving,
    Tuner,
    stable_seed,
)


def x_is_the_metric(values: dict[str, float], step: int) -> dict[str, float]:
    return {"val_acc": float(values["x"])}


TRAINER = SimulatedTrainer("xy", ("x",), cost=CostModel(base_seconds=1.0, scale={"x": (1.0, 1.0)}, load_seconds=0.5,
                                                        save_seconds=0.5),
                           curve=FormulaCurve(x_is_the_metric))


def space(*xs: float) -> GridSearchSpace:
    return GridSearchSpace({"x": [Constant(x) for x in xs]})


def run(tuner: Tuner, workers: int, run_dir: Path | None = None, merge: bool = True) -> SimulationResult:
    return simulate(TRAINER, [SimStudy("s", tuner)], workers=workers, merge=merge, run_dir=run_dir)


def x_of(result: SimulationResult, trial_id: str) -> Any:
    trial = next(t for t in result.summaries[0]["trials"] if t["trial_id"] == trial_id)
    return trial["hp"]["x"]["value"] if trial["hp"]["x"]["kind"] == "Constant" else trial["hp"]["x"]


def promotions(result: SimulationResult, from_steps: int) -> list[float]:
    decisions = result.results[0].decisions
    return [x_of(result, d.trial_id) for d in decisions if d.kind == "promote" and d.step == from_steps]


# ----------------------------------------------------------------------------- ASHA


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_asha_causal_promotes_by_hand_and_is_the_same_on_1_2_4_workers(workers: int) -> None:
    # Rung 0 results in submission order 3, 1, 4, 1.5, 5, 9, 2, 6 (reduction 2: the top
    # floor(n/2) of the n results so far are promoted, each once):
    #   n=2 -> {3}; n=3 -> {4}; n=4 -> {4,3}; n=5 -> {5,4}; n=6 -> {9,5,4}; n=7 -> -; n=8 -> {9,6,5,4}.
    # Rung 1 in promotion order 3, 4, 5, 9, 6: n=2 -> {4}; n=3 -> {5}; n=4 -> {9,5}; n=5 -> {9,6}.
    tuner = ASHA(space(3, 1, 4, 1.5, 5, 9, 2, 6), "val_acc", min_steps=1, max_steps=4, reduction=2, causal=True)
    result = run(tuner, workers)
    assert promotions(result, 1) == [3, 4, 5, 9, 6]
    assert promotions(result, 2) == [4, 5, 9, 6]
    assert result.summaries[0]["best_metric"] == 9.0
    steps = sorted((x_of(result, t["trial_id"]), t["steps"]) for t in result.summaries[0]["trials"])
    assert steps == [(1, 1), (1.5, 1), (2, 1), (3, 2), (4, 4), (5, 4), (6, 4), (9, 4)]


def test_asha_causal_mode_gives_identical_decisions_and_results_whatever_the_workers() -> None:
    xs = (3, 1, 4, 1.5, 5, 9, 2, 6, 5.5, 3.5, 8, 0.5)
    outcomes = []
    for workers in (1, 2, 4):
        result = run(ASHA(space(*xs), "val_acc", min_steps=1, max_steps=8, reduction=2, causal=True), workers)
        per_rung = {k: promotions(result, k) for k in (1, 2, 4)}
        trials = sorted((t["trial_id"], t["steps"], str(t["metrics"])) for t in result.summaries[0]["trials"])
        outcomes.append((per_rung, trials, result.summaries[0]["best_trial"], result.makespan_seconds))
    assert outcomes[0][:3] == outcomes[1][:3] == outcomes[2][:3]
    assert outcomes[2][3] < outcomes[0][3]  # more workers finish sooner, deciding the same


def test_asha_in_arrival_order_depends_on_the_workers_and_causal_order_costs_idle_time() -> None:
    # The problem causal order solves: in arrival order the promotions follow completion order.
    xs = (3, 1, 4, 1.5, 5, 9, 2, 6, 5.5, 3.5, 8, 0.5)
    arrival = [run(ASHA(space(*xs), "val_acc", min_steps=1, max_steps=8, reduction=2), w) for w in (1, 4)]
    assert promotions(arrival[0], 1) != promotions(arrival[1], 1)
    causal = run(ASHA(space(*xs), "val_acc", min_steps=1, max_steps=8, reduction=2, causal=True), 2)
    eager = run(ASHA(space(*xs), "val_acc", min_steps=1, max_steps=8, reduction=2), 2)
    assert causal.idle_worker_seconds > eager.idle_worker_seconds  # workers wait for earlier results


def test_asha_arrival_order_follows_the_log() -> None:
    # With one worker and equal costs, results arrive in the order the scheduler runs them,
    # and every promotion is of a trial in the top half of its rung at that moment.
    result = run(ASHA(space(3, 1, 4, 1.5, 5, 9, 2, 6), "val_acc", min_steps=1, max_steps=4, reduction=2), 1)
    assert result.summaries[0]["best_metric"] == 9.0
    assert set(promotions(result, 2)) <= set(promotions(result, 1))


# ----------------------------------------------------------------------------- Hyperband


def test_hyperband_brackets_by_hand() -> None:
    # R = 9, eta = 3: s_max = 2; brackets (n, rungs) = (9, [1, 3, 9]), (5, [3, 9]), (3, [9]).
    tuner = Hyperband(space(*range(1, 18)), "val_acc", min_steps=1, max_steps=9, reduction=3)
    assert tuner.brackets() == [(9, [1, 3, 9]), (5, [3, 9]), (3, [9])]
    result = run(tuner, 3)
    # 17 configurations exactly fill the brackets, dealt in stable-hash order.
    trials = result.summaries[0]["trials"]
    order = sorted(trials, key=lambda t: stable_seed("s", t["trial_id"]))
    xs = [t["hp"]["x"]["value"] for t in order]
    b0, b1, b2 = xs[:9], xs[9:14], xs[14:]
    expected = {}
    for x in b0:
        expected[x] = 9 if x == max(b0) else 3 if x in sorted(b0)[-3:] else 1
    for x in b1:
        expected[x] = 9 if x == max(b1) else 3
    for x in b2:
        expected[x] = 9
    assert {t["hp"]["x"]["value"]: t["steps"] for t in trials} == expected
    assert sorted(expected.values()).count(9) == 5
    assert result.summaries[0]["best_metric"] == 17.0


# ----------------------------------------------------------------------------- MedianStopping


@pytest.mark.parametrize("workers", [1, 3])
def test_median_stopping_by_hand(workers: int) -> None:
    # Causal order, min_trials 2, evaluations at steps 1, 2, 3; the metric is x at every step.
    # Step 1 in order 5, 1, 4, 2, 3: 2 stops (median of 5, 1, 4 is 4); 3 goes on (median 3).
    # Step 2 in order 5, 1, 4, 3: 3 stops (median of 5, 1, 4 is 4). Step 3: 5, 1, 4 finish.
    tuner = MedianStopping(space(5, 1, 4, 2, 3), "val_acc", max_steps=3, interval=1, min_trials=2, causal=True)
    result = run(tuner, workers)
    stops = [(x_of(result, d.trial_id), d.step) for d in result.results[0].decisions if d.kind == "stop"]
    assert stops == [(2, 1), (3, 2)]
    assert {x_of(result, t["trial_id"]): t["steps"] for t in result.summaries[0]["trials"]} == \
        {5: 3, 1: 3, 4: 3, 2: 1, 3: 2}
    assert result.summaries[0]["best_metric"] == 5.0


def test_median_stopping_grace_steps_stop_nobody_early() -> None:
    tuner = MedianStopping(space(5, 1, 4, 2, 3), "val_acc", max_steps=3, interval=1, min_trials=2, grace_steps=3,
                           causal=True)
    result = run(tuner, 2)
    assert not [d for d in result.results[0].decisions if d.kind == "stop"]
    assert all(t["steps"] == 3 for t in result.summaries[0]["trials"])


# ----------------------------------------------------------------------------- PBT


def test_pbt_exploits_by_branching_the_search_plan_at_the_donors_step(tmp_path: Path) -> None:
    # Population 4 (x = 4, 3, 2, 1), generations at steps 2, 4, 6, quantile 1/4, causal order.
    # Step 2: the bottom quarter is {1} and the top {4}, so x=1 exploits x=4 and explores x to
    # the only candidate, 7, from step 2 on (the new member N). Step 4: the results are
    # 4, 3, 2, 7 (N): x=2 exploits N, and exploring to 7 from step 4 on gives a trial whose
    # values are N's at every step, so the plan trains the two as one.
    tuner = PBT(space(4, 3, 2, 1), "val_acc", population=4, interval=2, max_steps=6, quantile=0.25,
                mutations={"x": [7]}, causal=True)
    result = run(tuner, 2, run_dir=tmp_path)
    first, second = [d for d in result.results[0].decisions if d.kind == "exploit"]
    loser, donor, step, new = first.trial_id, first.donor, first.step, first.new_trial_id
    assert (x_of(result, loser), x_of(result, donor), step) == (1, 4, 2)
    member = next(t for t in result.summaries[0]["trials"] if t["trial_id"] == new)
    assert Piecewise.model_validate(member["hp"]["x"]).value(1) == 4
    assert Piecewise.model_validate(member["hp"]["x"]).value(2) == 7
    assert member["steps"] == 6 and member["metrics"] == {"val_acc": 7.0}
    assert (x_of(result, second.trial_id), second.donor, second.step) == (2, new, 4)
    copy = next(t for t in result.summaries[0]["trials"] if t["trial_id"] == second.new_trial_id)
    assert [Piecewise.model_validate(copy["hp"]["x"]).value(s) for s in range(6)] == [4, 4, 7, 7, 7, 7]
    assert result.summaries[0]["best_trial"] in (new, copy["trial_id"])
    assert result.summaries[0]["best_metric"] == 7.0

    # The new member's node starts at step 2 under the donor's node: it trained only from 2 on.
    store = ProjectionStore(tmp_path / "state")
    try:
        state = store.load()
    finally:
        store.close()
    plan = state.plans[state.trials[new].plan_key]
    node = plan.nodes[state.trials[new].requests[4]]
    donor_node = plan.nodes[state.trials[donor].requests[2]]
    assert node.start_step == 2 and node.parent_id == donor_node.node_id
    # 4 members x 2 steps; x=4, 3, 2 and N 2 steps each to step 4; x=4, x=3 and N (with its
    # copy, trained once) 2 steps each to step 6.
    assert result.executed_steps == 4 * 2 + 4 * 2 + 3 * 2


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("xs", [(4, 3, 2, 1), (1, 2, 3, 4)])
def test_pbt_ranks_each_member_against_its_whole_generation(xs: tuple[int, ...], workers: int) -> None:
    """Truncation selection (Jaderberg et al. §4.1) ranks a member against the population, so
    the worst member exploits the best at every generation whatever order their results come in;
    with ``synch=False`` a member is ranked against the results handed over before it, and when
    the worst report first nobody ever exploits (what every PBT did before 2026-11-28)."""
    def exploits(tuner: PBT) -> list[tuple[Any, Any, int]]:
        result = run(tuner, workers)
        return [(x_of(result, d.trial_id), x_of(result, d.donor), d.step)
                for d in result.results[0].decisions if d.kind == "exploit"]

    def pbt(synch: bool) -> PBT:
        return PBT(space(*xs), "val_acc", population=4, interval=2, max_steps=4, mutations={"x": [9]},
                   causal=True, synch=synch)

    assert exploits(pbt(True)) == [(1, 4, 2)]
    assert exploits(pbt(False)) == ([(1, 4, 2)] if xs[-1] == 1 else [])


def test_pbt_explore_moves_to_a_neighbouring_candidate() -> None:
    import numpy as np

    tuner = PBT(space(1), "val_acc", population=1, interval=1, max_steps=2, mutations={"x": [1, 2, 3]},
                resample_probability=0.0)
    for seed in range(20):
        config = tuner.explore({"x": Constant(2)}, 5, np.random.default_rng(seed))
        assert config["x"].value(4) == 2 and config["x"].value(5) in (1, 3)


# ----------------------------------------------------------------------------- replay


TUNERS = {
    "grid": lambda: GridSearch(space(3, 1, 4, 1.5, 5, 9), 3, "val_acc"),
    "sha": lambda: SuccessiveHalving(space(3, 1, 4, 1.5, 5, 9, 2, 6), "val_acc", min_steps=1, max_steps=4,
                                     reduction=2),
    "asha": lambda: ASHA(space(3, 1, 4, 1.5, 5, 9, 2, 6), "val_acc", min_steps=1, max_steps=4, reduction=2),
    "asha-causal": lambda: ASHA(space(3, 1, 4, 1.5, 5, 9, 2, 6), "val_acc", min_steps=1, max_steps=4,
                                reduction=2, causal=True),
    "hyperband": lambda: Hyperband(space(*range(1, 12)), "val_acc", min_steps=1, max_steps=9, reduction=3),
    "median": lambda: MedianStopping(space(5, 1, 4, 2, 3, 6), "val_acc", max_steps=4, interval=1, min_trials=2),
    "pbt": lambda: PBT(space(4, 3, 2, 1, 5, 6, 7, 0.5), "val_acc", population=8, interval=2, max_steps=8,
                       mutations={"x": [1, 2, 3, 4, 5, 6, 7, 8]}),
}


@pytest.mark.parametrize("name", sorted(TUNERS))
def test_replaying_the_log_recomputes_every_decision_in_order(name: str, tmp_path: Path) -> None:
    result = run(TUNERS[name](), 3, run_dir=tmp_path)
    check = check_study(tmp_path, "s", TUNERS[name], TRAINER)
    assert check.ok, check.failure
    assert check.checked == len(result.results[0].decisions) > 0
    answer = result.results[0].decisions[-1]
    assert answer.kind == "answer" and answer.trial_id == result.summaries[0]["best_trial"]


def test_replay_notices_a_tuner_that_decides_differently(tmp_path: Path) -> None:
    """With the recorded settings (another mode or argument fails earlier, at the run's
    StudyStarted) but code that ranks the worst first: named at the first decision it changes."""
    run(TUNERS["asha"](), 3, run_dir=tmp_path)

    def other() -> Any:
        tuner = TUNERS["asha"]()
        rank = tuner.rank
        tuner.rank = lambda results: list(reversed(rank(results)))
        return tuner

    check = check_study(tmp_path, "s", other, TRAINER)
    assert not check.ok and check.failure is not None
    assert check.failure.check == "tuner" and check.failure.offset is not None
    assert "recorded step 1: promoted by ASHA" in check.failure.detail


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make, needle", [
    (lambda: ASHA(space(1), "val_acc", min_steps=4, max_steps=2), "`min_steps` is 4"),
    (lambda: ASHA(space(1), "val_acc", min_steps=1, max_steps=2, reduction=1), "`reduction` is 1"),
    (lambda: ASHA(space(1), "val_acc", min_steps=1, max_steps=2, causal="yes"), "`causal` is 'yes'"),
    (lambda: Hyperband(space(1), "val_acc", min_steps=0, max_steps=2), "`min_steps` is 0"),
    (lambda: MedianStopping(space(1), "val_acc", max_steps=3, interval=0), "`interval` is 0"),
    (lambda: MedianStopping(space(1), "val_acc", max_steps=3, interval=1, grace_steps=-1), "`grace_steps` is -1"),
    (lambda: PBT(space(1), "val_acc", population=2, interval=1, max_steps=3, mutations={}), "`mutations` is empty"),
    (lambda: PBT(space(1), "val_acc", population=2, interval=1, max_steps=3, mutations={"x": [1]}, quantile=0.7),
     "`quantile` is 0.7"),
    (lambda: PBT(space(1), "val_acc", population=2, interval=1, max_steps=3, mutations={"x": []}),
     "`mutations['x']` is []"),
])
def test_bad_tuner_arguments_name_the_field(make: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        make()
    assert needle in str(info.value)


def test_a_pbt_mutation_the_trainer_lacks_is_refused_before_anything_is_recorded(tmp_path: Path) -> None:
    """It was found only at the first exploit, after a generation had trained (and never when no
    member exploited): now the study file's load and the start of ``run`` check it."""
    from stagetree.simulate_cli import load_simulation

    tuner = PBT(space(1, 2, 3, 4), "val_acc", population=4, interval=1, max_steps=3, mutations={"nope": [1, 2]})
    with pytest.raises(ValueError) as info:
        run(tuner, 2, run_dir=tmp_path / "run")
    assert "`mutations` names 'nope', which trainer 'xy' lacks" in str(info.value)
    assert "['x']" in str(info.value)
    store = ProjectionStore(tmp_path / "run" / "state")
    try:
        assert not store.load().trials  # no trial was submitted
    finally:
        store.close()
    study = tmp_path / "pbt.py"
    study.write_text("from gpu_worker.simulated import SimulatedTrainer\n"
                     "from stagetree.tuners import PBT, GridSearchSpace\n"
                     "trainer = SimulatedTrainer('xy', ('x',))\n"
                     "tuner = PBT(GridSearchSpace({'x': [1, 2]}), 'val_acc', population=2, interval=1, max_steps=3,"
                     " mutations={'nope': [1, 2]})\n")
    with pytest.raises(ValueError, match="the tuner of study 'pbt': `mutations` names 'nope'"):
        load_simulation(str(study))

