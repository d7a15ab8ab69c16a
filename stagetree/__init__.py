"""stagetree: hyper-parameter optimization that never trains the same thing twice.

The public API, in one place::

    from stagetree import Trainer, Study, hp, GridSearchSpace, RandomSearchSpace, SuccessiveHalving

* :class:`Trainer`: what a user subclasses (model, optimizer, data; one step at a time).
* :mod:`hp` (``stagetree.hp``): hyper-parameter sequences, functions of the step (``hp.MultiStep``,
  ``hp.Warmup``, ...).
* Spaces: :class:`GridSearchSpace`, :class:`RandomSearchSpace` and its samplers
  (:class:`Choice`, :class:`Uniform`, :class:`LogUniform`, :class:`IntUniform`,
  :class:`Milestones`, :class:`Sampled`).
* Tuners: :class:`GridSearch`, :class:`SuccessiveHalving`, :class:`ASHA`, :class:`Hyperband`,
  :class:`MedianStopping`, :class:`PBT`, :class:`MLtunerTuner`, :class:`EarlyStopTuner` (with
  :class:`Schedule`), and their results :class:`TunerResult`, :class:`TrialResult`.
* The SDK: :func:`run_study` (run a study file as ``stagetree run`` does, from Python; returns
  its summary), :class:`Study` (submit trials, await metrics), :class:`TrialFailed`.
* Simulation (``stagetree simulate``): :class:`SimulatedTrainer` with its :class:`CostModel`
  and :class:`CurveModel`, and :class:`SimStudy` for several studies at once.

Names are imported on first use (PEP 562), so importing :mod:`stagetree` (or a command of
``stagetree``) does not import torch or the tuners until they are needed. The modules they come
from (``stagetree.tuners``, ``stagetree.spaces``, ``gpu_worker.trainer``, ...) stay importable.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_worker.simulated import CostModel, CurveModel, SimulatedTrainer
    from gpu_worker.trainer import Trainer
    from stagetree import hp
    from stagetree.runner import run_study
    from stagetree.simulate import SimStudy
    from stagetree.spaces import (
        Choice,
        GridSearchSpace,
        IntUniform,
        LogUniform,
        Milestones,
        RandomSearchSpace,
        Sampled,
        Uniform,
    )
    from stagetree.study import Study, TrialFailed
    from stagetree.tuners import (
        ASHA,
        PBT,
        EarlyStopTuner,
        GridSearch,
        Hyperband,
        MedianStopping,
        MLtunerTuner,
        Schedule,
        SuccessiveHalving,
        TrialResult,
        Tuner,
        TunerResult,
    )

__version__ = "0.1.0"

_WHERE = {
    "Trainer": "gpu_worker.trainer",
    "Study": "stagetree.study",
    "run_study": "stagetree.runner",
    "TrialFailed": "stagetree.study",
    "SimulatedTrainer": "gpu_worker.simulated",
    "CostModel": "gpu_worker.simulated",
    "CurveModel": "gpu_worker.simulated",
    "SimStudy": "stagetree.simulate",
    **{name: "stagetree.spaces" for name in (
        "GridSearchSpace", "RandomSearchSpace", "Choice", "Uniform", "LogUniform", "IntUniform", "Milestones",
        "Sampled")},
    **{name: "stagetree.tuners" for name in (
        "Tuner", "TunerResult", "TrialResult", "GridSearch", "SuccessiveHalving", "ASHA", "Hyperband",
        "MedianStopping", "PBT", "MLtunerTuner", "EarlyStopTuner", "Schedule")},
}

__all__ = [
    "ASHA",
    "PBT",
    "Choice",
    "CostModel",
    "CurveModel",
    "EarlyStopTuner",
    "GridSearch",
    "GridSearchSpace",
    "Hyperband",
    "IntUniform",
    "LogUniform",
    "MLtunerTuner",
    "MedianStopping",
    "Milestones",
    "RandomSearchSpace",
    "Sampled",
    "Schedule",
    "SimStudy",
    "SimulatedTrainer",
    "Study",
    "SuccessiveHalving",
    "Trainer",
    "TrialFailed",
    "TrialResult",
    "Tuner",
    "TunerResult",
    "Uniform",
    "hp",
    "run_study",
]


def __getattr__(name: str) -> Any:
    if name == "hp":
        return importlib.import_module("stagetree.hp")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stagetree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
