"""The embedded worker process: one per device, talking to the coordinator over a pipe.

The coordinator sends encoded StageDispatched events (bytes) and ``b"stop"``; the worker sends
back batches of events (:func:`events.codec.encode_batch`; WorkerJoined first, then each path's
results), each appended atomically. A message that is not a dispatch is dead-lettered (sent back
as a DeadLettered event), never a crash. The worker never writes the
log itself: in embedded mode the coordinator is the only writer (DESIGN.md "Processes").
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from events import tracing
from events.codec import InvalidEvent, decode, encode_batch
from events.deadletter import dead_letter
from events.models import Event, StageDispatched, WorkerJoined
from gpu_worker.checkpoint import LocalCheckpointStore
from gpu_worker.executor import PathExecutor, resolve_device
from gpu_worker.loader import load_trainer
from gpu_worker.session import TrainingSession
from gpu_worker.trainer import Trainer

STOP = b"stop"


def warm_up(trainer: Trainer, device: torch.device) -> None:
    """Build the trainer once and evaluate, before joining: loading data and torch's first-call
    costs are worker start-up, not time held by a stage (worker-seconds count stages only)."""
    session = TrainingSession(trainer, 0, device)
    session.start_fresh()
    session.evaluate()


def embedded_worker_main(conn: Connection, worker_id: str, index: int, study_file: str, checkpoint_dir: str,
                         device: str = "auto", threads: int = 1, otel_exporter: str = "none") -> None:
    """Entry point of a worker subprocess (multiprocessing, spawn start method).

    Args:
        conn: duplex pipe to the coordinator.
        index: the worker's position, used to pick ``cuda:<index>`` with ``device="auto"``.
        threads: torch intra-op threads (1 keeps N workers on N cores from oversubscribing, and
            keeps float reductions identical whatever the worker count).
        otel_exporter: the coordinator's ``--otel-exporter`` (see events.tracing).
    """
    tracing.configure(otel_exporter, f"stagetree-worker-{worker_id}")
    try:
        _serve(conn, worker_id, index, study_file, checkpoint_dir, device, threads)
    finally:
        tracing.shutdown()


def _serve(conn: Connection, worker_id: str, index: int, study_file: str, checkpoint_dir: str, device: str,
           threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    dev = resolve_device(device, index)
    trainer = load_trainer(study_file)
    executor = PathExecutor(trainer, worker_id, LocalCheckpointStore(Path(checkpoint_dir)), dev)
    warm_up(trainer, dev)

    def emit(events: list[Event]) -> None:
        conn.send_bytes(encode_batch(events))

    emit([executor.stamp(WorkerJoined(worker_id=worker_id, device=str(dev)))])
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if msg == STOP:
            return
        try:
            dispatch = decode(msg)
            if not isinstance(dispatch, StageDispatched):
                raise InvalidEvent(f"a worker is sent StageDispatched events, not {dispatch.type}")
        except InvalidEvent as exc:  # one rule: dead-letter with the reason, never crash, never drop
            emit([dead_letter(f"pipe:coordinator->{worker_id}", -1, msg, exc.reason, producer=f"worker:{worker_id}")])
            continue
        executor.run(dispatch, emit)
