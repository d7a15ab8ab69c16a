"""The example's digits trainer, counting its builds: for tests of a worker that loads into a
trainer it built, or restores its state, instead of building it again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import DigitsTrainer  # noqa: E402


class CountedBuilds(DigitsTrainer):
    """The digits trainer, counting its builds; ``build_s``: seconds each build takes at least
    (a large model's construction)."""

    builds = 0
    build_s = 0.0

    def build(self, seed: int, device: torch.device) -> None:
        self.builds += 1
        time.sleep(self.build_s)
        super().build(seed, device)
