"""Health checks and one-time setup for the local services started by infra/up.sh.

Usage (run by infra/up.sh with the project's virtualenv Python)::

    python infra/health.py kafka BOOTSTRAP PID TIMEOUT_S
    python infra/health.py minio ENDPOINT PID TIMEOUT_S BUCKET   # credentials from the environment
    python infra/health.py new-credentials                        # prints access key and secret key

Each check polls until the service answers or ``TIMEOUT_S`` seconds pass, and
fails fast if process ``PID`` exits. Kafka is healthy when the broker lists its
topics (confluent-kafka AdminClient); MinIO is healthy when it lists buckets
(minio client), after which ``BUCKET`` is created if missing. Exit status 0 on
success; otherwise 1 with a one-line reason on stderr. Secrets are read from
``STAGETREE_S3_ACCESS_KEY`` / ``STAGETREE_S3_SECRET_KEY`` and never printed
(except by ``new-credentials``: two lines, access key then secret key, which
up.sh reads into shell variables and writes only to the 0600 file ``.infra/env``).
"""

from __future__ import annotations

import logging
import os
import secrets
import string
import sys
import time
from typing import NoReturn


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _fail(msg: str) -> NoReturn:
    print(msg, file=sys.stderr)
    raise SystemExit(1)


def check_kafka(bootstrap: str, pid: int, timeout_s: float) -> None:
    from confluent_kafka.admin import AdminClient

    quiet = logging.getLogger("stagetree.infra.kafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": quiet, "socket.connection.setup.timeout.ms": 2000})
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if not _alive(pid):
            _fail(f"kafka: broker process {pid} exited before {bootstrap} answered")
        try:
            md = admin.list_topics(timeout=2)
            if md.brokers:
                return
            last = "metadata without brokers"
        except Exception as exc:  # KafkaException: broker not up yet
            last = str(exc)
        if time.monotonic() > deadline:
            _fail(f"kafka: {bootstrap} did not list topics within {timeout_s:g} s (last error: {last})")
        time.sleep(0.5)


def check_minio(endpoint: str, pid: int, timeout_s: float, bucket: str) -> None:
    from minio import Minio

    access = os.environ.get("STAGETREE_S3_ACCESS_KEY")
    secret = os.environ.get("STAGETREE_S3_SECRET_KEY")
    if not access or not secret:
        _fail("minio: STAGETREE_S3_ACCESS_KEY / STAGETREE_S3_SECRET_KEY are not set (is .infra/env complete?)")
    import urllib3

    # Fail fast on a refused connection instead of urllib3's retries; the loop below retries.
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=10), retries=False)
    client = Minio(endpoint, access_key=access, secret_key=secret, secure=False, http_client=http)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if not _alive(pid):
            _fail(f"minio: server process {pid} exited before {endpoint} answered")
        try:
            client.list_buckets()
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
            return
        except Exception as exc:
            # S3Error carries code and message; never the credentials.
            last = f"{type(exc).__name__}: {getattr(exc, 'code', None) or exc}"
            if getattr(exc, "code", None) in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"}:
                _fail(f"minio: {endpoint} rejected the credentials in .infra/env ({exc.code}); "
                      "the data directory was created with other credentials")
        if time.monotonic() > deadline:
            _fail(f"minio: {endpoint} did not list buckets within {timeout_s:g} s (last error: {last})")
        time.sleep(0.5)


def new_credentials() -> None:
    alphabet = string.ascii_uppercase + string.digits
    access = "stagetree-" + "".join(secrets.choice(alphabet) for _ in range(12))
    secret = secrets.token_urlsafe(30)
    print(access)
    print(secret)


def main(argv: list[str]) -> None:
    if argv[:1] == ["kafka"] and len(argv) == 4:
        check_kafka(argv[1], int(argv[2]), float(argv[3]))
    elif argv[:1] == ["minio"] and len(argv) == 5:
        check_minio(argv[1], int(argv[2]), float(argv[3]), argv[4])
    elif argv == ["new-credentials"]:
        new_credentials()
    else:
        _fail(__doc__.split("\n\n")[1])


if __name__ == "__main__":
    main(sys.argv[1:])
