"""A tiny study whose worker processes die while starting (building the trainer), for the
supervision tests: ``STAGETREE_TEST_DIE=once:PATH`` kills the first worker that gets to build
(SIGKILL, as the kernel's OOM killer would) and lets the others and its replacement live;
``STAGETREE_TEST_DIE=always`` makes every build raise."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits import DigitsTrainer  # noqa: E402

from stagetree import GridSearch, GridSearchSpace  # noqa: E402


class DiesAtStartup(DigitsTrainer):
    name = "DigitsTrainer"  # same plan key as the digits trainer: only start-up differs

    def build(self, seed, device):
        how = os.environ.get("STAGETREE_TEST_DIE", "")
        if how == "always":
            raise RuntimeError("this worker cannot build its trainer")
        if how.startswith("once:"):
            try:
                fd = os.open(how[len("once:"):], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        super().build(seed, device)


name = "dies"
seed = 3
trainer = DiesAtStartup()
tuner = GridSearch(GridSearchSpace({"lr": [0.1, 0.05], "batch_size": [32], "momentum": [0.0]}), steps=5,
                   metric="val_acc")
