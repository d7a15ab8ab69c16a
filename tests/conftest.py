"""Shared fixtures: the local Kafka broker and MinIO server, started by the project's own script."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def infra_env() -> dict[str, str]:
    """Start (or reuse) Kafka and MinIO with ``infra/up.sh``; the variables of ``.infra/env``.

    The first run on a machine builds MinIO from source (minutes). Services stay running
    (``make infra-down`` stops them). Values are secrets: never print them.
    """
    proc = subprocess.run(["bash", "infra/up.sh"], cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        pytest.fail(f"infra/up.sh failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    env = {}
    for line in (REPO / ".infra" / "env").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            env[name] = value
    return env
