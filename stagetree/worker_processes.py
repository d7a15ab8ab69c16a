"""Starting the embedded workers' processes: how (spawn, or forked from a fork server that
imported torch once), early (before the run's arguments are checked), and naming how they ended.

Importable without torch, pydantic or the log (``stagetree run`` starts its workers before it
imports those: their start-up, mostly importing torch, overlaps the coordinator's).
"""

from __future__ import annotations

import asyncio
import glob
import multiprocessing as mp
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from gpu_worker.boot import prestarted_worker_main
from stagetree.errors import RuntimeError_


def describe_exit(code: int | None) -> str:
    """A process exit code in words: ``exited with code 1``, ``was killed by SIGKILL``."""
    if code is None:
        return "is gone (its pipe closed)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


MAX_RESTARTS = 3
"""How many times a worker slot (or a process a Kafka run started) is started again after its
process exited unexpectedly."""


class Spawned:
    """A process a Kafka run started (``stagetree serve`` or ``worker``): ``name`` in messages,
    ``start()`` makes it (again), ``proc`` the current one, ``restarts`` so far."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen[bytes]]) -> None:
        self.name, self._start, self.restarts = name, start, 0
        self.proc = start()

    def restart(self) -> None:
        self.restarts += 1
        self.proc = self._start()


async def watch(spawned: list[Spawned], warn: Callable[[str], None], poll_s: float = 0.5) -> None:
    """Until cancelled, look at ``spawned`` every ``poll_s`` seconds: one that exited is started
    again, up to :data:`MAX_RESTARTS` times (``warn`` says so), as an embedded run does its
    workers; a Kafka deployment absorbs the loss meanwhile (a worker declared lost, its path
    dispatched again; another serve instance, or this one restarted, takes the role).

    Raises:
        ProcessesFailed: one exited with code 2 (bad input, which it would meet again: its
            error is on stderr above), or after its restarts.
    """
    while True:
        await asyncio.sleep(poll_s)
        for s in spawned:
            code = s.proc.poll()
            if code is None:
                continue
            how = describe_exit(code)
            if code == 2:
                raise ProcessesFailed(f"{s.name} (pid {s.proc.pid}) {how}, a refusal of its input (its error is "
                                      "above): the run cannot go on")
            if s.restarts >= MAX_RESTARTS:
                raise ProcessesFailed(f"{s.name} (pid {s.proc.pid}) {how} after {MAX_RESTARTS} restarts: the run "
                                      "cannot go on")
            warn(f"{s.name} (pid {s.proc.pid}) {how}; starting it again (restart {s.restarts + 1} of "
                 f"{MAX_RESTARTS})")
            s.restart()


class ProcessesFailed(RuntimeError_):
    """A process a run started cannot be kept running (exit 1)."""


WORKER_START_ENV = "STAGETREE_WORKER_START"
"""Environment variable choosing how embedded workers start: ``auto`` (the default), ``spawn``
or ``forkserver`` (see :func:`worker_start_method`)."""

WORKER_PRELOAD = ["gpu_worker.preload"]
"""What the fork server imports before it forks the workers (torch and the worker's modules)."""


def gpus_visible() -> bool:
    """Whether this machine shows a GPU device file (``/dev/nvidia0``..., ``/dev/kfd`` for ROCm,
    ``/dev/dxg`` under WSL): the cheap test, without importing torch, of whether a worker
    could use CUDA."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")


def worker_start_method(device: str, requested: str | None = None, gpus: bool | None = None) -> str:
    """How the embedded workers of a run on ``device`` start: a multiprocessing start method.

    ``forkserver`` where no worker can use a GPU (``device`` is ``cpu``, or ``auto`` on a machine
    without GPU device files, :func:`gpus_visible`): one fork server imports torch, its compiler
    front end and the worker once (:mod:`gpu_worker.preload`, about 2.8 s of CPU here) and forks
    every worker from there, so N workers cost one import instead of N, and a worker started
    again after a crash is up in milliseconds. ``spawn`` otherwise: CUDA must not be
    initialised in a process that is forked afterwards, and a spawned worker owes nothing to a
    parent. Both give the same results bit for bit (each worker builds its trainer and seeds
    its generators itself; tests/test_e2e.py compares them).

    A process has one fork server, started on first use and left when the process ends. A
    worker forked from it takes its coordinator's working directory (multiprocessing's doing)
    and environment (:func:`gpu_worker.boot.embedded_worker_main`'s) at its start, but writes
    to the standard output and error the server was started with.

    Args:
        device: the run's ``--device`` (``auto``, ``cpu``, ``cuda:N``).
        requested: ``auto``, ``spawn`` or ``forkserver``; default: ``$STAGETREE_WORKER_START``,
            else ``auto`` (the choice above).
        gpus: whether GPUs are visible (default: :func:`gpus_visible`).

    Raises:
        ValueError: ``requested`` (or the variable) is none of those, naming it and its value.
    """
    choice = requested if requested is not None else os.environ.get(WORKER_START_ENV, "auto")
    if choice not in ("auto", "spawn", "forkserver"):
        where = "`start_method`" if requested is not None else f"${WORKER_START_ENV}"
        raise ValueError(f"{where} is {choice!r}, but must be auto, spawn or forkserver")
    if choice != "auto":
        return choice
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    cpu_only = device == "cpu" or (device == "auto" and not (gpus_visible() if gpus is None else gpus))
    return "forkserver" if cpu_only else "spawn"


def start_process(target: Callable[..., None], args: tuple[object, ...], name: str, method: str = "spawn"
                  ) -> tuple[mp.process.BaseProcess, Connection]:
    """Start ``target(child_end, *args)`` in a daemon process started by ``method`` (``spawn`` or
    ``forkserver``, see :func:`worker_start_method`); returns it and the coordinator's end of the
    pipe. With ``forkserver`` the first call waits until the fork server has imported
    :data:`WORKER_PRELOAD` (seconds); later calls take milliseconds."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(WORKER_PRELOAD)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()
    return proc, parent


class PrestartedWorkers:
    """``n`` worker processes started before their run's arguments are checked: they import
    torch and the worker (seconds) while the coordinator loads the study file and opens the log,
    and wait for their arguments (see :func:`gpu_worker.boot.prestarted_worker_main`). They are
    started on a thread, as a fork server's first start waits for its imports. The coordinator
    takes them in :meth:`take`; :meth:`close` kills those not taken (the run was refused or
    failed): they have not touched the run directory.

    Args:
        n: processes to start (>= 0).
        method: their start method (:func:`worker_start_method`), kept as :attr:`method` for
            the processes the coordinator starts later (restarts).
    """

    def __init__(self, n: int, method: str = "spawn") -> None:
        self.method = method
        self._free: list[tuple[mp.process.BaseProcess, Connection]] = []
        self._starting = threading.Thread(target=self._start_all, args=(n, method), daemon=True,
                                          name="stagetree-prestart")
        self._starting.start()

    def _start_all(self, n: int, method: str) -> None:
        try:
            for _ in range(n):
                self._free.append(start_process(prestarted_worker_main, (), "stagetree-worker", method))
        except Exception:  # noqa: S110  the coordinator starts the missing workers itself, and raises the cause
            pass

    def take(self) -> tuple[mp.process.BaseProcess, Connection] | None:
        """A started process and its pipe that still runs (once all have started), or None when
        none is left."""
        self._starting.join()
        while self._free:
            proc, conn = self._free.pop(0)
            if proc.is_alive():
                return proc, conn
            conn.close()
        return None

    def close(self) -> None:
        """Kill the processes not taken (once all have started): they have only imported
        modules, touched nothing."""
        self._starting.join()
        for proc, conn in self._free:
            proc.kill()
            proc.join()
            conn.close()
        self._free.clear()
