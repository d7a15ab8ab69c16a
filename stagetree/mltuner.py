"""Old import path of :class:`stagetree.tuners.MLtunerTuner` (it lives in :mod:`stagetree.tuners.mltuner`)."""

from stagetree.tuners.mltuner import MLtunerTuner

__all__ = ["MLtunerTuner"]
