"""The studies of the Hippo paper's evaluation (HIPPO_SPEC.md §8), rebuilt for the simulator.

The papers give the hyper-parameter functions of each model (Tables 2-4), the number of trials,
the tuner and the merge rate p (Table 1), but not the exact search spaces. The spaces below use
exactly those functions, with parameter variants chosen so that the number of trials is the
paper's and p is close to the paper's (printed by ``benchmarks/paper_scale.py``):

=============  ===========  ======  ========  =========
study          tuner        trials  paper p   this p
=============  ===========  ======  ========  =========
ResNet56       SHA / ASHA   448     2.447     2.462
MobileNetV2    grid         240     3.144     see bench
BERT-Base      grid         40      2.045     see bench
=============  ===========  ======  ========  =========

Steps are epochs for the CIFAR-10 models and optimizer steps for BERT, as in the papers. The
cost models are calibrated to the trial-based GPU-hours of the paper's Table 5 on K80 GPUs
(about 100 s per ResNet56 epoch, 115 s per MobileNetV2 epoch, 2.6 s per BERT step at sequence
length 384). Optimizers and hyper-parameters that are not numbers are coded as numbers:
``optimizer`` 1 = SGD with momentum, 2 = Adam.
"""

from __future__ import annotations

import itertools
from typing import Any

from stagetree import CostModel, CurveModel, GridSearchSpace, SimulatedTrainer
from stagetree.hp import Constant, Cosine, CyclicLR, Exponential, Linear, MultiStep, Piecewise, Warmup

WORKERS = 40
"""The papers' cluster: 5 x p2.8xlarge, 8 K80 GPUs each (HIPPO_SPEC §8.1)."""

# Checkpoint sizes (bytes): float32 weights plus the optimizer state the studies use.
RESNET56_CHECKPOINT = 7_000_000  # 0.86 M parameters, SGD momentum
RESNET20_CHECKPOINT = 2_200_000  # 0.27 M parameters, SGD momentum
MOBILENETV2_CHECKPOINT = 18_000_000  # 2.2 M parameters, SGD momentum
BERT_BASE_CHECKPOINT = 1_320_000_000  # 110 M parameters, Adam (two moments)

# ----------------------------------------------------------------------------- ResNet56 / CIFAR-10


def resnet56_trainer() -> SimulatedTrainer:
    """ResNet56 on CIFAR-10 (step = epoch): ~100 s per epoch at batch size 128 on a K80."""
    return SimulatedTrainer(
        "resnet56-cifar10", ("lr", "batch_size", "momentum", "weight_decay", "optimizer"),
        cost=CostModel(base_seconds=100.0, scale={"batch_size": (128, -0.3)}, load_seconds=10.0, save_seconds=10.0,
                       eval_seconds=8.0, checkpoint_bytes=RESNET56_CHECKPOINT),
        curve=CurveModel(best_lr=0.1, rate=0.06, max_acc=0.97, noise=0.002,
                         bonus={"optimizer": {2.0: -0.008}, "weight_decay": {1e-3: -0.004}}))


def resnet56_lrs() -> list[Any]:
    """Table 2's learning-rate functions (step decay, warm-up + step decay / exponential /
    cosine with restarts, cyclic), two initial values, with milestone and gamma variants."""
    out: list[Any] = []
    for init in (0.1, 0.05):
        for gamma in (0.1, 0.2):
            for ms in ((90, 135), (100, 150), (95, 115)):
                out.append(MultiStep(init, ms, gamma))
            for ms in ((85, 130), (95, 110)):
                out.append(Warmup(init / 10, 5, MultiStep(init, ms, gamma)))
        out.append(Warmup(init / 10, 5, Exponential(init, 0.95)))
        out.append(Warmup(init / 10, 10, Cosine(init, 0.0, 20)))
        out.append(CyclicLR(0.001, init, 20, 20))
        out.append(Warmup(init / 10, 5, Exponential(init, 0.9)) if init == 0.1 else MultiStep(init, (90, 100), 0.1))
    return out


def resnet56_space() -> GridSearchSpace:
    """448 trials: 28 lr x 2 bs x 2 momentum x 2 weight decay x 2 optimizers."""
    return GridSearchSpace({
        "lr": resnet56_lrs(),
        "batch_size": [Constant(128), MultiStep(128, (70,), 2)],
        "momentum": [Constant(0.9), Piecewise([Constant(0.7), Constant(0.8), Constant(0.9)], [40, 80])],
        "weight_decay": [Constant(1e-4), Constant(1e-3)],
        "optimizer": [Constant(1), Constant(2)],
    })


# ----------------------------------------------------------------------------- MobileNetV2 / CIFAR-10


def mobilenetv2_trainer() -> SimulatedTrainer:
    """MobileNetV2 on CIFAR-10 (step = epoch): ~115 s per epoch at batch size 128 on a K80."""
    return SimulatedTrainer(
        "mobilenetv2-cifar10", ("lr", "batch_size", "cutout"),
        cost=CostModel(base_seconds=115.0, scale={"batch_size": (128, -0.3)}, load_seconds=8.0, save_seconds=8.0,
                       eval_seconds=10.0, checkpoint_bytes=MOBILENETV2_CHECKPOINT),
        curve=CurveModel(best_lr=0.1, rate=0.06, max_acc=0.985, noise=0.002,
                         bonus={"cutout": {18.0: 0.002, 20.0: 0.003}}))


def mobilenetv2_lrs() -> list[Any]:
    """Table 3's learning-rate functions: as ResNet56's with milestones [100, 150] and 10-epoch
    warm-ups, with milestone, gamma and initial-value variants."""
    out: list[Any] = []
    for init in (0.1, 0.05, 0.2, 0.15):
        for gamma in (0.1, 0.2):
            for ms in ((100, 150), (40, 110), (50, 100)):
                out.append(MultiStep(init, ms, gamma))
            out.append(Warmup(init / 10, 10, MultiStep(init, (90, 140), gamma)))
        out.append(Warmup(init / 10, 10, Exponential(init, 0.95)))
        out.append(Warmup(init / 10, 10, Cosine(init, 0.0, 20)))
        out.append(CyclicLR(0.001, init, 20, 20))
        out.append(MultiStep(init, (100, 110), 0.1))
        out.append(MultiStep(init, (30, 90), 0.1))
        out.append(MultiStep(init, (80, 110), 0.1))
        out.append(MultiStep(init, (60, 100), 0.1))
    return out


def mobilenetv2_space() -> GridSearchSpace:
    """240 trials: 60 lr x 2 bs x 2 cutout (optimizer SGD with weight decay 4e-5, fixed)."""
    return GridSearchSpace({
        "lr": mobilenetv2_lrs()[:60],
        "batch_size": [Constant(128), MultiStep(128, (100,), 2)],
        "cutout": [Constant(16), Piecewise([Constant(16), Constant(18), Constant(20)], [80, 100])],
    })


# ----------------------------------------------------------------------------- BERT-Base / SQuAD 2.0


def bert_trainer() -> SimulatedTrainer:
    """BERT-Base fine-tuning on SQuAD 2.0 (step = optimizer step): ~2.6 s per step at sequence
    length 384 on a K80; ``val_acc`` stands for F1."""
    return SimulatedTrainer(
        "bert-base-squad2", ("lr", "seq_len"),
        cost=CostModel(base_seconds=2.6, scale={"seq_len": (384, 1.3)}, load_seconds=20.0, save_seconds=20.0,
                       eval_seconds=300.0, checkpoint_bytes=BERT_BASE_CHECKPOINT),
        curve=CurveModel(best_lr=5e-5, rate=0.0004, max_acc=0.79, chance=0.0, initial_loss=4.0, min_loss=0.6,
                         acc_scale=1.5, noise=0.002, lr_hp="lr", momentum_hp="momentum", batch_size_hp="batch_size",
                         bonus={"seq_len": {512.0: 0.004}}))


def bert_lrs() -> list[Any]:
    """Table 4's functions: initial value + Linear decay over 30,000 steps, or a 3,000-step
    warm-up then Linear, with initial-value variants (values in 1e-5)."""
    out: list[Any] = []
    for init in (5e-5, 3e-5, 4e-5, 2e-5, 6e-5):
        out.append(Linear(init, -init / 30000))
        out.append(Warmup(init / 10, 3000, Linear(init, -init / 27000)))
    return out


def bert_space() -> GridSearchSpace:
    """40 trials: 10 lr x 4 sequence-length schedules (384, or 384 then 512 from a milestone).

    The lengths are ints throughout (chains of int constants): a ``MultiStep(384, ..., 512 / 384)``
    is the float 384.0 before its milestone, which is not the int 384 of ``Constant(384)``
    (:func:`events.hp.same_value`), so those trials shared nothing (p 1.44 instead of 2.0).
    """
    return GridSearchSpace({
        "lr": bert_lrs(),
        "seq_len": [Constant(384)] + [Piecewise([Constant(384), Constant(512)], [m]) for m in (21000, 18000, 15000)],
    })


# ----------------------------------------------------------------------------- multi-study ResNet20


def resnet20_trainer() -> SimulatedTrainer:
    """ResNet20 on CIFAR-10 (step = epoch): ~30 s per epoch at batch size 128 on a K80."""
    return SimulatedTrainer(
        "resnet20-cifar10", ("lr", "batch_size"),
        cost=CostModel(base_seconds=30.0, scale={"batch_size": (128, -0.3)}, load_seconds=4.0, save_seconds=4.0,
                       eval_seconds=3.0, checkpoint_bytes=RESNET20_CHECKPOINT),
        curve=CurveModel(best_lr=0.1, rate=0.06, max_acc=0.95, noise=0.002))


def resnet20_subspace(i: int) -> GridSearchSpace:
    """Subspace ``i`` (0-7) of the multi-study set: 144 trials = 36 lr x 4 bs. Neighbouring
    subspaces share part of their learning-rate schedules, as studies a user edits do."""
    lrs = []
    for init in (0.1, round(0.06 + 0.005 * i, 4), round(0.2 - 0.01 * i, 3)):
        for ms in ((55 + 4 * i, 92), (80, 91 + 2 * i), (70 + 3 * (i % 4), 95)):
            for gamma in (0.1, 0.2):
                lrs.append(MultiStep(init, ms, gamma))
        lrs.append(Warmup(init / 10, 5 + (i % 2) * 5, MultiStep(init, (80, 95), 0.1)))
        lrs.append(Warmup(init / 10, 5, Exponential(init, 0.95 - 0.01 * (i % 3))))
        lrs.append(Warmup(init / 10, 10, Cosine(init, 0.0, 20 + 10 * (i % 2))))
        lrs.append(CyclicLR(0.001, init, 20, 20))
        lrs.append(MultiStep(init, (50 + 4 * i, 75 + 2 * i), 0.1))
        lrs.append(MultiStep(init, (85, 95), 0.1 + 0.05 * (i % 3)))
    bs = [Constant(128), MultiStep(128, (50 + 5 * (i % 3),), 2), MultiStep(128, (70,), 2), Constant(256)]
    return GridSearchSpace({"lr": lrs[:36], "batch_size": bs})


def product_size(space: GridSearchSpace) -> int:
    return len(list(itertools.islice(iter(space), 100000)))


def resnet20_studies(k: int) -> list[Any]:
    """The multi-study case S``k``: subspaces 0..k-1, grid search to 100 epochs each, seed 0,
    all on one plan (same trainer and seed)."""
    from stagetree import GridSearch, SimStudy

    return [SimStudy(f"resnet20-study{i}", GridSearch(resnet20_subspace(i), 100, metric="val_acc", mode="max"), 0)
            for i in range(k)]
