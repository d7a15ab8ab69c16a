"""Optuna's samplers propose, stagetree merges (issue 13 item 2): OptunaSearch on its own and
OptunaSpace under SuccessiveHalving/ASHA/Hyperband, on the cluster simulator (the real tuners,
SDK, log, reducer and scheduler; simulated GPUs on a virtual clock).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna", reason="the Optuna searcher needs `pip install 'stagetree[optuna]'`")

from events.hp import MultiStep, Warmup  # noqa: E402
from replay.tuner import check_study  # noqa: E402
from stagetree import ASHA, Hyperband, SimulatedTrainer, SuccessiveHalving, hp  # noqa: E402
from stagetree.integration.optuna import OptunaSearch, OptunaSpace  # noqa: E402
from stagetree.simulate import SimStudy, SimulationResult, simulate  # noqa: E402
from stagetree.spaces import Choice, IntUniform, LogUniform, Milestones, Sampled, Uniform  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

TRAINER = SimulatedTrainer("optuna-toy", ("lr", "momentum", "batch_size"))
# Every parameter family of a sequence: warm-up length, initial value, milestones, gamma.
SEQUENCES = {
    "lr": Sampled(hp.Warmup, init=0.0, period=IntUniform(1, 8),
                  then=Sampled(hp.MultiStep, init=LogUniform(0.01, 0.5), milestones=Milestones(1, 10, 30),
                               gamma=Uniform(0.05, 0.5))),
    "momentum": Choice([0.5, 0.9]),
    "batch_size": 128,
}
# Proposals that share prefixes: two initial values, decays at sampled milestones.
PREFIXES = {
    "lr": Sampled(hp.MultiStep, init=Choice([0.1, 0.05]), milestones=Milestones(1, 5, 30), gamma=Choice([0.1, 0.3])),
    "momentum": 0.9,
    "batch_size": 128,
}
SAMPLERS = {
    "tpe": lambda: optuna.samplers.TPESampler(seed=3, n_startup_trials=4),
    "cma-es": lambda: optuna.samplers.CmaEsSampler(seed=3, warn_independent_sampling=False),
}


def search(sampler: str, **kw: Any) -> OptunaSearch:
    return OptunaSearch(SEQUENCES, "val_acc", n_trials=12, steps=40, batch=4, sampler=SAMPLERS[sampler](), seed=3,
                        **kw)


def run(tuner: Any, workers: int, run_dir: Path | None = None, name: str = "o") -> SimulationResult:
    return simulate(TRAINER, [SimStudy(name, tuner)], workers=workers, run_dir=run_dir)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_a_sampler_runs_a_study_with_the_same_configurations_and_answer_on_1_and_2_workers(
        sampler: str, tmp_path: Path) -> None:
    outcomes = []
    for workers in (1, 2):
        storage = optuna.storages.InMemoryStorage()  # any Optuna storage: it holds the Optuna study
        result = run(search(sampler, storage=storage), workers, tmp_path / f"w{workers}")
        summary = result.summaries[0]
        draws = [d for d in result.results[0].decisions if d.kind == "draw"]
        assert len(draws) == len(summary["trials"]) == 12
        assert {(d.sampler, d.seed) for d in draws} == {(type(SAMPLERS[sampler]()).__name__, 3)}
        assert [d.index for d in draws] == list(range(12))
        # the Optuna study was told every result: the stagetree metric of each trial at 40 steps
        study = optuna.load_study(study_name="o", storage=storage)
        told = {t.user_attrs["stagetree_trial"]: t.value for t in study.trials}
        assert told == {t["trial_id"]: t["metrics"]["val_acc"] for t in summary["trials"]}
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
        assert study.best_value == summary["best_metric"]
        # and replay verify recomputes every draw from the log
        check = check_study(tmp_path / f"w{workers}", "o", lambda: search(sampler), TRAINER)
        assert check.ok, check.failure
        assert check.checked == len(result.results[0].decisions)
        outcomes.append((sorted(told), summary["best_trial"], summary["best_metric"]))
    assert outcomes[0] == outcomes[1]


def test_the_parameters_of_sequences_are_optuna_parameters(tmp_path: Path) -> None:
    storage = optuna.storages.InMemoryStorage()  # read back here (a simulation writes no persistent storage)
    result = run(search("tpe", storage=storage), 2)
    study = optuna.load_study(study_name="o", storage=storage)
    configs = {t["trial_id"]: t["hp"] for t in result.summaries[0]["trials"]}
    for trial in study.trials:
        p = trial.params
        assert set(p) == {"lr.period", "lr.then.init", "lr.then.milestones.0", "lr.then.gamma", "momentum"}
        lr = Warmup.model_validate(configs[trial.user_attrs["stagetree_trial"]]["lr"])
        assert lr == Warmup(0.0, p["lr.period"], MultiStep(p["lr.then.init"], (p["lr.then.milestones.0"],),
                                                           p["lr.then.gamma"]))


def test_under_successive_halving_proposals_sharing_a_prefix_are_merged_and_rungs_reported(tmp_path: Path) -> None:
    def sha() -> SuccessiveHalving:
        space = OptunaSpace(PREFIXES, 16, sampler=optuna.samplers.TPESampler(seed=5), seed=5, storage=storage)
        return SuccessiveHalving(space, "val_acc", min_steps=10, max_steps=40, reduction=2)

    storage = optuna.storages.InMemoryStorage()
    result = run(sha(), 2, tmp_path)
    summary = result.summaries[0]
    assert len(summary["trials"]) == 16
    assert summary["executed_steps"] == summary["unique_steps"] < summary["total_steps"]  # prefixes trained once
    # every rung's value was reported to the Optuna study, stopped trials are pruned, the last rung complete
    study = optuna.load_study(study_name="o", storage=storage)
    steps = {t["trial_id"]: (t["steps"], t["metrics"]["val_acc"]) for t in summary["trials"]}
    states = {}
    proposals = [t for t in study.trials if "duplicate_of" not in t.user_attrs]
    assert len(proposals) == 16  # a proposal repeating an earlier configuration is failed and asked again
    assert all(t.state == optuna.trial.TrialState.FAIL for t in study.trials if "duplicate_of" in t.user_attrs)
    for trial in proposals:
        last, value = steps[trial.user_attrs["stagetree_trial"]]
        assert sorted(trial.intermediate_values) == [s for s in (10, 20, 40) if s <= last]
        assert trial.intermediate_values[last] == value
        states[last] = states.get(last, set()) | {trial.state}
    assert states == {10: {optuna.trial.TrialState.PRUNED}, 20: {optuna.trial.TrialState.PRUNED},
                      40: {optuna.trial.TrialState.COMPLETE}}
    check = check_study(tmp_path, "o", sha, TRAINER)
    assert check.ok, check.failure


@pytest.mark.parametrize("make", [
    lambda space: ASHA(space, "val_acc", min_steps=10, max_steps=40, reduction=2),
    lambda space: Hyperband(space, "val_acc", min_steps=10, max_steps=40, reduction=2),
], ids=["asha", "hyperband"])
def test_asha_and_hyperband_take_their_configurations_from_an_optuna_space(make: Any, tmp_path: Path) -> None:
    def tuner() -> Any:
        sampler = optuna.samplers.QMCSampler(seed=1, warn_independent_sampling=False)
        return make(OptunaSpace(PREFIXES, 12, sampler=sampler))

    result = run(tuner(), 3, tmp_path)
    assert result.summaries[0]["best_metric"] is not None
    draws = [d for d in result.results[0].decisions if d.kind == "draw"]
    assert draws and {d.sampler for d in draws} == {"QMCSampler"} and {d.seed for d in draws} == {1}
    check = check_study(tmp_path, "o", tuner, TRAINER)
    assert check.ok, check.failure


def test_a_pruner_stops_trials_from_their_reported_values(tmp_path: Path) -> None:
    def pruned() -> OptunaSearch:
        return OptunaSearch(SEQUENCES, "val_acc", n_trials=12, steps=40, batch=3, seed=2,
                            sampler=optuna.samplers.RandomSampler(seed=2), report_every=10,
                            pruner=optuna.pruners.MedianPruner(n_startup_trials=3))

    result = run(pruned(), 2, tmp_path)
    decisions = result.results[0].decisions
    stops = [d for d in decisions if d.kind == "stop"]
    assert stops and all(d.reason == "pruned" and d.evidence.prune and d.evidence.pruner == "MedianPruner"
                         for d in stops)
    assert {t["steps"] for t in result.summaries[0]["trials"]} > {40}  # some stopped before 40
    assert any(d.kind == "continue" and not d.evidence.prune for d in decisions)
    check = check_study(tmp_path, "o", pruned, TRAINER)
    assert check.ok, check.failure


@pytest.mark.parametrize("make, needle", [
    (lambda: OptunaSearch(SEQUENCES, "val_acc", n_trials=0, steps=4), "`n` is 0"),
    (lambda: OptunaSearch(SEQUENCES, "val_acc", n_trials=2, steps=4, batch=0), "`batch` is 0"),
    (lambda: OptunaSearch(SEQUENCES, "val_acc", n_trials=2, steps=4, sampler="tpe"), "`sampler` is 'tpe'"),
    (lambda: OptunaSearch(SEQUENCES, "val_acc", n_trials=2, steps=4, pruner=optuna.pruners.MedianPruner()),
     "a pruner needs `report_every`"),
    (lambda: OptunaSearch({"lr": Uniform(1, 0)}, "val_acc", n_trials=2, steps=4), "`hp_dict['lr']`: `Uniform.low`"),
])
def test_bad_arguments_name_the_field(make: Any, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert needle in str(info.value)


def test_hyperband_tells_a_trial_dealt_to_several_brackets_by_its_last_bracket(tmp_path: Path) -> None:
    """With fewer configurations than its brackets need, Hyperband deals one trial to several
    brackets: a stop in one bracket must not end the Optuna trial while another still trains it
    (the bug: every trial ended pruned at its first stop, and its later rungs went unreported)."""
    storage = optuna.storages.InMemoryStorage()

    def tuner() -> Hyperband:
        space = OptunaSpace(PREFIXES, 4, sampler=optuna.samplers.RandomSampler(seed=4), seed=4, storage=storage)
        return Hyperband(space, "val_acc", min_steps=10, max_steps=40, reduction=2)

    result = run(tuner(), 2, tmp_path)
    decisions = result.results[0].decisions
    brackets: dict[str, set[int | None]] = {}
    for d in decisions:
        if d.kind == "draw":
            brackets.setdefault(d.trial_id, set()).add(d.bracket)
    assert max(len(b) for b in brackets.values()) > 1  # some trial is in several brackets
    stopped_somewhere = {d.trial_id for d in decisions if d.kind == "stop"}
    trained = {t["trial_id"]: (t["steps"], t["metrics"]["val_acc"]) for t in result.summaries[0]["trials"]}
    study = optuna.load_study(study_name="o", storage=storage)
    proposals = {t.user_attrs["stagetree_trial"]: t for t in study.trials if "duplicate_of" not in t.user_attrs}
    assert set(proposals) == set(trained)
    completed = set()
    for trial_id, trial in proposals.items():
        steps, value = trained[trial_id]
        assert max(trial.intermediate_values) == steps  # every rung it reached was reported
        assert trial.intermediate_values[steps] == value
        if steps == 40:  # in some bracket's last rung
            assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value == value
            completed.add(trial_id)
        else:
            assert trial.state == optuna.trial.TrialState.PRUNED
    assert completed & stopped_somewhere  # a trial stopped in one bracket and finished in another
    assert study.best_trial.user_attrs["stagetree_trial"] == result.summaries[0]["best_trial"]
    check = check_study(tmp_path, "o", tuner, TRAINER)
    assert check.ok, check.failure


def test_the_samplers_seed_and_arguments_and_the_pruners_are_recorded() -> None:
    """Optuna 5's samplers keep no ``_seed``: the settings recorded ``seed: null`` for every
    sampler, and only the sampler's and pruner's class, so a ``--resume`` with another sampler
    seed or ``n_startup_trials`` was accepted and decided otherwise. Their attributes and the
    random state the seed made are recorded now, read before any draw."""
    from events.settings import difference
    from stagetree.tuners._settings import recorded_settings

    def settings(seed: int = 4, startup: int = 2, pruner: Any = None) -> dict[str, Any]:
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
        return recorded_settings(OptunaSearch({"lr": Uniform(0.01, 0.1)}, "acc", n_trials=4, steps=5,
                                              sampler=sampler, pruner=pruner, report_every=1 if pruner else None))

    base = settings()
    assert difference(base, settings()) is None
    assert "seed_state_sha256" in str(difference(base, settings(seed=5)))
    assert difference(base, settings(startup=1)) == "`space.sampler_settings.n_startup_trials`: 2 in the log, 1 now"
    median = settings(pruner=optuna.pruners.MedianPruner(n_startup_trials=3))
    assert difference(median, settings(pruner=optuna.pruners.MedianPruner(n_startup_trials=4))) == \
        "`space.pruner_settings.n_startup_trials`: 3 in the log, 4 now"
    space = OptunaSpace({"lr": Uniform(0.01, 0.1)}, 4, sampler=optuna.samplers.RandomSampler(seed=1))
    before = space.settings()
    space.sampler.sample_independent(None, None, "lr", optuna.distributions.FloatDistribution(0, 1))  # a draw
    assert space.settings() == before  # (read when it was built)
