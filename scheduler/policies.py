"""The names of the scheduling policies (the thesis's scheduler ablation, §6.3 / HIPPO_SPEC
§3.7), described and implemented in :mod:`scheduler.decide`, which exports them as well.
Importable without the scheduler (the command line lists them in its help)."""

from __future__ import annotations

from typing import Literal, get_args

Policy = Literal["critical-path", "bfs", "most-children"]
POLICIES: tuple[Policy, ...] = get_args(Policy)
"""The scheduling policies ``decide`` accepts, Hippo's critical path first (for the CLI)."""


def check_policy(policy: str) -> Policy:
    """``policy`` if it is one of :data:`POLICIES`. Raises ValueError naming it otherwise."""
    if policy not in POLICIES:
        raise ValueError(f"`policy` is {policy!r}, but must be one of {', '.join(map(repr, POLICIES))}")
    return policy  # type: ignore[return-value]
