"""The scheduler role of ``stagetree serve`` on real Kafka: a fence that no successor follows up.

A transaction coordinator that times out a transaction (a broker restart longer than the
transaction timeout does that) fences its producer exactly as a successor would, and so does a
successor that registers the role's ``transactional.id`` and dies before deciding anything. If
the fenced instance then waited for a new grant that never comes (it is still the group's choice),
the deployment would have no scheduler. The role takes itself over again once the group has had
``regrant_after_s`` to take the grant away and has not.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kafka_cluster import kafka_log, kafka_state, plan_records, wait_for

from events import topics
from events.codec import decode
from events.hp import Constant
from events.kafka_log import KafkaLog, TransactionalAppender, event_writes
from events.models import (
    CheckpointEvicted,
    CheckpointSaved,
    Event,
    LogSealed,
    MetricsReported,
    StageDispatched,
    StageFinished,
    StageSpec,
    TrialSubmitted,
    WorkerJoined,
    WorkerLost,
)
from scheduler.role import SchedulerRole, role_transactional_id
from stagetree.serve import ensure_topics

ROOT = Path(__file__).resolve().parents[1]


def _seals_by(log, producer: str, after: float) -> list[LogSealed]:  # type: ignore[no-untyped-def]
    return [e for records in plan_records(log).values() for e in map(decode, (r.value for r in records))
            if isinstance(e, LogSealed) and e.producer == producer and e.ts > after]


@contextmanager
def _holding_the_role(deployment: dict[str, str], instance: str, regrant_after_s: float, **options: Any
                      ) -> Iterator[tuple[SchedulerRole, KafkaLog]]:
    """A scheduler role running in a thread, granted the role and holding it, and a transport
    of the deployment; the role is stopped on leaving. ``options``: more SchedulerRole arguments."""
    log = kafka_log(deployment)
    ensure_topics(log)
    role = SchedulerRole(kafka_log(deployment), instance=instance, heartbeat_timeout_s=600, seal_interval_s=0.2,
                         regrant_after_s=regrant_after_s, **options)
    thread = threading.Thread(target=role.run, name="scheduler-role", daemon=True)
    thread.start()
    try:
        wait_for(role.ready.is_set, "the standby fold to catch up", 60)  # running, not granted yet
        role.grant()
        wait_for(lambda: role.acquired_at is not None, "the role to be taken over", 60)
        yield role, log
    finally:
        role.stop.set()
        thread.join(timeout=30)
        log.close()
    assert not thread.is_alive()


def _fence(role: SchedulerRole, log: KafkaLog, caplog: pytest.LogCaptureFixture) -> TransactionalAppender:
    """Start a successor's producer with the role's transactional.id, give the role something to
    seal, and wait until its next transaction finds it fenced; returns the successor."""
    successor = TransactionalAppender(log, role_transactional_id(log))
    successor.start()
    writer = TransactionalAppender(log, log.topic("test-writer"))
    writer.append(event_writes(topics.PLAN, [WorkerJoined(producer="test", ts=time.time(), worker_id="w9",
                                                          device="cpu")], log.partition_count(topics.PLAN)))
    writer.close()
    wait_for(lambda: "the scheduler role was taken over by another instance" in caplog.text,
             "the role to find itself fenced", 60)
    return successor


def test_a_fenced_role_still_granted_takes_the_role_over_again(deployment: dict[str, str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A successor registers the role's transactional.id and is gone before deciding anything:
    after ``regrant_after_s`` the role, still granted, takes itself over again and decides."""
    caplog.set_level(logging.WARNING, logger="scheduler.role")
    with _holding_the_role(deployment, "X", regrant_after_s=2.0) as (role, log):
        first = role.acquired_at
        fenced_at = time.time()
        _fence(role, log, caplog).close()
        wait_for(lambda: role.acquired_at != first, "the role to be taken over again", 60)
        assert "still grants this instance the scheduler role" in caplog.text
        assert role.acquired_at is not None and role.acquired_at - fenced_at >= 2.0  # not before regrant_after_s
        wait_for(lambda: bool(_seals_by(log, "serve:X", role.acquired_at or 0.0)), "a seal after the take-over", 60)


def test_a_fenced_role_the_group_revoked_stays_out(deployment: dict[str, str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Fenced, and then revoked by the group (a zombie that learned it was replaced): it does not
    take the role over again, however long it waits (nor claims to, before its first grant)."""
    caplog.set_level(logging.WARNING, logger="scheduler.role")
    with _holding_the_role(deployment, "Z", regrant_after_s=4.0) as (role, log):
        first = role.acquired_at
        successor = _fence(role, log, caplog)
        role.revoke()
        time.sleep(5.0)  # past regrant_after_s: nothing may happen
        assert role.acquired_at == first
        assert "still grants this instance" not in caplog.text
        successor.close()


def _write(log: KafkaLog, events: list[Event]) -> None:
    """Append ``events`` to the deployment's plan stream, in one transaction, as a worker would."""
    writer = TransactionalAppender(log, log.topic("test-writer"))
    try:
        writer.append(event_writes(topics.PLAN, events, log.partition_count(topics.PLAN)))
    finally:
        writer.close()


@pytest.mark.parametrize("status", ["running", "lost"])
def test_a_take_over_deletes_garbage_but_what_a_running_or_lost_path_may_write(
        deployment: dict[str, str], minio_store_factory: Any, status: str) -> None:
    """Two checkpoints of n0 were evicted (by a holder killed before it deleted them): the one at
    step 40 is deleted when the role is taken over; the one at step 20 is kept, since dispatch d2
    trains n0 over steps 0 to 20 (or was lost: its worker may be alive and train on, and the fold
    accepts the CheckpointSaved it would write). d2's end lets it go."""
    store = minio_store_factory()
    at_20, at_40 = (store.put(f"checkpoint at step {step}".encode()) for step in (20, 40))
    hp = {"lr": Constant(0.1)}

    def stage(to_step: int) -> list[StageSpec]:
        return [StageSpec(node_id="n0", hp=hp, from_step=0, to_step=to_step, evaluate=True)]

    plan = {"plan_key": "p1"}
    history: list[Event] = [
        WorkerJoined(worker_id="w1", device="cpu"), WorkerJoined(worker_id="w2", device="cpu"),
        TrialSubmitted(study_id="s1", trial_id="t1", **plan, seed=1, hp=hp, steps=40),
        StageDispatched(dispatch_id="d1", worker_id="w1", **plan, seed=1, decided_at=-1, source=None,
                        stages=stage(40)),
        CheckpointSaved(dispatch_id="d1", **plan, node_id="n0", step=20, ref=at_20.ref, size=at_20.size),
        CheckpointSaved(dispatch_id="d1", **plan, node_id="n0", step=40, ref=at_40.ref, size=at_40.size),
        MetricsReported(dispatch_id="d1", **plan, node_id="n0", step=40, metrics={"loss": 1.0}),
        StageFinished(dispatch_id="d1", worker_id="w1", **plan, node_id="n0", from_step=0, to_step=40, seconds=1,
                      train_seconds=1),
        *(CheckpointEvicted(**plan, node_id="n0", step=step, ref=c.ref, size=c.size, decided_at=-1,
                            checkpoint_budget=1)
          for step, c in ((20, at_20), (40, at_40))),
        StageDispatched(dispatch_id="d2", worker_id="w2", **plan, seed=1, decided_at=-1, source=None,
                        stages=stage(20)),
        *([WorkerLost(worker_id="w2", reason="no heartbeat")] if status == "lost" else []),
    ]
    log = kafka_log(deployment)
    try:
        ensure_topics(log)
        _write(log, history)
        with _holding_the_role(deployment, "G", regrant_after_s=60, checkpoint_budget=10**9, store=store) as (role, _):
            state = role.fold.state
            assert state.dispatches["d2"].status == status
            assert {r for r, o in state.objects.items() if o.references == 0} == {at_20.ref, at_40.ref}
            assert not store.exists(at_40.ref)  # deleted before the role's first decision
            assert store.exists(at_20.ref)
            if status == "running":
                _write(log, [StageFinished(dispatch_id="d2", worker_id="w2", **plan, node_id="n0", from_step=0,
                                           to_step=20, seconds=1, train_seconds=1)])
                wait_for(lambda: not store.exists(at_20.ref), "the role to delete what d2 no longer may write", 60)
            else:  # w2 was only paused: it writes at_20 again (a no-op: it is stored), and the fold accepts it
                _write(log, [CheckpointSaved(dispatch_id="d2", **plan, node_id="n0", step=20, ref=at_20.ref,
                                             size=at_20.size)])
                assert kafka_state(deployment)[0].objects[at_20.ref].references == 1
        if status == "lost":
            assert store.exists(at_20.ref)  # what the log names is stored
    finally:
        log.close()


STALLING_CHILD = """
import os, sys, threading
from events.models import StageDispatched, StageSpec
from events.hp import Constant
from scheduler.role import STALL_HOOK_ENV, _stall_hook

root = sys.argv[1]
decision = StageDispatched(dispatch_id="d0", worker_id="w0", plan_key="p", seed=1, decided_at=0, source=None,
                           stages=[StageSpec(node_id="n0", hp={"lr": Constant(0.1)}, from_step=0, to_step=1,
                                             evaluate=False)])

def appender():
    for i in range(int(sys.argv[2])):
        os.environ[STALL_HOOK_ENV] = f"{root}/stall-{i}"
        _stall_hook([decision])()  # stops the process; returns once it is continued
        open(f"{root}/after-{i}", "w").close()  # what the appender would do next: commit
    os._exit(0)

threading.Thread(target=appender).start()
while True:  # the main thread busy in Python, as a serve's event loop may be
    sum(range(1000))
"""


def test_the_stall_hook_stops_the_appending_thread_before_it_returns(tmp_path: Path) -> None:
    """The fault injection the fencing test relies on: the thread appending a decision stops
    inside the hook, before the commit. A SIGSTOP sent to the process stopped it only once the
    kernel's chosen thread (the busy main one) ran, and the appender went on meanwhile (on a
    loaded machine, long enough to commit: the zombie's decision then landed); run 10 times,
    the appender never gets past the hook before the process is continued."""
    rounds = 10
    child = subprocess.Popen([sys.executable, "-c", STALLING_CHILD, str(tmp_path), str(rounds)], cwd=ROOT)
    try:
        for i in range(rounds):
            wait_for(lambda i=i: child.poll() is not None
                     or (tmp_path / f"stall-{i}").exists() and _process_state(child.pid) == "T", f"stall {i}", 60)
            assert child.poll() is None, f"the stalling process ended (exit {child.returncode})"
            time.sleep(0.05)  # what the appender would do after the hook, given the time
            assert not (tmp_path / f"after-{i}").exists(), f"stall {i}: the appender ran past the hook"
            os.kill(child.pid, signal.SIGCONT)
            wait_for(lambda i=i: (tmp_path / f"after-{i}").exists(), f"the appender to go on after stall {i}", 60)
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped), from /proc."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
