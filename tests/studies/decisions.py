"""Every tuner on one simulated trainer: the studies of tests/test_decisions.py (issue 12).

``stagetree simulate`` runs them all at once on one plan; the tests run each alone. Stage costs
grow with the learning rate, so with several workers results arrive out of submission order.
"""

from stagetree import (
    ASHA,
    PBT,
    CostModel,
    EarlyStopTuner,
    GridSearch,
    GridSearchSpace,
    Hyperband,
    MedianStopping,
    MLtunerTuner,
    RandomSearchSpace,
    Schedule,
    SimStudy,
    SimulatedTrainer,
    SuccessiveHalving,
    hp,
)
from stagetree.spaces import Choice, LogUniform, Sampled

cost = CostModel(base_seconds=1.0, scale={"lr": (0.1, 0.5)}, load_seconds=0.5, save_seconds=0.5)
trainer = SimulatedTrainer("decisions-toy", ("lr", "momentum", "batch_size"), cost=cost)
workers = 3


def space() -> GridSearchSpace:
    """12 configurations; the MultiStep ones share their first steps with the constants."""
    return GridSearchSpace({
        "lr": [hp.Constant(0.3), hp.Constant(0.1), hp.Constant(0.03), hp.MultiStep(0.1, (8,), 0.1),
               hp.MultiStep(0.3, (4,), 0.3), hp.Constant(0.01)],
        "momentum": [hp.Constant(0.9), hp.Constant(0.5)],
        "batch_size": [hp.Constant(128)],
    })


def random_space() -> RandomSearchSpace:
    """10 configurations drawn with seed 11 (the draws record it)."""
    return RandomSearchSpace({"lr": Sampled(hp.MultiStep, init=LogUniform(0.01, 0.3), milestones=(6,), gamma=0.1),
                              "momentum": Choice([0.5, 0.9]), "batch_size": [128]}, n=10, seed=11)


studies = [
    SimStudy("grid", GridSearch(space(), 16, "val_acc")),
    SimStudy("sha", SuccessiveHalving(random_space(), "val_acc", min_steps=2, max_steps=16, reduction=2)),
    SimStudy("asha", ASHA(space(), "val_acc", min_steps=2, max_steps=16, reduction=2)),
    SimStudy("asha-causal", ASHA(space(), "val_acc", min_steps=2, max_steps=16, reduction=2, causal=True)),
    SimStudy("hyperband", Hyperband(space(), "val_acc", min_steps=2, max_steps=18, reduction=3)),
    SimStudy("median", MedianStopping(space(), "val_acc", max_steps=16, interval=4, min_trials=2)),
    SimStudy("pbt", PBT(space(), "val_acc", population=8, interval=4, max_steps=16,
                        mutations={"lr": [0.3, 0.1, 0.03, 0.01]})),
    SimStudy("mltuner", MLtunerTuner([{"lr": 0.001, "momentum": 0.9, "batch_size": 128}],
                                     tunables={"lr": [1.0, 0.3, 0.1, 0.03, 0.01]}, max_steps=160, epoch_steps=20,
                                     trial_steps=10, patience=3)),
    SimStudy("early-stop", EarlyStopTuner(Schedule.from_milestones((4, 12), (8, 6), (16, 3)), space(), "val_acc")),
]
