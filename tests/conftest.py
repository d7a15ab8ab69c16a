"""Shared fixtures: the local Kafka broker and MinIO server, started by the project's own script."""

from __future__ import annotations

import shlex
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from gpu_worker.object_store import S3CheckpointStore

REPO = Path(__file__).resolve().parents[1]

# No per-example deadline for any property test: on a loaded machine (CI shares 2 cores) one
# slow example would otherwise fail a test as "Flaky" for its timing alone. Speed is measured
# by benchmarks/, never by tests.
settings.register_profile("stagetree", deadline=None)
settings.load_profile("stagetree")


# The files that take minutes, longest first (their seconds in one process on 2 cores, 2026-12-06:
# 523, 230, 195, 153, 129; the other 40 files take 560 together). `make test` runs two files at a
# time (pytest-xdist, `--dist loadfile`), handing them out in the order collected: these start
# first, so the two processes end together rather than one running test_kafka_cluster alone at
# the end. Tests of a file keep their order; the other files keep theirs, after these.
SLOW_FILES = ("test_kafka_cluster.py", "test_bad_input.py", "test_kafka_e2e.py", "test_e2e.py", "test_dashboard.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # a stable sort


def _names_a_deployment(name: str) -> bool:
    return name in ("STAGETREE_BOOTSTRAP_SERVERS", "STAGETREE_CHECKPOINT_STORE", "STAGETREE_TOPIC_PREFIX") \
        or name.startswith(("STAGETREE_S3_", "STAGETREE_KAFKA_"))


@pytest.fixture(scope="session", autouse=True)
def _no_deployment_from_the_shell() -> Iterator[None]:
    """Take the variables that name a deployment (``.infra/env``'s, the topic prefix, Kafka's
    security settings) out of this process's environment for the session: each test chooses
    embedded mode or a deployment itself (:func:`deployment`). A shell that sourced
    ``.infra/env`` would otherwise send every ``stagetree run`` the suite starts as embedded to
    the broker instead."""
    import os

    taken = {name: os.environ.pop(name) for name in list(os.environ) if _names_a_deployment(name)}
    yield
    os.environ.update(taken)


@pytest.fixture(scope="session")
def infra_env() -> dict[str, str]:
    """Start (or reuse) Kafka and MinIO with ``infra/up.sh``; the variables of ``.infra/env``.

    The first run on a machine builds MinIO from source (minutes). Services stay running
    (``make infra-down`` stops them). Values are secrets: never print them.
    """
    proc = subprocess.run(["bash", "infra/up.sh"], cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        pytest.fail(f"infra/up.sh failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    env = {}
    for line in (REPO / ".infra" / "env").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            env[name] = value
    return env


# ---------------------------------------------------------------------- MinIO


@pytest.fixture(scope="session")
def minio_env(infra_env: dict[str, str]) -> dict[str, str]:
    """The variables of ``.infra/env`` (the session's ``infra_env``), checked for MinIO use."""
    env = infra_env
    for name in ("STAGETREE_S3_ENDPOINT", "STAGETREE_S3_ACCESS_KEY", "STAGETREE_S3_SECRET_KEY"):
        assert env.get(name), f"{name} missing from .infra/env"
    host = env["STAGETREE_S3_ENDPOINT"].rpartition(":")[0]
    assert host == "127.0.0.1", "tests only ever talk to a MinIO on 127.0.0.1"
    assert env["STAGETREE_CHECKPOINT_STORE"].startswith("s3://")
    return env


@pytest.fixture(scope="session")
def minio_client(minio_env: dict[str, str]) -> Any:
    """A plain minio client, to look at and tamper with objects behind the store's back."""
    from minio import Minio

    return Minio(
        minio_env["STAGETREE_S3_ENDPOINT"],
        access_key=minio_env["STAGETREE_S3_ACCESS_KEY"],
        secret_key=minio_env["STAGETREE_S3_SECRET_KEY"],
        secure=False,
    )


@pytest.fixture
def minio_store_factory(
    minio_env: dict[str, str], minio_client: Any
) -> Iterator[Callable[[], S3CheckpointStore]]:
    """Opens S3 stores on the infra bucket, each under a fresh prefix that is removed afterwards."""
    from kafka_cluster import infra_bucket, remove_prefix

    from gpu_worker.object_store import S3CheckpointStore, open_checkpoint_store

    bucket = infra_bucket(minio_env)
    prefixes: list[str] = []

    def make() -> S3CheckpointStore:
        prefix = f"test-checkpoint-store/{uuid.uuid4().hex}"
        prefixes.append(prefix)
        store = open_checkpoint_store(f"s3://{bucket}/{prefix}", minio_env)
        assert isinstance(store, S3CheckpointStore)
        return store

    yield make
    for prefix in prefixes:
        remove_prefix(minio_client, bucket, prefix)


TINY = REPO / "tests" / "studies" / "tiny_sha.py"


@pytest.fixture(scope="session")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/studies/tiny_sha.py run in embedded mode with 2 workers, once per session: the
    reference every Kafka-mode run of it is compared with, trial by trial."""
    import sys

    out = tmp_path_factory.mktemp("embedded") / "run"
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(TINY), "--workers", "2", "--out",
                           str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def deployment(infra_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Environment of a fresh Kafka deployment: its own topics and checkpoint prefix on the
    shared services, deleted after the test (:func:`forget_deployment`)."""
    import os
    import uuid

    tag = uuid.uuid4().hex[:10]
    env = {**os.environ, **infra_env, "STAGETREE_TOPIC_PREFIX": f"test-{tag}.",
           "STAGETREE_CHECKPOINT_STORE": f"s3://stagetree/test-{tag}"}
    yield env
    from kafka_cluster import forget_deployment

    forget_deployment(env)


@pytest.fixture(scope="session")
def wsd_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``examples/wsd_cooldown.py`` at its test size (``WSD_SIZE=test``) run with ``stagetree run``
    on 2 workers, merged and ``--no-merge``: ``{"merged": run dir, "trial": run dir}``. Shared by
    the example's tests and the tracker exports' (about 35 s on 2 cores)."""
    import os
    import sys

    out = {}
    env = {**os.environ, "WSD_SIZE": "test"}
    for mode, flags in (("merged", []), ("trial", ["--no-merge"])):
        run = tmp_path_factory.mktemp(f"wsd-{mode}") / "run"
        proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(REPO / "examples" / "wsd_cooldown.py"),
                               "--workers", "2", "--out", str(run), "--quiet", *flags],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"stagetree run of the WSD example ({mode}) failed:\n{proc.stdout}\n{proc.stderr}",
                        pytrace=False)
        out[mode] = run
    return out
