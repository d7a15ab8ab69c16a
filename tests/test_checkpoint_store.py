"""Checkpoint stores (local directory and MinIO) and the checkpoint byte encoding.

DESIGN.md invariant 4 ("nothing is lost"): a checkpoint object is written and
verified (sha256) before ``put`` returns, so CheckpointSaved is only published
for verified objects; a corrupt object is detected on ``get`` and repaired by
the next ``put``. One contract suite runs over both backends ("local",
"minio"); the MinIO backend is the real server started by ``infra/up.sh``
(issue 3: tests against real MinIO, not mocks), each test under its own
prefix, removed afterwards.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import itertools
import logging
import os
import pickle
import socket
import sys
import threading
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import urllib3
from kafka_cluster import infra_bucket

from gpu_worker import object_store
from gpu_worker.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMissing,
    CheckpointRef,
    CheckpointStore,
    HeldState,
    LoadedBytes,
    LocalCheckpointStore,
    SnapshotBuffers,
    StorageError,
    decode_state,
    encode_state,
    file_sha256,
    snapshot_state,
    state_bytes,
    write_state,
)
from gpu_worker.object_store import (
    GET_CONCURRENCY,
    PUT_CONCURRENCY,
    CheckpointStoreError,
    S3CheckpointStore,
    _content_length,
    _object_size,
    open_checkpoint_store,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits.py"


class Opaque:
    """A class that ``torch.load(weights_only=True)`` refuses to rebuild."""


def all_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def flip_middle_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    return bytes(flipped)


# ---------------------------------------------------------------------- MinIO helpers (fixtures: conftest.py)


def remove_bucket(client: Any, bucket: str) -> None:
    if client.bucket_exists(bucket):
        for item in client.list_objects(bucket, recursive=True):
            client.remove_object(bucket, item.object_name)
        client.remove_bucket(bucket)


# ---------------------------------------------------------------------- the contract suite


@dataclass
class Backend:
    """A store under test plus raw access to its objects, bypassing the store."""

    name: str
    store: Any
    read_raw: Callable[[str], bytes]
    write_raw: Callable[[str, bytes], None]
    location: Callable[[str], str]
    absent_store: Callable[[], Any]
    writes: list[str] = field(default_factory=list)
    sabotage: list[bool] = field(default_factory=lambda: [False])
    reads: list[str] = field(default_factory=list)  # MinIO: the store's GETs
    store_checks: list[bool] = field(default_factory=lambda: [True])  # MinIO: the PUT's sha256 reaches it


def local_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
    store = LocalCheckpointStore(tmp_path / "store")
    backend = Backend(
        name="local",
        store=store,
        read_raw=lambda ref: store.path(ref).read_bytes(),
        write_raw=lambda ref, data: store.path(ref).write_bytes(data),
        location=lambda ref: str(store.path(ref).relative_to(tmp_path / "store")),
        absent_store=lambda: LocalCheckpointStore(tmp_path / "absent"),
    )
    real_replace = os.replace

    def counting_replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        backend.writes.append(str(dst))
        if backend.sabotage[0]:
            Path(dst).write_bytes(flip_middle_byte(Path(dst).read_bytes()))

    monkeypatch.setattr(os, "replace", counting_replace)
    return backend


def minio_backend(
    factory: Callable[[], S3CheckpointStore],
    client: Any,
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    cleanup: list[str],
) -> Backend:
    store = factory()

    def read_raw(ref: str) -> bytes:
        response = client.get_object(store.bucket, store.key(ref))
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def write_raw(ref: str, data: bytes) -> None:
        client.put_object(store.bucket, store.key(ref), io.BytesIO(data), len(data))

    def absent_store() -> S3CheckpointStore:
        bucket = f"stagetree-absent-{uuid.uuid4().hex[:12]}"
        cleanup.append(bucket)
        absent = open_checkpoint_store(f"s3://{bucket}/x", env)
        assert isinstance(absent, S3CheckpointStore)
        return absent

    backend = Backend(
        name="minio",
        store=store,
        read_raw=read_raw,
        write_raw=write_raw,
        location=store.key,
        absent_store=absent_store,
    )
    real_put = store._client.put_object
    real_get = store._client.get_object

    def counting_put(bucket: str, key: str, data: Any, length: int, **kwargs: Any) -> Any:
        """The minio client's put_object, counted; ``sabotage``: a byte of the body flips on its
        way (the checksum the store checks stays); ``store_checks`` off: as a store without S3
        checksums (none is sent, so the reply confirms none)."""
        backend.writes.append(key)
        if not backend.store_checks[0]:
            kwargs["metadata"] = {k: v for k, v in kwargs["metadata"].items() if k != "x-amz-checksum-sha256"}
        if backend.sabotage[0]:
            body = flip_middle_byte(data.read())
            return real_put(bucket, key, io.BytesIO(body), len(body), **kwargs)
        return real_put(bucket, key, data, length, **kwargs)

    def counting_get(bucket: str, key: str, *args: Any, **kwargs: Any) -> Any:
        backend.reads.append(key)
        return real_get(bucket, key, *args, **kwargs)

    monkeypatch.setattr(store._client, "put_object", counting_put)
    monkeypatch.setattr(store._client, "get_object", counting_get)
    return backend


@pytest.fixture(params=["local", "minio"])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    if request.param == "local":
        yield local_backend(tmp_path, monkeypatch)
        return
    factory = request.getfixturevalue("minio_store_factory")
    client = request.getfixturevalue("minio_client")
    env = request.getfixturevalue("minio_env")
    buckets: list[str] = []
    yield minio_backend(factory, client, env, monkeypatch, buckets)
    for bucket in buckets:
        assert not client.bucket_exists(bucket), "reading an absent bucket must not create it"
        remove_bucket(client, bucket)


def test_put_get_round_trip(backend: Backend) -> None:
    store = backend.store
    assert isinstance(store, CheckpointStore)
    data = os.urandom(100_000)
    ref = store.put(data)
    digest = hashlib.sha256(data).hexdigest()
    assert ref == CheckpointRef(ref=digest, size=100_000)
    assert store.exists(ref.ref)
    assert store.get(ref.ref) == data
    assert backend.location(ref.ref).endswith(f"{digest[:2]}/{digest}")
    assert backend.read_raw(ref.ref) == data
    empty = store.put(b"")
    assert empty == CheckpointRef(ref=hashlib.sha256(b"").hexdigest(), size=0)
    assert store.get(empty.ref) == b""


def test_large_object_round_trip(backend: Backend) -> None:
    """12 MiB: above MinIO's 5 MiB part size, so the S3 upload is multipart."""
    data = os.urandom(12 * 2**20)
    ref = backend.store.put(data)
    assert ref.size == len(data)
    assert backend.store.get(ref.ref) == data


def test_same_bytes_same_ref_and_a_second_put_is_a_no_op(backend: Backend) -> None:
    store = backend.store
    first = store.put(b"same bytes")
    assert len(backend.writes) == 1
    second = store.put(b"same bytes")
    assert second == first
    assert len(backend.writes) == 1, "a second put of intact bytes must not write again"
    other = store.put(b"other bytes")
    assert other.ref != first.ref
    assert len(backend.writes) == 2


def test_missing_object_raises_and_delete_is_idempotent(backend: Backend) -> None:
    store = backend.store
    ref = store.put(b"to be deleted").ref
    store.delete(ref)
    assert not store.exists(ref)
    with pytest.raises(CheckpointMissing) as caught:
        store.get(ref)
    assert caught.value.ref == ref
    assert isinstance(caught.value, CheckpointError)
    store.delete(ref)
    never = hashlib.sha256(b"never stored").hexdigest()
    assert not store.exists(never)
    with pytest.raises(CheckpointMissing):
        store.get(never)


def test_absent_location_reads_as_missing_and_is_not_created(backend: Backend) -> None:
    """A store whose directory (or bucket) does not exist: missing, not an error."""
    absent = backend.absent_store()
    ref = hashlib.sha256(b"x").hexdigest()
    assert not absent.exists(ref)
    with pytest.raises(CheckpointMissing):
        absent.get(ref)
    absent.delete(ref)
    assert not absent.exists(ref)


@pytest.mark.parametrize("damage", ["flip", "truncate", "replace"])
def test_corrupted_object_raises_on_get_and_put_repairs_it(backend: Backend, damage: str) -> None:
    store = backend.store
    data = encode_state({"weights": torch.arange(1000, dtype=torch.float32)})
    ref = store.put(data).ref
    bad = {
        "flip": flip_middle_byte(data),  # same size: only the hash can tell
        "truncate": data[: len(data) // 2],
        "replace": b"other bytes entirely",
    }[damage]
    backend.write_raw(ref, bad)
    assert store.exists(ref)
    with pytest.raises(CheckpointCorrupt) as caught:
        store.get(ref)
    assert caught.value.ref == ref
    assert caught.value.actual == hashlib.sha256(bad).hexdigest()
    assert isinstance(caught.value, CheckpointError)
    writes = len(backend.writes)
    assert store.put(data).ref == ref
    assert len(backend.writes) == writes + 1, "put must rewrite a corrupt object"
    assert backend.read_raw(ref) == data
    assert store.get(ref) == data


@pytest.mark.parametrize("size", [11_000, 3_000_000], ids=["small", "hashed beside the write and the sync"])
def test_put_verifies_the_stored_object_before_returning(backend: Backend, size: int) -> None:
    """A write that stores other bytes than were sent makes put raise instead of returning a ref
    (from 1 MB on, the local store hashes while it writes and verifies while it syncs; MinIO checks
    the sha256 the PUT carries and keeps nothing)."""
    store = backend.store
    data = (b"sent bytes " * (size // 11 + 1))[:size]
    ref = hashlib.sha256(data).hexdigest()
    backend.sabotage[0] = True
    if backend.name == "minio":
        with pytest.raises(CheckpointStoreError) as refused:
            store.put(data)
        assert refused.value.code == "XAmzContentChecksumMismatch", refused.value
        assert not store.exists(ref), "a store that refused the bytes keeps no object"
    else:
        with pytest.raises(CheckpointCorrupt) as caught:
            store.put(data)
        assert caught.value.ref == ref
        assert caught.value.actual == hashlib.sha256(flip_middle_byte(data)).hexdigest()
    backend.sabotage[0] = False
    assert store.put(data).ref == ref  # and the next put repairs it
    assert store.get(ref) == data


def test_put_many_stores_each_object_and_returns_their_refs_in_order(backend: Backend) -> None:
    """put_many (the local store's one group commit, MinIO's uploads in flight together): every
    object stored and verified, an object already there or given twice stored once, the refs in
    the order of the data."""
    store = backend.store
    first = store.put(b"already here")
    datas = [os.urandom(3000), b"two", b"already here", os.urandom(70_000), b"two", b"", os.urandom(5)]
    refs = store.put_many(datas)
    assert [(r.ref, r.size) for r in refs] == [(hashlib.sha256(d).hexdigest(), len(d)) for d in datas]
    assert refs[2].ref == first.ref
    for data, ref in zip(datas, refs):
        assert store.get(ref.ref) == data
    assert store.put_many([]) == []


def test_s3_put_many_keeps_several_uploads_in_flight(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose stages end faster than one upload stores the queued checkpoints together:
    the first two uploads are both in flight before either ends (one at a time, the first would
    wait for the second forever, and the barrier breaks)."""
    backend = minio_backend(minio_store_factory, minio_client, {}, monkeypatch, [])
    counting_put = backend.store._client.put_object
    both = threading.Barrier(2, timeout=60)
    started = itertools.count()

    def meeting_put(*args: Any, **kwargs: Any) -> Any:
        if next(started) < 2:
            both.wait()  # raises BrokenBarrierError unless a second upload starts meanwhile
        return counting_put(*args, **kwargs)

    monkeypatch.setattr(backend.store._client, "put_object", meeting_put)
    datas = [os.urandom(4000) for _ in range(3 * PUT_CONCURRENCY)]
    refs = backend.store.put_many(datas)
    assert [r.ref for r in refs] == [hashlib.sha256(d).hexdigest() for d in datas]
    assert sorted(backend.writes) == sorted(backend.store.key(r.ref) for r in refs)
    assert [minio_client.stat_object(backend.store.bucket, backend.store.key(r.ref)).size for r in refs] == \
        [len(d) for d in datas]


def test_s3_keeps_a_connection_for_every_request_a_load_and_uploads_have_in_flight_together(
    minio_store_factory: Callable[[], S3CheckpointStore], caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker loads its next source (GET_CONCURRENCY ranged GETs) while the checkpoints of its
    last path are uploaded (PUT_CONCURRENCY at once): the store's pool keeps a connection for each
    of those requests, so none is closed when it ends (urllib3's "Connection pool is full") and the
    next round of them opens no new connection (over HTTPS each would be a TLS handshake)."""
    store = minio_store_factory()
    ref = store.put(os.urandom(64)).ref
    together = GET_CONCURRENCY + PUT_CONCURRENCY

    def round_of_requests() -> None:
        meet = threading.Barrier(together, timeout=60)

        def request(offset: int) -> None:
            with store._response(ref, store.key(ref), offset=offset, length=1) as response:
                meet.wait()  # each holds its connection (its body unread) until all of them are in flight
                assert len(response.read()) == 1

        with ThreadPoolExecutor(together) as pool:
            list(pool.map(request, range(together)))

    caplog.set_level(logging.DEBUG, logger="urllib3.connectionpool")
    round_of_requests()
    assert "Connection pool is full" not in caplog.text
    caplog.clear()
    round_of_requests()
    assert "Connection pool is full" not in caplog.text
    assert "Starting new HTTP" not in caplog.text, caplog.text  # every connection of the first round reused


def test_s3_put_many_raises_the_first_refused_upload_and_a_retry_sends_only_what_is_missing(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes altered on the way of two uploads among several: MinIO refuses those two and keeps
    nothing of them; put_many raises the refusal of the first by position once every upload ended,
    the others are stored, and the writer's retry uploads only the two."""
    backend = minio_backend(minio_store_factory, minio_client, {}, monkeypatch, [])
    store = backend.store
    datas = [os.urandom(5000) for _ in range(6)]
    keys = [store.key(hashlib.sha256(d).hexdigest()) for d in datas]
    damaged = {keys[4], keys[2]}
    counting_put = store._client.put_object

    def damaging_put(bucket: str, key: str, data: Any, length: int, **kwargs: Any) -> Any:
        if key in damaged:
            body = flip_middle_byte(data.read())
            return counting_put(bucket, key, io.BytesIO(body), len(body), **kwargs)
        return counting_put(bucket, key, data, length, **kwargs)

    monkeypatch.setattr(store._client, "put_object", damaging_put)
    with pytest.raises(CheckpointStoreError) as refused:
        store.put_many(datas)
    assert (refused.value.code, refused.value.key) == ("XAmzContentChecksumMismatch", keys[2])
    assert sorted(backend.writes) == sorted(keys)  # every upload was tried
    assert [store.exists(hashlib.sha256(d).hexdigest()) for d in datas] == [True, True, False, True, False, True]
    damaged.clear()
    backend.writes.clear()
    assert [r.ref for r in store.put_many(datas)] == [hashlib.sha256(d).hexdigest() for d in datas]
    assert sorted(backend.writes) == sorted([keys[2], keys[4]])


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "../" + "a" * 61])
def test_malformed_ref_is_rejected(backend: Backend, bad: str) -> None:
    store = backend.store
    for call in (store.get, store.exists, store.delete):
        with pytest.raises(ValueError, match="ref must be a sha256 hex digest"):
            call(bad)


# ---------------------------------------------------------------------- local store specifics


def test_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    refs = [store.put(f"checkpoint {i}".encode()) for i in range(20)]
    assert all_files(tmp_path) == sorted(store.path(ref.ref) for ref in refs)


def test_local_object_path(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    ref = store.put(b"where").ref
    assert store.path(ref) == tmp_path / ref[:2] / ref


def test_failed_write_leaves_no_object_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalCheckpointStore(tmp_path)
    data = b"never stored"

    def refuse(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(StorageError, match="disk full"):  # an I/O failure is the store's, not the checkpoint's
        store.put(data)
    monkeypatch.undo()
    assert all_files(tmp_path) == []
    assert not store.exists(hashlib.sha256(data).hexdigest())


def test_local_second_put_keeps_the_file(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    first = store.put(b"same bytes")
    before = store.path(first.ref).stat()
    store.put(b"same bytes")
    after = store.path(first.ref).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


# ---------------------------------------------------------------------- MinIO store specifics


def test_s3_object_names_and_metadata(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any
) -> None:
    store = minio_store_factory()
    ref = store.put(b"named").ref
    assert store.key(ref) == f"{store.prefix}/{ref[:2]}/{ref}"
    stat = minio_client.stat_object(store.bucket, store.key(ref))
    assert stat.size == len(b"named")
    assert stat.content_type == "application/octet-stream"
    assert {k.lower(): v for k, v in stat.metadata.items()}["x-amz-meta-stagetree-sha256"] == ref
    bare = S3CheckpointStore(store.endpoint, store.bucket, access_key="a", secret_key="b")
    assert bare.key(ref) == f"{ref[:2]}/{ref}"
    assert bare.url == f"s3://{store.bucket}"
    assert store.url == f"s3://{store.bucket}/{store.prefix}"


@pytest.mark.parametrize("size", [11_000, 6 * 1024 * 1024], ids=["small", "above a multipart part"])
def test_s3_put_is_verified_by_the_store_without_a_download(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any, monkeypatch: pytest.MonkeyPatch,
    size: int,
) -> None:
    """One PUT that carries the sha256, which MinIO checks and keeps with the object (its reply
    confirms it), and no verifying GET: half the traffic of a save (issue 15)."""
    backend = minio_backend(minio_store_factory, minio_client, {}, monkeypatch, [])
    data = os.urandom(size)
    ref = backend.store.put(data).ref
    assert ref == hashlib.sha256(data).hexdigest()
    assert (len(backend.writes), backend.reads) == (1, [])
    response = minio_client.get_object(backend.store.bucket, backend.store.key(ref),
                                       request_headers={"x-amz-checksum-mode": "ENABLED"})
    try:
        assert response.headers["x-amz-checksum-sha256"] == base64.b64encode(bytes.fromhex(ref)).decode()
        assert response.read() == data
    finally:
        response.close()
        response.release_conn()


def test_s3_put_reads_back_when_the_store_does_not_confirm_the_checksum(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store whose reply confirms no sha256 (no S3 checksums): put downloads and hashes the
    object, so one that stored other bytes raises CheckpointCorrupt instead of returning a ref."""
    backend = minio_backend(minio_store_factory, minio_client, {}, monkeypatch, [])
    backend.store_checks[0] = False
    data = os.urandom(20_000)
    ref = backend.store.put(data).ref
    assert backend.reads == [backend.store.key(ref)], "an unconfirmed upload is read back"
    other = os.urandom(20_000)
    backend.sabotage[0] = True
    with pytest.raises(CheckpointCorrupt) as caught:
        backend.store.put(other)
    assert caught.value.ref == hashlib.sha256(other).hexdigest()
    assert caught.value.actual == hashlib.sha256(flip_middle_byte(other)).hexdigest()
    backend.sabotage[0] = False
    assert backend.store.put(other).ref == caught.value.ref  # the next put repairs it


def test_s3_put_never_creates_a_missing_bucket(minio_env: dict[str, str], minio_client: Any) -> None:
    """A mistyped bucket in one worker's --checkpoint-store was created by its first put, and the
    deployment's checkpoints were split between two buckets (stages retrained, verify failed):
    a store refuses to write to a bucket that does not exist, and writes once it is created."""
    bucket = f"stagetree-test-{uuid.uuid4().hex[:12]}"
    try:
        store = open_checkpoint_store(f"s3://{bucket}/ckpt", minio_env)
        assert isinstance(store, S3CheckpointStore)
        for attempt in (lambda: store.put(b"first object"), store.check_bucket):
            with pytest.raises(CheckpointStoreError) as caught:
                attempt()
            assert caught.value.code == "NoSuchBucket" and caught.value.bucket == bucket
            assert "never creates one" in str(caught.value)
        assert not minio_client.bucket_exists(bucket)
        minio_client.make_bucket(bucket)
        store.check_bucket()
        ref = store.put(b"first object").ref
        assert open_checkpoint_store(f"s3://{bucket}/ckpt", minio_env).get(ref) == b"first object"
    finally:
        remove_bucket(minio_client, bucket)


@pytest.mark.timeout(120)
def test_s3_probe_writes_the_empty_checkpoint_and_ends_in_bounded_time(
    minio_env: dict[str, str], minio_store_factory: Callable[[], S3CheckpointStore]
) -> None:
    """``probe`` (a worker's check of its store before it joins) stores the empty checkpoint,
    as often as it is asked to; an endpoint that refuses connections fails it at once, and one
    that accepts them and never answers after ``timeout_s`` seconds, each request sent once
    (the store's own requests are tried 6 times and wait 5 minutes: a worker with a mistyped
    endpoint joined, and failed every stage later)."""
    store = minio_store_factory()
    empty = hashlib.sha256(b"").hexdigest()
    assert not store.exists(empty)
    store.probe()
    store.probe()
    assert store.get(empty) == b""
    store.probe(write=False)
    with pytest.raises(ValueError, match="timeout_s is 0"):
        store.probe(timeout_s=0)
    with socket.socket() as refusing, socket.socket() as silent:
        refusing.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections wait in the backlog, never accepted or answered
        # (bounded by the test's timeout, not timed: the store's own requests would wait 5 minutes)
        for sock, code, timeout_s in ((refusing, "NewConnectionError", 10.0), (silent, "ReadTimeoutError", 0.5)):
            endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
            away = open_checkpoint_store(store.url, {**minio_env, "STAGETREE_S3_ENDPOINT": endpoint})
            assert isinstance(away, S3CheckpointStore)
            with pytest.raises(CheckpointStoreError) as caught:
                away.probe(timeout_s=timeout_s)
            assert caught.value.code == code and caught.value.endpoint == endpoint, caught.value
            assert caught.value.operation == "check bucket", caught.value


def test_s3_wrong_credentials_raise_a_store_error_naming_bucket_and_key(
    minio_env: dict[str, str],
) -> None:
    wrong_secret = "wrong-secret-" + uuid.uuid4().hex
    env = dict(minio_env, STAGETREE_S3_SECRET_KEY=wrong_secret)
    bucket = infra_bucket(minio_env)
    store = open_checkpoint_store(f"s3://{bucket}/test-wrong-credentials", env)
    ref = hashlib.sha256(b"anything").hexdigest()
    errors = []
    for call in (store.get, store.exists, store.delete):
        with pytest.raises(CheckpointStoreError) as caught:
            call(ref)
        errors.append(caught.value)
    with pytest.raises(CheckpointStoreError) as caught:
        store.put(b"anything")
    errors.append(caught.value)
    for error in errors:
        assert isinstance(error, CheckpointError)
        assert error.code in {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}, error
        assert error.bucket == bucket and error.endpoint == minio_env["STAGETREE_S3_ENDPOINT"]
        assert f"s3://{bucket}" in str(error)
        assert "STAGETREE_S3_SECRET_KEY" in str(error)
        secrets = [wrong_secret, minio_env["STAGETREE_S3_SECRET_KEY"]]
        assert_no_secret(describe_exception(error), secrets)
    assert errors[0].key == store.key(ref) and f"s3://{bucket}/{store.key(ref)}" in str(errors[0])


def test_s3_unreachable_endpoint_raises_a_store_error() -> None:
    import urllib3

    with socket.socket() as probe:  # a free port on 127.0.0.1 that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    secret = "unreachable-secret-" + uuid.uuid4().hex
    store = S3CheckpointStore(
        f"127.0.0.1:{port}",
        "stagetree",
        "p",
        access_key="unreachable-access",
        secret_key=secret,
        region="us-east-1",
        http_client=urllib3.PoolManager(
            retries=urllib3.Retry(total=0), timeout=urllib3.Timeout(connect=2, read=2)
        ),
    )
    ref = hashlib.sha256(b"x").hexdigest()
    with pytest.raises(CheckpointStoreError) as caught:
        store.get(ref)
    error = caught.value
    assert error.endpoint == f"127.0.0.1:{port}" and error.key == store.key(ref)
    assert f"127.0.0.1:{port}" in str(error) and f"s3://stagetree/{store.key(ref)}" in str(error)
    assert error.code == "MaxRetryError"
    assert error.__cause__ is None and error.__suppress_context__
    assert_no_secret(describe_exception(error), [secret, "unreachable-access"])
    with pytest.raises(CheckpointStoreError):
        store.put(b"x")


def test_s3_store_refuses_to_be_pickled() -> None:
    store = S3CheckpointStore("127.0.0.1:9000", "stagetree", access_key="a", secret_key="b")
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(store)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"endpoint": "http://127.0.0.1:9000"}, "endpoint must be HOST or HOST:PORT"),
        ({"endpoint": "127.0.0.1:9000/path"}, "endpoint must be HOST or HOST:PORT"),
        ({"bucket": "Bad_Bucket"}, "bucket must be an S3 bucket name"),
        ({"bucket": "ab"}, "bucket must be an S3 bucket name"),
        ({"bucket": "10.0.0.1"}, "bucket must be an S3 bucket name"),
        ({"prefix": "a/../b"}, "prefix must be"),
        ({"prefix": "a//b"}, "prefix must be"),
        ({"access_key": ""}, "access_key must be"),
        ({"secret_key": ""}, "secret_key must be"),
    ],
)
def test_s3_store_rejects_bad_arguments(kwargs: dict[str, str], match: str) -> None:
    arguments = {
        "endpoint": "127.0.0.1:9000",
        "bucket": "stagetree",
        "prefix": "p",
        "access_key": "a",
        "secret_key": "b",
    } | kwargs
    endpoint = arguments.pop("endpoint")
    bucket = arguments.pop("bucket")
    prefix = arguments.pop("prefix")
    with pytest.raises(ValueError, match=match):
        S3CheckpointStore(endpoint, bucket, prefix, **arguments)


# ---------------------------------------------------------------------- open_checkpoint_store

S3_ENV = {
    "STAGETREE_S3_ENDPOINT": "127.0.0.1:9000",
    "STAGETREE_S3_ACCESS_KEY": "test-access-key",
    "STAGETREE_S3_SECRET_KEY": "test-secret-key-0123456789",
}


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://stagetree/checkpoints", "stagetree", "checkpoints"),
        ("s3://stagetree", "stagetree", ""),
        ("s3://stagetree/", "stagetree", ""),
        ("s3://my.bucket-1/a/b/c/", "my.bucket-1", "a/b/c"),
        ("S3://stagetree/x", "stagetree", "x"),
    ],
)
def test_open_s3_store(url: str, bucket: str, prefix: str) -> None:
    store = open_checkpoint_store(url, S3_ENV)
    assert isinstance(store, S3CheckpointStore) and isinstance(store, CheckpointStore)
    assert (store.endpoint, store.bucket, store.prefix) == ("127.0.0.1:9000", bucket, prefix)
    assert store.secure is False and store.region is None
    assert open_checkpoint_store(store.url, S3_ENV).url == store.url


@pytest.mark.parametrize(
    ("extra", "endpoint", "secure"),
    [
        ({"STAGETREE_S3_SECURE": "true"}, "127.0.0.1:9000", True),
        ({"STAGETREE_S3_SECURE": "FALSE"}, "127.0.0.1:9000", False),
        ({"STAGETREE_S3_SECURE": "1"}, "127.0.0.1:9000", True),
        ({"STAGETREE_S3_SECURE": ""}, "127.0.0.1:9000", False),
        ({"STAGETREE_S3_ENDPOINT": "http://127.0.0.1:9000"}, "127.0.0.1:9000", False),
        ({"STAGETREE_S3_ENDPOINT": "https://127.0.0.1:9443/"}, "127.0.0.1:9443", True),
        (
            {"STAGETREE_S3_ENDPOINT": "https://127.0.0.1:9443", "STAGETREE_S3_SECURE": "yes"},
            "127.0.0.1:9443",
            True,
        ),
        ({"STAGETREE_S3_ENDPOINT": "localhost"}, "localhost", False),
    ],
)
def test_open_s3_store_endpoint_and_tls(extra: dict[str, str], endpoint: str, secure: bool) -> None:
    store = open_checkpoint_store("s3://stagetree/p", S3_ENV | extra)
    assert isinstance(store, S3CheckpointStore)
    assert (store.endpoint, store.secure) == (endpoint, secure)


def test_open_s3_store_region() -> None:
    store = open_checkpoint_store("s3://stagetree/p", S3_ENV | {"STAGETREE_S3_REGION": "eu-west-1"})
    assert isinstance(store, S3CheckpointStore) and store.region == "eu-west-1"


def test_open_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in (f"file://{tmp_path}", str(tmp_path), tmp_path):
        store = open_checkpoint_store(url, {})
        assert isinstance(store, LocalCheckpointStore) and store.root == tmp_path
    monkeypatch.chdir(tmp_path)
    relative = open_checkpoint_store("runs/checkpoints", {})
    assert isinstance(relative, LocalCheckpointStore) and relative.root == Path("runs/checkpoints")
    ref = relative.put(b"relative").ref
    assert (tmp_path / "runs" / "checkpoints" / ref[:2] / ref).read_bytes() == b"relative"
    assert open_checkpoint_store("file://rel/dir", {}).root == Path("rel/dir")


@pytest.mark.parametrize(
    "name", ["STAGETREE_S3_ENDPOINT", "STAGETREE_S3_ACCESS_KEY", "STAGETREE_S3_SECRET_KEY"]
)
@pytest.mark.parametrize("absent", ["unset", "empty"])
def test_open_s3_store_names_the_missing_variable(name: str, absent: str) -> None:
    env = dict(S3_ENV)
    if absent == "unset":
        del env[name]
    else:
        env[name] = ""
    with pytest.raises(ValueError, match=f"{name} is not set") as caught:
        open_checkpoint_store("s3://stagetree/p", env)
    assert "s3://stagetree/p" in str(caught.value)
    assert_no_secret(describe_exception(caught.value), [S3_ENV["STAGETREE_S3_SECRET_KEY"]])


@pytest.mark.parametrize(
    ("url", "extra", "match"),
    [
        ("", {}, "must be a non-empty path or URL"),
        ("   ", {}, "must be a non-empty path or URL"),
        ("gs://bucket/x", {}, "unsupported scheme 'gs'"),
        ("http://127.0.0.1:9000/bucket", {}, "unsupported scheme 'http'"),
        ("file://", {}, "has no path"),
        ("s3://", {}, "has no bucket"),
        ("s3:///prefix", {}, "has no bucket"),
        ("s3://Bad_Bucket/x", {}, "bucket must be an S3 bucket name"),
        ("s3://stagetree:9000/x", {}, "bucket must be an S3 bucket name"),
        ("s3://stagetree/a/../b", {}, "prefix must be"),
        ("s3://stagetree/x?versionId=1", {}, "must not have a query or fragment"),
        ("s3://stagetree/x#frag", {}, "must not have a query or fragment"),
        ("s3://stagetree/x", {"STAGETREE_S3_SECURE": "maybe"}, "SECURE must be true or false"),
        ("s3://stagetree/x", {"STAGETREE_S3_ENDPOINT": "127.0.0.1:9000/x"}, "ENDPOINT must be HOST"),
        ("s3://stagetree/x", {"STAGETREE_S3_ENDPOINT": "ftp://127.0.0.1:9000"}, "ENDPOINT must be HOST"),
        (
            "s3://stagetree/x",
            {"STAGETREE_S3_ENDPOINT": "https://127.0.0.1:9000", "STAGETREE_S3_SECURE": "false"},
            "says https",
        ),
    ],
)
def test_open_checkpoint_store_rejects_bad_urls(
    url: str, extra: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match) as caught:
        open_checkpoint_store(url, S3_ENV | extra)
    assert_no_secret(describe_exception(caught.value), [S3_ENV["STAGETREE_S3_SECRET_KEY"]])


def test_credentials_in_the_url_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="must not contain credentials") as caught:
        open_checkpoint_store("s3://AKIDEXAMPLE:url-secret-99@stagetree/x", S3_ENV)
    assert_no_secret(describe_exception(caught.value), ["url-secret-99", "AKIDEXAMPLE"])


# ---------------------------------------------------------------------- secrets stay secret


def describe_exception(error: BaseException) -> str:
    """Everything an exception carries: str, repr, args, attributes, and the same for its chain.

    (The traceback's source lines are left out: they quote the test's own literals.)
    """
    parts: list[str] = []
    seen: BaseException | None = error
    while seen is not None:
        parts += [str(seen), repr(seen), repr(seen.args), repr(vars(seen))]
        parts += traceback.format_exception_only(type(seen), seen)
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def assert_no_secret(text: str, secrets: list[str]) -> None:
    """Fail, without showing ``text`` or the secret, when any of ``secrets`` occurs in ``text``."""
    leaked = [index for index, secret in enumerate(secrets) if secret in text]
    if leaked:
        pytest.fail(f"secret(s) number {leaked} of {len(secrets)} leaked", pytrace=False)


def test_repr_str_and_errors_never_show_the_secret_key(
    minio_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    secret = minio_env["STAGETREE_S3_SECRET_KEY"]
    access = minio_env["STAGETREE_S3_ACCESS_KEY"]
    bucket = infra_bucket(minio_env)
    caplog.set_level(logging.DEBUG)
    store = open_checkpoint_store(f"s3://{bucket}/test-secrets-{uuid.uuid4().hex}", minio_env)
    assert isinstance(store, S3CheckpointStore)
    shown = [repr(store), str(store), f"{store}", store.url]
    shown += [f"{key}={value!r}" for key, value in vars(store).items() if not key.startswith("_")]
    assert_no_secret("\n".join(shown), [secret, access])
    assert "S3CheckpointStore(" in repr(store) and bucket in repr(store)

    # Real traffic (put, get, corrupt, missing) with DEBUG logging of every library on.
    try:
        ref = store.put(b"secret test").ref
        assert store.get(ref) == b"secret test"
        errors: list[BaseException] = []
        store.delete(ref)
        with pytest.raises(CheckpointMissing) as missing:
            store.get(ref)
        errors.append(missing.value)
        wrong_env = dict(minio_env, STAGETREE_S3_SECRET_KEY="x" + secret)
        wrong = open_checkpoint_store(store.url, wrong_env)
        with pytest.raises(CheckpointStoreError) as denied:
            wrong.get(ref)
        errors.append(denied.value)
        for error in errors:
            assert_no_secret(describe_exception(error), [secret, "x" + secret])
        assert_no_secret(caplog.text, [secret, "x" + secret])
        assert_no_secret("\n".join(r.getMessage() for r in caplog.records), [secret])
    finally:
        store.delete(hashlib.sha256(b"secret test").hexdigest())


# ---------------------------------------------------------------------- a real torch checkpoint


def load_digits_example() -> ModuleType:
    name = "stagetree_example_digits"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_torch_checkpoint_through_minio_trains_bit_identically(
    minio_store_factory: Callable[[], S3CheckpointStore], tmp_path: Path
) -> None:
    """DigitsTrainer trained 20 steps, checkpointed, resumed to 45 steps from MinIO and from a
    local directory: identical parameters, checkpoint bytes and metrics, also identical to
    training straight through (DESIGN.md invariants 1 and 4)."""
    from events.hp import Constant, MultiStep
    from gpu_worker.session import TrainingSession

    digits = load_digits_example()
    config = {
        "lr": MultiStep(0.1, [30], 0.5),
        "batch_size": Constant(32),
        "momentum": Constant(0.9),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def session() -> TrainingSession:
            return TrainingSession(digits.DigitsTrainer(), 11, "cpu")

        first = session()
        first.start_fresh()
        first.train(config, 20)
        data = first.save()

        s3 = minio_store_factory()
        local = LocalCheckpointStore(tmp_path / "local")
        saved = {"minio": s3.put(data), "local": local.put(data)}
        expected_ref = CheckpointRef(hashlib.sha256(data).hexdigest(), len(data))
        assert saved["minio"] == saved["local"] == expected_ref

        resumed = {}
        for name, store in (("minio", s3), ("local", local)):
            loaded = store.get(saved[name].ref)
            assert loaded == data
            run = session()
            run.load(loaded)
            assert run.step == 20
            run.train(config, 45)
            resumed[name] = run

        straight = session()
        straight.start_fresh()
        straight.train(config, 45)

        reference = resumed["local"]
        for run in (resumed["minio"], straight):
            assert run.step == 45
            expected = reference.trainer.model.state_dict()
            actual = run.trainer.model.state_dict()
            assert expected.keys() == actual.keys()
            for name in expected:
                assert torch.equal(expected[name], actual[name]), name
            assert run.save() == reference.save()
            assert run.evaluate() == reference.evaluate()
        assert not torch.equal(  # the 25 resumed steps did train
            first.trainer.model.state_dict()["fc.weight"],
            reference.trainer.model.state_dict()["fc.weight"],
        )

        # The final checkpoint goes through MinIO too and comes back as the same ref.
        final = reference.save()
        assert s3.put(final) == local.put(final)
        assert decode_state(s3.get(s3.put(final).ref))["step"] == 45
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------- the byte encoding


def test_encode_decode_round_trip() -> None:
    model = torch.nn.Linear(4, 3)
    state = {
        "format": 1,
        "model": model.state_dict(),
        "generator": torch.Generator().manual_seed(3).get_state(),
        "values": [1, 2.5, None, True, "text", (1, 2)],
    }
    decoded = decode_state(encode_state(state))
    assert decoded["format"] == 1
    assert decoded["values"] == [1, 2.5, None, True, "text", (1, 2)]
    assert torch.equal(decoded["generator"], state["generator"])
    assert isinstance(decoded["model"], OrderedDict)
    assert decoded["model"]._metadata == state["model"]._metadata
    for name, tensor in state["model"].items():
        assert torch.equal(decoded["model"][name], tensor)
    assert encode_state(decoded) == encode_state(state)


def test_equal_states_encode_to_equal_bytes_whatever_objects_they_share() -> None:
    key = "".join(["l", "r"])  # equal to "lr", but a distinct object
    shared = {"lr": 0.1, "groups": [{"lr": 0.1}], "pair": (1, 2)}
    distinct = {key: 0.1, "groups": [{"".join(["l", "r"]): 0.1}], "pair": (1, 2)}
    pair = (1, 2)
    aliased = {"lr": 0.1, "groups": [{"lr": 0.1}], "pair": pair, "again": pair}
    fresh = {"lr": 0.1, "groups": [{"lr": 0.1}], "pair": (1, 2), "again": (1, 2)}
    assert encode_state(shared) == encode_state(distinct)
    assert encode_state(aliased) == encode_state(fresh)


def test_a_snapshot_encodes_as_the_state_did_when_it_was_taken() -> None:
    base = torch.arange(12, dtype=torch.float32)
    model = torch.nn.Linear(3, 3)
    state = {
        "tied": base, "again": base,  # one storage, saved once
        "view": base[4:10].view(2, 3),  # a view: its whole storage is saved, with the offset
        "leaf": torch.ones(3, requires_grad=True),
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "generator": torch.Generator().manual_seed(5).get_state(),
        "values": [1, 2.5, None, True, "text", (1, 2)],
    }
    data = encode_state(state)
    snapshot = snapshot_state(state)
    assert encode_state(snapshot) == data
    with torch.no_grad():  # training goes on in place
        base.add_(1)
        state["leaf"].mul_(2)
        model.weight.zero_()
    assert encode_state(state) != data
    assert encode_state(snapshot) == data
    assert snapshot["tied"].untyped_storage().data_ptr() == snapshot["again"].untyped_storage().data_ptr() == \
        snapshot["view"].untyped_storage().data_ptr()
    # the tensors' storages, each once: 12 + 3 floats, the model's 12, the generator's bytes
    tensors = 4 * (12 + 3 + 12) + state["generator"].numel()
    assert state_bytes(state) == state_bytes(snapshot) == tensors
    assert tensors < len(data) < tensors + 4096


def test_pooled_snapshots_encode_as_the_state_and_reuse_buffers_only_once_given_back() -> None:
    weights = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: pooled
    small = torch.arange(10, dtype=torch.float64)  # below min_bytes: cloned
    state = {"w": weights, "w_view": weights[10:20], "small": small, "step": 3}
    buffers = SnapshotBuffers(min_bytes=1 << 20)
    first = buffers.take(state)
    assert encode_state(first.state) == encode_state(state)
    assert [b.nbytes() for b in first.buffers] == [weights.untyped_storage().nbytes()]
    assert first.state["w"].untyped_storage().data_ptr() == first.state["w_view"].untyped_storage().data_ptr()
    weights.add_(1)
    second = buffers.take(state)  # the first is still lent: a buffer of its own
    assert second.buffers[0].data_ptr() != first.buffers[0].data_ptr()
    assert encode_state(second.state) == encode_state(state) != encode_state(first.state)
    buffers.give_back(first)
    weights.add_(1)
    third = buffers.take(state)
    assert third.buffers[0].data_ptr() == first.buffers[0].data_ptr()  # reused
    assert encode_state(third.state) == encode_state(state)
    assert encode_state(second.state) != encode_state(state)


def test_put_written_stores_what_its_writers_stream_hashed_as_written(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    # 4 MB of weights: from 1 MB on, a write is hashed on a helper thread beside the write
    state = {"weights": torch.arange(1_000_000, dtype=torch.float32), "step": 4, "small": torch.ones(3)}
    chunks = [b"several ", b"chunks", b""]
    already = store.put(b"already here")
    refs = store.put_written([lambda sink: write_state(state, sink), lambda sink: [sink.write(c) for c in chunks],
                              lambda sink: sink.write(b"already here")])
    assert refs[0] == CheckpointRef(hashlib.sha256(encode_state(state)).hexdigest(), len(encode_state(state)))
    assert store.get(refs[0].ref) == encode_state(state)
    assert store.get(refs[1].ref) == b"several chunks" and refs[1].size == 14
    assert refs[2] == already
    assert sorted(p.name for p in all_files(tmp_path)) == sorted(r.ref for r in refs)  # no temporary file left

    def failing(sink: Any) -> None:
        sink.write(b"half an obj")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="the writer failed"):
        store.put_written([failing])
    assert sorted(p.name for p in all_files(tmp_path)) == sorted(r.ref for r in refs)


@pytest.mark.parametrize("group", [1, 2], ids=["one object: fsync", "a group: syncfs"])
def test_objects_a_failed_call_renamed_into_place_are_made_durable_by_the_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    """A worker whose trainer state does not encode stores the group's other snapshots again
    without it (gpu_worker.executor). The first call renamed those objects into place before the
    writer raised, and never synced them. The retry finds them stored intact, and must still
    make them durable: after it returns, their CheckpointSaved events go out."""
    import gpu_worker.checkpoint as checkpoint

    store = LocalCheckpointStore(tmp_path)
    datas = [b"first object", b"second object"][:group]
    synced: list[str] = []  # what was fsynced (its path), or syncfs'ed ("syncfs:" and the path)
    real_fsync, real_syncfs = os.fsync, checkpoint._syncfs

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def syncfs(fd: int) -> int:
        synced.append("syncfs:" + os.readlink(f"/proc/self/fd/{fd}"))
        assert real_syncfs is not None
        return real_syncfs(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if real_syncfs is not None:
        monkeypatch.setattr(checkpoint, "_syncfs", syncfs)

    def unencodable(sink: Any) -> None:
        raise RuntimeError("the trainer's state does not encode")

    def writers() -> list[Callable[[Any], object]]:
        return [lambda sink, data=data: sink.write(data) for data in datas]

    with pytest.raises(RuntimeError, match="does not encode"):
        store.put_written([*writers(), unencodable])
    paths = [store.path(hashlib.sha256(d).hexdigest()) for d in datas]
    assert all(path.is_file() for path in paths)  # in place, but no sync ran: the writer raised first
    assert not any(str(path) in synced for path in paths)
    synced.clear()
    assert [r.ref for r in store.put_written(writers())] == [path.name for path in paths]
    if group == 1 or checkpoint._syncfs is None:
        assert all(str(path) in synced and str(path.parent) in synced for path in paths)
    else:
        assert synced == [f"syncfs:{tmp_path}"]


def _put_in_child(root: str, data: bytes) -> None:
    LocalCheckpointStore(root).put(data)


def test_a_process_forked_after_a_large_write_writes_large_objects_too(tmp_path: Path) -> None:
    """Large writes are hashed on a helper thread; a process forked afterwards has no such thread
    and must start its own instead of waiting forever on the parent's."""
    import multiprocessing

    store = LocalCheckpointStore(tmp_path)
    store.put(b"x" * (3 << 20))  # the helper thread now runs in this process
    child = multiprocessing.get_context("fork").Process(target=_put_in_child, args=(str(tmp_path), b"y" * (3 << 20)))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked process hung writing a large object")
    assert child.exitcode == 0
    assert store.get(hashlib.sha256(b"y" * (3 << 20)).hexdigest()) == b"y" * (3 << 20)


def test_file_sha256_hashes_the_stored_bytes(tmp_path: Path) -> None:
    for name, data in {"empty": b"", "small": b"state", "large": bytes(range(256)) * 40_000}.items():
        (tmp_path / name).write_bytes(data)
        assert file_sha256(tmp_path / name) == hashlib.sha256(data).hexdigest()
    with pytest.raises(FileNotFoundError):
        file_sha256(tmp_path / "absent")


def test_decoding_garbage_raises_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="cannot decode"):
        decode_state(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot decode"):
        decode_state(encode_state({"object": Opaque()}))


def test_local_put_many_stores_several_objects_with_one_group_commit(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    first = store.put(b"already here")
    datas = [b"one", b"two", b"one", b"already here", b"three" * 1000]
    refs = store.put_many(datas)
    assert [r.ref for r in refs] == [hashlib.sha256(d).hexdigest() for d in datas]
    assert [r.size for r in refs] == [len(d) for d in datas]
    assert refs[3].ref == first.ref
    for data, ref in zip(datas, refs):
        assert store.get(ref.ref) == data
    assert sorted(p.name for p in all_files(tmp_path)) == sorted({r.ref for r in refs})  # no temporary file left


def test_load_decodes_verified_bytes_one_checkpoint_after_another(backend: Backend) -> None:
    """A worker's load: small and large checkpoints (hashed beside the decoding from 1 MiB), one
    after another through the same store, each decoded as from its own bytes (the local store
    reads into memory it reuses, so a large load after a small one sees only its own bytes)."""
    store = backend.store
    states = {"large": {"w": torch.randn(700, 700), "step": 3},  # about 1.9 MB
              "small": {"w": torch.arange(5.0), "nested": [1, {"b": torch.ones(2, dtype=torch.int64)}]},
              "larger": {"w": torch.randn(900, 800), "v": torch.randn(10)}}
    refs = {name: store.put(encode_state(state)).ref for name, state in states.items()}
    for name in ["large", "small", "larger", "small", "large"]:
        loaded = store.load(refs[name], LoadedBytes.decode)
        assert encode_state(loaded) == encode_state(states[name]) == store.get(refs[name])
    seen: list[bytes] = []
    assert store.load(refs["small"], lambda loaded: seen.append(bytes(loaded.view))) is None
    assert seen == [store.get(refs["small"])]
    if backend.name == "local":
        copied = pickle.loads(pickle.dumps(store))
        assert copied.load(refs["small"], LoadedBytes.decode)["w"].tolist() == [0, 1, 2, 3, 4]


def test_a_large_load_is_mapped_and_no_later_load_changes_what_it_gave(backend: Backend) -> None:
    """From 1 MiB a store reads an object (a file, or MinIO's response) into a memory file and
    decodes it by mapping the file (no tensor copied). It reads the next object into the same
    file only when nothing decoded from it is referenced any more, else into a new one:
    tensors kept from a load, written to or not, never change with later loads."""
    store = backend.store
    states = [{"w": torch.randn(700, 700), "v": torch.arange(10.0) + i} for i in range(3)]
    datas = [encode_state(state) for state in states]
    assert len({len(data) for data in datas}) == 1 and len(datas[0]) > 1 << 20
    refs = [store.put(data).ref for data in datas]
    kept = store.load(refs[0], LoadedBytes.decode)
    assert store.load(refs[1], LoadedBytes.decode)["v"].equal(states[1]["v"])
    assert encode_state(kept) == datas[0]
    kept["w"].add_(1.0)  # copied on write: neither the file nor the next decode sees it
    again = store.load(refs[0], LoadedBytes.decode)
    assert encode_state(again) == datas[0] and kept["w"].equal(states[0]["w"] + 1.0)
    del kept, again
    memory_file = store._memory._file
    assert memory_file is not None and not memory_file.mapped_privately()
    decoded = store.load(refs[1], LoadedBytes.decode)
    assert memory_file.mapped_privately()  # its tensors map the file: nothing was copied out of it
    del decoded
    assert encode_state(store.load(refs[2], LoadedBytes.decode)) == datas[2]
    assert store._memory._file is memory_file  # nothing decoded from it was referenced: read into again


def test_a_load_of_another_size_reads_into_the_same_memory_file_made_that_long(backend: Backend) -> None:
    """One study's checkpoints differ in size (with and without momentum buffers, say): a load
    of another size than the last reads into the same memory file, cut or grown to it (its
    pages are not faulted in again), unless tensors decoded from the file are still referenced;
    what was kept from it never changes."""
    store = backend.store
    states = [{"w": torch.randn(700, 700)}, {"w": torch.randn(700, 700), "m": torch.randn(300, 700)},
              {"w": torch.randn(600, 600)}]
    datas = [encode_state(state) for state in states]
    assert len({len(data) for data in datas}) == 3 and min(map(len, datas)) > 1 << 20
    refs = [store.put(data).ref for data in datas]
    assert encode_state(store.load(refs[0], LoadedBytes.decode)) == datas[0]
    memory_file = store._memory._file
    assert memory_file is not None and memory_file.size == len(datas[0])
    for i in (1, 2, 0, 1):
        assert encode_state(store.load(refs[i], LoadedBytes.decode)) == datas[i]
        assert store._memory._file is memory_file and memory_file.size == len(datas[i])
        assert os.fstat(memory_file.fd).st_size == len(datas[i])
    kept = store.load(refs[1], LoadedBytes.decode)  # maps the file: a shorter one would cut it
    assert encode_state(store.load(refs[2], LoadedBytes.decode)) == datas[2]
    assert store._memory._file is not memory_file
    assert encode_state(kept) == datas[1]


@pytest.mark.parametrize("size", ["small", "large"])
def test_load_never_returns_what_it_decoded_from_bytes_that_do_not_verify(backend: Backend, size: str) -> None:
    """Damaged bytes raise CheckpointCorrupt whether the decoding succeeded (a flipped weight)
    or failed (a flipped header), never the decoded state; bytes that verify but are no
    checkpoint raise the decoding's error; an absent object CheckpointMissing."""
    store = backend.store
    state = {"w": torch.randn(1000, 1000) if size == "large" else torch.randn(10)}
    data = encode_state(state)
    ref = store.put(data).ref
    weight_at = data.index(state["w"].numpy().tobytes()[:64])
    for at in (weight_at + 10, 0):
        backend.write_raw(ref, data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
        decoded: list[Any] = []
        with pytest.raises(CheckpointCorrupt) as caught:
            store.load(ref, lambda loaded, into=decoded: into.append(loaded.decode()))  # a flipped weight decodes
        assert caught.value.ref == ref and caught.value.actual != ref
        assert bool(decoded) == (at != 0)
    junk = store.put(b"no checkpoint" * (100_000 if size == "large" else 1)).ref
    with pytest.raises(CheckpointError, match="cannot decode"):
        store.load(junk, LoadedBytes.decode)
    store.delete(ref)
    with pytest.raises(CheckpointMissing):
        store.load(ref, LoadedBytes.decode)
    assert store.put(data).ref == ref and store.load(ref, LoadedBytes.decode)["w"].equal(state["w"])


def test_load_pending_hands_on_what_it_decoded_with_the_check_of_its_bytes(backend: Backend) -> None:
    """``load_pending`` returns what ``use`` made of the bytes at once, beside the verification
    that they hash to the ref, which may still run: passes for intact bytes; for a flipped
    weight (which decodes) the check raises CheckpointCorrupt; a flipped header (the decoding
    fails) raises CheckpointCorrupt from the load itself."""
    store = backend.store
    state = {"w": torch.randn(1000, 1000)}
    data = encode_state(state)
    ref = store.put(data).ref
    decoded, verification = store.load_pending(ref, LoadedBytes.decode)
    verification.check()
    assert verification.done() and encode_state(decoded) == data
    weight_at = data.index(state["w"].numpy().tobytes()[:64])
    backend.write_raw(ref, data[:weight_at] + bytes([data[weight_at] ^ 1]) + data[weight_at + 1:])
    decoded, verification = store.load_pending(ref, LoadedBytes.decode)
    assert not decoded["w"].equal(state["w"])
    with pytest.raises(CheckpointCorrupt) as caught:
        verification.check()
    assert caught.value.ref == ref and caught.value.actual != ref
    backend.write_raw(ref, bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(CheckpointCorrupt):
        store.load_pending(ref, LoadedBytes.decode)


def test_a_load_waits_until_the_last_ones_bytes_are_hashed_before_it_reads_into_their_memory(
        backend: Backend) -> None:
    """A store reads each large object into the memory file of the last (nothing decoded from
    it is referenced), which a pending load's hash may still read: the next load waits for
    that hash, so every verification holds for the bytes it was given."""
    store = backend.store
    datas = [bytes([i]) * (64 << 20) for i in range(4)]
    refs = [store.put(data).ref for data in datas]
    verifications = [store.load_pending(ref, lambda loaded: None)[1] for ref in refs]
    for verification in verifications:
        verification.check()


def test_s3_a_large_load_reads_its_rest_in_ranged_gets_at_once(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3 serves each connection at a bounded rate: a load's first GET asks for the first
    ``FIRST_RANGE_BYTES`` (here 1 MiB), whose reply names the object's size, and the rest comes
    in ``GET_CONCURRENCY - 1`` ranged GETs, all in flight before any ends (one after another,
    the first would wait for the others forever, and the barrier breaks). The bytes decode to
    the state saved; a byte altered in the last range fails the load's hash."""
    monkeypatch.setattr(object_store, "FIRST_RANGE_BYTES", 1 << 20)
    backend = minio_backend(minio_store_factory, minio_client, {}, monkeypatch, [])
    store = backend.store
    state = {"w": torch.randn(1600, 1600)}
    data = encode_state(state)
    assert len(data) > GET_CONCURRENCY << 20  # a range of at least 1 MiB for each GET
    ref = store.put(data).ref
    counting_get = store._client.get_object
    together = threading.Barrier(GET_CONCURRENCY - 1, timeout=60)
    asked: list[tuple[int, int]] = []

    def ranged_get(bucket: str, key: str, *args: Any, offset: int = 0, length: int = 0, **kwargs: Any) -> Any:
        asked.append((offset, length))
        if offset > 0:
            together.wait()
        return counting_get(bucket, key, *args, offset=offset, length=length, **kwargs)

    monkeypatch.setattr(store._client, "get_object", ranged_get)
    assert store.load(ref, LoadedBytes.decode)["w"].equal(state["w"])
    first, *rest = asked
    assert first == (0, 1 << 20) and len(rest) == GET_CONCURRENCY - 1
    ranges = sorted(rest)  # they tile the rest of the object
    assert ranges[0][0] == 1 << 20 and sum(o + n == o_next for (o, n), (o_next, _) in zip(ranges, ranges[1:])) == \
        len(ranges) - 1 and ranges[-1][0] + ranges[-1][1] == len(data)
    damaged = bytearray(data)
    damaged[-10] ^= 1
    backend.write_raw(ref, bytes(damaged))
    with pytest.raises(CheckpointCorrupt) as caught:
        store.load(ref, lambda loaded: None)
    assert caught.value.actual == hashlib.sha256(damaged).hexdigest()


def test_s3_loads_an_empty_object_and_from_a_store_that_ignores_ranges(
    minio_store_factory: Callable[[], S3CheckpointStore], minio_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An empty object has no first byte to ask for (S3 answers InvalidRange): it is read with a
    plain GET. A store that ignores the Range header sends the whole object in its first reply,
    which the load then reads alone. A part whose reply does not say the object's size (no
    Content-Range) is dropped, and the object asked for whole."""
    backend = minio_backend(minio_store_factory, minio_client, {}, monkeypatch, [])
    store = backend.store
    empty = store.put(b"").ref
    assert store.load(empty, lambda loaded: bytes(loaded.view)) == b""
    monkeypatch.setattr(object_store, "FIRST_RANGE_BYTES", 1 << 20)
    data = os.urandom(3 << 20)
    ref = store.put(data).ref
    counting_get = store._client.get_object

    def whole_get(bucket: str, key: str, *args: Any, offset: int = 0, length: int = 0, **kwargs: Any) -> Any:
        return counting_get(bucket, key, *args, **kwargs)  # the Range dropped: a 200 with every byte

    monkeypatch.setattr(store._client, "get_object", whole_get)
    backend.reads.clear()
    assert store.load(ref, lambda loaded: bytes(loaded.view)) == data
    assert backend.reads == [store.key(ref)]

    def sizeless_get(bucket: str, key: str, *args: Any, **kwargs: Any) -> Any:
        response = counting_get(bucket, key, *args, **kwargs)
        response.headers.discard("Content-Range")  # a part of the object, but of what size?
        return response

    monkeypatch.setattr(store._client, "get_object", sizeless_get)
    backend.reads.clear()
    assert store.load(ref, lambda loaded: bytes(loaded.view)) == data  # asked again, for every byte
    assert backend.reads == [store.key(ref)] * 2


@pytest.mark.parametrize(("status", "headers", "body", "size"), [
    (206, {"Content-Range": "bytes 0-99/1000"}, 100, 1000), (206, {"Content-Range": "bytes 0-99/100"}, 100, 100),
    (200, {}, 1000, 1000), (206, {"Content-Range": "bytes 5-99/1000"}, 95, None),
    (206, {"Content-Range": "bytes 0-99/*"}, 100, None), (206, {}, 100, None),
    (206, {"Content-Range": "bytes 0-99/1000"}, 50, None), (206, {"Content-Range": "items 0-99/1000"}, 100, None),
    (206, {"Content-Range": "bytes 0-99/1000"}, None, None), (304, {}, 100, None)])
def test_an_s3_load_takes_the_objects_size_from_a_ranged_replys_content_range(
        status: int, headers: dict[str, str], body: int | None, size: int | None) -> None:
    """The first GET asks for a range: a 206 names the object's size in its Content-Range
    (which must start at byte 0 and match the body); a 200 is the whole object."""
    response = urllib3.HTTPResponse(body=io.BytesIO(b""), headers=headers, status=status, preload_content=False)
    assert _object_size(response, body) == size


@pytest.mark.parametrize(("headers", "size"), [
    ({"Content-Length": "1234"}, 1234), ({"Content-Length": "1234", "Content-Encoding": "identity"}, 1234),
    ({}, None), ({"Content-Length": "12a"}, None), ({"Content-Length": "-1"}, None),
    ({"Content-Length": "1234", "Content-Encoding": "gzip"}, None)])
def test_an_s3_load_reads_into_its_memory_only_what_the_content_length_announces(headers: dict[str, str],
                                                                                 size: int | None) -> None:
    """A MinIO response's body is read into the store's load memory when its Content-Length
    gives the size (MinIO sends one); without a usable one, or with a Content-Encoding (the
    decoded body has another size), the body is read whole first."""
    response = urllib3.HTTPResponse(body=io.BytesIO(b""), headers=headers, preload_content=False)
    assert _content_length(response) == size


@pytest.mark.parametrize("memory_file", [True, False], ids=["memfd", "bytes"])
def test_a_held_state_decodes_again_and_again_to_tensors_of_their_own(memory_file: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh start's kept state: every decode equals the state as encoded, and writing into
    what one decode gave (training, an optimizer's buffers loaded without a copy) changes
    neither the next decode nor the first; without memory files it is kept as bytes."""
    if not memory_file:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    state = {"w": torch.randn(600, 600), "opt": {"state": {}, "groups": [{"lr": 0.1}]}, "step": 0}
    held = HeldState(state)
    first = held.decode()
    assert encode_state(first) == encode_state(state)
    first["w"].add_(1.0)
    second = held.decode()
    assert torch.equal(second["w"], state["w"]) and not torch.equal(first["w"], state["w"])
    held.close()
    assert torch.equal(first["w"], state["w"] + 1.0) and torch.equal(second["w"], state["w"])
    with pytest.raises(CheckpointError, match="cannot decode"):
        HeldState({"object": Opaque()}).decode()  # encodes (torch.save pickles it), never loads


def _store_errors() -> list[Exception]:
    from events.execution import StageFault
    from gpu_worker.checkpoint_cache import CachedCopyCorrupt

    ref = "ab" * 32
    return [CheckpointMissing(ref), CheckpointCorrupt(ref, "cd" * 32),
            CachedCopyCorrupt(ref, Path("/cache/ab") / ref, "cd" * 32),
            CheckpointStoreError("get", "bucket", "prefix/key", "127.0.0.1:9000", "AccessDenied", "denied"),
            StageFault("checkpoint_corrupt", "the source is corrupt", ref)]


@pytest.mark.parametrize("error", _store_errors(), ids=lambda e: type(e).__name__)
def test_store_errors_cross_a_process_boundary_whole(error: Exception) -> None:
    """A pool's worker process sends its exception back pickled (``replay reexecute``): an
    exception pickles as its class called with its message unless told otherwise, which broke
    those made of several parts (a TypeError in place of the error) or repeated the message in
    itself ('checkpoint checkpoint ... is missing is missing')."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)
