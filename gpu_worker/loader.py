"""Loading a study file: a Python file defining module-level ``trainer`` and ``tuner``."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from gpu_worker.trainer import Trainer


class StudyFileError(ValueError):
    """The study file is missing, does not import, or lacks what a study needs."""


def load_module(path: str | Path) -> ModuleType:
    """Import the Python file at ``path`` as a fresh module.

    Raises:
        StudyFileError: the file does not exist or raises while importing (the message names
            the file and the original error).
    """
    path = Path(path)
    if not path.is_file():
        raise StudyFileError(f"study file {str(path)!r} does not exist")
    name = f"stagetree_study_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise StudyFileError(f"study file {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise StudyFileError(f"study file {str(path)!r}{_where(exc, path)} failed to import: "
                             f"{type(exc).__name__}: {exc}") from exc
    return module


def _where(exc: BaseException, path: Path) -> str:
    """``, line N (<source line>)`` of the study file's innermost frame in ``exc``'s traceback:
    the line the user wrote (``"lr": [MultiStep(float("nan"), ...)]``) names the field."""
    target = str(path.resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(Path(f.filename).resolve()) == target]
    if not frames:
        return ""
    frame = frames[-1]
    line = (frame.line or "").strip()
    return f", line {frame.lineno}" + (f" ({line})" if line else "")


def trainer_of(module: ModuleType, path: str | Path) -> Trainer:
    """The module's ``trainer``: a Trainer instance, or a Trainer subclass (instantiated).

    Raises:
        StudyFileError: ``trainer`` is missing or not a Trainer.
    """
    obj: Any = getattr(module, "trainer", None)
    if isinstance(obj, type) and issubclass(obj, Trainer):
        obj = obj()
    if not isinstance(obj, Trainer):
        raise StudyFileError(
            f"study file {str(path)!r} must define `trainer` as a Trainer subclass or instance, got {obj!r}"
        )
    return obj


def load_trainer(path: str | Path) -> Trainer:
    """Import the study file at ``path`` and return its trainer (used by worker processes)."""
    return trainer_of(load_module(path), path)
