"""The embedded worker process: one per device, talking to the coordinator over a pipe.

The coordinator sends encoded StageDispatched events (bytes) and ``b"stop"``; the worker sends
back batches of events (:func:`events.codec.encode_batch`; WorkerJoined first, then each path's
results), each appended atomically. A message that is not a dispatch is dead-lettered (sent back
as a DeadLettered event), never a crash. The worker never writes the
log itself: in embedded mode the coordinator is the only writer (DESIGN.md "Processes").
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from events.codec import InvalidEvent, decode, encode_batch
from events.deadletter import dead_letter
from events.execution import END_POLL_S, EndBatches
from events.faults import fault_point
from events.models import CheckpointRequested, Event, PathPreempted, StageDispatched, WorkerJoined
from gpu_worker.boot import STOP
from gpu_worker.checkpoint import LocalCheckpointStore
from gpu_worker.executor import PathExecutor, resolve_device
from gpu_worker.loader import load_trainer
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer


def warm_up(trainer: Trainer, device: torch.device) -> None:
    """Build the trainer once, evaluate and train one step, before joining: loading data and
    torch's first-call costs (oneDNN primitives on the CPU; cuBLAS and cuDNN handles and kernels
    loaded on first use on CUDA) are worker start-up, not time held by the first stage it runs
    (worker-seconds count stages only, and a plan's cost model reads seconds per step off them).

    The step trains the build's own hyper-parameter values at the trainer's default batch size
    (no ``setup``); its weights are thrown away, since every stage builds or loads its own. A
    trainer that cannot evaluate or train without its hyper-parameters set raises here: that
    error is left to the stage that meets it, which reports it as the trainer's (a failed
    trial), and the worker joins all the same. A build that raises is the worker's failure to
    start (it is started again, then the run ends saying why). Costs one training step and one
    evaluation of start-up.
    """
    session = TrainingSession(trainer, 0, device)
    session.start_fresh()
    for warm in (session.evaluate, functools.partial(session.train, {}, 1)):
        try:
            warm()
        except Exception:  # likewise: the first stage that evaluates or trains raises it again
            pass


def serve(conn: Connection, worker_id: str, index: int, study_file: str, checkpoint_dir: str, device: str,
          threads: int) -> None:
    """Serve the coordinator on ``conn`` until it sends :data:`~gpu_worker.boot.STOP` or closes
    the pipe (see :func:`gpu_worker.boot.embedded_worker_main` for the arguments): build the
    trainer, warm up, send WorkerJoined, then run each dispatched path."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    dev = resolve_device(device, index)
    trainer = load_trainer(study_file)
    executor = PathExecutor(trainer, worker_id, LocalCheckpointStore(Path(checkpoint_dir)), dev)
    warm_up(trainer, dev)

    def emit(events: list[Event]) -> None:
        conn.send_bytes(encode_batch(events))

    emit([executor.stamp(WorkerJoined(worker_id=worker_id, device=str(dev)))])
    backlog: deque[bytes] = deque()
    ends = EndBatches(emit)  # a path's end does not wait for its writes (PathTrained)
    while True:
        if backlog:
            msg = backlog.popleft()
        else:
            try:
                while ends and not conn.poll(END_POLL_S):  # idle: send each end batch once verified
                    ends.release(False)
                msg = conn.recv_bytes()
            except (EOFError, ConnectionError):  # the coordinator is gone (a kill -9 resets the pipe)
                return
        if msg == STOP:
            ends.release(True)
            return
        event = _decode(msg, worker_id, emit)
        if isinstance(event, StageDispatched):
            executor.run(event, emit, PipeControl(conn, backlog, worker_id, emit), ends=ends)
            if ends:  # handed on (PathTrained sent) before its writes were verified
                fault_point("worker-after-path-trained")
        # a decision about a path that has ended already (it finished first) needs nothing


def _decode(msg: bytes, worker_id: str, emit: Callable[[list[Event]], None]) -> Event | None:
    """The event of a coordinator message; a message that is not a worker's event is
    dead-lettered (one rule: never crash, never drop silently) and None returned."""
    try:
        event = decode(msg)
        if not isinstance(event, (StageDispatched, PathPreempted, CheckpointRequested)):
            raise InvalidEvent(f"a worker is sent StageDispatched, PathPreempted and CheckpointRequested events, "
                               f"not {event.type}")
        return event
    except InvalidEvent as exc:
        emit([dead_letter(f"pipe:coordinator->{worker_id}", -1, msg, exc.reason, producer=f"worker:{worker_id}")])
        return None


class PipeControl:
    """The :class:`~events.execution.Control` of a path on an embedded worker: decisions about
    it (PathPreempted, CheckpointRequested) arrive on the coordinator's pipe while it trains;
    anything else read meanwhile waits in ``backlog`` for the worker's loop."""

    def __init__(self, conn: Connection, backlog: deque[bytes], worker_id: str,
                 emit: Callable[[list[Event]], None]) -> None:
        self.conn, self.backlog, self.worker_id, self.emit = conn, backlog, worker_id, emit

    def waiting(self) -> bool:
        return self.conn.poll(0)

    def poll(self) -> list[Event]:
        """Decisions about the running path that arrived on the pipe (others wait in the backlog).

        Raises:
            SystemExit: the coordinator closed the pipe (it died): nobody is left to take the
                path's results, so the worker leaves at this step boundary instead of training
                on (the coordinator's restart dispatches the path again from its checkpoints).
        """
        out: list[Event] = []
        while self.conn.poll(0):
            try:
                msg = self.conn.recv_bytes()
            except (EOFError, ConnectionError):
                raise SystemExit(f"stagetree worker {self.worker_id}: the coordinator closed the pipe; "
                                 "leaving the path") from None
            event = None if msg == STOP else _decode(msg, self.worker_id, self.emit)
            if isinstance(event, (PathPreempted, CheckpointRequested)):
                out.append(event)
            elif msg == STOP or isinstance(event, StageDispatched):
                self.backlog.append(msg)
        return out
