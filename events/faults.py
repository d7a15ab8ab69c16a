"""Fault points: places where a test can kill the process at an exact moment (kill -9 between an
eviction event and the deletion it allows, say), to check that a crash there loses nothing.

``fault_point(name)`` does nothing unless the environment variable ``STAGETREE_FAULT`` names it;
then the process kills itself with SIGKILL, as a power loss or the kernel's OOM killer would.
"""

from __future__ import annotations

import os
import signal

ENV = "STAGETREE_FAULT"


def fault_point(name: str) -> None:
    """Die here (SIGKILL) when ``$STAGETREE_FAULT`` is ``name``."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
