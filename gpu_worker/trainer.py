"""The class users subclass to make a model trainable by stagetree.

Source: HIPPO_SPEC §5.1 (Trainer base class) and §6 (data pipeline), and the
determinism recipe of DESIGN.md. Unlike Hippo's ``train`` (one logical
iteration over many steps), a stagetree trainer exposes ONE optimizer update
per call: the framework (``gpu_worker.session.TrainingSession``) owns the loop,
the data order, the hyper-parameter values and the checkpoints, which is what
makes merged stages bit-for-bit equal to independent runs (DESIGN.md
invariant 1).
"""

from __future__ import annotations

import abc
import hashlib
import json
from typing import Any, ClassVar

import torch


class Trainer(abc.ABC):
    """A model, its optimizer and its data, trained one step at a time.

    Units: a *step* is one optimizer update on one mini-batch; step numbers
    are global (counted from 0 at the start of a trial, not from the start of
    a stage).

    Class attributes:

    * ``name`` (str): identifies the trainer in the plan key; defaults to the
      class ``__qualname__``.
    * ``version`` (str, default ``"1"``): bump it whenever a change to the code
      changes what training computes, so old checkpoints are not reused.
    * ``hyperparameters`` (tuple of str): names of the hyper-parameters the
      trainer accepts, e.g. ``("lr", "batch_size", "momentum")``. A study's
      trial configs must name exactly these (``stagetree.study.validate_config``),
      so the values of two trials can be compared step by step; a session
      given a partial config keeps the defaults set in ``build`` for the rest.
    * ``batch_size_hp`` (str or None, default ``"batch_size"``): the
      hyper-parameter that sets the mini-batch size (examples per step) drawn
      by the framework's sampler. When the config lacks it,
      ``default_batch_size`` is used. None means the framework draws no
      batches: ``train_step`` then receives an empty index tensor and the
      trainer makes its own data from the step-seeded torch RNG.
    * ``default_batch_size`` (int, default 32): examples per step when the
      config does not set ``batch_size_hp``.

    The framework calls, in order: ``build`` (after seeding torch's global RNG
    with the seed), then either nothing or ``load_state_dict`` (resume from a
    checkpoint), then for each step ``s``: ``setup`` (only when some value
    changed), ``train_step``; and ``evaluate`` / ``state_dict`` between steps.
    Once per worker process, before it joins, a warm-up builds with seed 0 and
    calls ``evaluate`` and one ``train_step`` at step 0 and the default batch
    size *without* ``setup`` (``gpu_worker.process.warm_up``: torch's first-call
    costs are start-up, not stage time); its weights are thrown away, and an
    error it raises is left to the first stage that meets it again.

    Determinism contract (DESIGN.md "Determinism recipe"):

    * ``build`` must derive everything (initial weights, train/validation
      split) from ``seed`` and torch's global RNG, which the framework seeds
      with ``seed`` just before the call.
    * Randomness inside ``setup``/``train_step`` (dropout, augmentation) must
      come from torch's global RNG, which the framework seeds from
      ``(seed, step)`` before every step, or its generator state must be part
      of ``state_dict``.
    * Every other piece of mutable training state must be in ``state_dict``.

    The defaults of ``state_dict`` / ``load_state_dict`` save and load the
    ``self.model`` and ``self.optimizer`` state dicts; a subclass with other
    state overrides both.
    """

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    batch_size_hp: ClassVar[str | None] = "batch_size"
    default_batch_size: ClassVar[int] = 32

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__qualname__

    @abc.abstractmethod
    def build(self, seed: int, device: torch.device) -> None:
        """Create model, optimizer and datasets on ``device`` from ``seed``.

        The train/validation split must be fixed by ``seed``. Called once per
        session, before any other method, also when resuming from a
        checkpoint (the checkpoint then overwrites the model and optimizer
        state), except that a worker resuming from a checkpoint with a trainer
        it built with the same seed on the same device, and only trained since,
        does not build it again: ``load_state_dict`` then overwrites its state
        and the gradients of ``self.model``'s parameters are dropped
        (``TrainingSession.load(rebuild=False)``); and a fresh start may restore
        the state dict the trainer had right after an earlier build with the
        same seed the same way, instead of building. The determinism contract
        below makes all of these the same.
        """

    @abc.abstractmethod
    def train_size(self) -> int:
        """Number of training examples; the sampler permutes ``range(train_size())``."""

    @abc.abstractmethod
    def setup(self, hp: dict[str, float | int]) -> None:
        """Apply hyper-parameter values: ``{name: value}`` for the changed names.

        Called before the step at which some value changed; at the first step
        of a fresh start or after loading a checkpoint it receives ALL values.
        Must be idempotent: the result may depend only on the values, not on
        how often or in which grouping they were applied (e.g. set
        ``optimizer.param_groups[*]["lr"]``). The batch-size hyper-parameter
        is included; the framework applies it, the trainer may ignore it.
        """

    @abc.abstractmethod
    def train_step(self, indices: torch.Tensor, step: int) -> None:
        """Do one optimizer update on the given training examples.

        ``indices``: int64 CPU tensor of shape ``(batch_size,)`` with values
        in ``[0, train_size())``; it may repeat an index when a batch spans
        two permutations. ``step``: the global step being trained.
        """

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Return metrics on the validation data, e.g. ``{"val_acc": 0.93}``.

        The framework calls it under ``torch.no_grad()`` and restores torch's
        global RNG afterwards. Switching the model to eval mode and back to
        train mode is the trainer's job; evaluate must not change parameters,
        optimizer state or any generator kept in ``state_dict``.

        A value that is NaN or infinite (a diverged model) is recorded as null (JSON has
        neither): the trial stays done, not failed, and every tuner ranks it below every
        finite value of its metric.
        """

    def state_dict(self) -> dict[str, Any]:
        """Return the training state: ``{"model": ..., "optimizer": ...}`` by default.

        Tensors may live on any device; the framework moves them to the CPU
        before saving. Only tensors, numbers, strings, bools, None and
        dicts/lists/tuples of these are allowed (``torch.load(weights_only=True)``).
        """
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; called right after ``build``.

        Tensors in ``state`` are on the CPU.
        """
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def constants(self) -> dict[str, Any]:
        """Fixed, untuned settings that change what training computes (default ``{}``).

        Values must be JSON-serializable (str, finite numbers, bools, None,
        lists and dicts with str keys); they go into ``fingerprint``.
        """
        return {}

    def fingerprint(self) -> str:
        """Return a sha256 hex digest identifying what this trainer computes.

        Covers ``name``, ``version``, ``constants()`` and the batch-size
        settings (``batch_size_hp``, ``default_batch_size``, which fix the data
        order). Part of the plan key (DESIGN.md "Terms"): two trainers with
        the same fingerprint and seed share one search plan.

        Raises ValueError when ``constants()`` is not JSON-serializable.
        """
        payload = {
            "name": self.name,
            "version": self.version,
            "constants": self.constants(),
            "batch_size_hp": self.batch_size_hp,
            "default_batch_size": self.default_batch_size,
        }
        try:
            text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"constants() of trainer {self.name!r} must be JSON-serializable "
                f"with finite numbers, got {payload['constants']!r}: {exc}"
            ) from exc
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
