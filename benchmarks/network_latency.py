"""An S3 endpoint across a slower network, for benchmarks: Toxiproxy in front of the local MinIO.

The local MinIO answers a request in about a millisecond; an object store across a network takes
tens of them (a cloud region's S3: 10 to 30 ms for a small PUT). :func:`delayed_endpoint` starts
Shopify's Toxiproxy (https://github.com/Shopify/toxiproxy), a TCP proxy built for exactly this,
between a client and an endpoint, and makes it hold every response ``latency_ms`` milliseconds
before it passes it on and, with ``rate_kb_s``, pass each connection's responses at a bounded
rate. The server is built on first use with ``go install`` (as ``infra/up.sh`` builds MinIO)
into ``.infra/cache/toxiproxy``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOXIPROXY_MODULE = "github.com/Shopify/toxiproxy/v2/cmd/server"
TOXIPROXY_VERSION = "v2.12.0"
CACHE = ROOT / ".infra" / "cache" / "toxiproxy"


def toxiproxy_server() -> Path:
    """The Toxiproxy server binary, built with ``go install`` when absent (about a minute).

    Raises RuntimeError when Go is missing or the build fails (its output is in
    ``.infra/cache/toxiproxy/build.log``)."""
    binary = CACHE / "bin" / "server"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(CACHE / "bin"), "GOPATH": str(CACHE / "go"),
           "GOMODCACHE": str(CACHE / "go" / "pkg" / "mod"), "GOCACHE": str(CACHE / "go" / "build")}
    log = CACHE / "build.log"
    try:
        with log.open("wb") as out:
            subprocess.run(["go", "install", "-trimpath", f"{TOXIPROXY_MODULE}@{TOXIPROXY_VERSION}"], cwd=CACHE,
                           env=env, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"building Toxiproxy ({TOXIPROXY_MODULE}@{TOXIPROXY_VERSION}) failed: {exc}; see {log}"
                           ) from None
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api(port: int, path: str, body: dict[str, object]) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10):
        pass


@contextmanager
def delayed_endpoint(upstream: str, latency_ms: int = 0, rate_kb_s: int | None = None) -> Iterator[str]:
    """``HOST:PORT`` of a proxy to ``upstream`` (``HOST:PORT``) that holds every response
    ``latency_ms`` milliseconds (Toxiproxy's ``latency`` toxic on the downstream direction) and,
    with ``rate_kb_s``, passes each connection's responses at most that many KB (1,000 bytes)
    per second (its ``bandwidth`` toxic: S3 serves one connection at a bounded rate), for the
    duration of the ``with`` block; the proxy server is stopped afterwards.

    Raises ValueError for a negative ``latency_ms`` or a ``rate_kb_s`` below 1; RuntimeError when
    the server cannot be built or does not answer within 10 seconds."""
    if isinstance(latency_ms, bool) or not isinstance(latency_ms, int) or latency_ms < 0:
        raise ValueError(f"`latency_ms` is {latency_ms!r}, but must be an int >= 0")
    if rate_kb_s is not None and (isinstance(rate_kb_s, bool) or not isinstance(rate_kb_s, int) or rate_kb_s < 1):
        raise ValueError(f"`rate_kb_s` is {rate_kb_s!r}, but must be an int >= 1")
    api, listen = _free_port(), _free_port()
    server = subprocess.Popen([str(toxiproxy_server()), "-host", "127.0.0.1", "-port", str(api)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                _api(api, "/proxies", {"name": "s3", "listen": f"127.0.0.1:{listen}", "upstream": upstream})
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"Toxiproxy did not answer on 127.0.0.1:{api}") from None
                time.sleep(0.05)
        _api(api, "/proxies/s3/toxics", {"name": "latency", "type": "latency", "stream": "downstream",
                                          "attributes": {"latency": latency_ms, "jitter": 0}})
        if rate_kb_s is not None:
            _api(api, "/proxies/s3/toxics", {"name": "rate", "type": "bandwidth", "stream": "downstream",
                                              "attributes": {"rate": rate_kb_s}})
        yield f"127.0.0.1:{listen}"
    finally:
        server.terminate()
        server.wait(10)
