"""Fault points: places where a test can kill the process at an exact moment (kill -9 between an
eviction event and the deletion it allows, say), to check that a crash there loses nothing.

``fault_point(name)`` does nothing unless the environment variable ``STAGETREE_FAULT`` names it;
then the process kills itself with SIGKILL, as a power loss or the kernel's OOM killer would.
``STAGETREE_FAULT=name@FILE`` kills only the first process to reach the point (the one that
creates ``FILE``): a worker its coordinator starts again must not die at the same place again.
"""

from __future__ import annotations

import os
import signal

ENV = "STAGETREE_FAULT"


def fault_point(name: str) -> None:
    """Die here (SIGKILL) when ``$STAGETREE_FAULT`` is ``name``, or ``name@FILE`` and ``FILE``
    did not exist yet (it is created first, atomically)."""
    spec = os.environ.get(ENV)
    if spec is None:
        return
    point, _, once = spec.partition("@")
    if point != name:
        return
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)
