"""Tuners (Hippo §5.3, §5.5 and the papers' baselines), one module per algorithm on a shared base.

======================  =============================================  ==============================
tuner                   module                                         source
======================  =============================================  ==============================
:class:`GridSearch`     :mod:`stagetree.tuners.grid`                   Hippo §5.3
:class:`SuccessiveHalving`  :mod:`stagetree.tuners.successive_halving` Jamieson & Talwalkar 2016
:class:`EarlyStopTuner` :mod:`stagetree.tuners.early_stop`             Hippo Fig. 9
:class:`ASHA`           :mod:`stagetree.tuners.asha`                   Li et al., MLSys 2020
:class:`Hyperband`      :mod:`stagetree.tuners.hyperband`              Li et al., JMLR 2018
:class:`MedianStopping` :mod:`stagetree.tuners.median`                 Golovin et al., KDD 2017
:class:`PBT`            :mod:`stagetree.tuners.pbt`                    Jaderberg et al. 2017
:class:`MLtunerTuner`   :mod:`stagetree.tuners.mltuner`                Cui et al., SoCC 2018
======================  =============================================  ==============================

The spaces (:class:`GridSearchSpace`, :class:`RandomSearchSpace` and its samplers) live in
:mod:`stagetree.spaces` and are re-exported here, where earlier versions defined some of them.
"""

from events.hp import continue_with
from stagetree.spaces import (
    Choice,
    GridSearchSpace,
    IntUniform,
    LogUniform,
    Milestones,
    RandomSearchSpace,
    Sampled,
    Uniform,
    candidates_of,
)
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, stable_seed
from stagetree.tuners._inbox import ResultInbox
from stagetree.tuners.asha import ASHA
from stagetree.tuners.early_stop import EarlyStopTuner, Schedule
from stagetree.tuners.grid import GridSearch
from stagetree.tuners.hyperband import Hyperband
from stagetree.tuners.median import MedianStopping
from stagetree.tuners.mltuner import MLtunerTuner
from stagetree.tuners.pbt import PBT
from stagetree.tuners.successive_halving import SuccessiveHalving, rungs

__all__ = [
    "ASHA",
    "PBT",
    "Choice",
    "EarlyStopTuner",
    "GridSearch",
    "GridSearchSpace",
    "Hyperband",
    "IntUniform",
    "LogUniform",
    "MLtunerTuner",
    "MedianStopping",
    "Milestones",
    "Mode",
    "RandomSearchSpace",
    "ResultInbox",
    "Sampled",
    "Schedule",
    "SuccessiveHalving",
    "TrialResult",
    "Tuner",
    "TunerResult",
    "Uniform",
    "candidates_of",
    "continue_with",
    "rungs",
    "stable_seed",
]
