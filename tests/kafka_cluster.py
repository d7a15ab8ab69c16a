"""Helpers of the Kafka-mode end-to-end tests: start the processes of a deployment, read what
it wrote, and check what must hold after faults."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson

from events import topics
from events.codec import decode
from events.kafka_log import KafkaLog
from events.log import Record
from events.models import CheckpointSaved, Event, StageDispatched, StageFinished
from gpu_worker.kafka_worker import HOLD_HOOK_ENV
from gpu_worker.object_store import open_checkpoint_store
from projections.partitions import PartitionedFold
from projections.state import State
from projections.store import ProjectionStore, Projector, snapshot

STUDIES = Path(__file__).parent / "studies"
STUDY = STUDIES / "tiny_sha.py"
CLI = [sys.executable, "-m", "stagetree.cli"]


def per_trial(summary: dict) -> dict:
    return {t["trial_id"]: (t["steps"], t["metrics"]) for t in summary["trials"]}


def summary_of(run: Path) -> dict:
    return orjson.loads((run / "summary.json").read_bytes())


def kafka_log(env: dict[str, str]) -> KafkaLog:
    return KafkaLog(env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=env["STAGETREE_TOPIC_PREFIX"])


def plan_records(log: KafkaLog) -> dict[int, list[Record]]:
    """Every record of every partition of the deployment's plan stream, per partition."""
    return {p: list(log.read(topics.PLAN, partition=p)) for p in range(log.partition_count(topics.PLAN))}


def kafka_state(env: dict[str, str]) -> tuple[State, list[Event]]:
    """The merged view of the deployment's plan stream, and its events (partition by partition)."""
    with kafka_log(env) as log:
        fold = PartitionedFold(log, log.partition_count(topics.PLAN))
        fold.catch_up()
        events = [decode(r.value) for records in plan_records(log).values() for r in records]
    return fold.state, events


def embedded_state(run: Path) -> State:
    store = ProjectionStore(run / "state")
    try:
        return store.load()
    finally:
        store.close()


def spawn(cmd: list[str], env: dict[str, str], log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a process in a session of its own (so its children die with it), its output to
    ``log`` (or nowhere)."""
    out: int | IO[bytes] = subprocess.DEVNULL if log is None else log.open("ab")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if log else out,
                            start_new_session=True)


def _tail(text: str, lines: int = 150) -> str:
    """The last ``lines`` lines of ``text`` other than librdkafka's connection complaints."""
    kept = [line for line in text.splitlines() if "Connection refused" not in line and "Connect to ipv4" not in line]
    return "\n".join(kept[-lines:])


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running (its whole session), then wait; SIGKILL stragglers."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGCONT)  # a paused one must be able to leave
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                p.kill()
            p.wait(timeout=30)


class Deployment:
    """The processes of one Kafka deployment in a test: serve instances, workers, studies."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        self.kafka = ["--bootstrap-servers", env["STAGETREE_BOOTSTRAP_SERVERS"]]
        self.app_id = f"stagetree-{env['STAGETREE_TOPIC_PREFIX'].strip('.')}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.serves: dict[str, subprocess.Popen[bytes]] = {}
        self.workers: dict[str, subprocess.Popen[bytes]] = {}

    def serve(self, instance: str = "A", *, heartbeat_timeout: float = 3, extra_env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        cmd = [*CLI, "serve", *self.kafka, "--state-dir", str(self.state_dir(instance)), "--app-id", self.app_id,
               "--instance-id", instance, "--heartbeat-timeout", str(heartbeat_timeout)]
        proc = spawn(cmd, {**self.env, **(extra_env or {})}, self.log_path(instance))
        self.procs.append(proc)
        self.serves[instance] = proc
        return proc

    def state_dir(self, instance: str) -> Path:
        return self.tmp / f"serve-{instance}"

    def log_path(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def output(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def worker(self, worker_id: str, study: Path = STUDY, *, hold_in_path: int | None = None
               ) -> subprocess.Popen[bytes]:
        """Start worker ``worker_id``; with ``hold_in_path`` N it stops in its N-th path, once that
        path's first stage has started, until :meth:`release` (``HOLD_HOOK_ENV``)."""
        env = {} if hold_in_path is None else {HOLD_HOOK_ENV: f"{hold_in_path}:{self.tmp}"}
        return self.worker_with_env(worker_id, env, study)

    def held(self, *workers: str, timeout: float = 300) -> None:
        """Wait until every one of ``workers`` is held in its path (see :meth:`worker`)."""
        for worker_id in workers:
            proc, held = self.workers[worker_id], self.tmp / f"{worker_id}.held"
            wait_for(lambda p=proc, h=held: h.exists() or p.poll() is not None,
                     f"worker {worker_id} to be held in its path", timeout)
            assert proc.poll() is None, self.output(worker_id)

    def release(self, *workers: str) -> None:
        """Let held workers go on."""
        for worker_id in workers:
            (self.tmp / f"{worker_id}.held").unlink()

    def worker_with_env(self, worker_id: str, extra_env: dict[str, str], study: Path = STUDY
                        ) -> subprocess.Popen[bytes]:
        proc = spawn([*CLI, "worker", *self.kafka, "--worker-id", worker_id, "--study", str(study), "--device", "cpu"],
                     {**self.env, **extra_env}, self.log_path(worker_id))
        self.procs.append(proc)
        self.workers[worker_id] = proc
        return proc

    def joined(self, *workers: str) -> None:
        wait_for(lambda: set(workers) <= {w for w, x in kafka_state(self.env)[0].workers.items() if x.alive},
                 f"workers {workers} to join")

    def run(self, study: Path = STUDY, out: str = "run") -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([*CLI, "run", str(study), *self.kafka, "--workers", "0", "--out", str(self.tmp / out),
                                 "--quiet"], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(proc)
        return proc

    def finish(self, run: subprocess.Popen[bytes], timeout: float = 900) -> None:
        """Wait for the study ``run`` to end, and check it succeeded. When it does not end in
        ``timeout`` seconds, every process of the deployment prints its threads' stacks (SIGUSR1,
        see ``stagetree.cli.main``) and the failure shows them with each one's output."""
        try:
            _, err = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for proc in self.procs:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            run.kill()
            _, err = run.communicate()
            names = [*self.serves, *self.workers]
            raise AssertionError(f"the study did not end in {timeout:g} s; its stderr (stacks at the end):\n"
                                 + _tail(err.decode(errors="replace"))
                                 + "".join(f"\n--- {name} (stacks at the end):\n{_tail(self.output(name))}"
                                           for name in names)) from None
        assert run.returncode == 0, err.decode()

    def close(self) -> None:
        """Stop studies and workers first (a worker leaving writes a WorkerLost), then the serve
        instances (the one holding the scheduler role seals what it folded as it leaves)."""
        for held in self.tmp.glob("*.held"):
            held.unlink()  # a held worker leaves at once on SIGTERM anyway
        serves = set(self.serves.values())
        stop_all([p for p in self.procs if p not in serves])
        stop_all([p for p in self.procs if p in serves])


def role_holder(cluster: Deployment) -> str | None:
    """The serve instance holding the scheduler role by its own output (its last role line says
    "taken over"), when exactly one does; None otherwise (a hand-over in progress)."""
    holders = []
    for instance, proc in cluster.serves.items():
        lines = re.findall(r"scheduler role (taken over|given up) at", cluster.output(instance))
        if proc.poll() is None and lines and lines[-1] == "taken over":
            holders.append(instance)
    return holders[0] if len(holders) == 1 else None


def decisions(events: list[Event]) -> list[StageDispatched]:
    return [e for e in events if isinstance(e, StageDispatched)]


def assert_no_duplicate_or_conflicting_decisions(state: State, events: list[Event]) -> None:
    """Every committed StageDispatched is unique (event and dispatch id), was accepted by the
    reducer, and no worker was given a path while another of its paths was running."""
    dispatched = decisions(events)
    assert len({d.event_id for d in dispatched}) == len(dispatched)
    assert len({d.dispatch_id for d in dispatched}) == len(dispatched), sorted(d.dispatch_id for d in dispatched)
    assert set(state.dispatches) == {d.dispatch_id for d in dispatched}  # none rejected


def assert_what_must_hold_after_faults(env: dict[str, str], run: Path, embedded: Path,
                                       serve_states: list[Path]) -> None:
    """What a study must show after processes died under it (the plan itself may differ from an
    undisturbed run's in where checkpoints were taken):

    * per-trial results bit-identical to embedded mode;
    * no lost checkpoint: every checkpoint the log names, and every one the final plan holds,
      exists in the store and matches its sha256;
    * no unneeded retraining: no step of a node is in two finished stages (work lost with a dead
      worker never finished), so the steps executed are the unique steps;
    * every serve store refolds byte-identically from its own partition of the log (the records
      up to the store's offset).
    """
    result = summary_of(run)
    assert per_trial(result) == per_trial(summary_of(embedded))
    with kafka_log(env) as log:
        parts = plan_records(log)
    events: dict[str, Event] = {}
    for records in parts.values():
        for r in records:
            event = decode(r.value)
            events.setdefault(event.event_id, event)
    state, _ = kafka_state(env)
    store = open_checkpoint_store(env["STAGETREE_CHECKPOINT_STORE"], env)
    refs = {e.ref for e in events.values() if isinstance(e, CheckpointSaved)}
    held = {c.ref for plan in state.plans.values() for node in plan.nodes.values() for c in node.ckpt.values()}
    assert held <= refs
    for ref in refs:
        store.get(ref)  # exists and matches its sha256
    trained: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for e in events.values():
        if isinstance(e, StageFinished) and e.to_step > e.from_step:
            ranges = trained.setdefault((e.plan_key, e.node_id), [])
            assert all(e.to_step <= a or b <= e.from_step for a, b in ranges), (e, ranges)
            ranges.append((e.from_step, e.to_step))
    assert result["executed_steps"] == result["unique_steps"]
    for serve_state in serve_states:
        for partition, records in parts.items():
            path = serve_state / f"plan-{partition}"
            if not path.exists():
                continue  # this instance never owned the partition
            stored = ProjectionStore(path)
            try:
                records_there = stored.records()
                offset = stored.load().offset
            finally:
                stored.close()
            if not records_there:
                continue  # opened and never written: the fold of nothing
            refolded = Projector(None, dead_letters=False, partition=partition)  # type: ignore[arg-type]
            refolded.fold([r for r in records if r.offset <= offset])
            assert records_there == snapshot(refolded.state), (serve_state, partition)


def verify_deployment(env: dict[str, str]) -> str:
    """``stagetree replay verify kafka://...`` of the deployment (after its seals caught up);
    returns its output. Fails the test when it does not pass."""
    source = f"kafka://{env['STAGETREE_BOOTSTRAP_SERVERS']}/{env['STAGETREE_TOPIC_PREFIX']}{topics.PLAN}"
    cmd = [*CLI, "replay", "verify", source, "--checkpoints", env["STAGETREE_CHECKPOINT_STORE"], "--quiet"]
    deadline = time.monotonic() + 60
    while True:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode == 0 or "are not sealed" not in proc.stdout or time.monotonic() > deadline:
            break
        time.sleep(1)  # the scheduler role seals what it folded every 0.5 s
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def forget_deployment(env: dict[str, str]) -> None:
    """Delete what a test's deployment left on the shared broker and MinIO: the topics named
    with its ``STAGETREE_TOPIC_PREFIX`` and its serve instances' faust topics
    (``stagetree-<prefix>-*``), and the objects under its ``STAGETREE_CHECKPOINT_STORE``. The
    services outlive the test session, and every run of the suite would otherwise leave a few
    dozen topics and megabytes of checkpoints behind."""
    from minio import Minio

    prefix = env["STAGETREE_TOPIC_PREFIX"]
    failed = delete_topics(env["STAGETREE_BOOTSTRAP_SERVERS"], prefix, f"stagetree-{prefix.strip('.')}-")
    assert not failed, failed
    bucket, _, key_prefix = env["STAGETREE_CHECKPOINT_STORE"].removeprefix("s3://").partition("/")
    assert key_prefix, "a test's checkpoint store is a prefix of the shared bucket, never all of it"
    remove_prefix(Minio(env["STAGETREE_S3_ENDPOINT"], access_key=env["STAGETREE_S3_ACCESS_KEY"],
                        secret_key=env["STAGETREE_S3_SECRET_KEY"], secure=False), bucket, key_prefix)


def delete_topics(bootstrap: str, *prefixes: str) -> list[str]:
    """Delete every topic whose name starts with one of ``prefixes`` from the broker at
    ``bootstrap`` (:meth:`KafkaLog.delete_topics`); a line for each one that failed."""
    from events.kafka_log import KafkaLog

    with KafkaLog(bootstrap, client_id="stagetree-test-cleanup", create_topics=False) as log:
        return log.delete_topics(*prefixes)


def infra_bucket(env: dict[str, str]) -> str:
    """The bucket of the deployment's checkpoint store (``s3://BUCKET/...``)."""
    return env["STAGETREE_CHECKPOINT_STORE"].removeprefix("s3://").partition("/")[0]


def remove_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix/`` of ``bucket`` through the minio ``client``; raises
    when one could not be deleted."""
    from minio.deleteobjects import DeleteObject

    listed = client.list_objects(bucket, prefix=f"{prefix}/", recursive=True)
    failed = list(client.remove_objects(bucket, [DeleteObject(o.object_name) for o in listed]))
    assert not failed, failed[:3]
