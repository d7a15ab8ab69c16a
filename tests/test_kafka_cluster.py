"""Kafka mode as a team runs it: workers that drain on SIGTERM and hand their path back, bad
records dead-lettered instead of crashing anything, several studies at once on one deployment,
and a broker restart in the middle of a study; each bit for bit equal to embedded mode, trial by
trial."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kafka_cluster import (
    CLI,
    STUDIES,
    STUDY,
    Deployment,
    assert_no_duplicate_or_conflicting_decisions,
    assert_what_must_hold_after_faults,
    decisions,
    forget_deployment,
    kafka_log,
    kafka_state,
    per_trial,
    spawn,
    stop_all,
    summary_of,
    verify_deployment,
    wait_for,
)
from private_kafka import PrivateBroker, _free_port, cluster_id, freeze

from events import topics
from events.codec import decode, encode
from events.kafka_log import AppendAbandoned, KafkaLog, KafkaLogError, TransactionalAppender, Write
from events.models import (
    CheckpointSaved,
    DeadLettered,
    Event,
    StageDispatched,
    StageFinished,
    StudyStarted,
    WorkerJoined,
    WorkerLost,
)
from gpu_worker.kafka_worker import SIGTERM_HOOK_ENV
from gpu_worker.loader import load_module, trainer_of
from gpu_worker.object_store import open_checkpoint_store
from stagetree.errors import StudyTakenOver
from stagetree.kafka_runtime import KafkaRuntime
from stagetree.state_lock import RUN_LOCK_FILE, StateDirLock
from stagetree.study import Study, plan_key_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

VERSIONED = STUDIES / "versioned.py"
"""A tiny study whose trainer's `version` is $STAGETREE_TEST_TRAINER_VERSION (default "1")."""


@pytest.fixture(scope="module")
def embedded_others(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny_sha_b.py, tiny_sha_c.py and tiny_grid.py, each run alone in embedded mode (the
    references)."""
    out = {}
    for name in ("tiny_sha_b", "tiny_sha_c", "tiny_grid"):
        run = tmp_path_factory.mktemp(name) / "run"
        proc = subprocess.run([*CLI, "run", str(STUDIES / f"{name}.py"), "--workers", "2", "--out", str(run),
                               "--quiet"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        out[name] = run
    return out


@pytest.fixture(scope="module")
def embedded_versioned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/studies/versioned.py run in embedded mode (the reference)."""
    run = tmp_path_factory.mktemp("versioned") / "run"
    proc = subprocess.run([*CLI, "run", str(VERSIONED), "--workers", "1", "--out", str(run), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return run


def _dead_letters(env: dict[str, str]) -> list[DeadLettered]:
    with kafka_log(env) as log:
        return [decode(r.value) for r in log.read(topics.DEADLETTER)]  # type: ignore[misc]


def test_a_draining_worker_hands_its_path_back_and_bad_records_are_dead_lettered(
        embedded_others: dict[str, Path], deployment: dict[str, str], tmp_path: Path) -> None:
    """tests/studies/tiny_grid.py's first path has three stages (a shared prefix checkpointed
    at 30 and 60) and goes to w0, which gets SIGTERM as it starts training the first one: w0
    finishes that stage, hands the rest back (WorkerLost "drained", written by itself) and exits
    0; the rest is dispatched to w1 from the checkpoint w0 just saved. A malformed record on
    w1's dispatch stream and a malformed heartbeat are dead-lettered with their reasons, and
    nothing crashes; the study equals embedded mode's."""
    env = deployment
    study = STUDIES / "tiny_grid.py"
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A")
        w0 = cluster.worker_with_env("w0", {SIGTERM_HOOK_ENV: "1"}, study)
        cluster.worker("w1", study)
        cluster.joined("w0", "w1")
        with kafka_log(env) as log:
            log.append(topics.dispatch_stream("w1"), "w1", b"not an event")
            log.append(topics.HEARTBEAT, "w9", b'{"ts": 1}')
        run = cluster.run(study)
        assert w0.wait(timeout=600) == 0, cluster.output("w0")
        cluster.finish(run)
    finally:
        cluster.close()
    state, events = kafka_state(env)
    drained = [e for e in events if isinstance(e, WorkerLost) and e.worker_id == "w0"]
    assert drained and drained[0].producer == "worker:w0" and "handed back" in drained[0].reason
    handed = next(d for d in events if isinstance(d, StageDispatched) and d.worker_id == "w0")
    assert len(handed.stages) == 3
    first = handed.stages[0]
    finished_by_w0 = [e for e in events if isinstance(e, StageFinished) and e.dispatch_id == handed.dispatch_id]
    assert [(e.node_id, e.from_step, e.to_step) for e in finished_by_w0] == [(first.node_id, first.from_step,
                                                                               first.to_step)]
    assert state.dispatches[handed.dispatch_id].status == "lost"
    (saved,) = [e for e in events if isinstance(e, CheckpointSaved) and e.dispatch_id == handed.dispatch_id]
    rest = handed.stages[1]
    again = [d for d in events if isinstance(d, StageDispatched) and d.worker_id == "w1"
             and (d.stages[0].node_id, d.stages[0].from_step) == (rest.node_id, rest.from_step)]
    assert again and again[0].source is not None and again[0].source.ref == saved.ref
    letters = _dead_letters(env)
    assert any(x.stream == topics.dispatch_stream("w1") and x.raw == "not an event" and "not JSON" in x.reason
               for x in letters), letters
    assert any(x.stream == topics.HEARTBEAT and "worker_id" in x.reason for x in letters), letters
    assert_no_duplicate_or_conflicting_decisions(state, events)
    assert_what_must_hold_after_faults(env, tmp_path / "run", embedded_others["tiny_grid"], [cluster.state_dir("A")])
    verify_deployment(env)


def test_a_serve_killed_between_an_eviction_and_its_deletion_leaves_no_garbage(
        embedded_others: dict[str, Path], deployment: dict[str, str], tmp_path: Path) -> None:
    """Two serves under a checkpoint budget; the one holding the scheduler role is killed (-9)
    right after it committed its first eviction, before it deleted the object. The other takes
    the role over and deletes what no plan references (no worker is writing at that step): at
    the end no unreferenced object is left in the store, the log verifies without naming one,
    and every trial equals embedded mode's."""
    env = deployment
    cluster = Deployment(env, tmp_path)
    faults = {"STAGETREE_CHECKPOINT_BUDGET": "150000",  # tiny_grid's checkpoints: 100,921 bytes
              "STAGETREE_FAULT": f"after-eviction-event@{tmp_path / 'killed-once'}"}
    try:
        serves = [cluster.serve(instance, extra_env=faults) for instance in ("A", "B")]
        cluster.worker("w1", STUDIES / "tiny_grid.py")
        cluster.joined("w1")
        cluster.finish(cluster.run(STUDIES / "tiny_grid.py"))
    finally:
        cluster.close()
    assert sorted(p.returncode for p in serves)[0] == -signal.SIGKILL, [cluster.output(i) for i in ("A", "B")]
    state, events = kafka_state(env)
    assert state.stats.evictions > 0
    store = open_checkpoint_store(env["STAGETREE_CHECKPOINT_STORE"], env)
    unreferenced = sorted(ref for ref, obj in state.objects.items() if obj.references == 0)
    assert unreferenced and [ref for ref in unreferenced if store.exists(ref)] == []
    said = " ".join(verify_deployment(env).split())
    assert "are expected missing" in said and "still stored" not in said, said
    assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded_others["tiny_grid"]))


def test_studies_run_at_once_on_one_deployment(embedded: Path, embedded_others: dict[str, Path],
                                              deployment: dict[str, str], tmp_path: Path) -> None:
    """Three ``stagetree run --workers 0`` at once: "tiny" and "tiny-b" share a plan key and so
    their work; "tiny-c" has another and runs beside them. Each summary counts its own study,
    every trial equals embedded mode's, and no step is trained twice."""
    env = deployment
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A")
        cluster.worker("w0")
        cluster.worker("w1")
        cluster.joined("w0", "w1")
        names = ("tiny_sha", "tiny_sha_b", "tiny_sha_c")
        runs = {name: cluster.run(STUDIES / f"{name}.py", out=name) for name in names}
        for run in runs.values():
            cluster.finish(run)
    finally:
        cluster.close()
    references = {"tiny_sha": embedded, **embedded_others}
    summaries = {name: summary_of(tmp_path / name) for name in runs}
    for name, summary in summaries.items():
        reference = summary_of(references[name])
        assert per_trial(summary) == per_trial(reference), name
        assert len(summary["trials"]) == len(reference["trials"])
    assert summaries["tiny_sha"]["studies_sharing_plan"] == ["tiny", "tiny-b"]
    assert summaries["tiny_sha_b"]["studies_sharing_plan"] == ["tiny", "tiny-b"]
    assert summaries["tiny_sha_c"]["studies_sharing_plan"] == ["tiny-c"]
    state, events = kafka_state(env)
    assert len({p.plan_key for p in state.plans.values()}) == 2
    trained: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for e in events:
        if isinstance(e, StageFinished) and e.to_step > e.from_step:
            ranges = trained.setdefault((e.plan_key, e.node_id), [])
            assert all(e.to_step <= a or b <= e.from_step for a, b in ranges), (e, ranges)
            ranges.append((e.from_step, e.to_step))
    assert_no_duplicate_or_conflicting_decisions(state, events)
    verify_deployment(env)


def test_a_private_broker_formats_its_storage_whatever_its_cluster_id(infra_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """One random cluster id in 64 starts with ``-``, which the storage tool's command line read as an
    option (CI failed at one): such an id is formatted, and the ids made here never start with one."""
    assert not any(cluster_id().startswith("-") for _ in range(2000))
    PrivateBroker(tmp_path / "kafka", cluster="-j8g3eM1RgucgxmKWWy3zg")
    meta = (tmp_path / "kafka" / "data" / "meta.properties").read_text()
    assert "cluster.id=-j8g3eM1RgucgxmKWWy3zg" in meta.splitlines()


@pytest.fixture
def private_broker(infra_env: dict[str, str], tmp_path: Path) -> Iterator[PrivateBroker]:
    """A Kafka broker of this test's own (it is stopped and restarted mid-study)."""
    broker = PrivateBroker(tmp_path / "kafka")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def test_a_broker_restart_mid_study(embedded: Path, infra_env: dict[str, str], private_broker: PrivateBroker,
                                    tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The broker stops (cleanly) in the middle of a study and comes back a few seconds later:
    the serve instance, the workers and the SDK reconnect by themselves, and the study finishes
    with the same per-trial results as embedded mode; the log verifies. No worker is declared
    lost: the beats it could not send while the broker was away are no evidence against it."""
    tag = uuid.uuid4().hex[:10]
    env = {**os.environ, **infra_env, "STAGETREE_BOOTSTRAP_SERVERS": private_broker.bootstrap,
           "STAGETREE_TOPIC_PREFIX": f"restart-{tag}.", "STAGETREE_CHECKPOINT_STORE": f"s3://stagetree/test-{tag}"}
    request.addfinalizer(lambda: forget_deployment(env))  # before the private broker stops
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A")
        cluster.worker("w0", hold_in_path=2)
        cluster.worker("w1", hold_in_path=2)
        cluster.joined("w0", "w1")
        run = cluster.run()
        cluster.held("w0", "w1")  # mid-study, each in a path
        private_broker.stop()
        time.sleep(3)  # the broker stays away a while (not a synchronisation: any length will do)
        private_broker.start()
        cluster.release("w0", "w1")
        cluster.finish(run)
    finally:
        cluster.close()
    state, events = kafka_state(env)
    assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded))
    assert_no_duplicate_or_conflicting_decisions(state, events)
    assert_what_must_hold_after_faults(env, tmp_path / "run", embedded, [cluster.state_dir("A")])
    verify_deployment(env)
    judged = [e for e in events if isinstance(e, WorkerLost) and e.producer.startswith("serve:")]
    assert not judged, [(e.worker_id, e.reason) for e in judged]


def test_a_worker_paused_until_declared_lost_drops_its_path_and_joins_again(embedded: Path,
                                                                            deployment: dict[str, str],
                                                                            tmp_path: Path) -> None:
    """A worker paused (SIGSTOP: a frozen host, a long stall) in the middle of a path is declared
    lost, and its path goes to the other worker. When it wakes up, it does not train the void
    path on (it did, to its end, counting its steps twice): it publishes nothing more about that
    dispatch, joins again and takes work. The study ends as embedded mode's, trial by trial."""
    env = deployment
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A", heartbeat_timeout=3)
        cluster.worker("w0", hold_in_path=2)
        cluster.worker("w1")
        cluster.joined("w0", "w1")
        run = cluster.run()
        cluster.held("w0")  # the first stage of its second path has started
        w0 = cluster.workers["w0"]
        os.killpg(w0.pid, signal.SIGSTOP)  # every thread: its beats stop too
        try:
            with kafka_log(env) as log:
                wait_for(lambda: any(isinstance(decode(r.value), WorkerLost)
                                     for r in log.read(topics.dispatch_stream("w0"))),
                         "w0 to be declared lost", 120)
        finally:
            os.killpg(w0.pid, signal.SIGCONT)
        cluster.release("w0")
        cluster.finish(run)
    finally:
        cluster.close()
    state, events = kafka_state(env)
    void = [d for d in decisions(events) if d.worker_id == "w0"][1]  # the path it was held in
    assert state.dispatches[void.dispatch_id].status == "lost"
    about_void = [type(e).__name__ for e in events if getattr(e, "dispatch_id", None) == void.dispatch_id]
    assert about_void == ["StageDispatched", "StageStarted"], about_void
    lost = [i for i, e in enumerate(events) if isinstance(e, WorkerLost) and e.worker_id == "w0"
            and e.producer.startswith("serve:")]
    assert lost and any(isinstance(e, WorkerJoined) and e.worker_id == "w0" for e in events[lost[0]:]), \
        "w0 joined again"
    assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded))
    assert_no_duplicate_or_conflicting_decisions(state, events)
    verify_deployment(env)


def test_a_worker_whose_trainer_is_another_version_hands_its_dispatch_back_untrained_and_exits_2(
        embedded_versioned: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """The study's trainer is at version 1; the deployment's only worker, w1, loads the same study
    file as version 2 (another version of the code deployed there: another plan key). It gets a
    dispatch of the study's plan and does not train it: it hands it back (its own WorkerLost; no
    StageStarted, metrics, checkpoint or StageFinished of it) and exits 2 with one line naming
    the plan key, its trainer, its study file and the key that trainer gives. A worker of the
    right version started afterwards finishes the study as embedded mode does. It trained every
    stage with its own trainer, and the study ended with results embedded mode does not give."""
    env = deployment
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A")
        stale = cluster.worker_with_env("w1", {"STAGETREE_TEST_TRAINER_VERSION": "2"}, VERSIONED)
        cluster.joined("w1")
        run = cluster.run(VERSIONED)
        assert stale.wait(timeout=300) == 2, cluster.output("w1")
        cluster.worker("w2", VERSIONED)
        cluster.finish(run)
    finally:
        cluster.close()
    state, events = kafka_state(env)
    (key,) = {e.plan_key for e in events if isinstance(e, StudyStarted)}
    (refused,) = [d for d in decisions(events) if d.worker_id == "w1"]
    trainer_class = trainer_of(load_module(VERSIONED), VERSIONED).__class__
    other_key = plan_key_of(type("Versioned", (trainer_class,), {"name": "versioned", "version": "2"})(), 3)
    assert other_key != key
    said = f"error: worker w1: dispatch {refused.dispatch_id} of plan {key!r}: this worker's trainer versioned@2 " \
           f"(study file {str(VERSIONED)!r}) gives plan key {other_key!r} with seed 3, not {key!r}: another version " \
           "of the code is deployed here (bump or align the trainer's `version`); not trained, handed back"
    assert said in cluster.output("w1").splitlines(), cluster.output("w1")
    by_w1 = {type(e).__name__ for e in events if e.producer == "worker:w1"}
    assert by_w1 == {"WorkerJoined", "WorkerLost"}, by_w1
    assert [type(e).__name__ for e in events if getattr(e, "dispatch_id", None) == refused.dispatch_id] \
        == ["StageDispatched"]
    assert state.dispatches[refused.dispatch_id].status == "lost"
    lost = [(e.producer, e.reason) for e in events if isinstance(e, WorkerLost) and e.worker_id == "w1"]
    assert lost and all("handed back untrained" in reason for _, reason in lost), lost
    assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded_versioned))
    assert_no_duplicate_or_conflicting_decisions(state, events)


def test_a_worker_started_with_another_studys_file_trains_a_plan_with_its_recorded_study_file(
        embedded_versioned: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """A worker started with ``--study`` of another study (tiny_sha.py: the digits trainer) gets
    the stages of tests/studies/versioned.py's plan, which its trainer does not give: it trains
    them with the trainer of the study file the plan's StudyStarted records, says so, and stays;
    the study equals embedded mode's. It trained them with the digits trainer: the study ended
    with the digits model's metrics."""
    env = deployment
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A")
        w1 = cluster.worker("w1", STUDY)
        cluster.joined("w1")
        cluster.finish(cluster.run(VERSIONED))
        assert w1.poll() is None, cluster.output("w1")
    finally:
        cluster.close()
    state, events = kafka_state(env)
    assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded_versioned))
    said = " ".join(cluster.output("w1").split())
    assert f"is not the plan of --study {str(STUDY)!r}" in said, said
    assert f"its stages are trained with the trainer of the study file its StudyStarted records, {str(VERSIONED)!r}" \
        in said, said
    assert {d.worker_id for d in decisions(events)} == {"w1"}
    assert_no_duplicate_or_conflicting_decisions(state, events)


def _plan_values(log: KafkaLog) -> list[bytes]:
    """The values of every record of every plan partition."""
    return [r.value for part in range(log.partition_count(topics.PLAN)) for r in log.read(topics.PLAN, partition=part)]


def _appending(runtime: KafkaRuntime, events: list[Event]) -> tuple[threading.Thread, list[BaseException]]:
    """A started thread appending ``events`` through ``runtime``, and the list where it puts
    what the append raised."""
    errors: list[BaseException] = []

    def append() -> None:
        try:
            runtime.append(events)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=append)
    thread.start()
    return thread, errors


def test_the_sdk_rides_out_a_broker_away_longer_than_one_append(private_broker: PrivateBroker) -> None:
    """The SDK's append meets a broker that is away for longer than one attempt may take (3 s
    here): it keeps trying, and once the broker is back its records are in the log exactly once
    (a failed attempt's transaction is never committed, so nothing of it shows) and folded."""
    log = KafkaLog(private_broker.bootstrap, timeout_s=3, topic_prefix=f"away-{uuid.uuid4().hex[:8]}.")
    runtime = KafkaRuntime(log, retry_s=600)
    joined = [WorkerJoined(producer="test", ts=1.0, worker_id=f"w{i}", device="cpu") for i in range(4)]
    try:
        private_broker.stop()
        appender, errors = _appending(runtime, joined)
        wait_for(lambda: runtime.retries >= 1 or not appender.is_alive(), "an attempt of the append to fail", 120)
        private_broker.start()
        appender.join(timeout=600)
        assert not appender.is_alive() and not errors, errors
        assert sorted(runtime.state.workers) == ["w0", "w1", "w2", "w3"]
        values = _plan_values(log)
        assert sorted(values) == sorted(encode(e) for e in joined), "each record once"
    finally:
        runtime.close()
        log.close()


def _started(study: str) -> StudyStarted:
    return StudyStarted(producer="cli", study_id=study, name=study, plan_key=f"plan-{study}", mode="merged",
                        workers=0, seed=0, trainer="t@1")


def test_a_second_client_of_a_study_takes_it_over_and_the_first_appends_nothing_more(
        deployment: dict[str, str]) -> None:
    """Two clients driving one study (a second `stagetree run` of it) would both record its tuner's
    decisions. The second fences the first at its first append: the first's next append is
    refused by the broker (StudyTakenOver; nothing of it is in the log), even before it has read
    the second's StudyStarted, and reading that fails its waiting trials with StudyTakenOver.
    Clients of other studies, and of none, are not affected."""
    logs = [kafka_log(deployment) for _ in range(5)]
    runtimes = first, second, other, anonymous, third = (
        KafkaRuntime(logs[0], study="s"), KafkaRuntime(logs[1], study="s"), KafkaRuntime(logs[2], study="t"),
        KafkaRuntime(logs[3]), KafkaRuntime(logs[4], study="s"))
    try:
        # the second was caught up before the first started: its claim reads the first's start,
        # which is an earlier client's, not a takeover of its own
        first.append([_started("s")])
        other.append([_started("t")])
        second.append([_started("s")])  # continues the study: the first is fenced
        assert second.failure is None
        late = WorkerJoined(producer="test", ts=1.0, worker_id="w-late", device="cpu")
        assert first.failure is None  # it has not read the second's StudyStarted yet
        with pytest.raises(StudyTakenOver, match="another client started driving study 's'"):
            first.append([late])
        assert isinstance(first.failure, StudyTakenOver)
        with pytest.raises(StudyTakenOver):
            first.append([late])
        second.fold()
        assert second.failure is None
        other.append([WorkerJoined(producer="test", ts=2.0, worker_id="w-other", device="cpu")])
        anonymous.append([WorkerJoined(producer="test", ts=3.0, worker_id="w-none", device="cpu")])
        _, events = kafka_state(deployment)
        assert sorted((type(e).__name__, getattr(e, "name", None) or getattr(e, "worker_id", None)) for e in events
                      if isinstance(e, (StudyStarted, WorkerJoined))) == [
            ("StudyStarted", "s"), ("StudyStarted", "s"), ("StudyStarted", "t"), ("WorkerJoined", "w-none"),
            ("WorkerJoined", "w-other")]  # partitions are read one after another: no order across them
        # a client that reads the takeover stops before it appends: its waiting trials fail
        third.append([_started("s")])
        wait_for(lambda: (second.fold(), second.failure)[1] is not None, "the second to read the third's start", 60)
        assert isinstance(second.failure, StudyTakenOver), second.failure
        assert "a second `stagetree run` of it, at" in str(second.failure)
        assert other.failure is None and anonymous.failure is None
    finally:
        for runtime in runtimes:
            runtime.close()
        for log in logs:
            log.close()


def test_a_commit_whose_outcome_is_not_known_is_resumed_and_its_records_are_written_once(
        private_broker: PrivateBroker) -> None:
    """A transaction's commit times out (the broker stalls after the records reached it): its
    outcome is not known, and the broker may still complete it. The retry resumes that commit on
    the same producer rather than aborting it and appending again (a new producer's registration
    completed the stalled commit, and the retry wrote every record a second time). A commit in
    doubt that a call gave up on is resumed by the next call, which then appends its own writes
    (it returned the earlier call's positions for writes it never appended)."""
    log = KafkaLog(private_broker.bootstrap, timeout_s=3, topic_prefix=f"doubt-{uuid.uuid4().hex[:8]}.")
    appender = TransactionalAppender(log, log.topic("doubt"), timeout_s=3)
    assert private_broker.proc is not None
    broker = private_broker.proc.pid
    try:
        appender.append([Write("s", "k", b"warm")])
        writes = [Write("s", "k", b"x1"), Write("s", "k", b"x2")]

        def stall() -> None:  # the broker stops once the records reached it; it goes on once the
            freeze(broker)  # commit timed out and was tried again (a warning)

            def go_on_after_a_retry() -> None:
                while appender.retries == 0:
                    time.sleep(0.05)
                os.killpg(broker, signal.SIGCONT)
            threading.Thread(target=go_on_after_a_retry, daemon=True).start()

        def readable(values: list[bytes]) -> Callable[[], bool]:
            # a commit's markers reach the partition after commit_transaction returns, and a
            # read_committed reader stops at the last stable offset: wait until it passed them
            return lambda: [r.value for r in log.read("s")] == values

        positions = appender.append_retrying(writes, 120, who="test", before_commit=stall)
        assert appender.retries >= 1
        wait_for(readable([b"warm", b"x1", b"x2"]), "x1 and x2 to be readable, once each", 60)
        assert positions == [(0, 2), (0, 3)]  # the stalled transaction's own records
        # a commit in doubt left by a call that gave up is resumed by the next call, whose own
        # writes are then appended (it returned the earlier call's positions for them)
        with pytest.raises(KafkaLogError, match="the commit's outcome is not known yet"):
            appender.append([Write("s", "k", b"y1")], before_commit=lambda: freeze(broker))
        os.killpg(broker, signal.SIGCONT)
        positions = appender.append_retrying([Write("s", "k", b"z1")], 120, who="test")
        wait_for(readable([b"warm", b"x1", b"x2", b"y1", b"z1"]), "y1 and z1 to be readable, once each", 60)
        assert positions == [(0, [r.offset for r in log.read("s")][-1])]
    finally:
        os.killpg(broker, signal.SIGCONT)
        appender.close()
        log.close()


def test_an_append_retrying_through_an_outage_gives_up_when_the_process_is_stopping(
        private_broker: PrivateBroker) -> None:
    """The SDK's append retries for minutes while the broker is away, holding the event loop
    (appends are synchronous): a run's signal handler sets ``stop_requested`` on the log, and the
    append gives up within a second or so, with AppendAbandoned (not retried), rather than hold
    a SIGTERM or Ctrl-C back until its retries are spent."""
    log = KafkaLog(private_broker.bootstrap, timeout_s=30, topic_prefix=f"stop-{uuid.uuid4().hex[:8]}.")
    runtime = KafkaRuntime(log, retry_s=600)
    try:
        private_broker.stop()
        appender, errors = _appending(runtime, [WorkerJoined(producer="test", ts=1.0, worker_id="w0", device="cpu")])
        log.stop_requested = True  # what the handler does (the first attempt waits for the broker now)
        appender.join(timeout=60)
        assert not appender.is_alive(), "the append did not give up"
        assert len(errors) == 1 and isinstance(errors[0], AppendAbandoned), errors
        assert runtime.retries == 0
    finally:
        runtime.close()
        log.close()


def test_a_study_whose_append_fails_ends_with_the_error_rather_than_waiting(private_broker: PrivateBroker) -> None:
    """A submission is appended by a callback of the event loop (one batch per loop turn); when
    that append fails for good (the broker away beyond the runtime's ``retry_s``), the study's
    futures get the error, rather than the study waiting for ever for trials never recorded."""
    log = KafkaLog(private_broker.bootstrap, timeout_s=2, topic_prefix=f"fails-{uuid.uuid4().hex[:8]}.")
    runtime = KafkaRuntime(log, retry_s=0)
    module = load_module(STUDY)
    trainer = trainer_of(module, STUDY)

    async def main() -> None:
        study = Study(runtime, "fails", trainer, module.seed)
        future = study.submit(next(iter(module.space)), 20)
        with pytest.raises(KafkaLogError, match="append"):
            await asyncio.wait_for(future, 120)

    try:
        private_broker.stop()
        asyncio.run(main())
        assert runtime.failure is not None
    finally:
        runtime.close()
        log.close()


REPO = Path(__file__).resolve().parents[1]


def _compose_value(value: str, variables: dict[str, str]) -> str:
    """``value`` of infra/compose.yaml with its ``${NAME}``, ``${NAME:-default}`` and
    ``${NAME:?message}`` expanded from ``variables``, as docker compose does."""
    def expand(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in variables and variables[name] != "":
            return variables[name]
        assert op != ":?", f"compose needs {name}: {arg}"
        return arg if op == ":-" else ""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", expand, str(value))


def test_the_compose_services_commands_run_a_study_here(embedded: Path, deployment: dict[str, str],
                                                        tmp_path: Path) -> None:
    """The commands and environments of infra/compose.yaml's projector, scheduler and worker,
    run as processes here against the local broker and MinIO (no Docker engine here builds the
    image): two serve instances without --app-id and a worker without --study or --worker-id
    (its trainer comes from the study file StudyStarted records), as the cluster runs them.
    Changed for this machine only: the services' host names (kafka, minio) to the local
    services, cuda:0 to cpu, the state volume to a directory, and the test's topic prefix, app
    id and no trace exporter (no collector here). A study submitted with ``stagetree run
    --workers 0`` then ends equal to embedded mode, trial by trial."""
    import yaml

    services = yaml.safe_load((REPO / "infra" / "compose.yaml").read_text())["services"]
    variables = {"STAGETREE_CLUSTER_BOOTSTRAP_SERVERS": deployment["STAGETREE_BOOTSTRAP_SERVERS"],
                 **{k: deployment[k] for k in ("STAGETREE_CHECKPOINT_STORE", "STAGETREE_S3_ACCESS_KEY",
                                               "STAGETREE_S3_SECRET_KEY")}}
    here = {"STAGETREE_TOPIC_PREFIX": deployment["STAGETREE_TOPIC_PREFIX"],
            "STAGETREE_APP_ID": f"stagetree-{deployment['STAGETREE_TOPIC_PREFIX'].strip('.')}",
            "STAGETREE_OTEL_EXPORTER": "none"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("projector", "scheduler", "worker"):
            service = services[name]
            environment = {k: _compose_value(v, variables) for k, v in service["environment"].items()}
            assert environment.pop("STAGETREE_S3_ENDPOINT") == "minio:9000"
            environment["STAGETREE_S3_ENDPOINT"] = deployment["STAGETREE_S3_ENDPOINT"]
            command = [_compose_value(word, variables) for word in service["command"]]
            assert command[0] == "stagetree"
            command = [{"cuda:0": "cpu", "/home/stagetree/serve-state": str(tmp_path / name)}.get(w, w)
                       for w in command]
            env = {**os.environ, **environment, **here}
            procs.append(spawn([sys.executable, "-m", "stagetree.cli", *command[1:]], env, tmp_path / f"{name}.log"))
        wait_for(lambda: any(w.alive for w in kafka_state(deployment)[0].workers.values())
                 or any(p.poll() is not None for p in procs), "the compose worker to join")
        assert all(p.poll() is None for p in procs), [(tmp_path / f"{n}.log").read_text()[-3000:]
                                                       for n in ("projector", "scheduler", "worker")]
        run = subprocess.run([*CLI, "run", str(STUDY), "--workers", "0", "--out", str(tmp_path / "run"), "--quiet"],
                             capture_output=True, text=True, timeout=900, env=deployment)
        assert run.returncode == 0, run.stdout + run.stderr + (tmp_path / "worker.log").read_text()[-3000:]
        assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded))
    finally:
        stop_all(procs[2:])  # the worker first (it leaves with a WorkerLost), then the serves
        stop_all(procs[:2])


def test_an_audit_or_export_of_a_deployment_that_is_not_there_is_refused(deployment: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """``replay verify`` and ``log export`` of a kafka:// address whose plan topic does not exist
    (a mistyped prefix, a bare address, another stream's topic) exit 2 naming the topic: they
    said 'verified: 0 records' and 'exported 0 records', an audit that passed on nothing."""
    servers = deployment["STAGETREE_BOOTSTRAP_SERVERS"]
    prefix = deployment["STAGETREE_TOPIC_PREFIX"]  # a fresh deployment's: nothing created yet
    heartbeat = f"{prefix}stagetree.heartbeat"  # read as a prefix
    for url, topic in ((f"kafka://{servers}/{prefix}stagetree.plan", f"{prefix}stagetree.plan"),
                       (f"kafka://{servers}/{heartbeat}", f"{heartbeat}stagetree.plan")):
        for argv in (["replay", "verify", url, "--quiet"], ["log", "export", url, "--out", str(tmp_path / "x.jsonl")]):
            proc = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=300, env=deployment)
            err = " ".join(proc.stderr.split())
            assert proc.returncode == 2 and f"no topic '{topic}'" in err and "Traceback" not in err, \
                proc.stdout + proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize(("env", "needle"), [
    ({"STAGETREE_S3_SECRET_KEY": "not-the-secret"}, "refused this worker's credentials"),
    ({"STAGETREE_CHECKPOINT_CACHE": "cache", "STAGETREE_CHECKPOINT_CACHE_BYTES": "lots"}, "'lots'"),
    ({"STAGETREE_CHECKPOINT_STORE": "s3://stagetree-no-such-bucket/x"},  # a typo: never created
     "bucket 'stagetree-no-such-bucket' does not exist"),
], ids=["wrong-credentials", "bad-cache-size", "missing-bucket"])
def test_a_kafka_run_whose_worker_refuses_its_input_ends_saying_why(deployment: dict[str, str], tmp_path: Path,
                                                                    env: dict[str, str], needle: str) -> None:
    """``run --workers N`` on Kafka watches the processes it started: a worker that exits with
    code 2 (credentials the object store refuses, a bad variable) ends the run with exit 1,
    naming the worker, its error above. The run waited for ever; with wrong credentials every
    stage failed and was dispatched again, in silence."""
    env = {**deployment, **env}
    if "STAGETREE_CHECKPOINT_CACHE" in env:
        env["STAGETREE_CHECKPOINT_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run([*CLI, "run", str(STUDY), "--workers", "1", "--out", str(tmp_path / "run"), "--quiet"],
                          capture_output=True, text=True, timeout=300, env=env)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and needle in err, proc.stdout + proc.stderr
    assert "worker w0" in err and "exited with code 2" in err and "Traceback" not in err, err


@pytest.mark.parametrize(("command", "env", "needle"), [
    ("worker", {"STAGETREE_S3_ENDPOINT": "closed"}, "the object store at {endpoint} ($STAGETREE_S3_ENDPOINT) "
     "cannot be used (3 tries): check bucket s3://stagetree at {endpoint} failed: NewConnectionError"),
    ("worker", {"STAGETREE_CHECKPOINT_STORE": "s3://stagetree-no-such-bucket/x"},
     "bucket 'stagetree-no-such-bucket' does not exist at {endpoint}"),
    ("worker", {"STAGETREE_S3_SECRET_KEY": "not-the-secret"}, "refused this worker's credentials"),
    ("worker", {"STAGETREE_S3_ACCESS_KEY": "read-only"}, "refused this worker's credentials: put s3://"),
    ("worker", {"STAGETREE_CHECKPOINT_STORE": "/proc/stagetree-checkpoints"}, "this worker cannot write checkpoints "
     "there: writing 1 checkpoint(s)"),
    ("serve", {"STAGETREE_S3_ENDPOINT": "closed", "STAGETREE_CHECKPOINT_BUDGET": "1GB"},
     "the object store at {endpoint} ($STAGETREE_S3_ENDPOINT) cannot be used (3 tries)"),
], ids=["worker-endpoint-closed", "worker-missing-bucket", "worker-wrong-credentials", "worker-read-only-credentials",
        "worker-unwritable-directory", "serve-endpoint-closed"])
def test_a_process_whose_checkpoint_store_cannot_be_used_exits_2_before_it_joins(
        deployment: dict[str, str], tmp_path: Path, command: str, env: dict[str, str], needle: str) -> None:
    """``stagetree worker`` (and ``serve`` with a checkpoint budget, which deletes there) whose
    object store cannot be used (an endpoint nothing listens on, a bucket that does not exist,
    credentials it refuses, or credentials that may read but not write) exits 2 within seconds,
    before it joins: one line naming ``--checkpoint-store``, the endpoint or bucket and why, and
    no WorkerJoined in the log. A worker with a mistyped endpoint joined, took paths and failed
    each one's checkpoint."""
    env = {**deployment, **env}
    if env["STAGETREE_S3_ENDPOINT"] == "closed":
        env["STAGETREE_S3_ENDPOINT"] = f"127.0.0.1:{_free_port()}"
    if env["STAGETREE_S3_ACCESS_KEY"] == "read-only":
        with read_only_user(deployment) as (access_key, secret_key):
            env |= {"STAGETREE_S3_ACCESS_KEY": access_key, "STAGETREE_S3_SECRET_KEY": secret_key}
            _exits_2_before_it_joins(deployment, tmp_path, command, env, needle)
        return
    _exits_2_before_it_joins(deployment, tmp_path, command, env, needle)


@contextmanager
def read_only_user(deployment: dict[str, str]) -> Iterator[tuple[str, str]]:
    """A MinIO user (its access and secret key) allowed to read the deployment's bucket and list
    it, not to write: made with MinIO's admin API, removed after."""
    from minio import MinioAdmin
    from minio.credentials import StaticProvider

    admin = MinioAdmin(endpoint=deployment["STAGETREE_S3_ENDPOINT"], secure=False, credentials=StaticProvider(
        deployment["STAGETREE_S3_ACCESS_KEY"], deployment["STAGETREE_S3_SECRET_KEY"]))
    bucket = deployment["STAGETREE_CHECKPOINT_STORE"].removeprefix("s3://").split("/")[0]
    name = f"stagetree-read-only-{uuid.uuid4().hex[:8]}"
    admin.policy_add(name, policy={"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation"],
        "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]})
    try:
        admin.user_add(name, secret := uuid.uuid4().hex)
        try:
            admin.policy_set(name, user=name)
            yield name, secret
        finally:
            admin.user_remove(name)
    finally:
        admin.policy_remove(name)


def _exits_2_before_it_joins(deployment: dict[str, str], tmp_path: Path, command: str, env: dict[str, str],
                             needle: str) -> None:
    needle = needle.format(endpoint=env["STAGETREE_S3_ENDPOINT"])
    servers = ["--bootstrap-servers", env["STAGETREE_BOOTSTRAP_SERVERS"]]
    argv = ["worker", *servers, "--worker-id", "w0", "--study", str(STUDY), "--device", "cpu"] if command == "worker" \
        else ["serve", *servers, "--state-dir", str(tmp_path / "serve"), "--instance-id", "A"]
    # (it waited for ever: a timeout the store's 5 minute requests exceed, not a timing)
    proc = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=180, env=env)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and needle in err and "Traceback" not in err, proc.stdout + proc.stderr
    assert f"--checkpoint-store '{env['STAGETREE_CHECKPOINT_STORE']}'" in err and len(proc.stderr.splitlines()) == 1
    assert env["STAGETREE_S3_SECRET_KEY"] not in err
    assert not [e for e in kafka_state(deployment)[1] if isinstance(e, WorkerJoined)]


def children_of(parent: int, wanted: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids of ``parent``'s child processes whose argv ``wanted`` accepts (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and wanted(argv):
            found.append(int(entry.name))
    return found


def test_a_kafka_run_starts_a_worker_that_died_again_and_finishes(deployment: dict[str, str],
                                                                 tmp_path: Path) -> None:
    """A worker process of ``run --workers N`` on Kafka killed with SIGKILL (here in its start-up,
    which the run waits for) is started again, as an embedded run's are, and the study finishes
    with every trial done."""
    out = tmp_path / "run"
    run = subprocess.Popen([*CLI, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=deployment)

    def worker_w1() -> int | None:
        return next(iter(children_of(run.pid, lambda argv: b"worker" in argv and b"w1" in argv)), None)

    try:
        wait_for(lambda: worker_w1() is not None, "worker w1 to start", timeout=120)
        pid = worker_w1()  # in its start-up: the run waits for it to join
        assert pid is not None
        os.kill(pid, 9)
        stdout, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, stdout + stderr
    said = " ".join(stdout.split())  # the run's warnings, as its others
    assert "worker w1 (pid" in said and "was killed by SIGKILL; starting it again (restart 1 of 3)" in said, said
    assert {t["status"] for t in summary_of(out)["trials"]} == {"done"}


def test_a_run_with_no_deployment_to_run_it_says_what_it_waits_for(deployment: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """``run --workers 0`` on a prefix where no serve and no worker run waited in silence, for
    ever: after 15 s with nothing dispatched it warns that no worker has joined, and waits on."""
    import selectors
    import time

    run = subprocess.Popen([*CLI, "run", str(STUDY), "--workers", "0", "--out", str(tmp_path / "run"), "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=deployment)
    try:
        seen, deadline = "", time.monotonic() + 60
        assert run.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(run.stdout, selectors.EVENT_READ)
            while "no worker has joined" not in seen and time.monotonic() < deadline and run.poll() is None:
                if sel.select(timeout=1):
                    seen += run.stdout.readline()
        said = " ".join(seen.split())
        assert "waiting: no worker has joined the deployment" in said, seen
        assert deployment["STAGETREE_TOPIC_PREFIX"] in said and "stagetree worker" in said, seen
        assert run.poll() is None  # it waits on
    finally:
        run.kill()
        run.wait()


def test_a_kafka_runs_checkpoint_budget_flag_reaches_the_serve_it_starts(deployment: dict[str, str],
                                                                        tmp_path: Path) -> None:
    """``run --workers N --checkpoint-budget SIZE`` on Kafka started its serve without the flag
    (nor ``--checkpoint-store``): the budget was ignored without a word, and with the budget in
    the serve's environment the serve refused to start for want of a store. The serve it starts
    gets both now; with ``--workers 0`` nothing would apply the flag, so it is refused."""
    study = STUDY.parent / "tiny_grid.py"  # checkpoints of 100,921 bytes: 150,000 holds one
    out = tmp_path / "run"
    proc = subprocess.run([*CLI, "run", str(study), "--workers", "1", "--out", str(out), "--quiet",
                           "--checkpoint-budget", "150000"], capture_output=True, text=True, timeout=600,
                          env=deployment)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = summary_of(out)
    # the first path writes 3 checkpoints, alone; evictions asked again after each group kept it to that
    # (a dispatch decided from the state the evictions made, not asked again, let it reach 4)
    assert summary["checkpoints_evicted"] > 0 and summary["peak_checkpoint_bytes"] <= 3 * 100921, summary
    proc = subprocess.run([*CLI, "run", str(study), "--workers", "0", "--out", str(tmp_path / "zero"), "--quiet",
                           "--checkpoint-budget", "1GB"], capture_output=True, text=True, timeout=300, env=deployment)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "--checkpoint-budget 1000000000 is applied by the serve" in err, err


@pytest.mark.parametrize("sig, code, words", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                               (signal.SIGINT, 130, "stopped by Ctrl-C (SIGINT)")])
def test_a_signal_stops_a_kafka_run_and_the_processes_it_started(sig: signal.Signals, code: int, words: str,
                                                                 deployment: dict[str, str], tmp_path: Path) -> None:
    """SIGTERM (how kill, systemd and batch schedulers stop a process) ended ``run --workers N``
    on Kafka alone: its serve and worker kept running, re-parented, for ever, and a rerun's serve
    crashed on their state's lock; Ctrl-C printed two chained tracebacks. Both stop them now and
    say so in one line, exit 143 and 130 (as a shell reports a process the signal ended)."""
    out = tmp_path / "run"
    run = subprocess.Popen([*CLI, "run", str(STUDY), "--workers", "1", "--out", str(out), "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=deployment)

    def children() -> list[int]:
        return children_of(run.pid, lambda argv: b"worker" in argv or b"serve" in argv)

    try:
        wait_for(lambda: len(children()) == 2 and any(isinstance(e, WorkerJoined) for e in kafka_state(deployment)[1]),
                 "the serve and the worker to start", timeout=180)
        started = children()
        run.send_signal(sig)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    err = " ".join(stderr.split())
    assert run.returncode == code and words in err and "Traceback" not in err, stdout + stderr
    for pid in started:  # terminated and reaped by the run, not left behind
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), pid


def test_the_processes_a_kafka_run_started_leave_when_it_is_killed(deployment: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """kill -9 of ``run --workers N`` on Kafka (it cannot clean up) left its serve and worker
    running, re-parented, for ever: they are now sent SIGTERM when it dies, and leave (the
    worker drains its stage first). Bounded by the wait, not timed."""
    run = subprocess.Popen([*CLI, "run", str(STUDY), "--workers", "1", "--out", str(tmp_path / "run"), "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=deployment)
    try:
        wait_for(lambda: len(children_of(run.pid, lambda argv: b"worker" in argv or b"serve" in argv)) == 2,
                 "the serve and the worker to start", timeout=180)
        started = children_of(run.pid, lambda argv: b"worker" in argv or b"serve" in argv)
    finally:
        run.kill()
        run.wait()

    def gone(pid: int) -> bool:
        try:
            return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        except OSError:
            return True

    wait_for(lambda: all(gone(pid) for pid in started), "the serve and the worker to leave", timeout=120)


def _serve_on(cluster: Deployment, state_dir: Path, name: str) -> subprocess.Popen[bytes]:
    """A serve instance of ``cluster``'s app named ``name`` (its output in ``name.log``) on
    ``state_dir``."""
    proc = spawn([*CLI, "serve", *cluster.kafka, "--state-dir", str(state_dir), "--app-id", cluster.app_id,
                  "--instance-id", name, "--heartbeat-timeout", "3"], cluster.env, cluster.log_path(name))
    cluster.procs.append(proc)
    cluster.serves[name] = proc
    return proc


def _holds_the_role(cluster: Deployment, name: str) -> Callable[[], bool]:
    def holds() -> bool:
        assert cluster.serves[name].poll() is None, cluster.output(name)
        return "scheduler role taken over" in cluster.output(name)
    return holds


def test_a_serve_on_a_state_dir_another_serve_holds_exits_2_and_a_killed_ones_is_free(
        embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """A second ``serve`` (or a ``run --workers N`` whose ``--out`` holds the state directory)
    while a live serve holds the state directory exits 2 before it contacts anything, one line
    naming ``--state-dir`` (or ``--out``), the directory and the other serve's pid, and the first
    serve runs a study on; it crashed in faust with a traceback (RocksDB's LOCK of a
    ``plan-<p>`` store) once the group gave it a partition. After kill -9 of the holder, a serve
    starts on the directory at once (the kernel dropped the lock). On the way: a second run
    holding another run's ``--out`` lock, and a run of the finished study's name with another
    seed, are refused before they append anything."""
    cluster = Deployment(deployment, tmp_path)
    earlier = tmp_path / "earlier"  # as an earlier `run --out earlier` left its serve running
    state_dir = earlier / "serve-state"
    try:
        first = _serve_on(cluster, state_dir, "A")
        wait_for(_holds_the_role(cluster, "A"), "serve A to take the scheduler role")
        in_use = f"is in use by another serve process (pid {first.pid})"
        for app in (f"{cluster.app_id}-other", cluster.app_id):  # another app, or another instance of its app
            second = subprocess.run([*CLI, "serve", *cluster.kafka, "--state-dir", str(state_dir), "--app-id", app,
                                     "--instance-id", "B"], capture_output=True, text=True, timeout=300,
                                    env=deployment)
            err = " ".join(second.stderr.split())
            assert second.returncode == 2 and f"--state-dir '{state_dir}' {in_use}" in err, second.stderr
            assert "Traceback" not in err and len(second.stderr.splitlines()) == 1, second.stderr
        run = subprocess.run([*CLI, "run", str(STUDY), "--workers", "1", "--out", str(earlier), "--quiet"],
                             capture_output=True, text=True, timeout=300, env=deployment)
        err = " ".join(run.stderr.split())
        assert run.returncode == 2 and f"--out '{earlier}': the serve state directory '{state_dir}' {in_use}" in err, \
            run.stdout + run.stderr
        assert len(run.stderr.splitlines()) == 1 and not list(earlier.glob("summary*.json")), run.stderr
        resumed = subprocess.run([*CLI, "run", str(STUDY), "--workers", "1", "--out", str(earlier), "--resume",
                                  "--quiet"], capture_output=True, text=True, timeout=300, env=deployment)
        err = " ".join(resumed.stderr.split())
        assert resumed.returncode == 2 and "run the study again without --resume to continue it" in err, err
        other = tmp_path / "other"  # two runs started at once on one --out both passed the check above
        with StateDirLock(other, RUN_LOCK_FILE, "run"):  # as a run of it going on holds it (here: this process)
            run = subprocess.run([*CLI, "run", str(STUDY), "--workers", "1", "--out", str(other), "--quiet"],
                                 capture_output=True, text=True, timeout=300, env=deployment)
        err = " ".join(run.stderr.split())
        assert run.returncode == 2 and f"--out '{other}' is in use by another run process (pid {os.getpid()})" in err, \
            run.stdout + run.stderr
        assert sorted(p.name for p in other.iterdir()) == [RUN_LOCK_FILE], run.stderr  # no serve was started

        assert first.poll() is None  # the first serve works on: a study through it
        cluster.worker("w0")
        cluster.joined("w0")
        cluster.finish(cluster.run())
        assert per_trial(summary_of(tmp_path / "run")) == per_trial(summary_of(embedded))
        # the same study name with another seed is another study: refused before it appends anything
        # (on a deployment it was taken as a continuation, its requests made anew under the old name)
        other_seed = tmp_path / "tiny_seed8.py"
        other_seed.write_text(STUDY.read_text().replace("seed = 7", "seed = 8").replace(
            'Path(__file__).resolve().parents[2] / "examples"', repr(str(STUDY.parents[2] / "examples"))))
        with kafka_log(deployment) as log:
            ends = {p: log.end_offset(topics.PLAN, p) for p in range(log.partition_count(topics.PLAN))}
            again = subprocess.run([*CLI, "run", str(other_seed), *cluster.kafka, "--workers", "0", "--out",
                                    str(tmp_path / "seed8"), "--quiet"], capture_output=True, text=True, timeout=300,
                                   env=deployment)
            err = " ".join(again.stderr.split())
            assert again.returncode == 2 and "study 'tiny' in the log ran with seed 7" in err and \
                "gives seed 8" in err, again.stdout + again.stderr
            assert {p: log.end_offset(topics.PLAN, p) for p in ends} == ends

        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        again = _serve_on(cluster, state_dir, "A2")  # its lock file is still there, its lock gone
        wait_for(_holds_the_role(cluster, "A2"), "serve A2 to take the scheduler role on A's state directory")
        assert (state_dir / "serve.lock").read_text().split() == [str(again.pid)]
    finally:
        cluster.close()


NO_BROKER_COMMANDS = ("run", "serve", "worker", "worker-env", "replay", "dashboard")


@pytest.fixture(scope="module")
def no_broker_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, subprocess.Popen[str]]]]:
    """Each of :data:`NO_BROKER_COMMANDS` started, all at once, against an address where nothing
    listens: command -> (the address, its process). Each waits out the probe's deadline (15 s),
    so they wait side by side rather than one after another."""
    tmp = tmp_path_factory.mktemp("no-broker")
    started = {}
    for command in NO_BROKER_COMMANDS:
        address = f"127.0.0.1:{_free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")}
        flag = ["--bootstrap-servers", address]
        if command == "worker-env":
            env["STAGETREE_BOOTSTRAP_SERVERS"] = address
            flag = []
        out = tmp / command
        argv = {"run": ["run", str(STUDY), "--workers", "0", "--out", str(out / "run"), "--quiet", *flag],
                "serve": ["serve", "--state-dir", str(out / "serve"), *flag],
                "worker": ["worker", "--checkpoint-store", str(out / "store"), "--device", "cpu", *flag],
                "replay": ["replay", "verify", f"kafka://{address}/x.", "--quiet"],
                "dashboard": ["dashboard", f"kafka://{address}/x.", "--port", "0"]}[command.removesuffix("-env")]
        started[command] = (address, subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True, env=env))
    yield started
    for _, proc in started.values():  # those whose test failed before it ended
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.timeout(300)  # it waited 60 s per command: a bound of the wait, not a timing
@pytest.mark.parametrize("command", NO_BROKER_COMMANDS)
def test_a_kafka_command_where_no_broker_answers_exits_2_naming_the_flag(
        command: str, no_broker_runs: dict[str, tuple[str, subprocess.Popen[str]]]) -> None:
    """``run``, ``serve`` and ``worker`` on ``--bootstrap-servers`` (or
    ``$STAGETREE_BOOTSTRAP_SERVERS``) where nothing listens, and ``replay verify`` of such a
    ``kafka://`` address, exit 2 with one error naming the flag, the variable or the source, and
    the address. They waited a minute and named the address alone (the dashboard served a page
    saying that reading failed, for ever)."""
    address, running = no_broker_runs[command]
    stdout, stderr = running.communicate(timeout=240)
    proc = subprocess.CompletedProcess(running.args, running.returncode, stdout, stderr)
    named = {"run": "--bootstrap-servers", "serve": "--bootstrap-servers", "worker": "--bootstrap-servers",
             "worker-env": "$STAGETREE_BOOTSTRAP_SERVERS", "replay": f"source 'kafka://{address}/x.'",
             "dashboard": f"source 'kafka://{address}/x.'"}[command]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout + proc.stderr
    said = errors[0]
    assert said.startswith(f"error: {named}") and address in said and "no Kafka broker" in said, said
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_runs_serve_app_is_named_under_the_topic_prefix_within_the_app_id_limit() -> None:
    """The serve app a run starts names its consumer group and faust topics: under the deployment's
    topic prefix, the study's name made fit for a topic name and cut to keep to ``--app-id``'s
    200 characters; without the prefix only when it leaves no room."""
    from stagetree.cli import _app_id, _run_app_id

    named = _run_app_id("team-a.", "digits: cnn/v2")
    assert re.fullmatch(r"team-a\.stagetree-digits__cnn_v2-[0-9a-f]{8}", named), named
    assert _app_id(named) == named
    cut = _run_app_id("p" * 150, "s" * 300)
    assert cut.startswith("p" * 150 + "stagetree-" + "s" * 31 + "-") and len(cut) == 200 and _app_id(cut) == cut
    assert re.fullmatch(r"stagetree-s-[0-9a-f]{8}", _run_app_id("p" * 190, "s"))
    assert _run_app_id("", "s") != _run_app_id("", "s")  # each run an app of its own
