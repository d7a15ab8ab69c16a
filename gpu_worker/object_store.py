"""Checkpoint storage in an S3 object store (MinIO), and opening a store from a URL.

``S3CheckpointStore`` implements the ``CheckpointStore`` protocol of
``gpu_worker.checkpoint`` on an S3 bucket with the ``minio`` client. Objects
are content-addressed exactly as in ``LocalCheckpointStore``: the checkpoint
whose bytes hash to ``ref`` (sha256, 64 lowercase hex digits) is the object
``PREFIX/ref[:2]/ref`` of the bucket. ``put`` returns only once the object is
stored and its sha256 verified, so a worker publishes CheckpointSaved only for an
object that is stored and verified (DESIGN.md invariant 4; issue 3 item 4): by
the store itself, which checks the sha256 the upload carries
(``x-amz-checksum-sha256``) before it keeps the object and says so in its
reply, or, where it does not say so, by downloading the object again.

``open_checkpoint_store(url)`` turns the ``--checkpoint-store`` value
(``s3://BUCKET/PREFIX``, ``file://PATH`` or a plain path) into a store; for
S3 it takes the endpoint and the credentials from ``STAGETREE_S3_*``
environment variables, never from the URL.

Credentials are handed to the minio client and kept nowhere else: they are
not attributes of the store, not in its ``repr``, and not in any exception
message or log record this module produces.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import certifi
import urllib3
from minio import Minio
from minio.error import MinioException, S3Error

from gpu_worker.checkpoint import (
    _READ_CHUNK,
    CheckpointCorrupt,
    CheckpointMissing,
    CheckpointRef,
    CheckpointStore,
    LoadedBytes,
    LoadMemory,
    LocalCheckpointStore,
    StorageError,
    Verification,
    _check_ref,
    sha256_hex,
    use_pending,
)

_T = TypeVar("_T")

__all__ = [
    "CREDENTIAL_CODES",
    "CheckpointStoreError",
    "ENV_S3_ACCESS_KEY",
    "ENV_S3_ENDPOINT",
    "ENV_S3_REGION",
    "ENV_S3_SECRET_KEY",
    "ENV_S3_SECURE",
    "S3CheckpointStore",
    "open_checkpoint_store",
]

ENV_S3_ENDPOINT = "STAGETREE_S3_ENDPOINT"
"""``HOST:PORT`` of the S3 server (an ``http://`` or ``https://`` prefix also sets TLS)."""
ENV_S3_ACCESS_KEY = "STAGETREE_S3_ACCESS_KEY"
ENV_S3_SECRET_KEY = "STAGETREE_S3_SECRET_KEY"
ENV_S3_SECURE = "STAGETREE_S3_SECURE"
"""Optional: ``true``/``false`` (or ``1``/``0``, ``yes``/``no``, ``on``/``off``); default false."""
ENV_S3_REGION = "STAGETREE_S3_REGION"
"""Optional: the bucket's region; when unset the client asks the server."""

SINGLE_PUT_BYTES = 5 * 1024**3
"""The largest checkpoint (bytes) uploaded in one PUT, S3's limit for one: such a PUT carries the
object's sha256, which the store verifies (:meth:`S3CheckpointStore.put`)."""
GET_CONCURRENCY = 8
"""Ranged GETs one load of a large checkpoint keeps in flight at once (the first one's included):
:meth:`S3CheckpointStore.load_pending`."""
FIRST_RANGE_BYTES = 8 << 20
"""The bytes a load's first GET asks for: an object up to this size comes in that one request;
a larger one's rest in ranges of at least this size."""
PUT_CONCURRENCY = 8
"""Uploads :meth:`S3CheckpointStore.put_many` keeps in flight at once (boto3's transfer manager
keeps 10). An object store answers one request in milliseconds here and tens of them across a
network, which bounds a worker whose stages are shorter than that when it stores one at a time."""
POOL_CONNECTIONS = GET_CONCURRENCY + PUT_CONCURRENCY + 2
"""Connections the store's HTTP pool keeps to the endpoint: a load's ranged GETs and the uploads
of a ``put_many`` are in flight together when a worker loads its next source while its last
path's checkpoints are stored, plus single requests (an ``exists``, a ``put``) from other
threads. A connection beyond the pool is closed once its request ends (the minio client's own
pool keeps 10: the next request then opens a new TCP, and over HTTPS TLS, connection, and
urllib3 warns "Connection pool is full")."""
PROBE_TIMEOUT_S = 10.0
"""Seconds each request of :meth:`S3CheckpointStore.probe` may take to connect, and then to be
answered: a worker's check of its store ends in bounded time (the store's own requests wait up
to 5 minutes, and are tried 6 times)."""
_MIN_PART_BYTES = 5 * 1024**2  # the minio client's smallest part size (an object up to it is one PUT)
_CHECKSUM_HEADER = "x-amz-checksum-sha256"  # S3's full-object sha256: base64 of the digest

# S3 "not there" error codes: the object or its whole bucket is absent.
_ABSENT_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchObject"})
CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"}
)
"""The S3 error codes of a request refused for its credentials (CheckpointStoreError.code)."""
_BUCKET_PATTERN = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4_PATTERN = re.compile(r"\d+\.\d+\.\d+\.\d+")
_ENDPOINT_PATTERN = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class CheckpointStoreError(StorageError):
    """An object-store request failed for a reason other than a missing or corrupt object.

    Attributes: ``operation`` (``"put"``, ``"get"``, ``"stat"``, ``"delete"``,
    ``"check bucket"``, ...), ``bucket``, ``key`` (object name, or None for a
    bucket-level request), ``endpoint`` and ``code`` (the S3 error code such as
    ``"AccessDenied"``, or the name of the transport error such as
    ``"MaxRetryError"``). The message names the bucket and key, never the
    credentials; the original minio/urllib3 exception is not chained, so no
    unscrubbed text travels with it.
    """

    def __init__(
        self, operation: str, bucket: str, key: str | None, endpoint: str, code: str, detail: str
    ) -> None:
        target = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
        super().__init__(f"{operation} {target} at {endpoint} failed: {code}: {detail}")
        self.operation = operation
        self.bucket = bucket
        self.key = key
        self.endpoint = endpoint
        self.code = code
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None, str, str, str]]:  # pickled whole
        return type(self), (self.operation, self.bucket, self.key, self.endpoint, self.code, self.detail)


def _validate_bucket(bucket: str) -> str:
    if (
        not isinstance(bucket, str)
        or _BUCKET_PATTERN.fullmatch(bucket) is None
        or _IPV4_PATTERN.fullmatch(bucket) is not None
        or any(pair in bucket for pair in ("..", ".-", "-."))
    ):
        raise ValueError(
            "bucket must be an S3 bucket name (3-63 lowercase letters, digits, '.' and '-', "
            f"starting and ending with a letter or digit), got {bucket!r}"
        )
    return bucket


def _normalize_prefix(prefix: str) -> str:
    """``"/a/b/"`` -> ``"a/b"``; ValueError for empty, ``.`` or ``..`` segments or a backslash."""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {prefix!r}")
    stripped = prefix.strip("/")
    if not stripped:
        return ""
    segments = stripped.split("/")
    if any(segment in ("", ".", "..") for segment in segments) or "\\" in stripped:
        raise ValueError(
            f"prefix must be '/'-separated names without empty, '.' or '..' parts, got {prefix!r}"
        )
    return stripped


def _validate_endpoint(endpoint: str) -> str:
    if not isinstance(endpoint, str) or _ENDPOINT_PATTERN.fullmatch(endpoint) is None:
        raise ValueError(
            f"endpoint must be HOST or HOST:PORT without scheme or path, got {endpoint!r}"
        )
    return endpoint


class S3CheckpointStore:
    """CheckpointStore in an S3 bucket (MinIO): object ``ref`` is ``prefix/ref[:2]/ref``.

    ``endpoint`` is ``HOST:PORT`` (no scheme); ``secure`` selects HTTPS;
    ``region`` is the bucket's region (None: asked from the server).
    ``access_key`` / ``secret_key`` go to the minio client only. The bucket
    must exist: a store never creates one (a mistyped bucket would have been
    created, and the deployment's checkpoints split between two buckets);
    ``put`` raises CheckpointStoreError with code ``NoSuchBucket``, and
    :meth:`check_bucket` tells a worker before it joins. ``http_client``
    (optional) replaces the store's default urllib3 pool (the minio client's:
    5 retries with backoff, 5 minute timeouts, the CA certificates of
    ``$SSL_CERT_FILE`` or certifi, but :data:`POOL_CONNECTIONS` connections
    kept), e.g. to fail fast.

    Uploads are single S3 PUTs up to :data:`SINGLE_PUT_BYTES` (multipart
    above); S3 makes an object visible only when complete, so a crash
    mid-upload leaves no object. A single PUT carries the object's sha256 as
    its S3 checksum: the store hashes what it received and refuses the object
    when that differs, and its reply echoes the checksum it verified and
    stored with the object; ``put`` then returns without a download. Where
    the reply does not echo it (a store without S3 checksums, a multipart
    upload) ``put`` verifies by downloading, as it did before (issue 15: the
    download doubled each save's traffic, and its hashing competed with
    training for the CPU). :meth:`put_many` keeps up to
    :data:`PUT_CONCURRENCY` such uploads in flight.

    Errors: ValueError for a malformed ref, bucket, prefix or endpoint;
    CheckpointMissing / CheckpointCorrupt as in the protocol; every other
    failure of the server or the connection raises CheckpointStoreError
    naming the operation, bucket, key and endpoint.
    """

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        prefix: str = "",
        *,
        access_key: str,
        secret_key: str,
        secure: bool = False,
        region: str | None = None,
        http_client: urllib3.PoolManager | None = None,
    ) -> None:
        self.endpoint = _validate_endpoint(endpoint)
        self.bucket = _validate_bucket(bucket)
        self.prefix = _normalize_prefix(prefix)
        self.secure = bool(secure)
        self.region = region
        if not isinstance(access_key, str) or not access_key:
            raise ValueError("access_key must be a non-empty str")
        if not isinstance(secret_key, str) or not secret_key:
            raise ValueError("secret_key must be a non-empty str")
        self._secrets = (access_key, secret_key)
        self._client = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            secure=self.secure,
            region=region,
            http_client=http_client if http_client is not None else _http_client(),
        )
        self._bucket_ready = False
        self._memory = LoadMemory()  # what loads download into, reused: see load_pending

    def __repr__(self) -> str:
        return (
            f"S3CheckpointStore(endpoint={self.endpoint!r}, bucket={self.bucket!r}, "
            f"prefix={self.prefix!r}, secure={self.secure!r}, region={self.region!r})"
        )

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        # Pickling would copy the credentials into whatever receives the bytes.
        raise TypeError(
            "S3CheckpointStore cannot be pickled (it holds credentials); "
            "pass the store URL and open_checkpoint_store() it on the other side"
        )

    @property
    def url(self) -> str:
        """``s3://BUCKET/PREFIX``, the URL ``open_checkpoint_store`` opens (no credentials)."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, ref: str) -> str:
        """Return the object name ``prefix/ref[:2]/ref`` (ValueError on a malformed ref)."""
        _check_ref(ref)
        name = f"{ref[:2]}/{ref}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, data: bytes) -> CheckpointRef:
        """Store ``data`` and return its ref once the stored object is verified.

        A no-op (no upload) when an object with the right bytes is already
        stored; an object stored under the same ref with other bytes (corrupt)
        is overwritten. The upload carries the sha256 (up to
        :data:`SINGLE_PUT_BYTES`): when the store's reply confirms it, the
        store verified the bytes it keeps; otherwise the object is downloaded
        and hashed. Raises CheckpointCorrupt
        when the stored object does not read back with the right hash,
        CheckpointMissing when it vanished before it could be read back (a
        concurrent ``delete``), CheckpointStoreError on any other failure (code
        ``NoSuchBucket``: the bucket does not exist, see :meth:`check_bucket`),
        among them a store that refused the upload because the bytes it
        received do not hash to ``ref`` (code ``XAmzContentChecksumMismatch``
        on MinIO, ``BadDigest`` on AWS): nothing is stored then, and a retry
        sends the bytes again.
        """
        data = bytes(data)
        ref = sha256_hex(data)
        key = self.key(ref)
        self._ensure_bucket()
        if self._intact(ref, key, len(data)):
            return CheckpointRef(ref=ref, size=len(data))
        metadata: dict[str, str | list[str] | tuple[str]] = {"stagetree-sha256": ref}  # minio's DictType
        single = len(data) <= SINGLE_PUT_BYTES
        checksum = base64.b64encode(bytes.fromhex(ref)).decode("ascii")
        if single:
            metadata[_CHECKSUM_HEADER] = checksum
        with self._translate("put", key):
            written = self._client.put_object(
                self.bucket,
                key,
                io.BytesIO(data),  # read whole from offset 0: the same bytes object, not a copy
                len(data),
                content_type="application/octet-stream",
                metadata=metadata,
                part_size=max(len(data), _MIN_PART_BYTES) if single else 0,
            )
        if single and written.http_headers.get(_CHECKSUM_HEADER) == checksum:
            return CheckpointRef(ref=ref, size=len(data))  # the store verified the sha256
        stored = self.get(ref)  # raises CheckpointCorrupt / CheckpointMissing
        return CheckpointRef(ref=ref, size=len(stored))

    def put_many(self, datas: Sequence[bytes]) -> list[CheckpointRef]:
        """Store several objects, up to :data:`PUT_CONCURRENCY` uploads in flight at once, each
        as :meth:`put` stores one (verified before its ref is returned). Returns their refs in
        order once every upload ended; raises what the first failed one raised, by position
        (then none is to be trusted; those that succeeded stay stored, and a retry skips them).
        Holds no bytes beyond ``datas``: the caller bounds what it passes at once."""
        if len(datas) <= 1:
            return [self.put(data) for data in datas]
        self._ensure_bucket()  # once, before the uploads race to it
        with futures.ThreadPoolExecutor(min(PUT_CONCURRENCY, len(datas)), thread_name_prefix="s3-put") as uploads:
            pending = [uploads.submit(self.put, data) for data in datas]
        return [upload.result() for upload in pending]

    def get(self, ref: str) -> bytes:
        """Download object ``ref`` and return its bytes after checking their sha256.

        Raises CheckpointMissing when the object (or the bucket) is absent,
        CheckpointCorrupt(ref, actual) when the bytes hash to ``actual``,
        CheckpointStoreError on any other failure (a short read included).
        """
        key = self.key(ref)
        data = self._download(ref, key)
        actual = sha256_hex(data)
        if actual != ref:
            raise CheckpointCorrupt(ref, actual)
        return data

    def load(self, ref: str, use: Callable[[LoadedBytes], _T]) -> _T:
        """Download object ``ref`` and return ``use`` of its bytes once they hash to ``ref``
        (:meth:`load_pending`, checked): how a worker loads a checkpoint. Nothing ``use`` returns
        from bytes that do not verify is returned.

        Raises as :meth:`get`, CheckpointCorrupt also when ``use`` failed on the bytes; else
        what ``use`` raises.
        """
        value, verification = self.load_pending(ref, use)
        verification.check()
        return value

    def load_pending(self, ref: str, use: Callable[[LoadedBytes], _T]) -> tuple[_T, Verification]:
        """Download object ``ref`` and return ``use`` of its bytes and the :class:`Verification
        <gpu_worker.checkpoint.Verification>` that they hash to ``ref``, which may still be
        running: how a worker loads a checkpoint and goes on before the hash ends
        (:meth:`LocalCheckpointStore.load_pending
        <gpu_worker.checkpoint.LocalCheckpointStore.load_pending>`).

        The object is read into memory this store keeps for the next load, as the local
        store reads a file (:class:`~gpu_worker.checkpoint.LoadMemory`: a memory file that
        :meth:`LoadedBytes.decode <gpu_worker.checkpoint.LoadedBytes.decode>` maps, from 1 MiB
        on Linux), hashed chunk by chunk on a helper thread as it arrives, while ``use`` runs
        and after it returns. The first GET asks for its first :data:`FIRST_RANGE_BYTES`;
        a larger object's rest comes in up to ``GET_CONCURRENCY - 1`` ranged GETs at once, sent
        as soon as the first reply names the size (S3 serves each connection at a bounded rate:
        one stream of a large checkpoint is a load's slowest part). A reply without usable
        sizes (no Content-Length, a Content-Encoding) is read whole first.

        Raises as :meth:`get` (CheckpointCorrupt only when ``use`` failed on the bytes); else
        what ``use`` raises.
        """
        key = self.key(ref)
        with self._memory.turn():
            try:
                with self._response(ref, key, length=FIRST_RANGE_BYTES) as response:
                    read = self._read_ranges(ref, key, response)
                    if read is None:  # a reply without usable sizes
                        data = response.read() if response.status == 200 else None
            except CheckpointStoreError as exc:
                if exc.code != "InvalidRange":  # an empty object has no first byte to ask for
                    raise
                read = data = None
            if read is not None:
                return self._memory.use(ref, read, use)
            if data is None:
                with self._response(ref, key) as response:
                    data = response.read()
            return use_pending(ref, data, use)

    def exists(self, ref: str) -> bool:
        """Return whether an object is stored under ``ref`` (its bytes are not checked)."""
        return self._stat_size(self.key(ref)) is not None

    def delete(self, ref: str) -> None:
        """Remove object ``ref``; a no-op when it (or the bucket) is absent."""
        key = self.key(ref)
        try:
            with self._translate("delete", key):
                self._client.remove_object(self.bucket, key)
        except CheckpointStoreError as exc:
            if exc.code not in _ABSENT_CODES:
                raise

    # ------------------------------------------------------------------ internals

    def _intact(self, ref: str, key: str, size: int) -> bool:
        """Whether ``key`` holds exactly the bytes of ``ref`` (a size check first, then a hash)."""
        stored_size = self._stat_size(key)
        if stored_size is None or stored_size != size:
            return False
        try:
            return sha256_hex(self._download(ref, key)) == ref
        except CheckpointMissing:
            return False

    def _stat_size(self, key: str) -> int | None:
        """Size in bytes of object ``key``, or None when it (or the bucket) is absent."""
        try:
            with self._translate("stat", key):
                stat = self._client.stat_object(self.bucket, key)
        except CheckpointStoreError as exc:
            if exc.code in _ABSENT_CODES:
                return None
            raise
        return stat.size

    def _read_ranges(self, ref: str, key: str, response: urllib3.BaseHTTPResponse
                     ) -> tuple[LoadedBytes, Any] | None:
        """Read the object whose first range ``response`` holds into the load memory, the rest
        in ranged GETs on threads of their own (:meth:`LoadMemory.read
        <gpu_worker.checkpoint.LoadMemory.read>`); None when the reply's sizes are not usable."""
        first = _content_length(response)
        size = _object_size(response, first)
        if first is None or size is None:
            return None
        rest = size - first
        count = min(GET_CONCURRENCY - 1, -(-rest // FIRST_RANGE_BYTES))
        step = -(-rest // count) if count else 0
        parts = [(offset, functools.partial(self._fill, ref, key, offset)) for offset in range(first, size, step or 1)]
        return self._memory.read(size, response.readinto, parts if rest else ())

    def _fill(self, ref: str, key: str, offset: int, view: memoryview) -> int:
        """Read the object's ``len(view)`` bytes from ``offset`` into ``view`` (one ranged GET);
        how many it wrote (fewer when the object is shorter)."""
        with self._response(ref, key, offset=offset, length=len(view)) as response:
            got = 0
            while got < len(view) and (n := response.readinto(view[got:got + _READ_CHUNK])):
                got += n
            return got

    def _download(self, ref: str, key: str) -> bytes:
        with self._response(ref, key) as response:
            return response.read()

    @contextmanager
    def _response(self, ref: str, key: str, offset: int = 0, length: int = 0) -> Iterator[urllib3.BaseHTTPResponse]:
        """The GET response of ``key`` (its body not read yet), of ``length`` bytes from
        ``offset`` when ``length`` is not 0 (a ranged GET), closed and its connection released
        afterwards. Raises CheckpointMissing when the object (or the bucket) is absent,
        CheckpointStoreError when the request or reading the body fails (a short read
        included)."""
        response = None
        try:
            with self._translate("get", key):
                response = self._client.get_object(self.bucket, key, offset=offset, length=length)
                yield response
        except CheckpointStoreError as exc:
            if exc.code in _ABSENT_CODES:
                raise CheckpointMissing(ref) from None
            raise
        finally:
            if response is not None:
                response.close()
                response.release_conn()

    def check_bucket(self) -> None:
        """One request (a HEAD of the bucket) that the bucket exists.

        Raises:
            CheckpointStoreError: code ``NoSuchBucket`` when it does not (a store never
                creates one), a credential code (:data:`CREDENTIAL_CODES`) when the request is
                refused, another code when the store cannot be reached. Credentials limited to
                objects under a prefix, refused a look at the bucket itself, pass: the object
                requests that follow tell whether it is usable.
        """
        self._bucket_ready = False
        self._ensure_bucket()

    def probe(self, *, write: bool = True, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """Show that the store can be used, in bounded time: a HEAD of the bucket (as
        :meth:`check_bucket`), with ``write`` a PUT of the empty checkpoint (the object of
        ``sha256(b"")``, content-addressed as any other: writing it again changes nothing), and a
        HEAD of an object (that one, else one no checkpoint is). Each request is sent once, on a
        connection of its own (not the store's pool), and fails after ``timeout_s`` seconds to
        connect or to be answered: at most 3 requests, so about ``3 * 2 * timeout_s`` seconds in
        all. The caller retries what may pass later (``stagetree worker`` and ``serve`` check
        their store with it before they join the cluster).

        Raises:
            CheckpointStoreError: code ``NoSuchBucket`` when the bucket does not exist, a
                credential code (:data:`CREDENTIAL_CODES`) when a request is refused (a PUT too:
                credentials that may read but not write), another code when the endpoint cannot
                be reached or does not answer in time (the transport error's name, e.g.
                ``NewConnectionError``, ``ConnectTimeoutError``, ``ReadTimeoutError``) or
                answers with an error of its own (a 5xx reply's S3 code).
            ValueError: ``timeout_s`` is not a positive number of seconds.
        """
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"timeout_s is {timeout_s!r}, but must be a positive number of seconds")
        access_key, secret_key = self._secrets
        pool = _http_client(timeout_s, retry=False)
        once = S3CheckpointStore(self.endpoint, self.bucket, self.prefix, access_key=access_key,
                                 secret_key=secret_key, secure=self.secure, region=self.region, http_client=pool)
        try:
            once.check_bucket()
            ref = sha256_hex(b"") if write else "0" * 64
            if write:
                key = once.key(ref)
                with once._translate("put", key):
                    once._client.put_object(self.bucket, key, io.BytesIO(b""), 0,
                                            content_type="application/octet-stream",
                                            metadata={"stagetree-sha256": ref})
            once.exists(ref)
        finally:
            pool.clear()

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        try:
            with self._translate("check bucket", None):
                present = self._client.bucket_exists(self.bucket)
        except CheckpointStoreError as exc:
            if exc.code != "AccessDenied":
                raise
            present = True  # credentials limited to a prefix: the object requests will tell
        if not present:
            raise CheckpointStoreError("check bucket", self.bucket, None, self.endpoint, "NoSuchBucket",
                                       "the bucket does not exist (a checkpoint store never creates one: create it "
                                       "with the object store's tools; infra/up.sh creates the local deployment's)")
        self._bucket_ready = True

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return text

    @contextmanager
    def _translate(self, operation: str, key: str | None) -> Iterator[None]:
        """Turn minio/urllib3/socket errors into CheckpointStoreError (scrubbed, not chained)."""
        try:
            yield
        except S3Error as exc:
            code = exc.code or "S3Error"
            detail = exc.message or "no message"
            if code in CREDENTIAL_CODES:
                detail += f" (check {ENV_S3_ACCESS_KEY} / {ENV_S3_SECRET_KEY})"
            error = CheckpointStoreError(
                operation, self.bucket, key, self.endpoint, code, self._scrub(detail)
            )
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            error = CheckpointStoreError(
                operation,
                self.bucket,
                key,
                self.endpoint,
                type(exc).__name__,
                self._scrub(str(exc)),
            )
        else:
            return
        raise error from None


def _object_size(response: urllib3.BaseHTTPResponse, body: int | None) -> int | None:
    """The size in bytes of the object a GET's reply is part of: the total of its Content-Range
    (a ranged GET's 206), else ``body``, the reply's own size (a 200: the store sent it whole);
    None when neither is usable."""
    if response.status != 206:
        return body if response.status == 200 else None
    unit, _, span = response.headers.get("Content-Range", "").partition(" ")
    first_last, _, total = span.partition("/")
    first, _, last = first_last.partition("-")
    try:
        size, start, end = int(total), int(first), int(last)
    except ValueError:
        return None
    if unit.strip().lower() != "bytes" or start != 0 or body != end + 1 or not 0 < body <= size:
        return None
    return size


def _content_length(response: urllib3.BaseHTTPResponse) -> int | None:
    """The body's size in bytes from the response's Content-Length, or None without one (or
    with a Content-Encoding, whose decoded body has another size)."""
    if response.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        return None
    try:
        size = int(response.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return size if size >= 0 else None


def _env_flag(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false (or 1/0, yes/no, on/off), got {raw!r}")


def _required(env: Mapping[str, str], name: str, what: str, url: str) -> str:
    value = env.get(name)
    if not value:
        raise ValueError(f"{name} is not set: {what} is needed to open checkpoint store {url}")
    return value


def _http_client(timeout_s: float = 300.0, *, retry: bool = True) -> urllib3.PoolManager:
    """The minio client's default HTTP pool (minio 7.2: 5 minute timeouts, 5 retries with
    backoff on 5xx replies, certificates checked against ``$SSL_CERT_FILE`` or certifi's), keeping
    :data:`POOL_CONNECTIONS` connections per endpoint instead of 10; ``timeout_s`` seconds to
    connect and to read instead, and without ``retry`` no request tried again (a refused
    connection or a 5xx reply fails it at once: :meth:`S3CheckpointStore.probe`)."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
        maxsize=POOL_CONNECTIONS,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]) if retry else False,
    )


def open_checkpoint_store(
    url: str | os.PathLike[str], env: Mapping[str, str] = os.environ
) -> CheckpointStore:
    """Open the checkpoint store named by ``url`` (the ``--checkpoint-store`` value).

    * ``s3://BUCKET`` or ``s3://BUCKET/PREFIX`` -> ``S3CheckpointStore`` with
      the endpoint from ``STAGETREE_S3_ENDPOINT`` (``HOST:PORT``; a leading
      ``http://`` / ``https://`` also sets TLS off / on), credentials from
      ``STAGETREE_S3_ACCESS_KEY`` and ``STAGETREE_S3_SECRET_KEY``, TLS from the
      optional ``STAGETREE_S3_SECURE`` (default false) and the region from the
      optional ``STAGETREE_S3_REGION``. Nothing is contacted until the first
      request.
    * ``file://PATH`` or a plain path -> ``LocalCheckpointStore(PATH)``.

    Raises ValueError naming the problem: an empty URL, an unsupported
    scheme, a malformed bucket or prefix, credentials, a query or a fragment
    in an ``s3://`` URL (the URL is then not echoed), an unset or empty
    required variable (named), or a malformed ``STAGETREE_S3_SECURE``.
    """
    text = os.fspath(url)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"checkpoint store URL must be a non-empty path or URL, got {url!r}")
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalCheckpointStore(Path(text))
    scheme = scheme.lower()
    if scheme == "file":
        if not rest:
            raise ValueError(f"checkpoint store URL {text!r} has no path")
        return LocalCheckpointStore(Path(rest))
    if scheme != "s3":
        raise ValueError(
            f"checkpoint store URL {text!r} has unsupported scheme {scheme!r}; "
            "use s3://BUCKET/PREFIX, file://PATH or a plain path"
        )
    if "@" in rest:
        raise ValueError(
            "checkpoint store URL must not contain credentials (user:password@); "
            f"set {ENV_S3_ACCESS_KEY} and {ENV_S3_SECRET_KEY} instead"
        )
    if "?" in rest or "#" in rest:
        raise ValueError(f"checkpoint store URL {text!r} must not have a query or fragment")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"checkpoint store URL {text!r} has no bucket: use s3://BUCKET/PREFIX")
    _validate_bucket(bucket)
    prefix = _normalize_prefix(prefix)

    endpoint = _required(env, ENV_S3_ENDPOINT, "the S3 endpoint HOST:PORT", text).strip()
    secure = _env_flag(env, ENV_S3_SECURE)
    for url_scheme, scheme_secure in (("http://", False), ("https://", True)):
        if endpoint.lower().startswith(url_scheme):
            if secure is not None and secure != scheme_secure:
                raise ValueError(
                    f"{ENV_S3_ENDPOINT}={endpoint!r} says {url_scheme[:-3]} but "
                    f"{ENV_S3_SECURE}={env[ENV_S3_SECURE]!r} says otherwise"
                )
            endpoint, secure = endpoint[len(url_scheme) :].rstrip("/"), scheme_secure
            break
    try:
        _validate_endpoint(endpoint)
    except ValueError:
        raise ValueError(
            f"{ENV_S3_ENDPOINT} must be HOST:PORT (optionally with http:// or https://), "
            f"got {env[ENV_S3_ENDPOINT]!r}"
        ) from None
    access_key = _required(env, ENV_S3_ACCESS_KEY, "the S3 access key", text)
    secret_key = _required(env, ENV_S3_SECRET_KEY, "the S3 secret key", text)
    return S3CheckpointStore(
        endpoint,
        bucket,
        prefix,
        access_key=access_key,
        secret_key=secret_key,
        secure=bool(secure),
        region=env.get(ENV_S3_REGION) or None,
    )
