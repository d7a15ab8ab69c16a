"""End to end: `stagetree run` with 2 worker processes on the real digits data.

Merged and --no-merge runs of the same study give identical per-trial metrics (merging changes
what is computed, never the answer), and a run killed with SIGKILL mid-study finishes with
--resume, retraining no finished stage, with the same results.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from events import topics
from events.codec import decode
from events.log import EmbeddedLog
from events.models import (
    CheckpointSaved,
    MetricsReported,
    PathTrained,
    StageDispatched,
    StageFailed,
    StageFinished,
    WorkerLost,
)
from projections.state import State
from projections.store import ProjectionStore, fold_records, snapshot
from replay.decisions import same_decision
from scheduler.decide import decide

pytestmark = pytest.mark.e2e

STUDY = Path(__file__).parent / "studies" / "tiny_sha.py"
STAGETREE = [sys.executable, "-m", "stagetree.cli"]


def run(out: Path, *flags: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([*STAGETREE, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet", *flags],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return orjson.loads((out / "summary.json").read_bytes())


def per_trial(summary: dict) -> dict:
    return {t["trial_id"]: (t["steps"], t["metrics"]) for t in summary["trials"]}


@pytest.fixture(scope="module")
def merged_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("merged") / "run"
    run(out)
    return out


@pytest.fixture(scope="module")
def merged(merged_dir: Path) -> dict:
    return orjson.loads((merged_dir / "summary.json").read_bytes())


def test_every_dispatch_is_what_the_scheduler_computes_from_the_log_prefix(merged_dir: Path) -> None:
    """Invariant 3: fold the log; at each StageDispatched, the decision recomputed from the
    prefix it records (decided_at) equals the recorded one; and the rebuilt projection equals
    the stored one byte for byte."""
    log = EmbeddedLog(merged_dir / "log")
    try:
        checked = 0

        def check(record: object, event: object, state: State) -> None:
            nonlocal checked
            if isinstance(event, StageDispatched):
                assert event.decided_at == state.offset
                recomputed = decide(state)
                assert recomputed is not None and same_decision(recomputed, event), event.dispatch_id
                checked += 1

        state = State()
        fold_records(state, log.read(topics.PLAN), on_event=check)  # the projector's own fold
        assert checked > 10
        assert not state.rejected
    finally:
        log.close()
    store = ProjectionStore(merged_dir / "state")
    try:
        assert store.records() == snapshot(state)
    finally:
        store.close()


def test_a_paths_end_hands_its_worker_on_and_its_end_batches_follow(merged_dir: Path) -> None:
    """PathTrained (issue 15 goal 2): a worker's path ends without waiting for its writes; every
    trained path's last stage still finishes, once, after it, with the stage's checkpoint in
    the same batch (verified before it was sent), and every dispatch ended."""
    events = _events(merged_dir)
    trained = {e.dispatch_id: i for i, e in enumerate(events) if isinstance(e, PathTrained)}
    assert trained, "no path of the run was handed on before its writes were verified"
    dispatched = {e.dispatch_id: e for e in events if isinstance(e, StageDispatched)}
    for dispatch_id, at in trained.items():
        last = dispatched[dispatch_id].stages[-1]
        ends = [i for i, e in enumerate(events) if isinstance(e, StageFinished) and e.dispatch_id == dispatch_id
                and (e.node_id, e.from_step, e.to_step) == (last.node_id, last.from_step, last.to_step)]
        assert len(ends) == 1 and ends[0] > at, (dispatch_id, at, ends)
        if last.to_step > last.from_step:  # it trained: its checkpoint is in its end batch
            saved = events[ends[0] - 1]
            assert isinstance(saved, CheckpointSaved) and (saved.node_id, saved.step) == (last.node_id, last.to_step)
    state = State()
    fold_records(state, EmbeddedLog(merged_dir / "log", read_only=True).read(topics.PLAN))
    assert not [d.dispatch_id for d in state.dispatches.values() if d.status == "running"]  # every one ended
    assert all(not w.writing and w.dispatch_id is None for w in state.workers.values())


def test_merged_and_trial_based_runs_give_identical_metrics(merged: dict, tmp_path: Path) -> None:
    trial = run(tmp_path / "trial", "--no-merge")
    assert merged["mode"] == "merged" and trial["mode"] == "trial"
    assert per_trial(merged) == per_trial(trial)
    assert len(merged["trials"]) == 16
    assert merged["best_trial"] == trial["best_trial"] and merged["best_metric"] == trial["best_metric"]
    # merging trains each unique step once; the baseline trains every trial's steps
    assert merged["executed_steps"] == merged["unique_steps"] < merged["total_steps"]
    assert trial["executed_steps"] == trial["total_steps"]
    assert merged["merge_rate"] == pytest.approx(merged["total_steps"] / merged["unique_steps"])
    assert merged["best_metric"] > 0.5  # it really learned to read digits


def _events(out: Path) -> list:
    log = EmbeddedLog(out / "log")
    try:
        return [decode(r.value) for r in log.read(topics.PLAN)]
    finally:
        log.close()


def test_spawned_and_forked_workers_give_identical_results(merged: dict, tmp_path: Path) -> None:
    """Where no GPU can be used the workers fork from a server that imported torch once; where
    one can they are spawned (stagetree.worker_processes.worker_start_method). Either way every
    trial gets the same steps and metrics, bit for bit, as the default run (``merged``)."""
    for method in ("spawn", "forkserver"):
        summary = run(tmp_path / method, env={"STAGETREE_WORKER_START": method})
        assert per_trial(summary) == per_trial(merged), method


def _mid_study(out: Path, output: int) -> subprocess.Popen[str]:
    """``run`` of the study into ``out`` (its own session, as a terminal's job), once 6
    checkpoint files are written: mid-study. ``output``: where its stdout and stderr go."""
    proc = subprocess.Popen([*STAGETREE, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet"],
                            stdout=output, stderr=output, text=True, start_new_session=True)
    ckpts = out / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpts.exists() and sum(1 for _ in ckpts.rglob("*") if _.is_file()) >= 6:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the study finished before it could be stopped"
    return proc


def test_ctrl_c_stops_a_run_in_one_line_and_resume_finishes_it(merged: dict, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's process group: the run and its workers) mid-study printed
    two chained tracebacks (CancelledError, then KeyboardInterrupt) and no word on what to do.
    It now says, in one line, that it stopped and how to continue (exit 130, as a shell reports
    a process SIGINT ended); ``--resume`` then finishes the study with the same results."""
    out = tmp_path / "interrupted"
    proc = _mid_study(out, subprocess.PIPE)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    err = " ".join(stderr.split())
    assert proc.returncode == 130 and "stopped by Ctrl-C" in err and "--resume" in err, stdout + stderr
    assert "Traceback" not in stderr, stderr
    resumed = run(out, "--resume")
    assert per_trial(resumed) == per_trial(merged)


def test_kill_and_resume_finishes_with_the_same_results(merged: dict, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    proc = _mid_study(out, subprocess.DEVNULL)
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator and its workers, mid-study
    proc.wait(timeout=30)
    before = _events(out)
    finished = [(e.plan_key, e.node_id, e.from_step, e.to_step) for e in before if isinstance(e, StageFinished)]
    assert finished, "nothing had finished before the kill"

    # Whole after the crash (issue 11 item 12): every metric recorded came with its stage's
    # checkpoint and accounting, in one atomic batch.
    for i, e in enumerate(before):
        if isinstance(e, MetricsReported):
            batch = before[i:i + 3]
            assert [type(x) for x in batch[1:]] in ([CheckpointSaved, StageFinished], [StageFinished]), batch

    resumed = run(out, "--resume")
    assert per_trial(resumed) == per_trial(merged)
    assert resumed["best_trial"] == merged["best_trial"]
    assert resumed["executed_steps"] >= resumed["unique_steps"]
    state = State()
    fold_records(state, EmbeddedLog(out / "log", read_only=True).read(topics.PLAN))
    for plan in state.plans.values():
        for node in plan.nodes.values():
            parent = plan.nodes.get(node.parent_id) if node.parent_id else None
            for step in node.metrics:
                assert step in node.ckpt or (parent is not None and step == node.start_step and step in parent.ckpt), \
                    f"{node.node_id} has metrics at step {step} but no checkpoint there"
    # both runs' tuner decisions recompute from the log: the killed run up to where it ended,
    # the resumed one (a fresh tuner, answered from stored metrics) to the end
    verified = subprocess.run([*STAGETREE, "replay", "verify", str(out), "--quiet"], capture_output=True, text=True,
                              timeout=600)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    said = " ".join(verified.stdout.split())  # rich wraps long lines
    assert "tuner decisions of 1 study recomputed" in said, said
    assert "has not finished (it was stopped, or is still running)" in said, said
    after = _events(out)[len(before):]
    for e in after:
        if isinstance(e, StageDispatched):
            for s in e.stages:
                for plan_key, node_id, a, b in finished:
                    overlap = plan_key == e.plan_key and node_id == s.node_id and s.from_step < b and a < s.to_step
                    assert not overlap, f"finished stage {node_id} [{a},{b}) was retrained by {e.dispatch_id}"


def test_resuming_a_finished_run_gives_its_summary_and_appends_nothing(merged: dict, tmp_path: Path) -> None:
    out = tmp_path / "done"
    first = run(out)
    n = len(_events(out))
    again = run(out, "--resume")
    assert per_trial(again) == per_trial(first) == per_trial(merged)
    assert _events(out)[n:] == []  # no second run of its tuner, no decision recorded twice


def test_a_failing_trainer_fails_its_trial_with_the_error(tmp_path: Path) -> None:
    out = tmp_path / "failing"
    study = Path(__file__).parent / "studies" / "failing.py"
    proc = subprocess.run([*STAGETREE, "run", str(study), "--workers", "1", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "loss diverged at step 12" in proc.stderr
    failed = [e for e in _events(out) if isinstance(e, StageFailed)]
    assert len(failed) == 1 and failed[0].kind == "error" and failed[0].to_step == 20
    # A failed trial is a loss (issue 11 item 17): the study finished, its summary is written
    # with the error, and the answer is the trial that did not fail.
    summary = orjson.loads((out / "summary.json").read_bytes())
    statuses = {t["hp"]["lr"]["value"]: (t["status"], t.get("error")) for t in summary["trials"]}
    assert statuses[0.5][0] == "failed" and "loss diverged at step 12" in statuses[0.5][1]
    assert statuses[0.05] == ("done", None)
    best = next(t for t in summary["trials"] if t["trial_id"] == summary["best_trial"])
    assert best["hp"]["lr"]["value"] == 0.05
    # the tuner's decision about the failed trial is in the log and recomputes
    stops = [e.decision for e in _events(out) if e.type == "TunerDecided" and e.decision.kind == "stop"]
    assert [(d.reason, d.step) for d in stops if d.reason == "failed"] == [("failed", 20)]
    verified = subprocess.run([*STAGETREE, "replay", "verify", str(out), "--quiet"], capture_output=True, text=True,
                              timeout=600)
    assert verified.returncode == 0 and "tuner decisions of 1 study recomputed" in verified.stdout, verified.stdout


def test_a_non_finite_metric_is_recorded_as_null_and_ranks_last(tmp_path: Path) -> None:
    """evaluate() returning NaN or -inf (tests/studies/non_finite.py, a "min" metric, where -inf
    would be the best loss): the value is null in the log and the summary, the trial is done (no
    failure), and it ranks below every finite value (README "Writing a trainer")."""
    out = tmp_path / "run"
    study = Path(__file__).parent / "studies" / "non_finite.py"
    proc = subprocess.run([*STAGETREE, "run", str(study), "--workers", "1", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reported = {e.metrics["x"]: e.metrics["val_loss"] for e in _events(out) if isinstance(e, MetricsReported)}
    assert reported == {0.0: None, 1.0: None, 2.0: pytest.approx(0.7), 3.0: pytest.approx(0.8)}
    summary = orjson.loads((out / "summary.json").read_bytes())
    trials = {t["hp"]["x"]["value"]: t for t in summary["trials"]}
    assert all(trials[x]["status"] == "done" and trials[x]["metrics"]["val_loss"] is None for x in (0.0, 1.0))
    assert summary["best_trial"] == trials[2.0]["trial_id"] and summary["best_metric"] == pytest.approx(0.7)


def test_a_worker_killed_after_path_trained_loses_nothing(merged: dict, tmp_path: Path) -> None:
    """kill -9 of a worker right after its PathTrained, before the path's end batches: the
    coordinator declares it lost, which releases the trained path too (its stages were never
    finished, so they are trained again), starts it again, and the run gives the same results;
    the log verifies."""
    out = tmp_path / "run"
    env = {"STAGETREE_FAULT": f"worker-after-path-trained@{tmp_path / 'killed-once'}"}
    proc = subprocess.run([*STAGETREE, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "was killed by SIGKILL while running; starting it again" in proc.stderr, proc.stderr
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert per_trial(summary) == per_trial(merged)
    events = _events(out)
    lost_at = next(i for i, e in enumerate(events) if isinstance(e, WorkerLost))
    trained = [e for e in events[:lost_at] if isinstance(e, PathTrained) and e.worker_id == events[lost_at].worker_id]
    dead = trained[-1]  # the path whose writes the kill cut off
    finished = {(e.dispatch_id, e.node_id, e.from_step) for e in events if isinstance(e, StageFinished)}
    dispatched = next(e for e in events if isinstance(e, StageDispatched) and e.dispatch_id == dead.dispatch_id)
    last = dispatched.stages[-1]
    assert (dead.dispatch_id, last.node_id, last.from_step) not in finished
    # trained again after the loss (maybe in stages split otherwise: the plan may have grown)
    again = [(e.from_step, e.to_step) for e in events[lost_at:] if isinstance(e, StageFinished)
             and e.plan_key == dispatched.plan_key and e.node_id == last.node_id]
    missing = [s for s in range(last.from_step, last.to_step) if not any(a <= s < b for a, b in again)]
    assert not missing, f"steps {missing} of the stage the lost worker had trained were not trained again"
    verified = subprocess.run([*STAGETREE, "replay", "verify", str(out), "--quiet"], capture_output=True, text=True,
                              timeout=600)
    assert verified.returncode == 0, verified.stdout + verified.stderr


DIES = Path(__file__).parent / "studies" / "dies_at_startup.py"


def test_a_worker_killed_during_start_up_is_started_again(tmp_path: Path) -> None:
    """Issue 11 item 8: kill -9 of a worker while it starts does not end the run; the message
    says what happened (no made-up timeout)."""
    env = {**os.environ, "STAGETREE_TEST_DIE": f"once:{tmp_path / 'killed-once'}"}
    proc = subprocess.run([*STAGETREE, "run", str(DIES), "--workers", "2", "--out", str(tmp_path / "run"), "--quiet"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "was killed by SIGKILL during start-up; starting it again (restart 1 of 3)" in proc.stderr, proc.stderr
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert {t["status"] for t in summary["trials"]} == {"done"}


def test_a_worker_that_cannot_start_ends_the_run_saying_why(tmp_path: Path) -> None:
    env = {**os.environ, "STAGETREE_TEST_DIE": "always"}
    proc = subprocess.run([*STAGETREE, "run", str(DIES), "--workers", "1", "--out", str(tmp_path / "run"), "--quiet"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    assert "cannot build its trainer" in err  # the worker's own output
    assert "exited with code 1 during start-up, after 3 restarts" in err, err
    assert "did not start within" not in err


TRIVIAL = Path(__file__).parent.parent / "benchmarks" / "studies" / "trivial.py"
EXECUTABLE = Path(sys.executable).with_name("stagetree")


def test_the_stagetree_executable_leaves_a_durable_run_and_its_exit_code(tmp_path: Path) -> None:
    """The console script leaves with ``os._exit`` after ``main`` (issue 15): the run it leaves
    behind is complete and verifies, and the exit code is main's (0 run, 2 bad input)."""
    out = tmp_path / "run"
    env = {**os.environ, "STAGETREE_TRIVIAL_TRIALS": "6"}
    proc = subprocess.run([str(EXECUTABLE), "run", str(TRIVIAL), "--workers", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"summary: {out / 'summary.json'}" in proc.stdout  # printed output is flushed before leaving
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert len(summary["trials"]) == 6 and {t["status"] for t in summary["trials"]} == {"done"}
    verified = subprocess.run([str(EXECUTABLE), "replay", "verify", str(out), "--quiet"], capture_output=True,
                              text=True, timeout=600, env=env)  # the study file reads the variable too
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verified" in verified.stdout

    refused = subprocess.run([str(EXECUTABLE), "run", str(tmp_path / "missing.py"), "--out", str(tmp_path / "r2")],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "missing.py" in refused.stderr, refused.stderr
    assert not (tmp_path / "r2").exists()
    usage = subprocess.run([str(EXECUTABLE), "run", "--workers", "x"], capture_output=True, text=True, timeout=600)
    assert usage.returncode == 2 and "--workers" in usage.stderr, usage.stderr


def test_a_refused_run_kills_the_workers_it_started_and_creates_nothing(tmp_path: Path) -> None:
    """Workers start before the arguments are checked (their start-up overlaps the
    coordinator's); a refused run leaves no worker process and no directory behind."""
    import multiprocessing

    from stagetree.cli import main

    before = {p.pid for p in multiprocessing.active_children()}
    bad = tmp_path / "bad.py"
    bad.write_text("tuner = 1\n")
    assert main(["run", str(bad), "--workers", "2", "--out", str(tmp_path / "run")]) == 2
    assert {p.pid for p in multiprocessing.active_children()} == before
    assert not (tmp_path / "run").exists()


def test_the_executable_leaves_with_an_idle_thread_pool_and_waits_for_other_threads(tmp_path: Path) -> None:
    """``console_main`` leaves as the interpreter would: a thread pool never shut down (a
    store's helper pool in a worker that drained) does not hold the process for ever, and a
    non-daemon thread still running is waited for, with the exit code of ``main``."""
    script = (
        "import sys, threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from stagetree import cli\n"
        "pool = ThreadPoolExecutor(2)\n"
        "pool.submit(int).result()\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done', flush=True))).start()\n"
        "sys.argv = ['stagetree', 'replay', 'verify', sys.argv[1]]\n"
        "cli.console_main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "none")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "thread done" in proc.stdout, proc.stdout + proc.stderr
