"""Resumable mini-batch sampler: the data order as checkpointable state.

Source: HIPPO_SPEC §6 (the checkpoint holds the current permutation and the
position in it; the batch size may change mid-run) and DESIGN.md
"Determinism recipe".
"""

from __future__ import annotations

from typing import Any

import torch


def _check_int(field: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{field} must be >= {minimum}{upper}, got {value!r}")
    return value


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    return repr(value)


class ResumableSampler:
    """Draws mini-batches of example indices from successive permutations of ``range(n)``.

    Permutations come from a CPU ``torch.Generator`` seeded with ``seed``.
    ``next_batch(b)`` takes the next ``b`` indices of the current permutation
    and, when it runs out, continues into a fresh permutation. Hence the batch
    size may change at any step (even mid-epoch) and every index appears
    exactly once in each permutation; a batch that spans two permutations may
    repeat an index.

    The state (generator state, current permutation, position, epoch) is
    returned by ``state_dict`` as tensors and ints, so that
    ``torch.load(weights_only=True)`` accepts it.

    Raises ValueError, naming the field and value, for ``n < 1`` or a seed
    outside ``[0, 2**63)``.
    """

    def __init__(self, n: int, seed: int) -> None:
        self._n = _check_int("n", n, 1)
        _check_int("seed", seed, 0, 2**63 - 1)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._permutation = torch.randperm(self._n, generator=self._generator, dtype=torch.int64)
        self._position = 0
        self._epoch = 0

    @property
    def n(self) -> int:
        """Number of examples permuted."""
        return self._n

    @property
    def epoch(self) -> int:
        """Index (from 0) of the current permutation."""
        return self._epoch

    @property
    def position(self) -> int:
        """Indices of the current permutation already drawn, in ``[0, n]``."""
        return self._position

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """Return the next ``batch_size`` indices as an int64 CPU tensor of shape ``(batch_size,)``.

        Raises ValueError when ``batch_size`` is not an int >= 1.
        """
        _check_int("batch_size", batch_size, 1)
        pieces: list[torch.Tensor] = []
        needed = batch_size
        while needed > 0:
            if self._position == self._n:
                self._permutation = torch.randperm(
                    self._n, generator=self._generator, dtype=torch.int64
                )
                self._position = 0
                self._epoch += 1
            take = min(needed, self._n - self._position)
            pieces.append(self._permutation[self._position : self._position + take])
            self._position += take
            needed -= take
        return torch.cat(pieces)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"n", "generator", "permutation", "position", "epoch"}``.

        ``generator`` is the uint8 generator state, ``permutation`` an int64
        tensor of shape ``(n,)``; the others are ints. Tensors are copies.
        """
        return {
            "n": self._n,
            "generator": self._generator.get_state(),
            "permutation": self._permutation.clone(),
            "position": self._position,
            "epoch": self._epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state returned by ``state_dict``.

        Raises ValueError, naming the field and value, when the state was made
        for another ``n`` or is malformed.
        """
        missing = sorted({"n", "generator", "permutation", "position", "epoch"} - state.keys())
        if missing:
            raise ValueError(f"sampler state lacks fields {missing}, got keys {sorted(state)}")
        n = state["n"]
        if n != self._n:
            raise ValueError(f"sampler state n must be {self._n}, got {n!r}")
        permutation = state["permutation"]
        if (
            not isinstance(permutation, torch.Tensor)
            or permutation.dtype != torch.int64
            or tuple(permutation.shape) != (self._n,)
        ):
            raise ValueError(
                f"sampler state permutation must be an int64 tensor of shape ({self._n},), "
                f"got {_describe(permutation)}"
            )
        position = _check_int("sampler state position", state["position"], 0, self._n)
        epoch = _check_int("sampler state epoch", state["epoch"], 0)
        self._generator.set_state(state["generator"])
        self._permutation = permutation.clone()
        self._position = position
        self._epoch = epoch
