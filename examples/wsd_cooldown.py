"""Example study: warmup-stable-decay (WSD) cooldowns of a small character-level transformer.

Hägele et al., "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"
(NeurIPS 2024): train one long run at a constant learning rate after a short warm-up, and get a
finished model of any length by branching a short *cooldown* (the learning rate decayed to 0)
off the constant phase where you want it; the shape of the decay matters (1-sqrt beats linear
and cosine) and 10-20% of the steps is enough. Every trial here is such a schedule, so they all
share the warm-up and the constant phase up to their cooldown: stagetree trains that trunk once
and every cooldown resumes from its checkpoint, which is where merging pays most.

Data: text that ships with every Python: the source files of the interpreter's own standard
library (``sysconfig.get_path("stdlib")``, top-level ``*.py`` files), taken in the order of the
sha256 of their names until the size's character budget, each headed by ``# file: <name>``;
characters are their code points below 127, anything else is code 127. The first 90% of the
characters train, the last 10% validate. The corpus's sha256 is one of the trainer's constants,
so another Python (another standard library) makes another search plan.

Model: a decoder-only transformer (learned positions, pre-norm blocks of causal self-attention
and a 4x GELU MLP, no dropout, tied input and output embeddings initialised with std 0.02) trained with AdamW on windows
of ``context + 1`` characters (the training text cut into non-overlapping windows, drawn by the
framework's resumable sampler). Tuned: ``lr`` (AdamW's learning rate, a sequence of the global
step). Metric: ``val_loss``, the mean cross-entropy of the next character on the validation
windows in nats per character (lower is better); ``val_bpc`` is the same in bits.

Search space (``WSD_SIZE=full``, the default): warm-up 0 -> 3e-3 over 50 steps, then constant;
cooldowns start at steps 200, 400 and 600 and last 10% or 20% of the steps before them, with
shapes linear, cosine and 1-sqrt (``PowerRamp`` power 1, ``Cosine`` to 0, ``PowerRamp`` power
0.5); plus the constant schedule with no cooldown, evaluated where each cooldown ends. Every
trial trains to the step its cooldown ends. ``WSD_SIZE=test`` is the same study with a smaller
model, corpus and steps (the test suite runs it).

Run: ``stagetree run examples/wsd_cooldown.py --workers 2`` (a few minutes on 2 CPU cores; the
framework passes ``cuda:i`` to ``build`` when CUDA is present).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from stagetree import Study, Trainer, TrialFailed, TrialResult, Tuner, TunerResult
from stagetree.hp import Constant, Cosine, HPFunction, Piecewise, PowerRamp, Warmup

VALIDATION_FRACTION = 0.1
UNKNOWN = 127  # code of every character outside ASCII 0..126


@dataclass(frozen=True)
class Size:
    """One size of the study: corpus (characters), model, batch and schedule (steps)."""

    chars: int
    context: int
    width: int
    layers: int
    heads: int
    batch: int
    val_windows: int
    warmup: int
    peak_lr: float
    cooldown_starts: tuple[int, ...]
    cooldown_fractions: tuple[float, ...]


SIZES = {
    "full": Size(chars=400_000, context=64, width=96, layers=2, heads=4, batch=32, val_windows=256, warmup=50,
                 peak_lr=3e-3, cooldown_starts=(200, 400, 600), cooldown_fractions=(0.1, 0.2)),
    "test": Size(chars=40_000, context=32, width=32, layers=1, heads=2, batch=16, val_windows=32, warmup=5,
                 peak_lr=3e-3, cooldown_starts=(20, 40), cooldown_fractions=(0.2,)),
}
SIZE_NAME = os.environ.get("WSD_SIZE", "full")
if SIZE_NAME not in SIZES:
    raise ValueError(f"WSD_SIZE is {SIZE_NAME!r}, but must be one of {sorted(SIZES)}")
SIZE = SIZES[SIZE_NAME]


# ----------------------------------------------------------------------------- data


@lru_cache(maxsize=4)
def corpus(chars: int) -> tuple[str, list[str]]:
    """The first ``chars`` characters of the standard library's top-level sources in the order of
    sha256(file name), each file headed by ``# file: <name>``; and the names of the files used."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    files = sorted(stdlib.glob("*.py"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    parts, names, size = [], [], 0
    for path in files:
        if size >= chars:
            break
        text = f"# file: {path.name}\n" + path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        names.append(path.name)
        size += len(text)
    if size < chars:
        raise ValueError(f"the standard library at {stdlib} holds {size} characters of top-level sources, "
                         f"fewer than the {chars} this size needs")
    return "".join(parts)[:chars], names


def encode(text: str) -> torch.Tensor:
    """Character codes, int64 ``(len(text),)``: the code point below 127, else 127."""
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
    return codes.clamp(max=UNKNOWN)


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attention = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """``(batch, t)`` character codes (t <= context) -> ``(batch, t, 128)`` next-character logits."""

    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(UNKNOWN + 1, width)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.position = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.embed(codes) + self.position[: codes.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


class WSDTrainer(Trainer):
    """AdamW on :class:`CharTransformer` over the standard library's sources; ``lr`` is tuned."""

    name = "wsd-char-transformer"
    hyperparameters = ("lr",)
    default_batch_size = SIZE.batch

    train_windows: torch.Tensor
    val_windows: torch.Tensor

    def constants(self) -> dict[str, Any]:
        text, files = corpus(SIZE.chars)
        return {
            "corpus": "python stdlib top-level *.py by sha256(name)",
            "corpus_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "files": len(files),
            "size": SIZE_NAME,
            "validation_fraction": VALIDATION_FRACTION,
            "model": {"context": SIZE.context, "width": SIZE.width, "layers": SIZE.layers, "heads": SIZE.heads},
            "val_windows": SIZE.val_windows,
            "optimizer": {"name": "AdamW", "betas": [0.9, 0.95], "weight_decay": 0.1},
        }

    def build(self, seed: int, device: torch.device) -> None:
        codes = encode(corpus(SIZE.chars)[0])
        split = int(len(codes) * (1 - VALIDATION_FRACTION))
        w = SIZE.context + 1
        train, val = codes[:split], codes[split:]
        self.train_windows = train[: len(train) // w * w].view(-1, w).to(device)
        stride = max(1, (len(val) - w) // SIZE.val_windows)
        starts = torch.arange(SIZE.val_windows) * stride
        self.val_windows = torch.stack([val[s: s + w] for s in starts.tolist()]).to(device)
        self.model = CharTransformer(SIZE.context, SIZE.width, SIZE.layers, SIZE.heads).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, betas=(0.9, 0.95), weight_decay=0.1)

    def train_size(self) -> int:
        return len(self.train_windows)

    def setup(self, hp: dict[str, float | int]) -> None:
        if "lr" in hp:
            for group in self.optimizer.param_groups:
                group["lr"] = float(hp["lr"])

    def _loss(self, windows: torch.Tensor) -> torch.Tensor:
        logits = self.model(windows[:, :-1])
        return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        self.model.train()
        loss = self._loss(self.train_windows[indices.to(self.train_windows.device)])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        loss = self._loss(self.val_windows).item()
        self.model.train()
        return {"val_loss": loss, "val_bpc": loss / math.log(2)}


# ----------------------------------------------------------------------------- the schedules

SHAPES = ("linear", "cosine", "1-sqrt")


def cooldown(shape: str, peak: float, length: int) -> HPFunction:
    """The decay from ``peak`` to 0 over ``length`` steps (then 0), in its own frame."""
    if shape == "linear":
        return PowerRamp(peak, 0.0, length, 1)
    if shape == "cosine":
        return Piecewise([Cosine(peak, 0.0, length), Constant(0.0)], [length])
    if shape == "1-sqrt":
        return PowerRamp(peak, 0.0, length, 0.5)
    raise ValueError(f"`shape` is {shape!r}, but must be one of {SHAPES}")


def wsd(start: int | None, shape: str = "", length: int = 0) -> HPFunction:
    """Warm-up to the peak, constant, and (unless ``start`` is None) the cooldown from ``start``."""
    stable = Warmup(0.0, SIZE.warmup, Constant(SIZE.peak_lr))
    if start is None:
        return stable
    return Piecewise([stable, cooldown(shape, SIZE.peak_lr, length)], [start])


def schedules() -> list[tuple[dict[str, HPFunction], list[int]]]:
    """``(config, steps to evaluate it at)``: every cooldown once, at its end; the constant
    schedule at every cooldown's end."""
    out, ends = [], []
    for start in SIZE.cooldown_starts:
        for fraction in SIZE.cooldown_fractions:
            length = max(1, round(start * fraction))
            ends.append(start + length)
            out += [({"lr": wsd(start, shape, length)}, [start + length]) for shape in SHAPES]
    return [({"lr": wsd(None)}, sorted(set(ends))), *out]


class EvaluateAt(Tuner):
    """Trains every configuration to each of its steps (all submitted at once) and picks the best
    result at a configuration's last steps; a configuration asked at several steps is one trial
    extended to each (its earlier steps come from its own checkpoints). A trial whose training
    failed is a result with its error (a loss, as in every stagetree tuner)."""

    def __init__(self, plan: list[tuple[dict[str, HPFunction], list[int]]], metric: str, mode: str = "min") -> None:
        super().__init__([config for config, _ in plan], metric, mode)  # type: ignore[arg-type]
        self.plan = plan

    async def run(self, study: Study) -> TunerResult:
        asked = [(config, steps) for config, all_steps in self.plan for steps in all_steps]
        answers = await asyncio.gather(*(study.submit(config, steps) for config, steps in asked),
                                       return_exceptions=True)
        last: dict[str, TrialResult] = {}
        for (config, steps), answer in zip(asked, answers):
            if isinstance(answer, TrialFailed):
                result = TrialResult(study.trial_id(config), config, steps, {}, error=answer.error or "failed")
            elif isinstance(answer, BaseException):
                raise answer
            else:
                result = TrialResult(study.trial_id(config), config, steps, answer)
            if result.trial_id not in last or steps > last[result.trial_id].steps:
                last[result.trial_id] = result
        return self._result(study, list(last.values()), last)


name = f"wsd-{SIZE_NAME}"
seed = 0
trainer = WSDTrainer()
tuner = EvaluateAt(schedules(), metric="val_loss", mode="min")
