"""The entry point of an embedded worker process, importing nothing heavy itself.

multiprocessing's spawn start method unpickles the process target in the new interpreter before
calling it, importing the target's module; this module is that target, so a worker process
starts at once and imports torch (through :mod:`gpu_worker.process`) as its first piece of work,
while the coordinator goes on without torch. (With the forkserver start method the server has
imported all that already: :mod:`gpu_worker.preload`.)
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

STOP = b"stop"
"""The coordinator's message asking a worker to finish: sent after its last dispatch ended."""


def embedded_worker_main(conn: Connection, worker_id: str, index: int, study_file: str, checkpoint_dir: str,
                         device: str = "auto", threads: int = 1, otel_exporter: str = "none",
                         environ: dict[str, str] | None = None) -> None:
    """Entry point of a worker subprocess (multiprocessing, spawn or forkserver start method).

    Args:
        conn: duplex pipe to the coordinator.
        index: the worker's position, used to pick ``cuda:<index>`` with ``device="auto"``.
        threads: torch intra-op threads (1 keeps N workers on N cores from oversubscribing, and
            keeps float reductions identical whatever the worker count).
        otel_exporter: the coordinator's ``--otel-exporter`` (see events.tracing).
        environ: the coordinator's environment when it started this worker, made this process's
            own (a spawned process has it already; one forked from a fork server has the
            server's, from when the server started).

    A worker that finished cleanly (asked to stop, or its coordinator gone) leaves with
    ``os._exit(0)`` once its spans are exported and its output flushed: every checkpoint it wrote
    was awaited before the event that names it, so nothing is left to do, and tearing down an
    interpreter that has imported torch costs seconds. An error takes the normal path
    (traceback, exit code 1).

    SIGINT is ignored: Ctrl-C reaches the terminal's whole process group, and the coordinator
    stops its workers itself (a worker would die mid-stage with a KeyboardInterrupt traceback).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    from events import tracing
    from gpu_worker.process import serve

    tracing.configure(otel_exporter, f"stagetree-worker-{worker_id}")
    try:
        serve(conn, worker_id, index, study_file, checkpoint_dir, device, threads)
    finally:
        tracing.shutdown()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def prestarted_worker_main(conn: Connection) -> None:
    """Entry point of a worker started before its run's arguments are checked (``stagetree run``
    starts its workers first, so that their start-up, mostly importing torch, overlaps the
    coordinator's own): import the worker, then wait for the arguments of
    :func:`embedded_worker_main` after ``conn`` (one pickled tuple) and serve; the pipe closing
    first means the coordinator is gone: leave at once. (A refused run kills these processes.)
    SIGINT is ignored, as in :func:`embedded_worker_main`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import gpu_worker.process  # noqa: F401  (torch, the trainer's modules: the bulk of start-up)

    try:
        args = conn.recv()
    except EOFError:
        os._exit(0)
    embedded_worker_main(conn, *args)
