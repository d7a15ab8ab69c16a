"""Where the dashboard reads a study from, without ever writing: a run directory, an export or a
Kafka deployment.

Each source hands out the plan stream's records as they arrive (:meth:`DashboardSource.poll`)
and runs ``replay verify`` on demand (:meth:`DashboardSource.verify`):

* a **run directory** (``RUN_DIR``): its embedded log is followed by a RocksDB secondary
  instance (:class:`events.log.EmbeddedLog` with ``follow=True``) that catches up with the
  running coordinator at every poll (milliseconds; ``benchmarks/dashboard_follow.py`` measures
  it against reopening the log read-only); no lock is taken, nothing is written. A directory
  whose log does not exist yet is waited for. ``verify`` reads the stored projection and the
  log read-only, the plan stream cut at the projection's offset (a consistent pair while the
  coordinator writes both);
* an **export** (``EXPORT.jsonl``, ``stagetree log export``): read once;
* a **Kafka deployment** (``kafka://BOOTSTRAP[/PREFIX]``): a plain consumer
  (:class:`events.kafka_log.KafkaLog` with ``read_only=True``: no producer, no group, no
  commits) reading every partition of the plan topic, each from the last offset it saw there.
  Credentials come from the ``STAGETREE_KAFKA_*`` variables, never from the address.

The label a source shows the page (:attr:`DashboardSource.label`) never holds a secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from events import topics
from events.log import EmbeddedLog, Record
from replay.audit import (
    AuditError,
    LogDamaged,
    Source,
    check_key,
    kafka_location,
    open_export,
    open_kafka,
    open_source,
    probe_kafka,
)
from replay.tuner import verify_all


class SourceError(ValueError):
    """The dashboard's source cannot be read: it does not exist or is not a run directory,
    export or ``kafka://`` address (the message names it)."""


def _check_given_key(source: Source, secret: bytes | None) -> None:
    """Refuse a key given for a keyed log (a run directory's or an export's) that is not its
    key (:func:`replay.audit.check_key`): verify would show the chain broken at offset 0, a
    tampering that is not there. A keyed log without a key, or an unkeyed one with a key, is
    served: its views need no key, and verify names the mismatch as such.

    Raises:
        SourceError: naming ``--log-key`` and ``$STAGETREE_LOG_KEY``.
    """
    if secret and source.chain == "hmac-sha256":
        try:
            check_key(source, secret)
        except AuditError as exc:
            raise SourceError(str(exc)) from None


class DashboardSource(Protocol):
    """A read-only source of the plan stream."""

    kind: str  # "run" | "export" | "kafka"
    label: str  # what the page shows as the source: never a secret
    live: bool  # whether records may still arrive

    def poll(self) -> list[Record]:
        """The plan-stream records that arrived since the last poll, in offset order within
        each partition (I/O: call it off the event loop)."""
        ...

    def verify(self) -> dict[str, Any]:
        """``replay verify`` now, every check of the command (:func:`replay.tuner.verify_all`:
        the tuner's decisions recomputed from the study file the log names too):
        :meth:`replay.audit.AuditResult.as_dict`, plus ``scope`` (what was verified, in words)."""
        ...

    def close(self) -> None: ...


class RunDirSource:
    """A run directory, followed beside its running coordinator (see the module docstring).

    Args:
        path: the run directory (it or its ``log/`` may not exist yet).
        secret: the log's HMAC key, for :meth:`verify` only (never sent to the page).
    """

    kind = "run"
    live = True

    def __init__(self, path: Path, secret: bytes | None = None) -> None:
        self.path = Path(path)
        self.label = str(self.path)
        self._secret = secret
        self._log: EmbeddedLog | None = None
        self._next = 0

    def _open(self) -> EmbeddedLog | None:
        if self._log is None and (self.path / "log" / "CURRENT").is_file():
            self._log = EmbeddedLog(self.path / "log", follow=True)
        return self._log

    def poll(self) -> list[Record]:
        log = self._open()
        if log is None:
            return []
        try:
            log.catch_up()
        except Exception:  # noqa: BLE001 - rocksdict raises bare Exceptions; start a fresh follower
            log.close()
            self._log = None
            log = self._open()
            if log is None:
                return []
        records = list(log.read(topics.PLAN, self._next))
        if records:
            self._next = records[-1].offset + 1
        return records

    def verify(self) -> dict[str, Any]:
        source = open_source(self.path, self._secret, as_of_projection=True)
        result = verify_all(source, self._secret).as_dict()
        upto = max((r.offset for r in source.streams.get(topics.PLAN, [])), default=-1)
        scope = f"the run directory's log up to plan offset {upto}, the offset of its stored projection"
        if source.left_out:
            scope += f" ({source.left_out} later records were appended meanwhile; verify again after the run)"
        return {**result, "scope": scope}

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class ExportSource:
    """A JSONL export (``stagetree log export``), read once."""

    kind = "export"
    live = False

    def __init__(self, path: Path, secret: bytes | None = None) -> None:
        self.path = Path(path)
        self.label = str(self.path)
        self._secret = secret
        try:
            export = open_export(self.path)
            self._records: list[Record] | None = list(export.streams.get(topics.PLAN, []))
        except AuditError as exc:
            raise SourceError(str(exc)) from None
        _check_given_key(export, secret)

    def poll(self) -> list[Record]:
        records, self._records = self._records or [], None
        return records

    def verify(self) -> dict[str, Any]:
        return {**verify_all(open_export(self.path), self._secret).as_dict(), "scope": "the whole export"}

    def close(self) -> None:
        self._records = None


class KafkaSource:
    """A Kafka deployment's plan topic, read as a plain consumer (see the module docstring).

    Every partition of the plan topic is read (as many as the cluster shows once the topic
    exists); one partition holds the whole history of each plan keyed to it, and the page
    folds each partition on its own.
    """

    kind = "kafka"
    live = True

    def __init__(self, url: str, secret: bytes | None = None) -> None:
        from events.kafka_log import KafkaLog, security_from_env

        try:
            servers, prefix = kafka_location(url)
        except AuditError as exc:
            raise SourceError(str(exc)) from None
        self.url = f"kafka://{servers}/{prefix}"
        self.label = self.url
        self._secret = secret
        self._log = KafkaLog(servers, client_id="stagetree-dashboard", topic_prefix=prefix,
                             security=security_from_env(), read_only=True, timeout_s=30.0)
        try:
            probe_kafka(self._log, url)  # a mistyped address is named at once, as replay's sources are
        except AuditError as exc:
            self._log.close()
            raise SourceError(str(exc)) from None
        self._next: dict[int, int] = {}  # partition -> offset of the next record to read

    def poll(self) -> list[Record]:
        records = []
        for partition in range(self._log.partition_count(topics.PLAN)):
            part = list(self._log.read(topics.PLAN, self._next.get(partition, 0), partition=partition))
            if part:
                self._next[partition] = part[-1].offset + 1
            records += part
        return records

    def verify(self) -> dict[str, Any]:
        return {**verify_all(open_kafka(self.url), self._secret).as_dict(),
                "scope": "the deployment's plan stream as it is now (sealed up to its last LogSealed)"}

    def close(self) -> None:
        self._log.close()


def open_dashboard_source(where: str, secret: bytes | None = None) -> DashboardSource:
    """The source named by ``where``: ``kafka://BOOTSTRAP[/PREFIX]``, a JSONL export (a file) or
    a run directory (a directory, or a path that does not exist yet: a run about to start).

    Raises:
        SourceError: a malformed ``kafka://`` address, an unreadable export, or a path that is
            neither a directory nor an export (the message names it); a key given for a keyed
            run directory or export that is not its key (naming ``--log-key``).
    """
    if where.startswith("kafka://"):
        return KafkaSource(where, secret)
    path = Path(where)
    if path.is_file():
        return ExportSource(path, secret)
    if path.exists() and not path.is_dir():
        raise SourceError(f"source {where!r} is neither a run directory nor a JSONL export")
    if path.is_dir() and not (path / "log").exists() and any(path.iterdir()):
        raise SourceError(f"source {where!r} is a directory without a log/: not a run directory (a study run on "
                          "Kafka is read from its deployment: kafka://BOOTSTRAP/PREFIX)")
    if secret and (path / "log" / "CURRENT").is_file():  # a log written later is not checked
        try:
            run = open_source(path, secret)
        except LogDamaged:  # verify reports it
            pass
        else:
            _check_given_key(run, secret)
    return RunDirSource(path, secret)
