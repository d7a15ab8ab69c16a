"""Optuna's journal storage on a stagetree log: durable, replayable, and in a run directory
tamper-evident.

Optuna's :class:`~optuna.storages.JournalStorage` keeps a study as a list of operations (create
study, create trial, set a parameter, report a value, ...) and rebuilds it by replaying them in
order; a :class:`~optuna.storages.journal.BaseJournalBackend` only appends and reads that list.
Here the list is one stream of a stagetree log (:data:`events.topics.OPTUNA`), one record per
operation, so the journal's log number is the record's offset:

* **a run directory** (:class:`RunDirJournalBackend`): the stream lives in the run directory's
  embedded log next to a study's plan stream, hash-chained like every stream, so
  ``stagetree log export`` carries it and ``stagetree replay verify`` checks its chain. Several
  processes of one machine may use it at once: the first becomes the log's one writer and the
  others send their operations to it (:class:`events.shared_log.SharedEmbeddedLog`).
* **a Kafka topic** (:class:`KafkaJournalBackend`): ``<prefix>stagetree.optuna``, partition 0,
  written with acks=all by an idempotent producer; any number of processes on any machines.
  Kafka records carry no hash chain (stagetree seals only its plan stream).

Values are written with Python's ``json`` as Optuna's own file backend writes them (``NaN`` and
``Infinity`` included). No snapshots (:class:`~optuna.storages.journal.BaseJournalSnapshot`) are
kept: they are pickles, which a tamper-evident log should not make anyone load.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from events import topics
from events.kafka_log import KafkaLog, KafkaUrlError, parse_kafka_url, security_from_env
from events.keys import secret_from
from events.log import EventLog, LogError
from events.shared_log import SharedEmbeddedLog
from stagetree.integration import require

optuna = require("optuna", "optuna", "stagetree.integration.optuna")
from optuna.storages import JournalStorage  # noqa: E402
from optuna.storages.journal import BaseJournalBackend  # noqa: E402

KAFKA_SCHEME = "kafka://"


class JournalDecodeError(LogError):
    """A record of the journal stream is not an Optuna journal operation (JSON object)."""


class LogJournalBackend(BaseJournalBackend):
    """A :class:`~optuna.storages.journal.BaseJournalBackend` on one stream of a stagetree log.

    Log number ``n`` is the record at offset ``n`` of ``stream`` (offsets are dense from 0 in
    both transports). ``open_log`` makes the log on first use in a process (again after a
    fork); the backend pickles without it. Thread-safe.

    Raises (from ``read_logs``): :class:`JournalDecodeError` naming the offset of a record that
    is not a JSON object; :class:`events.log.LogError` when the log fails.
    """

    def __init__(self, open_log: Callable[[], EventLog], stream: str = topics.OPTUNA) -> None:
        self._open_log = open_log
        self.stream = stream
        self._log: EventLog | None = None
        self._pid = -1
        self._mutex = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_log", "_pid", "_mutex")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._log, self._pid, self._mutex = None, -1, threading.Lock()

    def log(self) -> EventLog:
        """The log, opened in this process on first use."""
        if self._log is None or self._pid != os.getpid():
            self._log, self._pid = self._open_log(), os.getpid()  # a forked copy is dropped, not closed
        return self._log

    def _check_pid(self) -> None:
        if self._pid not in (-1, os.getpid()):  # forked: the parent's lock may have been held
            self._mutex = threading.Lock()

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        """The operations with log number >= ``log_number_from``, in order."""
        self._check_pid()
        with self._mutex:
            records = list(self.log().read(self.stream, log_number_from))
        logs = []
        for expected, record in enumerate(records, start=log_number_from):
            if record.offset != expected:
                raise JournalDecodeError(f"stream {self.stream}: offset {expected} is missing "
                                         f"(the next record has offset {record.offset})")
            try:
                op = json.loads(record.value)
            except ValueError as exc:
                raise JournalDecodeError(f"stream {self.stream}, offset {record.offset}: not JSON ({exc})") from None
            if not isinstance(op, dict):
                raise JournalDecodeError(f"stream {self.stream}, offset {record.offset}: a journal operation "
                                         f"must be a JSON object, got {type(op).__name__}")
            logs.append(op)
        return logs

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        """Append operations atomically, in order; returns once they are durable.

        Each record's key is a fresh request id (``<uuid>.<i>``), so a retried batch is
        recognized (:meth:`events.shared_log.SharedEmbeddedLog.append_many`)."""
        request = uuid.uuid4().hex
        items = [(f"{request}.{i}", json.dumps(op, separators=(",", ":")).encode()) for i, op in enumerate(logs)]
        self._check_pid()
        with self._mutex:
            self.log().append_many(self.stream, items)

    def close(self) -> None:
        """Close the log of this process (a run directory's owner hands it over)."""
        with self._mutex:
            if self._log is not None and self._pid == os.getpid():
                self._log.close()
            self._log = None


class _OpenRunDir:
    """A picklable ``open_log`` for a run directory."""

    def __init__(self, run_dir: Path, secret: bytes | None, timeout_s: float) -> None:
        self.run_dir, self.secret, self.timeout_s = run_dir, secret, timeout_s

    def __call__(self) -> SharedEmbeddedLog:
        return SharedEmbeddedLog(self.run_dir / "log", secret=self.secret, timeout_s=self.timeout_s)


class _OpenKafka:
    """A picklable ``open_log`` for a Kafka cluster (security settings from the environment)."""

    def __init__(self, bootstrap_servers: str, topic_prefix: str) -> None:
        self.bootstrap_servers, self.topic_prefix = bootstrap_servers, topic_prefix

    def __call__(self) -> KafkaLog:
        return KafkaLog(self.bootstrap_servers, topic_prefix=self.topic_prefix, client_id="stagetree-optuna",
                        security=security_from_env())


class RunDirJournalBackend(LogJournalBackend):
    """Optuna's journal in ``RUN_DIR/log``, stream :data:`events.topics.OPTUNA`.

    Process-safe on one machine: see :class:`events.shared_log.SharedEmbeddedLog` (the first
    process to use the run directory owns its log while it lives; a run directory whose log a
    running ``stagetree run`` holds cannot be used until it ends: :class:`events.log.LogLocked`
    after ``timeout_s``). ``secret``: the HMAC key of the log's hash chain (default
    ``$STAGETREE_LOG_KEY``), needed when the run directory was made with one.
    """

    def __init__(self, run_dir: str | Path, *, secret: bytes | None = None, timeout_s: float = 60.0) -> None:
        self.run_dir = Path(run_dir)
        super().__init__(_OpenRunDir(self.run_dir, secret if secret is not None else secret_from(None), timeout_s))


class KafkaJournalBackend(LogJournalBackend):
    """Optuna's journal on topic ``<topic_prefix>stagetree.optuna`` of a Kafka cluster.

    Any number of processes on any machines may share it: the broker orders their appends
    (partition 0), and an append returns once every in-sync replica has it (acks=all).
    Security settings come from ``$STAGETREE_KAFKA_*`` (:func:`events.kafka_log.security_from_env`).

    Raises:
        events.kafka_log.KafkaLogError: no broker at ``bootstrap_servers`` answered within
            :data:`~events.kafka_log.PROBE_DEADLINE_S` seconds (the message names them).
    """

    def __init__(self, bootstrap_servers: str, topic_prefix: str = "") -> None:
        self.bootstrap_servers, self.topic_prefix = bootstrap_servers, topic_prefix
        super().__init__(_OpenKafka(bootstrap_servers, topic_prefix))
        log = self.log()
        assert isinstance(log, KafkaLog)
        log.probe()  # an address where nothing answers is named now, not by each call after a minute


def journal_backend(url: str | Path, *, log_key: str | None = None, timeout_s: float = 60.0) -> LogJournalBackend:
    """The backend ``url`` names: ``kafka://HOST:PORT[,HOST:PORT...][/PREFIX]`` (topic
    ``PREFIX + "stagetree.optuna"``), else a run directory (a path, or ``file://PATH``).

    Raises:
        ValueError: ``url`` is empty, has another scheme, or a Kafka URL has no servers, a bad
            port, ``user@`` credentials (masked in the message) or a topic prefix Kafka does not
            allow (:func:`events.kafka_log.parse_kafka_url`).
        events.kafka_log.KafkaLogError: no broker answers at a Kafka URL (see
            :class:`KafkaJournalBackend`).
    """
    text = str(url)
    if text.startswith(KAFKA_SCHEME):
        try:
            servers, prefix = parse_kafka_url(text)
        except KafkaUrlError as exc:
            raise ValueError(f"`url` is {exc.shown!r}, but it {exc.reason}") from None
        return KafkaJournalBackend(servers, prefix)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if not text or "://" in text:
        raise ValueError(f"`url` is {str(url)!r}, but must be a run directory (a path or file://PATH) or "
                         "kafka://HOST:PORT[/PREFIX]")
    return RunDirJournalBackend(text, secret=secret_from(log_key), timeout_s=timeout_s)


def journal_storage(url: str | Path, *, log_key: str | None = None, timeout_s: float = 60.0) -> JournalStorage:
    """A ready :class:`optuna.storages.JournalStorage` on a stagetree log.

    ``url``: a run directory (``runs/hpo`` or ``file://runs/hpo``: the journal goes to stream
    ``stagetree.optuna`` of ``runs/hpo/log``, created if absent) or a Kafka cluster
    (``kafka://HOST:PORT[/PREFIX]``: topic ``PREFIX + "stagetree.optuna"``). ``log_key``: the
    HMAC key of a run directory's hash chain (default ``$STAGETREE_LOG_KEY``). ``timeout_s``:
    how long a run directory's log is waited for.

    Use it like any Optuna storage::

        study = optuna.create_study(study_name="s", storage=journal_storage("runs/hpo"), load_if_exists=True)

    Raises:
        ValueError: a bad ``url`` (see :func:`journal_backend`).
        events.kafka_log.KafkaLogError: no broker answers at a Kafka URL.
        events.log.LogLocked: the run directory's log is held by a process that does not share it.
    """
    return JournalStorage(journal_backend(url, log_key=log_key, timeout_s=timeout_s))
