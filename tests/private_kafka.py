"""A Kafka broker of a test's own, which the test may stop and restart (the shared one on
127.0.0.1:9092 serves everybody and is never stopped).

It is started the way ``infra/up.sh`` starts the shared one: KRaft combined mode from the jars
``infra/up.sh`` cached in ``.infra/cache/kafka/libs`` (so the ``infra_env`` fixture must have
run), ``infra/kafka/server.properties`` with free loopback ports and a data directory under the
test's temporary directory.
"""

from __future__ import annotations

import base64
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBS = REPO / ".infra" / "cache" / "kafka" / "libs"


def freeze(pid: int, timeout: float = 10) -> None:
    """SIGSTOP the process group of ``pid`` and wait until every thread of ``pid`` is stopped.
    The signal stops each thread only when that thread next runs: on this 2-core machine under
    load a broker's group stop took 5 to 34 ms to complete, and a broker thread answered a
    commit sent after ``killpg`` returned (2 of 25 commits meant to time out were committed)."""
    os.killpg(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that ended
                pass
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout} s: {states}"
        time.sleep(0.005)


def _free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range: the broker binds
    it seconds later (and again after a restart), and a port of that range may meanwhile become
    the local end of any outgoing connection of the suite's clients."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(max(10_000, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
        return port


def cluster_id() -> str:
    """A random KRaft cluster id, as Kafka's ``Uuid.randomUuid`` makes one: 22 url-safe base64 characters
    that do not start with ``-`` (one in 64 random ids does, and a command line reads it as an option)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


class PrivateBroker:
    """One KRaft broker+controller on two free loopback ports, data in ``root``."""

    def __init__(self, root: Path, cluster: str | None = None) -> None:
        if not (LIBS / ".pom.sha256").exists():
            raise RuntimeError(f"no Kafka jars in {LIBS}: infra/up.sh fetches them")
        self.root = root
        self.port = self.controller_port = _free_port()
        while self.controller_port == self.port:
            self.controller_port = _free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        data = root / "data"
        data.mkdir(parents=True)
        text = (REPO / "infra" / "kafka" / "server.properties").read_text()
        text = (text.replace("@KAFKA_DATA@", str(data))
                .replace("127.0.0.1:9092", f"127.0.0.1:{self.port}")
                .replace("127.0.0.1:9093", f"127.0.0.1:{self.controller_port}"))
        self.config = root / "server.properties"
        self.config.write_text(text)
        formatted = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "--ignore-formatted",
                       f"--cluster-id={cluster or cluster_id()}", f"--config={self.config}", tools=True),
            capture_output=True, text=True, timeout=120)
        if formatted.returncode != 0:
            raise RuntimeError(f"kafka.tools.StorageTool format exited {formatted.returncode}: "
                               f"{formatted.stdout}{formatted.stderr}")
        self.proc: subprocess.Popen[bytes] | None = None

    def _java(self, main: str, *args: str, tools: bool = False) -> list[str]:
        log4j = "tools-log4j.properties" if tools else "log4j.properties"
        return ["java", "-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                f"-Dlog4j.configuration=file:{REPO / 'infra' / 'kafka' / log4j}",
                f"-Dkafka.logs.dir={self.root / 'logs'}", "-cp", f"{LIBS}/*", main, *args]

    def start(self, timeout: float = 120) -> None:
        """Start the broker and wait until it answers metadata requests."""
        from confluent_kafka.admin import AdminClient

        out = (self.root / "broker.log").open("ab")
        self.proc = subprocess.Popen(self._java("kafka.Kafka", str(self.config)), stdout=out, stderr=out,
                                     start_new_session=True)
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, (self.root / "broker.log").read_text()[-3000:]
            try:
                admin.list_topics(timeout=2)
                return
            except Exception:
                assert time.monotonic() < deadline, f"the private broker did not answer in {timeout} s"
                time.sleep(0.5)

    def stop(self, timeout: float = 60) -> None:
        """Stop the broker (SIGTERM: a clean shutdown) and wait until it has exited."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.proc = None
