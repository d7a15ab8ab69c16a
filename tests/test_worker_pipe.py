"""An embedded worker's pipe to its coordinator (gpu_worker/process.py), on a real OS pipe."""

from __future__ import annotations

import multiprocessing
from collections import deque

import pytest

from events.models import Event
from gpu_worker.process import PipeControl


def test_a_worker_leaves_its_path_when_the_coordinator_closes_the_pipe() -> None:
    """A coordinator killed with kill -9 closes the pipe: the worker must not train the rest of
    its path for nobody (an orphan keeps a GPU busy); it leaves at the next step boundary."""
    coordinator, worker = multiprocessing.Pipe()
    emitted: list[list[Event]] = []
    control = PipeControl(worker, deque(), "w0", emitted.append)
    assert control.poll() == []  # nothing yet: the path trains on
    coordinator.close()
    assert control.waiting()  # the end of the pipe is news: the step boundary looks at it
    with pytest.raises(SystemExit, match="coordinator closed the pipe"):
        control.poll()
    assert emitted == []
