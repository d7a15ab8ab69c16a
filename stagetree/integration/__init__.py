"""stagetree with the tools users already have: Optuna (``stagetree.integration.optuna``), and
TensorBoard and MLflow (``stagetree.export``). Each needs an optional dependency
(``pip install 'stagetree[optuna]'``, ``[tensorboard]``, ``[mlflow]``); :func:`require` says
which one when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` for ``what`` (e.g. "stagetree export tensorboard").

    Raises:
        MissingExtra: ``module`` cannot be imported; the message says
            ``pip install 'stagetree[<extra>]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{what} needs the optional dependency {module!r}, which is not installed "
                           f"({exc}); install it with: pip install 'stagetree[{extra}]'") from exc
