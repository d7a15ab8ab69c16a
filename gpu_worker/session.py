"""The framework side of training: the step loop, hyper-parameter values and checkpoints.

A ``TrainingSession`` drives one ``Trainer`` from a fresh start or from a
checkpoint up to a given global step. Everything that decides what a step
computes is either a pure function of ``(seed, step, config)`` or saved in the
checkpoint, so training in stages resumed from checkpoints equals training
straight through, bit for bit, on the same device (DESIGN.md invariant 1 and
"Determinism recipe"; HIPPO_SPEC §6).
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from events.hp import HPConfig, config_values, same_value
from gpu_worker.checkpoint import Snapshot, SnapshotBuffers, decode_state, encode_state, snapshot_state
from gpu_worker.sampler import ResumableSampler
from gpu_worker.trainer import Trainer

CHECKPOINT_FORMAT = 1
"""Version of the checkpoint layout written by ``TrainingSession.save``."""


def set_determinism() -> None:
    """Make torch choose deterministic kernels, process-wide.

    The effect of ``torch.use_deterministic_algorithms(True)`` without its cost: that function
    imports torch's compiler stack (``torch._inductor``, ``torch._dynamo``: seconds of start-up and
    hundreds of MB per worker) only to set inductor's ``deterministic`` flag. Here the flag is set
    through ``TORCHINDUCTOR_DETERMINISTIC=1`` (read when inductor is imported, as a trainer using
    ``torch.compile`` does later) or directly when inductor is loaded already, and the kernels'
    switch through ``torch._C._set_deterministic_algorithms`` (falling back to the public call on
    a torch without it). Also disables cuDNN autotuning; when CUDA is available sets (if unset)
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which must happen before the first cuBLAS call.
    """
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None and hasattr(inductor, "deterministic"):  # from torch 2.6 on
        inductor.deterministic = True
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is None:
        torch.use_deterministic_algorithms(True)
    else:
        switch(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def step_seed(seed: int, step: int) -> int:
    """Return the seed of torch's global RNG at global ``step``: a 63-bit hash of (seed, step).

    Stable across processes and Python versions (sha256, not ``hash``).
    """
    digest = hashlib.sha256(f"stagetree-step:{seed}:{step}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def seed_global_rng(value: int, device: torch.device) -> None:
    """Seed torch's global random number generators that training on ``device`` draws from:
    the CPU generator, and every CUDA device's on ``cuda`` (what ``torch.manual_seed`` does for
    them, bit for bit). Other device types get ``torch.manual_seed`` itself.

    Why not ``torch.manual_seed`` everywhere: it also queues a seed for each accelerator
    backend not initialised in this process (CUDA on a CPU worker, XPU, MTIA), and queuing
    formats the caller's whole stack (``traceback.format_stack``): 60 to 250 microseconds per
    call depending on the stack's depth, paid before every step (a fifth of a step of the
    example's small CNN on a CPU core)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(value)
    elif device.type == "cuda":
        torch.default_generator.manual_seed(value)
        torch.cuda.manual_seed_all(value)
    else:
        torch.manual_seed(value)


def _differs(old: float | int, new: float | int) -> bool:
    """Whether ``new`` is not the same value as ``old`` (``3 != 3.0``, ``0.0 != -0.0``): the one
    rule of :func:`events.hp.same_value`, also the sharing rule of the search plan.

    ``setup`` after a restore receives the exact values, so a straight run
    must call it for any change a restore could observe.
    """
    return not same_value(old, new)


_PASSED_ON_BYTES = 1 << 20
"""A decoded tensor of at least this many bytes whose place in the trainer's state holds a
tensor on another device (a GPU) is handed to the trainer as it is: the trainer moves it there."""


def _into_current(current: Any, loaded: Any, memo: dict[int, Any]) -> Any:
    """``loaded`` (part of a decoded trainer state: tensors on the CPU), changed in place where
    it is a dict or a list, its tensors replaced so that the trainer keeps none of them:

    * where ``current`` (the same part of the trainer's ``state_dict()``) holds a contiguous CPU
      tensor of the same shape, dtype and layout at the same place, by that tensor, into which
      its values are copied (no new memory);
    * where it holds a tensor on another device, a tensor of at least ``_PASSED_ON_BYTES`` is
      left as it is (the trainer's ``load_state_dict`` copies it to that device);
    * every other one by a copy of its own (``copy.deepcopy`` with ``memo``: tensors sharing
      memory in ``loaded`` share their copy's).

    So the trainer still gets CPU tensors of the same values (the Trainer's contract). Tensors
    in other containers are left as they are."""
    if isinstance(loaded, torch.Tensor):
        if isinstance(current, torch.Tensor) and current.layout == loaded.layout == torch.strided \
                and current.shape == loaded.shape and current.dtype == loaded.dtype:
            if current.device.type == "cpu" and current.is_contiguous() and not current.is_inference():
                with torch.no_grad():
                    current.copy_(loaded)
                return current
            if current.device.type not in ("cpu", "meta") and loaded.nbytes >= _PASSED_ON_BYTES:
                return loaded
        return copy.deepcopy(loaded, memo)
    if isinstance(loaded, dict):
        for key, value in loaded.items():
            loaded[key] = _into_current(current.get(key) if isinstance(current, dict) else None, value, memo)
    elif isinstance(loaded, list):
        same = isinstance(current, list) and len(current) == len(loaded)
        for i, value in enumerate(loaded):
            loaded[i] = _into_current(current[i] if same else None, value, memo)
    elif type(loaded) is tuple:
        same = isinstance(current, tuple) and len(current) == len(loaded)
        return tuple(_into_current(current[i] if same else None, value, memo) for i, value in enumerate(loaded))
    return loaded


class TrainingSession:
    """Trains one trainer with one seed on one device, stage after stage.

    Start with ``start_fresh()`` (step 0) or ``load(checkpoint_bytes)``, then
    call ``train(config, to_step)`` for each stage, ``evaluate()`` and
    ``save()`` between stages. The constructor calls ``set_determinism()``.

    Per global step ``s`` ``train`` does, in order: seed torch's global RNG
    with ``step_seed(seed, s)`` (:func:`seed_global_rng`); compute the values ``config_values(config, s)``;
    call ``trainer.setup`` with the values that changed since step ``s - 1``
    (all of them at the first step after ``start_fresh``; ``load`` applies the
    values of step ``s - 1`` itself); draw the
    mini-batch from the ``ResumableSampler``; call ``trainer.train_step``.

    Raises ValueError (naming field and value) for a seed outside
    ``[0, 2**63)``; RuntimeError when ``train``/``save``/``evaluate`` is called
    before ``start_fresh`` or ``load``.
    """

    def __init__(self, trainer: Trainer, seed: int, device: torch.device | str = "cpu") -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        set_determinism()
        self.trainer = trainer
        self.seed = seed
        self.device = torch.device(device)
        self._sampler: ResumableSampler | None = None
        self._step = 0
        self._hp: dict[str, float | int] = {}
        self._setup_all = True
        self.build_seconds: float | None = None
        """Seconds the trainer's build took in this session (None: not built by it)."""

    @property
    def step(self) -> int:
        """The next global step to train (= number of steps trained so far)."""
        return self._step

    def start_fresh(self) -> None:
        """Build the trainer from the seed and start at step 0."""
        self._build()
        self._sampler = ResumableSampler(self.trainer.train_size(), self.seed)
        self._step = 0
        self._hp = {}
        self._setup_all = True

    def load(self, data: bytes | Callable[[], Any], rebuild: bool = True) -> None:
        """Build the trainer from the seed, then restore a checkpoint made by ``save``.

        ``data``: the checkpoint's bytes, or a function returning its decoded state
        (:func:`~gpu_worker.checkpoint.decode_state` of the verified bytes), called once the
        trainer is built (a worker reads, verifies and decodes the checkpoint on another thread
        meanwhile); what it raises propagates, and the trainer is left as it was.

        ``rebuild=False``: the trainer is not built again. For a trainer already built with this
        seed on this device (by an earlier session) and only trained since: by the Trainer's
        determinism contract every piece of mutable training state is in its state dict, which
        this load overwrites, and what ``build`` derived from the seed alone (the data, the
        split) is the same; the gradients of ``trainer.model``'s parameters are dropped, as
        after a build. The result is then the same, bit for bit, without the build's cost (the
        model's construction and initialization, the data's preparation).

        Restores the trainer state (model, optimizer), the sampler (generator
        state, permutation, position), the step and the hyper-parameter
        values, and calls ``setup`` with ALL the values of step ``step - 1``
        (the last ones a straight run applied): the trainer keeps
        hyper-parameter effects outside its state dict (a rebuilt loader, a
        dropout rate, a label smoothing used by ``evaluate``), and since
        ``setup`` is idempotent, re-applying every value restores them exactly.
        So ``evaluate`` right after a load sees the same trainer as a straight
        run evaluating there, and the next ``train`` step calls ``setup`` with
        the values that changed, as a straight run does.

        The trainer's ``load_state_dict`` receives the decoded state with each tensor copied
        into the CPU tensor the trainer's own ``state_dict()`` holds at the same place (same
        shape and dtype): its memory is reused (no new memory faulted in; a decoded state may
        be views of a mapped file, :meth:`LoadedBytes.decode
        <gpu_worker.checkpoint.LoadedBytes.decode>`); large tensors whose place holds a GPU
        tensor are handed on as they are (the trainer copies them there), and the others are
        copies of their own (``copy.deepcopy``), so the trainer keeps nothing of the decoded
        state's memory unless it keeps a large tensor on the CPU where it had one on a GPU.
        Equal CPU tensors at every place, so the same result, by the Trainer's contract that
        its ``load_state_dict`` restores exactly what it is given.

        Raises CheckpointError when ``data`` cannot be decoded, ValueError
        when the format is not ``CHECKPOINT_FORMAT`` or the sampler state
        does not fit the trainer's ``train_size()``.
        """
        if rebuild:
            self._build()
        state = decode_state(data) if isinstance(data, bytes) else data()
        if not rebuild:
            model = getattr(self.trainer, "model", None)
            if isinstance(model, torch.nn.Module):
                for parameter in model.parameters():
                    parameter.grad = None
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"checkpoint format must be {CHECKPOINT_FORMAT}, got {found!r}")
        self.trainer.load_state_dict(_into_current(self.trainer.state_dict(), state["trainer"], {}))
        sampler = ResumableSampler(self.trainer.train_size(), self.seed)
        sampler.load_state_dict(state["sampler"])
        self._sampler = sampler
        self._step = state["step"]
        self._hp = dict(state["hp"])
        # The values of step - 1 applied, as a straight run has them at this step: what
        # evaluate() computes may depend on them (sequence length, label smoothing). The next
        # train step then calls setup with what changed, as a straight run does.
        if self._hp:
            self.trainer.setup(dict(self._hp))
        self._setup_all = not self._hp

    def save(self) -> bytes:
        """Return the checkpoint bytes of the current state.

        Layout: ``encode_state({"format": 1, "step": int, "trainer":
        trainer.state_dict(), "sampler": sampler.state_dict(), "hp": {name:
        value}})`` with every tensor on the CPU; equal states give equal bytes.
        """
        return encode_state(self.state())

    def snapshot(self, buffers: SnapshotBuffers | None = None) -> Snapshot:
        """Return a copy of the current state that training will not change: ``encode_state(
        session.snapshot().state) == session.save()``, bit for bit. Taking it costs one memory
        copy of the tensors (no serialization), so a worker encodes, hashes and writes it on
        another thread while training goes on (gpu_worker.executor). With ``buffers``, large
        storages are copied into reused memory (give the snapshot back once encoded)."""
        if buffers is not None:
            return buffers.take(self.state())
        return Snapshot(snapshot_state(self.state()), ())

    def state(self) -> dict[str, object]:
        """The current state as :meth:`save` encodes it, its tensors the live ones (training
        changes them in place: write it before training goes on, or take a :meth:`snapshot`)."""
        sampler = self._require_started()
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self._step,
            "trainer": self.trainer.state_dict(),
            "sampler": sampler.state_dict(),
            "hp": dict(self._hp),
        }

    def train(self, config: HPConfig, to_step: int, interrupt: Callable[[], bool] | None = None) -> None:
        """Train global steps ``[step, to_step)`` under ``config``; afterwards ``step == to_step``,
        unless ``interrupt()`` (asked before every step) was true: then it returns at that step
        boundary (a decision about the running path arrived; see events.execution).

        ``config`` maps hyper-parameter names (a subset of
        ``trainer.hyperparameters``) to functions of the global step. The
        mini-batch size is ``config[trainer.batch_size_hp]`` at each step when
        present, else ``trainer.default_batch_size``.

        Raises ValueError when ``to_step < step``, when the config names a
        hyper-parameter the trainer does not accept or differs in names from
        the values restored from a checkpoint, or when a batch size is not a
        positive integer.
        """
        sampler = self._require_started()
        if isinstance(to_step, bool) or not isinstance(to_step, int) or to_step < self._step:
            raise ValueError(f"to_step must be an int >= step {self._step}, got {to_step!r}")
        unknown = sorted(set(config) - set(self.trainer.hyperparameters))
        if unknown:
            raise ValueError(
                f"config names hyper-parameters {unknown} that trainer {self.trainer.name!r} "
                f"does not accept; it accepts {list(self.trainer.hyperparameters)}"
            )
        if self._hp and set(config) != set(self._hp):
            raise ValueError(
                f"config hyper-parameters {sorted(config)} differ from those already applied "
                f"{sorted(self._hp)}"
            )
        for s in range(self._step, to_step):
            if interrupt is not None and interrupt():
                return  # at a step boundary: self.step says where
            seed_global_rng(step_seed(self.seed, s), self.device)
            values = config_values(config, s)
            batch_size = self._batch_size(values, s)
            if self._setup_all:
                changed = values
            else:
                changed = {k: v for k, v in values.items() if _differs(self._hp[k], v)}
            if changed:
                self.trainer.setup(dict(changed))
            self._hp = values
            self._setup_all = False
            indices = (
                torch.empty(0, dtype=torch.int64)
                if batch_size is None
                else sampler.next_batch(batch_size)
            )
            self.trainer.train_step(indices, s)
            self._step = s + 1

    def evaluate(self) -> dict[str, float]:
        """Return ``trainer.evaluate()`` as ``{name: float}``, sorted by name.

        Runs under ``torch.no_grad()`` with torch's global RNG (CPU, and the
        session's CUDA device) saved and restored, so evaluating between steps
        never changes what training computes.
        """
        self._require_started()
        cuda_devices = (
            [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            if self.device.type == "cuda"
            else []
        )
        with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
            metrics = self.trainer.evaluate()
        return {str(name): float(metrics[name]) for name in sorted(metrics)}

    def _build(self) -> None:
        t0 = time.perf_counter()
        seed_global_rng(self.seed, self.device)
        self.trainer.build(self.seed, self.device)
        self.build_seconds = time.perf_counter() - t0

    def _require_started(self) -> ResumableSampler:
        if self._sampler is None:
            raise RuntimeError("training session not started: call start_fresh() or load() first")
        return self._sampler

    def _batch_size(self, values: dict[str, float | int], step: int) -> int | None:
        """Examples to draw at ``step``; None when the trainer draws no batches."""
        name = self.trainer.batch_size_hp
        if name is None:
            return None
        if name not in values:
            return self.trainer.default_batch_size
        value = values[name]
        if isinstance(value, bool) or value != int(value) or int(value) < 1:
            raise ValueError(
                f"hyper-parameter {name!r} (batch size) must be a positive integer, "
                f"got {value!r} at step {step}"
            )
        return int(value)
