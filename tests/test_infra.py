"""The local infrastructure of Kafka mode, tested against the real services (no mocks).

The session fixture runs ``infra/up.sh`` (what ``make infra-up`` runs), so
``make test`` needs nothing started beforehand: the first run builds MinIO from
source (several minutes; hence the long timeout of this module), later runs
start the cached broker and server in seconds, and a running pair is reused.
The services stay up afterwards (``make infra-down`` stops them).

What is shown here:

* Kafka 3.9.2 (KRaft) on 127.0.0.1:9092 takes topics with explicit partition
  counts and round-trips keyed messages with **confluent-kafka** (librdkafka)
  **and with aiokafka** (faust-streaming's driver), across clients in both
  directions; a key lands on the same partition from both when confluent-kafka
  uses the Java-compatible ``murmur2_random`` partitioner. A faust-streaming
  app folds a keyed stream into a table on the same broker.
* MinIO on 127.0.0.1:9000 stores and returns an object through the ``minio``
  client with the credentials of ``.infra/env`` and refuses wrong ones.
* ``.infra/env`` is complete, private (0600), ignored by git, and the secrets
  never appear in the scripts' output.
* ``infra/compose.yaml`` (not run here: no Docker engine) parses and describes
  the cluster without secret literals or non-loopback host ports.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shlex
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".infra"
ENV_FILE = STATE / "env"
COMPOSE = ROOT / "infra" / "compose.yaml"
OTEL_CONFIG = ROOT / "infra" / "otel-collector.yaml"
DOCKERFILE = ROOT / "infra" / "stagetree.Dockerfile"

# The first infra/up.sh builds MinIO from source; on 2 cores that takes many minutes.
pytestmark = pytest.mark.timeout(3600)

ENV_KEYS = (
    "STAGETREE_BOOTSTRAP_SERVERS",
    "STAGETREE_CHECKPOINT_STORE",
    "STAGETREE_S3_ENDPOINT",
    "STAGETREE_S3_ACCESS_KEY",
    "STAGETREE_S3_SECRET_KEY",
)


def _service_running(pid_file: Path, marker: str) -> bool:
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return False
    return marker in cmdline


def _running() -> dict[str, bool]:
    return {
        "kafka": _service_running(STATE / "kafka.pid", "kafka.Kafka"),
        "minio": _service_running(STATE / "minio.pid", "minio server"),
    }


def _run_script(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    """Parse the ``export KEY=VALUE`` lines of ``.infra/env`` (shell quoting) into a dict."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        assert words[0] == "export" and len(words) == 2 and "=" in words[1], f"not an export line: {line.split('=')[0]}"
        key, value = words[1].split("=", 1)
        env[key] = value
    return env


@pytest.fixture(scope="session")
def infra():
    """Start (or reuse) the local Kafka and MinIO; the variables of ``.infra/env`` and the script output.

    The services are left running for later tests and runs, like the other Kafka/MinIO fixtures
    (``make infra-down`` stops them)."""
    started = time.monotonic()
    proc = _run_script("infra/up.sh")
    if proc.returncode != 0:
        pytest.fail(f"infra/up.sh failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    env = read_env_file()
    env["_up_output"] = proc.stdout + proc.stderr
    env["_up_seconds"] = f"{time.monotonic() - started:.1f}"
    return env


@pytest.fixture
def topic_name():
    return f"stagetree.test.infra.{uuid.uuid4().hex[:12]}"


def _admin(bootstrap: str):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import NewTopic

    admin = _admin(bootstrap)  # keep the handle alive until the future resolves
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    futures[topic].result(timeout=30)


def _delete_topic(bootstrap: str, topic: str) -> None:
    admin = _admin(bootstrap)
    futures = admin.delete_topics([topic])
    futures[topic].result(timeout=30)


def _partition_count(bootstrap: str, topic: str) -> int:
    md = _admin(bootstrap).list_topics(topic, timeout=10)
    assert md.topics[topic].error is None, md.topics[topic].error
    return len(md.topics[topic].partitions)


def _confluent_produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> list[tuple[int, int]]:
    """Produce (key, value) records idempotently with acks=all; returns (partition, offset) of each, in order."""
    from confluent_kafka import Producer

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            # The Java client's partitioner, which aiokafka (faust) also uses: a key maps to the
            # same partition whichever client writes it. librdkafka's default (consistent_random,
            # CRC32) would not.
            "partitioner": "murmur2_random",
        }
    )
    delivered: list = [None] * len(records)

    def report(i):
        def cb(err, msg):
            delivered[i] = err if err is not None else (msg.partition(), msg.offset())

        return cb

    for i, (key, value) in enumerate(records):
        producer.produce(topic, key=key, value=value, on_delivery=report(i))
    assert producer.flush(30) == 0, "confluent-kafka: messages still undelivered after 30 s"
    for d in delivered:
        assert isinstance(d, tuple), f"confluent-kafka delivery failed: {d}"
    return delivered


def _confluent_consume(bootstrap: str, topic: str, count: int, timeout_s: float = 30) -> list:
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"stagetree-test-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append((msg.key(), msg.value(), msg.partition(), msg.offset()))
        if out:
            consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return out


async def _aiokafka_produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> list[tuple[int, int]]:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        out = []
        for key, value in records:
            meta = await producer.send_and_wait(topic, key=key, value=value)
            out.append((meta.partition, meta.offset))
        return out
    finally:
        await producer.stop()


async def _aiokafka_consume(bootstrap: str, topic: str, count: int, timeout_s: float = 30) -> list:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"stagetree-test-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=1000)
            for tp, msgs in batches.items():
                out.extend((m.key, m.value, tp.partition, m.offset) for m in msgs)
        if out:
            await consumer.commit()
    finally:
        await consumer.stop()
    return out


# ---------------------------------------------------------------- .infra/env and the scripts


def test_env_file_is_complete_private_and_ignored(infra):
    for key in ENV_KEYS:
        assert infra.get(key), f".infra/env lacks {key}"
    assert infra["STAGETREE_BOOTSTRAP_SERVERS"] == "127.0.0.1:9092"
    assert infra["STAGETREE_CHECKPOINT_STORE"] == "s3://stagetree/checkpoints"
    assert infra["STAGETREE_S3_ENDPOINT"] == "127.0.0.1:9000"
    assert len(infra["STAGETREE_S3_SECRET_KEY"]) >= 32
    mode = stat.S_IMODE(ENV_FILE.stat().st_mode)
    assert mode & 0o077 == 0, f".infra/env is readable by others (mode {oct(mode)})"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(ENV_FILE)], cwd=ROOT)
    assert ignored.returncode == 0, ".infra/env is not ignored by git"
    # A shell can source it.
    out = subprocess.run(
        ["bash", "-c", '. "$1" && test -n "$STAGETREE_S3_SECRET_KEY" && echo "$STAGETREE_BOOTSTRAP_SERVERS"', "-",
         str(ENV_FILE)],
        capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
    )
    assert out.returncode == 0 and out.stdout.strip() == "127.0.0.1:9092", out.stderr


def test_secrets_never_printed(infra):
    for key in ("STAGETREE_S3_ACCESS_KEY", "STAGETREE_S3_SECRET_KEY"):
        assert infra[key] not in infra["_up_output"], f"infra/up.sh printed {key}"
    for log in ("minio.log", "kafka.log"):
        path = STATE / log
        if path.exists():
            assert infra["STAGETREE_S3_SECRET_KEY"] not in path.read_text(errors="replace"), f"{log} holds the secret"


def test_up_is_idempotent(infra):
    assert _running() == {"kafka": True, "minio": True}
    pids = {name: (STATE / f"{name}.pid").read_text().strip() for name in ("kafka", "minio")}
    proc = _run_script("infra/up.sh", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "kafka already running" in proc.stdout and "minio already running" in proc.stdout, proc.stdout
    assert {name: (STATE / f"{name}.pid").read_text().strip() for name in pids} == pids
    assert read_env_file()["STAGETREE_S3_SECRET_KEY"] == infra["STAGETREE_S3_SECRET_KEY"], "credentials changed"


# ---------------------------------------------------------------- Kafka: confluent-kafka and aiokafka


def test_confluent_kafka_keyed_roundtrip(infra, topic_name):
    bootstrap = infra["STAGETREE_BOOTSTRAP_SERVERS"]
    _create_topic(bootstrap, topic_name, partitions=3)
    try:
        assert _partition_count(bootstrap, topic_name) == 3
        records = [(b"plan-key-a", b"event-%d" % i) for i in range(5)] + [(b"plan-key-b", b"other")]
        delivered = _confluent_produce(bootstrap, topic_name, records)
        # One key, one partition, in order.
        a_parts = {p for p, _ in delivered[:5]}
        assert len(a_parts) == 1
        assert [o for _, o in delivered[:5]] == sorted(o for _, o in delivered[:5])

        got = _confluent_consume(bootstrap, topic_name, len(records))
        assert sorted(got) == sorted((k, v, p, o) for (k, v), (p, o) in zip(records, delivered))
        a_values = [v for k, v, _, _ in got if k == b"plan-key-a"]
        assert a_values == [b"event-%d" % i for i in range(5)]
    finally:
        _delete_topic(bootstrap, topic_name)


def test_aiokafka_keyed_roundtrip_and_cross_client(infra, topic_name):
    """faust-streaming's driver (aiokafka) creates, produces and consumes on the same broker, and
    reads what confluent-kafka wrote (and the other way round); both put a key on one partition."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    bootstrap = infra["STAGETREE_BOOTSTRAP_SERVERS"]

    async def scenario():
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic_name, num_partitions=4, replication_factor=1)])
        finally:
            await admin.close()

        records = [(b"plan-key-a", b"aio-%d" % i) for i in range(3)] + [(b"plan-key-b", b"aio-b")]
        aio_delivered = await _aiokafka_produce(bootstrap, topic_name, records)
        got = await _aiokafka_consume(bootstrap, topic_name, len(records))
        return records, aio_delivered, got

    try:
        records, aio_delivered, got = asyncio.run(scenario())
        assert _partition_count(bootstrap, topic_name) == 4
        assert sorted(got) == sorted((k, v, p, o) for (k, v), (p, o) in zip(records, aio_delivered))
        assert [v for k, v, _, _ in got if k == b"plan-key-a"] == [b"aio-0", b"aio-1", b"aio-2"]

        # Cross-client: confluent-kafka writes the same keys; they land on aiokafka's partitions.
        conf_records = [(b"plan-key-a", b"conf-a"), (b"plan-key-b", b"conf-b")]
        conf_delivered = _confluent_produce(bootstrap, topic_name, conf_records)
        aio_partition = {k: p for (k, _), (p, _) in zip(records, aio_delivered)}
        assert [p for p, _ in conf_delivered] == [aio_partition[b"plan-key-a"], aio_partition[b"plan-key-b"]]

        # aiokafka reads confluent-kafka's records, confluent-kafka reads aiokafka's.
        all_values = {v for _, v in records + conf_records}
        aio_read = asyncio.run(_aiokafka_consume(bootstrap, topic_name, len(all_values)))
        conf_read = _confluent_consume(bootstrap, topic_name, len(all_values))
        assert {v for _, v, _, _ in aio_read} == all_values
        assert {v for _, v, _, _ in conf_read} == all_values
    finally:
        _delete_topic(bootstrap, topic_name)


def test_broker_refuses_undeclared_topics(infra):
    """auto.create.topics.enable=false: every topic is created with an explicit partition count."""
    from confluent_kafka import KafkaError, Producer

    bootstrap = infra["STAGETREE_BOOTSTRAP_SERVERS"]
    producer = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 3000})
    errors = []
    producer.produce(f"stagetree.test.undeclared.{uuid.uuid4().hex[:8]}", b"x",
                     on_delivery=lambda err, msg: errors.append(err))
    producer.flush(10)
    assert errors and errors[0] is not None
    expected = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._MSG_TIMED_OUT, KafkaError._UNKNOWN_TOPIC}
    assert errors[0].code() in expected, errors[0]


FAUST_SMOKE_APP = """
import os
import faust

bootstrap, topic, app_id, datadir = (os.environ[f"SMOKE_{k}"] for k in ("BOOTSTRAP", "TOPIC", "APP_ID", "DATADIR"))
app = faust.App(app_id, broker=f"kafka://{bootstrap}", web_enabled=False, datadir=datadir, store="memory://")
events = app.topic(topic, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw", partitions=2)
# A table: faust declares its changelog topic itself (the broker auto-creates nothing).
counts = app.Table("counts", default=int, partitions=2, key_type=bytes)
seen = []

@app.agent(events)
async def fold(stream):
    async for key, value in stream.items():
        counts[key] += 1
        seen.append(value)
        if len(seen) == 3:
            print(f"FOLDED {counts[key]} {b','.join(seen).decode()}", flush=True)
            os._exit(0)

@app.task
async def produce():
    for i in range(3):
        await events.send(key=b"plan-key-a", value=b"v%d" % i)

app.main()
"""


def test_faust_app_folds_a_keyed_stream(infra, topic_name, tmp_path):
    """A faust-streaming app (aiokafka driver) on this broker: an agent folds keyed records into a
    table whose changelog topic faust declares itself."""
    import sys

    bootstrap = infra["STAGETREE_BOOTSTRAP_SERVERS"]
    _create_topic(bootstrap, topic_name, partitions=2)
    app_file = tmp_path / "smoke_app.py"
    app_file.write_text(FAUST_SMOKE_APP)
    app_id = f"stagetree-infra-smoke-{uuid.uuid4().hex[:8]}"
    try:
        env = dict(os.environ, SMOKE_BOOTSTRAP=bootstrap, SMOKE_TOPIC=topic_name, SMOKE_APP_ID=app_id,
                   SMOKE_DATADIR=str(tmp_path / "data"))
        proc = subprocess.run(
            [sys.executable, str(app_file), "worker", "-l", "warn"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )
        assert "FOLDED 3 v0,v1,v2" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
        changelog = f"{app_id}-counts-changelog"
        assert _partition_count(bootstrap, changelog) == 2
    finally:
        _delete_topic(bootstrap, topic_name)
        for extra in (f"{app_id}-counts-changelog", f"{app_id}-__assignor-__leader"):
            try:
                _delete_topic(bootstrap, extra)
            except Exception:
                pass


# ---------------------------------------------------------------- MinIO


def _minio(infra, secret: str | None = None):
    from minio import Minio

    return Minio(
        infra["STAGETREE_S3_ENDPOINT"],
        access_key=infra["STAGETREE_S3_ACCESS_KEY"],
        secret_key=secret if secret is not None else infra["STAGETREE_S3_SECRET_KEY"],
        secure=False,
    )


def test_minio_put_get_object(infra):
    bucket, prefix = re.fullmatch(r"s3://([^/]+)/(.+)", infra["STAGETREE_CHECKPOINT_STORE"]).groups()
    client = _minio(infra)
    assert client.bucket_exists(bucket), f"infra/up.sh did not create bucket {bucket}"
    data = os.urandom(256 * 1024) + b"stagetree"
    name = f"{prefix}/test-infra/{uuid.uuid4().hex}"
    client.put_object(bucket, name, io.BytesIO(data), length=len(data), content_type="application/octet-stream")
    try:
        assert client.stat_object(bucket, name).size == len(data)
        resp = client.get_object(bucket, name)
        try:
            assert resp.read() == data
        finally:
            resp.close()
            resp.release_conn()
    finally:
        client.remove_object(bucket, name)


def test_minio_rejects_wrong_credentials(infra):
    from minio.error import S3Error

    with pytest.raises(S3Error) as err:
        _minio(infra, secret="not-the-secret-" + uuid.uuid4().hex).list_buckets()
    assert err.value.code in {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}


# ---------------------------------------------------------------- compose.yaml (linted, not run)


def _yaml(path: Path):
    import yaml  # a test dependency: a missing one must fail, not skip
    return yaml.safe_load(path.read_text())


SECRET_NAME = re.compile(r"(PASSWORD|SECRET|ACCESS_KEY|TOKEN|ROOT_USER|CREDENTIAL)", re.I)
# "secret_key = 'abc123...'" style literals; values read from ${VAR} or os.environ are fine.
SECRET_LITERAL = re.compile(
    r"(?i)(password|secret[_-]?key|access[_-]?key)\s*[=:]\s*[\"']?(?!\$\{|os\.environ)[^\s\"',)]{6,}"
)
VAR_REF = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*(:?[-?][^}]*)?\}$")


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def test_compose_describes_the_cluster():
    compose = _yaml(COMPOSE)
    services = compose["services"]
    assert {"kafka", "minio", "otel-collector", "projector", "scheduler", "worker"} <= set(services)

    # Same versions as the local services.
    kafka_version = re.search(r"<kafka.version>([^<]+)<", (ROOT / "infra/kafka/pom.xml").read_text()).group(1)
    assert services["kafka"]["image"].endswith(f":{kafka_version}")
    kafka_env = _environment(services["kafka"])
    assert "broker" in kafka_env["KAFKA_PROCESS_ROLES"] and "controller" in kafka_env["KAFKA_PROCESS_ROLES"]
    up_sh = (ROOT / "infra/up.sh").read_text()
    minio_pin = re.search(r"^MINIO_VERSION=(\S+)$", up_sh, re.M).group(1)
    minio_build = services["minio"]["build"]
    assert minio_build["args"]["MINIO_VERSION"] == minio_pin

    # The image's torch is the oldest pyproject.toml allows: the one `make test-oldest-torch` tests.
    image_torch = re.search(r"^FROM pytorch/pytorch:(\d+\.\d+)\.\d+-", DOCKERFILE.read_text(), re.M).group(1)
    floor = re.search(r'"torch>=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert image_torch == floor
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^OLDEST_TORCH\s*:?=\s*{re.escape(floor)}\.\d+$", makefile, re.M)
    # ...with the same pins as that target: constraints.txt less what the image's torch brings
    leave_out = re.compile(r"grep -v -E '(\^\([^']+\)=)' constraints\.txt")
    image_pins = leave_out.search(DOCKERFILE.read_text())
    assert image_pins and image_pins.group(1) == leave_out.search(makefile).group(1)
    assert re.search(r"pip install [^\n]*-c /tmp/constraints\.txt \.", DOCKERFILE.read_text())

    for name in ("projector", "scheduler"):
        assert services[name]["command"][:2] == ["stagetree", "serve"], name
    worker = services["worker"]
    cmd = worker["command"]
    assert cmd[:2] == ["stagetree", "worker"]
    for flag in ("--bootstrap-servers", "--checkpoint-store", "--device"):
        assert flag in cmd, f"worker command lacks {flag}"
    assert cmd[cmd.index("--checkpoint-store") + 1].startswith(("s3://", "${"))
    assert cmd[cmd.index("--device") + 1] in {"cuda:0", "${STAGETREE_DEVICE:-cuda:0}"}
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices), "workers reserve no GPU"

    # The collector mounts infra/otel-collector.yaml, which defines a working pipeline.
    otel = services["otel-collector"]
    assert any("otel-collector.yaml" in str(v) for v in otel.get("volumes", []))
    otel_config = _yaml(OTEL_CONFIG)
    pipelines = otel_config["service"]["pipelines"]
    assert "traces" in pipelines and "otlp" in pipelines["traces"]["receivers"]
    for pipeline in pipelines.values():
        for part in ("receivers", "processors", "exporters"):
            for ref in pipeline.get(part, []):
                assert ref in otel_config[part], f"pipeline references undefined {part[:-1]} {ref}"


def test_compose_has_no_secret_literals_and_loopback_ports():
    compose = _yaml(COMPOSE)
    for name, service in compose["services"].items():
        for key, value in _environment(service).items():
            if SECRET_NAME.search(key):
                assert VAR_REF.match(value), f"{name}: {key} must come from a variable, not a literal"
                assert ":-" not in value, f"{name}: {key} must not have a default value"
        for text in map(str, service.get("command") or []):
            assert not SECRET_LITERAL.search(text), f"{name}: command holds a secret literal"
        for port in service.get("ports", []):
            spec = port if isinstance(port, str) else \
                f"{port.get('host_ip', '')}:{port.get('published', '')}:{port.get('target', '')}"
            host_ip = spec.rsplit(":", 2)[0] if spec.count(":") >= 2 else ""
            assert host_ip in {"127.0.0.1", "${STAGETREE_BIND_ADDRESS:-127.0.0.1}"}, (
                f"{name}: port {spec} is published on all interfaces; bind it to 127.0.0.1 by default"
            )
    # No secret-looking literal anywhere in the file (keys of .infra/env, for one).
    text = COMPOSE.read_text()
    if ENV_FILE.exists():
        env = read_env_file()
        for key in ("STAGETREE_S3_ACCESS_KEY", "STAGETREE_S3_SECRET_KEY"):
            assert env[key] not in text, f"compose.yaml holds the value of {key}"


def test_make_test_floors_pins_every_dependency_at_its_floor():
    """`make test-floors` installs every dependency pyproject.toml lists at the lowest version it
    allows (torch at the Makefile's OLDEST_TORCH): the constraints tests/floors.py writes."""
    from floors import floors

    pyproject = (ROOT / "pyproject.toml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^OLDEST_TORCH\s*:?=\s*(\S+)$", makefile, re.M).group(1)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "floors.py"), f"torch={oldest}"],
                         capture_output=True, text=True, check=True).stdout
    pins = dict(line.split("==") for line in out.splitlines())
    declared = re.findall(r'^\s*"([A-Za-z0-9._-]+)>=([^",;]+)', pyproject.split("[project.optional-dependencies]")[0],
                          re.M)
    assert pins == {name: (oldest if name == "torch" else floor) for name, floor in declared}
    assert {"pydantic", "torch", "faust-streaming", "confluent-kafka", "minio", "rocksdict"} <= set(pins)
    assert re.search(r"^test-floors:", makefile, re.M)
    assert "tests/floors.py torch=$(OLDEST_TORCH) > .venv-floors/constraints.txt" in makefile
    assert "-c .venv-floors/constraints.txt" in makefile

    with pytest.raises(ValueError, match="'numpy' names no floor"):
        floors('[project]\ndependencies = ["orjson>=3.9", "numpy"]\n')
    with pytest.raises(ValueError, match="override 'torhc' names no dependency"):
        floors('[project]\ndependencies = ["torch>=2.5"]\n', {"torhc": "2.5.1"})
    assert floors('[project]\ndependencies = ["optuna>=4.7,<6", "torch>=2.5"]\n', {"torch": "2.5.1"}) == {
        "optuna": "4.7", "torch": "2.5.1"}
    bad = subprocess.run([sys.executable, str(ROOT / "tests" / "floors.py"), "torch"], capture_output=True, text=True)
    assert bad.returncode == 2 and "NAME=VERSION, got 'torch'" in bad.stderr
