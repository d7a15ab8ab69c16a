"""Kafka mode end to end, on the real broker and MinIO: separate processes for the SDK, the faust
serve app (one or two instances) and the workers, equal to embedded mode bit for bit, through
worker and serve crashes, a serve paused between deciding and committing (fenced), a failover
to a standby serve, and a corrupted checkpoint."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from confluent_kafka import Consumer, TopicPartition
from kafka_cluster import (
    CLI,
    STUDY,
    Deployment,
    assert_no_duplicate_or_conflicting_decisions,
    assert_what_must_hold_after_faults,
    decisions,
    embedded_state,
    kafka_state,
    per_trial,
    role_holder,
    verify_deployment,
    wait_for,
)

from events import topics
from events.codec import decode
from events.kafka_log import KafkaLog, partition_for
from events.models import CheckpointSaved, StageDispatched, StageFailed, WorkerLost
from gpu_worker.loader import load_module, trainer_of
from gpu_worker.object_store import open_checkpoint_store
from gpu_worker.session import TrainingSession
from projections.store import search_plan_records
from scheduler.role import STALL_HOOK_ENV
from stagetree.kafka_runtime import KafkaRuntime
from stagetree.study import Study

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]


def _faust_topics(env: dict[str, str], admin: Any = None) -> set[str]:
    """The faust apps' internal topics under the deployment's topic prefix (``<app id>-__assignor-__leader``;
    other tests' deployments on the same broker have other prefixes)."""
    from confluent_kafka.admin import AdminClient

    admin = admin or AdminClient({"bootstrap.servers": env["STAGETREE_BOOTSTRAP_SERVERS"]})
    return {t for t in admin.list_topics(timeout=30).topics
            if t.startswith(env["STAGETREE_TOPIC_PREFIX"]) and t.endswith("-__assignor-__leader")}


def test_kafka_study_equals_embedded_bit_for_bit(embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """A study on Kafka and MinIO, with two workers sharing a node cache of checkpoints (what they
    save and download), gives the embedded run's results and plan; the deployment's log verifies
    (chain, decisions, every checkpoint in MinIO), and an edited export of it does not."""
    out, cache = tmp_path / "kafka", tmp_path / "cache"
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": deployment["STAGETREE_BOOTSTRAP_SERVERS"]})
    run = subprocess.Popen([*CLI, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**deployment, "STAGETREE_CHECKPOINT_CACHE": str(cache)})
    seen: set[str] = set()  # the run's serve app's topics, under the deployment's prefix as all its topics
    deadline = time.monotonic() + 900
    try:
        while run.poll() is None and time.monotonic() < deadline:
            seen |= _faust_topics(deployment, admin)
            time.sleep(0.5)
        stdout, stderr = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if run.poll() is None:  # past its 900 s (as subprocess.run's timeout): not left running
            run.kill()
            run.wait()
    assert run.returncode == 0, stdout + stderr
    assert len(seen) == 1 and next(iter(seen)).startswith(f"{deployment['STAGETREE_TOPIC_PREFIX']}stagetree-"), seen
    # the run's serve app is its own: its faust topics go with it (one a run was left before)
    assert not _faust_topics(deployment, admin), stdout + stderr
    kafka = orjson.loads((out / "summary.json").read_bytes())
    local = orjson.loads((embedded / "summary.json").read_bytes())
    assert per_trial(kafka) == per_trial(local)
    assert kafka["executed_steps"] == local["executed_steps"] == local["unique_steps"]
    state, events = kafka_state(deployment)
    assert search_plan_records(state) == search_plan_records(embedded_state(embedded))
    # the copies: not temporaries, not the tally of their bytes
    copies = {p.name for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert copies and copies <= {e.ref for e in events if isinstance(e, CheckpointSaved)}

    # the serve projector sealed the plan stream: the deployment verifies as a source...
    source = f"kafka://{deployment['STAGETREE_BOOTSTRAP_SERVERS']}/{deployment['STAGETREE_TOPIC_PREFIX']}stagetree.plan"
    audit = [*CLI, "replay", "verify", source, "--checkpoints", deployment["STAGETREE_CHECKPOINT_STORE"], "--quiet"]
    ok = subprocess.run(audit, capture_output=True, text=True, timeout=300, env=deployment)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok chain" in ok.stdout and "ok decision" in ok.stdout and "ok checkpoint" in ok.stdout
    # the SDK's tuner decisions (decided_at: offsets of the plan topic it had folded) recompute from the topic
    decided = sum(1 for e in kafka_state(deployment)[1] if e.type == "TunerDecided")
    assert f"ok tuner: {decided} tuner decisions of 1 study recomputed" in ok.stdout and decided > 16, ok.stdout
    # ...and an edited export of it fails at the first seal after the edit
    export = tmp_path / "kafka.jsonl"
    subprocess.run([*CLI, "log", "export", source, "--out", str(export)], check=True, timeout=300, env=deployment)
    # (a deployment's export does not become a run directory: it said "pass the matching --log-key")
    imported = subprocess.run([*CLI, "log", "import", str(export), "--out", str(tmp_path / "imported")],
                              capture_output=True, text=True, timeout=300, env=deployment)
    err = " ".join(imported.stderr.split())
    assert imported.returncode == 2 and "the export is of a Kafka deployment" in err, imported.stdout + err
    assert not (tmp_path / "imported").exists()
    rows = [orjson.loads(x) for x in export.read_bytes().splitlines()]
    i = next(i for i, r in enumerate(rows) if '"MetricsReported"' in r.get("value", ""))
    event = orjson.loads(rows[i]["value"])
    event["payload"]["metrics"]["val_acc"] = 1.0
    rows[i]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()
    export.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    bad = subprocess.run([*CLI, "replay", "verify", str(export), "--quiet"], capture_output=True, text=True,
                         timeout=300, env=deployment)
    assert bad.returncode == 1 and "does not match its seal" in bad.stdout, bad.stdout

    # the same study with another tuner argument is another study: refused (exit 2, naming the
    # difference from the settings its StudyStarted records) before anything is appended
    changed = tmp_path / "tiny_sha.py"
    changed.write_text(STUDY.read_text().replace("reduction=2", "reduction=4").replace(
        'Path(__file__).resolve().parents[2] / "examples"', repr(str(STUDY.parents[2] / "examples"))))
    records = len(kafka_state(deployment)[1])
    refused = subprocess.run([*CLI, "run", str(changed), "--workers", "0", "--out", str(tmp_path / "again"),
                              "--quiet"], capture_output=True, text=True, timeout=300, env=deployment)
    err = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "`reduction`: 2 in the log, 4 now" in err, refused.stdout + refused.stderr
    assert len(kafka_state(deployment)[1]) == records


def test_worker_kill_and_app_restart_finish_with_the_same_results(
        embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    env = deployment
    cluster = Deployment(env, tmp_path)
    try:
        serve = cluster.serve("A")
        cluster.worker("w0", hold_in_path=4)
        cluster.worker("w1", hold_in_path=2)
        cluster.joined("w0", "w1")
        run = cluster.run()
        cluster.held("w1")
        os.killpg(cluster.workers["w1"].pid, signal.SIGKILL)  # a worker dies in a path mid-study
        cluster.held("w0")  # w0 alone goes on (w1's path is dispatched again once it is declared lost)
        os.killpg(serve.pid, signal.SIGKILL)  # the faust app dies...
        serve.wait()
        cluster.serve("A")  # ...and restarts on its state dir
        cluster.release("w0")
        cluster.finish(run)
    finally:
        cluster.close()
    state, events = kafka_state(env)
    assert any(isinstance(e, WorkerLost) and e.worker_id == "w1" for e in events)
    assert_what_must_hold_after_faults(env, tmp_path / "run", embedded, [cluster.state_dir("A")])
    assert_no_duplicate_or_conflicting_decisions(state, events)


def test_a_second_run_of_a_study_takes_it_over_and_the_first_stops(
        embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """A second `stagetree run` of a study that a first one is driving (the same file, another
    terminal) continues it from the log, as after a kill; the first stops at once (exit 1),
    saying so, and appends nothing more. The study's results equal embedded mode's bit for bit,
    and `replay verify` passes: one tuner's decisions are recorded, not two clients'."""
    cluster = Deployment(deployment, tmp_path)
    try:
        cluster.serve("A")
        cluster.worker("w0", hold_in_path=2)
        cluster.joined("w0")
        first = cluster.run(out="first")
        cluster.held("w0")  # the first client's trials are submitted; a path is being trained
        second = cluster.run(out="second")
        _, err = first.communicate(timeout=300)
        assert first.returncode == 1, err.decode()
        assert "another client started driving study" in " ".join(err.decode().split())
        cluster.release("w0")
        cluster.finish(second)
    finally:
        cluster.close()
    assert not (tmp_path / "first" / "summary.json").exists()
    assert_what_must_hold_after_faults(deployment, tmp_path / "second", embedded, [cluster.state_dir("A")])
    verify_deployment(deployment)


def _taken_over(cluster: Deployment, instance: str, after: float = 0.0) -> float | None:
    """When ``instance`` last took the scheduler role over (epoch seconds, from its output)."""
    times = [float(t) for t in re.findall(r"scheduler role taken over at ([0-9.]+)", cluster.output(instance))]
    times = [t for t in times if t > after]
    return times[-1] if times else None


def _uncommitted(env: dict[str, str], topic: str, partition: int) -> list[bytes]:
    """Every record value physically in a partition, aborted transactions' included."""
    consumer = Consumer({"bootstrap.servers": env["STAGETREE_BOOTSTRAP_SERVERS"], "group.id": "x",
                         "isolation.level": "read_uncommitted", "enable.partition.eof": True,
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, partition, 0)])
        out = []
        while True:
            msg = consumer.poll(5)
            assert msg is not None, f"no end of {topic}[{partition}] within 5 s"
            if msg.error() is not None:
                break  # the partition's end
            out.append(msg.value())
        return out
    finally:
        consumer.close()


def test_a_serve_paused_between_deciding_and_committing_is_fenced(
        embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """Serve A decides a dispatch, sends it in its transaction, and stops (SIGSTOP) before the
    commit, as a long pause or a network partition would leave it. Serve B takes the scheduler
    role over when A's group session expires, which fences A and aborts its open transaction;
    A then resumes. The stale decision is never visible: not on the plan stream, not on the
    worker's stream, not in any projection; and the study finishes as embedded mode does."""
    env = deployment
    stall = tmp_path / "stalled-decision.json"
    cluster = Deployment(env, tmp_path)
    try:
        a = cluster.serve("A", extra_env={STALL_HOOK_ENV: str(stall)})
        wait_for(lambda: _taken_over(cluster, "A") is not None, "serve A to hold the scheduler role", 120)
        cluster.worker("w0")
        cluster.worker("w1")
        cluster.joined("w0", "w1")
        run = cluster.run()
        wait_for(stall.exists, "serve A to stall inside its first decision's transaction", 300)
        stalled = decode(stall.read_bytes().splitlines()[0])
        assert isinstance(stalled, StageDispatched)
        cluster.serve("B")
        wait_for(lambda: _taken_over(cluster, "B") is not None, "serve B to take the role over", 120)
        wait_for(lambda: any(d.producer == "serve:B" for d in decisions(kafka_state(env)[1])),
                 "serve B's first decision", 120)
        os.kill(a.pid, signal.SIGCONT)  # the zombie wakes up and tries to commit
        wait_for(lambda: "(fenced: " in cluster.output("A"), "serve A to learn it was fenced", 120)
        cluster.finish(run)
    finally:
        cluster.close()
    state, events = kafka_state(env)
    landed = [e for e in events if e.event_id == stalled.event_id]
    assert not landed, (f"the stalled decision landed: {landed}\n--- serve A ---\n{cluster.output('A')}"
                        f"\n--- serve B ---\n{cluster.output('B')}")
    with KafkaLog(env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=env["STAGETREE_TOPIC_PREFIX"]) as log:
        plan_topic = log.topic(topics.PLAN)
        partition = partition_for(stalled.plan_key, log.partition_count(topics.PLAN))
        worker_stream = topics.dispatch_stream(stalled.worker_id)
        assert stalled.event_id not in {decode(r.value).event_id for r in log.read(worker_stream)}
        worker_topic = log.topic(worker_stream)
    # it did reach the broker, in the transaction that B's take-over aborted
    assert any(stalled.event_id.encode() in v for v in _uncommitted(env, plan_topic, partition))
    assert any(stalled.event_id.encode() in v for v in _uncommitted(env, worker_topic, 0))
    assert_no_duplicate_or_conflicting_decisions(state, events)
    assert_what_must_hold_after_faults(env, tmp_path / "run", embedded,
                                       [cluster.state_dir("A"), cluster.state_dir("B")])
    verify_deployment(env)


def test_failover_to_a_standby_serve_after_kill_9(embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    """Two serve instances; kill -9 of the one holding the scheduler role mid-study: the other
    takes it over and the study finishes as embedded mode does, with no decision duplicated or
    conflicting, and the log verifies."""
    env = deployment
    cluster = Deployment(env, tmp_path)
    try:
        cluster.serve("A")
        cluster.serve("B")
        cluster.worker("w0", hold_in_path=2)
        cluster.worker("w1", hold_in_path=2)
        cluster.joined("w0", "w1")
        run = cluster.run()
        cluster.held("w0", "w1")  # mid-study: most decisions are still to be made
        wait_for(lambda: role_holder(cluster) is not None, "one serve to hold the scheduler role", 120)
        active = role_holder(cluster)
        assert active is not None
        standby = "B" if active == "A" else "A"
        killed_at = time.time()
        os.killpg(cluster.serves[active].pid, signal.SIGKILL)
        cluster.release("w0", "w1")
        cluster.finish(run)
        took_over = _taken_over(cluster, standby, after=killed_at)
    finally:
        cluster.close()
    assert took_over is not None, cluster.output(standby)
    print(f"failover: serve {standby} took the scheduler role over {took_over - killed_at:.1f} s after "
          f"kill -9 of serve {active}")
    state, events = kafka_state(env)
    assert any(d.producer == f"serve:{standby}" and d.ts > killed_at for d in decisions(events))
    assert_no_duplicate_or_conflicting_decisions(state, events)
    assert_what_must_hold_after_faults(env, tmp_path / "run", embedded,
                                       [cluster.state_dir("A"), cluster.state_dir("B")])
    verify_deployment(env)


def test_a_corrupted_checkpoint_is_detected_and_recomputed(deployment: dict[str, str], tmp_path: Path) -> None:
    env = deployment
    cluster = Deployment(env, tmp_path)
    cluster.serve("A")
    cluster.worker("w0")
    module = load_module(STUDY)
    trainer = trainer_of(module, STUDY)
    hp = next(iter(module.space))
    try:
        async def main() -> tuple[dict, dict]:
            log = KafkaLog(env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=env["STAGETREE_TOPIC_PREFIX"])
            runtime = KafkaRuntime(log)
            poller = asyncio.create_task(runtime.run())
            try:
                await runtime.ready(["w0"])
                study = Study(runtime, "corrupt", trainer, module.seed)
                first = await study.submit(hp, 40)
                await runtime.drain()  # its checkpoint is saved after the metrics are reported
                saved = [e for e in kafka_state(env)[1] if isinstance(e, CheckpointSaved) and e.step == 40]
                store = open_checkpoint_store(env["STAGETREE_CHECKPOINT_STORE"], env)
                # overwrite the object behind the store's back, as a disk fault or a person would
                store._client.put_object(store.bucket, store.key(saved[-1].ref), io.BytesIO(b"not a checkpoint"), 16)
                # a fresh worker process (no weights in memory) must read it from the store
                os.killpg(cluster.workers["w0"].pid, signal.SIGTERM)
                cluster.workers["w0"].wait(timeout=60)
                cluster.worker("w1")
                await runtime.ready(["w1"])
                second = await study.submit(hp, 60)  # resumes from the corrupted checkpoint at 40
                return first, second
            finally:
                poller.cancel()
                runtime.close()
                log.close()

        first, second = asyncio.run(main())
    finally:
        cluster.close()
    _, events = kafka_state(env)
    failed = [e for e in events if isinstance(e, StageFailed)]
    assert failed and failed[0].kind == "checkpoint_corrupt"
    # recomputed, never loaded: the answer equals straight-through training (one thread, as workers)
    torch.set_num_threads(1)
    session = TrainingSession(trainer, module.seed)
    session.start_fresh()
    config = {k: v for k, v in sorted(hp.items())}
    session.train(config, 40)
    assert session.evaluate() == first
    session.train(config, 60)
    assert session.evaluate() == second
