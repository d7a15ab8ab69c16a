"""Kafka mode end to end, on the real broker and MinIO: separate processes for the SDK, the faust
serve app and the workers, equal to embedded mode bit for bit, through worker and app crashes
and a corrupted checkpoint."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
import torch

from events import topics
from events.codec import decode
from events.kafka_log import KafkaLog
from events.models import CheckpointSaved, StageFailed, WorkerLost
from gpu_worker.loader import load_module, trainer_of
from gpu_worker.object_store import open_checkpoint_store
from gpu_worker.session import TrainingSession
from projections.store import ProjectionStore, Projector, search_plan_records
from stagetree.kafka_runtime import KafkaRuntime
from stagetree.study import Study

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

STUDY = Path(__file__).parent / "studies" / "tiny_sha.py"
CLI = [sys.executable, "-m", "stagetree.cli"]


def per_trial(summary: dict) -> dict:
    return {t["trial_id"]: (t["steps"], t["metrics"]) for t in summary["trials"]}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("embedded") / "run"
    proc = subprocess.run([*CLI, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def deployment(infra_env: dict[str, str]) -> dict[str, str]:
    """Environment of a fresh deployment: its own topics and checkpoint prefix on the shared services."""
    tag = uuid.uuid4().hex[:10]
    return {**os.environ, **infra_env, "STAGETREE_TOPIC_PREFIX": f"test-{tag}.",
            "STAGETREE_CHECKPOINT_STORE": f"s3://stagetree/test-{tag}"}


def kafka_state(env: dict[str, str]):
    with KafkaLog(env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=env["STAGETREE_TOPIC_PREFIX"]) as log:
        projector = Projector(log, dead_letters=False)
        projector.catch_up()
        events = [decode(r.value) for r in log.read(topics.PLAN)]
    return projector.state, events


def embedded_state(run: Path):
    store = ProjectionStore(run / "state")
    try:
        return store.load()
    finally:
        store.close()


def test_kafka_study_equals_embedded_bit_for_bit(embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "kafka"
    proc = subprocess.run([*CLI, "run", str(STUDY), "--workers", "2", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=900, env=deployment)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kafka = orjson.loads((out / "summary.json").read_bytes())
    local = orjson.loads((embedded / "summary.json").read_bytes())
    assert per_trial(kafka) == per_trial(local)
    assert kafka["executed_steps"] == local["executed_steps"] == local["unique_steps"]
    state, _ = kafka_state(deployment)
    assert search_plan_records(state) == search_plan_records(embedded_state(embedded))

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
    rows = [orjson.loads(x) for x in export.read_bytes().splitlines()]
    i = next(i for i, r in enumerate(rows) if '"MetricsReported"' in r.get("value", ""))
    event = orjson.loads(rows[i]["value"])
    event["payload"]["metrics"]["val_acc"] = 1.0
    rows[i]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()
    export.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    bad = subprocess.run([*CLI, "replay", "verify", str(export), "--quiet"], capture_output=True, text=True,
                         timeout=300, env=deployment)
    assert bad.returncode == 1 and "does not match its seal" in bad.stdout, bad.stdout


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_for(predicate, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_worker_kill_and_app_restart_finish_with_the_same_results(
        embedded: Path, deployment: dict[str, str], tmp_path: Path) -> None:
    env = deployment
    kafka = ["--bootstrap-servers", env["STAGETREE_BOOTSTRAP_SERVERS"]]
    serve_cmd = [*CLI, "serve", *kafka, "--state-dir", str(tmp_path / "serve-state"), "--app-id",
                 f"stagetree-{env['STAGETREE_TOPIC_PREFIX'].strip('.')}", "--heartbeat-timeout", "3"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        serve = _spawn(serve_cmd, env)
        workers = {w: _spawn([*CLI, "worker", *kafka, "--worker-id", w, "--study", str(STUDY), "--device", "cpu"], env)
                   for w in ("w0", "w1")}
        procs += [serve, *workers.values()]
        _wait_for(lambda: {"w0", "w1"} <= {w for w, x in kafka_state(env)[0].workers.items() if x.alive},
                  "both workers to join")
        run = subprocess.Popen([*CLI, "run", str(STUDY), *kafka, "--workers", "0", "--out", str(tmp_path / "run"),
                                "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(run)

        def saved() -> int:
            return sum(isinstance(e, CheckpointSaved) for e in kafka_state(env)[1])

        _wait_for(lambda: saved() >= 3, "first checkpoints")
        os.killpg(workers["w1"].pid, signal.SIGKILL)  # a worker dies mid-study
        _wait_for(lambda: saved() >= 8, "more checkpoints")
        os.killpg(serve.pid, signal.SIGKILL)  # the faust app dies...
        serve.wait()
        time.sleep(1)
        procs.append(_spawn(serve_cmd, env))  # ...and restarts on its state dir
        _, err = run.communicate(timeout=900)
        assert run.returncode == 0, err.decode()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM) if p is not run else p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    result = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert per_trial(result) == per_trial(orjson.loads((embedded / "summary.json").read_bytes()))
    state, events = kafka_state(env)
    assert any(isinstance(e, WorkerLost) and e.worker_id == "w1" for e in events)
    assert search_plan_records(state) == search_plan_records(embedded_state(embedded))
    store = open_checkpoint_store(env["STAGETREE_CHECKPOINT_STORE"], env)
    refs = {e.ref for e in events if isinstance(e, CheckpointSaved)}
    for ref in refs:
        store.get(ref)  # exists and matches its sha256
    # the restarted app's projection equals a fresh fold of the log
    restarted = ProjectionStore(tmp_path / "serve-state")
    try:
        assert search_plan_records(restarted.load()) == search_plan_records(state)
    finally:
        restarted.close()


def test_a_corrupted_checkpoint_is_detected_and_recomputed(deployment: dict[str, str], tmp_path: Path) -> None:
    env = deployment
    kafka = ["--bootstrap-servers", env["STAGETREE_BOOTSTRAP_SERVERS"]]
    procs = [_spawn([*CLI, "serve", *kafka, "--state-dir", str(tmp_path / "serve"), "--app-id",
                     f"stagetree-{env['STAGETREE_TOPIC_PREFIX'].strip('.')}"], env),
             _spawn([*CLI, "worker", *kafka, "--worker-id", "w0", "--study", str(STUDY), "--device", "cpu"], env)]
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
                saved = [e for e in (decode(r.value) for r in log.read(topics.PLAN))
                         if isinstance(e, CheckpointSaved) and e.step == 40]
                store = open_checkpoint_store(env["STAGETREE_CHECKPOINT_STORE"], env)
                # overwrite the object behind the store's back, as a disk fault or a person would
                store._client.put_object(store.bucket, store.key(saved[-1].ref), io.BytesIO(b"not a checkpoint"), 16)
                # a fresh worker process (no weights in memory) must read it from the store
                os.killpg(procs[1].pid, signal.SIGTERM)
                procs[1].wait(timeout=60)
                procs.append(_spawn([*CLI, "worker", *kafka, "--worker-id", "w1", "--study", str(STUDY),
                                     "--device", "cpu"], env))
                await runtime.ready(["w1"])
                second = await study.submit(hp, 60)  # resumes from the corrupted checkpoint at 40
                return first, second
            finally:
                poller.cancel()
                log.close()

        first, second = asyncio.run(main())
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
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
