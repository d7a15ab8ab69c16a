"""How embedded workers start (issue 15 goal 1: start-up): forked from a server that imported
torch once where no GPU can be used, spawned otherwise; a bad choice is refused naming it; a
forked worker runs with its coordinator's environment, not the server's.

Spawned and forked workers giving the same results bit for bit: tests/test_e2e.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from stagetree.cli import main
from stagetree.worker_processes import WORKER_START_ENV, PrestartedWorkers, worker_start_method

ECHO = Path(__file__).parent / "studies" / "env_echo.py"


def test_workers_fork_from_a_server_where_no_gpu_can_be_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_START_ENV, raising=False)
    assert worker_start_method("cpu", gpus=True) == "forkserver"
    assert worker_start_method("auto", gpus=False) == "forkserver"
    assert worker_start_method("auto", gpus=True) == "spawn"  # CUDA must not be initialised before a fork
    assert worker_start_method("cuda:0", gpus=True) == "spawn"
    assert worker_start_method("cpu", requested="spawn") == "spawn"
    assert worker_start_method("auto", requested="forkserver", gpus=True) == "forkserver"
    monkeypatch.setenv(WORKER_START_ENV, "spawn")
    assert worker_start_method("cpu") == "spawn"


def test_a_bad_start_method_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"`start_method` is 'fork', but must be auto, spawn or forkserver"):
        worker_start_method("cpu", requested="fork")
    monkeypatch.setenv(WORKER_START_ENV, "threads")
    with pytest.raises(ValueError, match=r"\$STAGETREE_WORKER_START is 'threads', but must be auto, spawn or"):
        worker_start_method("cpu")
    # the command line refuses it before anything is started or created (exit 2)
    assert main(["run", str(ECHO), "--workers", "1", "--out", str(tmp_path / "run")]) == 2
    assert "$STAGETREE_WORKER_START is 'threads'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()



def test_a_forked_worker_runs_with_the_environment_of_its_coordinator(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The fork server keeps the environment it started with; a worker forked from it later
    takes its coordinator's at that time, as a spawned one does (without that, the worker of
    this study cannot build: the variable it reads was set after the server started)."""
    monkeypatch.delenv("STAGETREE_TEST_ECHO", raising=False)
    monkeypatch.setenv(WORKER_START_ENV, "forkserver")
    PrestartedWorkers(1, "forkserver").close()  # the server runs (in this process, from now on) without it
    monkeypatch.setenv("STAGETREE_TEST_ECHO", "0.25")
    out = tmp_path / "run"
    assert main(["run", str(ECHO), "--workers", "1", "--out", str(out), "--quiet"]) == 0
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["best_metric"] == 0.25



def test_the_preload_only_imports_outside_the_fork_server() -> None:
    """gpu_worker.preload freezes the collector's view and leaves with os._exit(0) only in the
    fork server; imported by any other process it changes neither (its exit code stays its own)."""
    code = "import gc, sys, gpu_worker.preload as p\nprint(p.in_fork_server(), gc.get_freeze_count())\nsys.exit(3)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["False", "0"]
