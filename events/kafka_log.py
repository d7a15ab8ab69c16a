"""The Kafka log transport: the :class:`~events.log.EventLog` protocol on confluent-kafka.

Each stream is a Kafka topic. ``stagetree.plan`` has ``plan_partitions`` partitions (default
8, a setting; fixed when the topic is created, read from the cluster afterwards) and every other
stream one, unless ``partitions`` says otherwise. A record goes to the partition of its key
(:func:`partition_for`, the Java client's murmur2 partitioner), so one partition holds every
record of one plan key, in append order: a plan's whole history (DESIGN.md "The event log").

Guarantees, compared with :class:`~events.log.EmbeddedLog`:

* **Offsets** are Kafka's offsets within a partition. They increase but are *not dense*:
  transactional producers (the serve roles, the workers: :class:`TransactionalAppender`)
  leave commit and abort markers that take offsets of their own, and records of aborted
  transactions are never delivered. A reader tracks the last offset it applied, never a count.
* **Durability**: every producer is idempotent with ``acks=all``; an append returns only after
  the broker acknowledged every record (``min.insync.replicas`` replicas hold it).
* **Order and duplicates**: the idempotent producer keeps the order of one ``append_many`` and
  never writes a record twice because of its own retries. A *process* that crashes and appends
  again can write an event twice; consumers recognize that by ``event_id``.
* **Atomicity**: :meth:`KafkaLog.append_many` validates every item before producing, but a
  broker failure in the middle may leave a prefix (:class:`DeliveryFailed`). A batch that must
  be all-or-nothing (a stage's end; a decision with its dispatch copy) goes through a
  :class:`TransactionalAppender`: one Kafka transaction, visible to ``read_committed``
  readers at once or never.
* **Fencing**: a :class:`TransactionalAppender`'s ``transactional.id`` names the role (the
  scheduler), partition or worker it writes for; starting one fences every earlier producer
  with the same id (its open transaction is aborted, its next one fails with :class:`Fenced`).
* **Hash chain**: records read from Kafka have ``chain == b""``; on Kafka the chain of each
  partition is kept by seal events (LogSealed), not per record.

Every consumer here reads ``read_committed``, with ``enable.auto.commit=False`` and no group
membership: it never commits offsets; consumers that need a durable position keep it with their
effect (the projection store keeps its offset in the same WriteBatch as its state; a decision
records its prefix inside the event, in the decision's own transaction).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka.partitioner import murmur2
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from events import topics
from events.codec import encode
from events.log import LogError, Record, check_items, event_key, is_broadcast
from events.models import Event

log = logging.getLogger(__name__)

DEFAULT_PLAN_PARTITIONS = topics.DEFAULT_PLAN_PARTITIONS

TRANSACTION_TIMEOUT_MS = 10_000
"""``transaction.timeout.ms`` of every transactional producer: how long the broker lets an open
transaction of a producer that died (kill -9) hold back ``read_committed`` readers before it
aborts it (at the broker's next ``transaction.abort.timed.out.transaction.cleanup.interval.ms``),
unless a successor with the same ``transactional.id`` aborts it at once by starting."""


PROBE_DEADLINE_S = 15.0
"""Seconds :meth:`KafkaLog.probe` waits for a first answer from the cluster by default: long
enough for a broker that is starting or slowed down (a loaded machine), short enough that a
mistyped address is reported at once rather than after the operations' ``timeout_s``."""

PROBE_ATTEMPT_S = 5.0
"""Seconds each metadata request of :meth:`KafkaLog.probe` waits at most (the client reconnects
meanwhile); it asks again until the deadline."""


_BROKER = re.compile(r"(?:(?i:plaintext|ssl|sasl_plaintext|sasl_ssl)://)?(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)"
                     r"(?::(\d{1,5}))?")
"""One address of Kafka's ``bootstrap.servers``: ``[PROTOCOL://]HOST[:PORT]``, PROTOCOL one
librdkafka knows (librdkafka's default port when none is given)."""


def check_bootstrap_servers(value: str, *, port: bool = False) -> str:
    """``value`` when it is Kafka's ``HOST:PORT[,HOST:PORT...]`` (``port``: every address must
    give its port), checked before librdkafka tries a mistyped address for a minute.

    Raises:
        ValueError: an address is not one (the address and the value are named).
    """
    for address in value.split(","):
        address = address.strip()
        match = _BROKER.fullmatch(address)
        if match is None or (match[1] is None and port) or (match[1] is not None and not 1 <= int(match[1]) <= 65535):
            hint = (" (kafka://HOST:PORT is how a replay source names a deployment; here give HOST:PORT)"
                    if address.lower().startswith("kafka://") else "")
            raise ValueError(f"must be HOST:PORT[,HOST:PORT...] with ports 1 to 65535, got {value!r} "
                             f"({address!r}){hint}")
    return value


KAFKA_URL = "kafka://HOST:PORT[,HOST:PORT...][/PREFIX]"
"""How a ``kafka://`` URL is written (:func:`parse_kafka_url`)."""


class KafkaUrlError(ValueError):
    """A malformed ``kafka://`` URL. ``shown`` is the URL with any ``user@`` credentials masked
    (``***@``), ``reason`` what is wrong, worded to follow it (``"must be ..."``); the message is
    both: it never holds the credentials."""

    def __init__(self, shown: str, reason: str) -> None:
        super().__init__(f"{shown!r} {reason}")
        self.shown, self.reason = shown, reason


def parse_kafka_url(url: str, *, topic: str | None = None) -> tuple[str, str]:
    """``(bootstrap servers, topic prefix)`` of ``kafka://HOST:PORT[,HOST:PORT...][/PREFIX]``:
    every address with its port, PREFIX empty (no prefix) or a valid part of a Kafka topic name
    (:data:`events.topics.TOPIC_PART`). ``topic``: a stream name the URL may also end with, after
    the prefix (``kafka://HOST:PORT/<prefix><topic>``: replay names a deployment by its plan
    topic too); the prefix is what precedes it. Credentials never go in the URL: they come from
    the ``STAGETREE_KAFKA_*`` variables.

    Raises:
        KafkaUrlError: (a ValueError) not such a URL, naming it and what is wrong: another
            scheme, an address without a port or with one outside 1 to 65535, ``user@``
            credentials (masked in the message), a topic prefix Kafka does not allow.
    """
    if not isinstance(url, str) or not url.startswith("kafka://"):
        raise KafkaUrlError(str(url), f"must be {KAFKA_URL}")
    servers, slash, where = url[len("kafka://"):].partition("/")
    if "@" in servers:
        raise KafkaUrlError(f"kafka://***@{servers.rpartition('@')[2]}{slash}{where}",
                            "must not hold credentials (user@host): set STAGETREE_KAFKA_SASL_* and the other "
                            "STAGETREE_KAFKA_* variables instead")
    try:
        check_bootstrap_servers(servers, port=True)
    except ValueError:
        raise KafkaUrlError(url, f"must be {KAFKA_URL}, ports 1 to 65535") from None
    prefix = where[: -len(topic)] if topic and where.endswith(topic) else where
    if prefix and not topics.TOPIC_PART.fullmatch(prefix):
        raise KafkaUrlError(url, f"has a topic prefix {prefix!r} that is not a valid Kafka topic name part")
    return servers, prefix


def partition_for(key: str, partitions: int) -> int:
    """The partition of a record keyed ``key`` among ``partitions``: Kafka's default
    partitioner (murmur2 of the UTF-8 key, as the Java client and faust's aiokafka compute it),
    so every client puts a key in the same partition.

    Raises:
        ValueError: ``partitions`` < 1.
    """
    if partitions < 1:
        raise ValueError(f"`partitions` is {partitions!r}, but must be >= 1")
    if partitions == 1:
        return 0
    return (murmur2(key.encode("utf-8")) & 0x7FFFFFFF) % partitions

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")

# Settings the transport's guarantees rest on: `security` may not override them.
_GUARDED = frozenset({
    "bootstrap.servers", "client.id", "group.id", "enable.idempotence", "acks", "request.required.acks",
    "transactional.id", "isolation.level", "enable.auto.commit", "enable.auto.offset.store",
    "auto.offset.reset", "max.in.flight.requests.per.connection", "max.in.flight", "retries",
    "message.send.max.retries", "enable.partition.eof",
})

# One produce request in flight per broker connection, so at most one batch per partition: with
# more (librdkafka's default is 5), a first batch refused (e.g. "not leader" on a partition whose
# leader was just elected) and a second accepted meanwhile (a broker takes any sequence number
# from a producer it has no state of) made librdkafka count the first as written ("implicitly
# acked by subsequent batch success") and report it delivered without an offset: a record lost
# from the log with its append reported done (seen once in 5,139 appends of 12 records to a
# topic just created, 2026-12-06). The batches of the partitions of one request still go together.
ONE_REQUEST_IN_FLIGHT = {"max.in.flight.requests.per.connection": 1}


def _delivery(err: KafkaError | None, msg: Message) -> tuple[KafkaError | None, int]:
    """The error and offset of a delivery report. A record reported delivered without an offset
    was acknowledged only implicitly (after a later batch of its partition, or as a duplicate of
    an earlier attempt): it is not known to be in the log, so it counts as not delivered."""
    if err is not None:
        return err, -1
    offset = msg.offset()
    if offset is None or offset < 0:
        return KafkaError(KafkaError._FAIL, "acknowledged without an offset: not known to be in the log"), -1
    return None, offset


# Per-record framing overhead allowed for when checking sizes against message.max.bytes.
_RECORD_OVERHEAD = 512

ENV_SECURITY = {
    "STAGETREE_KAFKA_SECURITY_PROTOCOL": "security.protocol",
    "STAGETREE_KAFKA_SASL_MECHANISM": "sasl.mechanism",
    "STAGETREE_KAFKA_SASL_USERNAME": "sasl.username",
    "STAGETREE_KAFKA_SASL_PASSWORD": "sasl.password",
    "STAGETREE_KAFKA_SSL_CA_LOCATION": "ssl.ca.location",
    "STAGETREE_KAFKA_SSL_CERTIFICATE_LOCATION": "ssl.certificate.location",
    "STAGETREE_KAFKA_SSL_KEY_LOCATION": "ssl.key.location",
    "STAGETREE_KAFKA_SSL_KEY_PASSWORD": "ssl.key.password",
}
"""Environment variables read by :func:`security_from_env`, and the client setting each sets."""


def security_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``security`` settings named by ``STAGETREE_KAFKA_*`` variables (see ``ENV_SECURITY``);
    unset or empty variables are left out. The values may be secrets: never log the result."""
    env = os.environ if environ is None else environ
    return {setting: env[var] for var, setting in ENV_SECURITY.items() if env.get(var)}


class KafkaLogError(LogError):
    """A Kafka operation failed. ``topic`` is the topic (None when not about one topic) and
    ``error`` the client's error (a :class:`confluent_kafka.KafkaError`, or a string)."""

    def __init__(self, message: str, *, topic: str | None = None, error: object = None) -> None:
        super().__init__(message)
        self.topic = topic
        self.error = error


class AppendAbandoned(KafkaLogError):
    """An append gave up waiting for the broker because the process is stopping
    (:attr:`KafkaLog.stop_requested`): its records may or may not be in the log."""


class DeliveryFailed(KafkaLogError):
    """The broker did not acknowledge every record of an append.

    ``offsets`` holds the offsets of the records of the batch that *were* acknowledged (a prefix
    of the batch, in order: the idempotent producer never writes a later record of a partition
    without the earlier ones); the others are not in the log.
    """

    def __init__(self, message: str, *, topic: str, error: object, offsets: list[int]) -> None:
        super().__init__(message, topic=topic, error=error)
        self.offsets = offsets


def trace_headers(value: bytes) -> list[tuple[str, bytes]] | None:
    """W3C trace context of an encoded event, as Kafka record headers (``traceparent``,
    ``tracestate``), so brokers' tools and other consumers see the trace without decoding."""
    if b'"traceparent"' not in value:
        return None
    try:
        trace = orjson.loads(value).get("trace") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return [(k, str(v).encode()) for k, v in sorted(trace.items()) if k in ("traceparent", "tracestate")] or None


_TRANSIENT = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    # librdkafka answers this one from its own metadata cache for a partition it has not learned
    # again yet (after a broker restart): it goes away with the next metadata refresh.
    KafkaError._UNKNOWN_PARTITION,
})


def _transient(err: object) -> bool:
    """Whether a client error is one that goes away by itself (a leader being elected, a broker
    restarting): retried until the operation's timeout."""
    return isinstance(err, KafkaError) and (err.retriable() or err.code() in _TRANSIENT)


def _check_topic(stream: str) -> str:
    if not isinstance(stream, str) or not _TOPIC_NAME.fullmatch(stream) or stream in (".", ".."):
        raise ValueError(f"stream {stream!r} is not a valid Kafka topic name "
                         "(1 to 249 characters of A-Z a-z 0-9 . _ -, not '.' or '..')")
    return stream


@dataclass(frozen=True)
class Write:
    """One record of a transaction: ``key`` and ``value`` to ``stream`` (a logical stream name,
    made a topic by the log's prefix), in ``partition`` or, when None, the key's partition."""

    stream: str
    key: str
    value: bytes
    partition: int | None = None


class KafkaLog:
    """An :class:`~events.log.EventLog` on Apache Kafka (confluent-kafka / librdkafka).

    Args:
        bootstrap_servers: ``host:port[,host:port...]`` of the brokers.
        client_id: ``client.id`` of the producer, consumer and admin client (shows in broker logs).
        partitions: partition count per topic, used when a topic is created (default 1 each,
            ``plan_partitions`` for the plan stream's topic). An existing topic keeps the count it
            has: every client reads it from the cluster.
        plan_partitions: partitions of ``<prefix>stagetree.plan`` when this log creates it.
        create_topics: create a missing topic (``partitions[topic]`` partitions, replication
            ``replication_factor``) on its first append and wait until the cluster metadata
            shows it. When false, appending to a missing topic raises :class:`KafkaLogError`.
            Reading a missing topic never creates it: it reads as empty.
        security: further librdkafka client settings for every client, meant for
            ``security.protocol``, ``sasl.mechanism``, ``sasl.username``, ``sasl.password``,
            ``ssl.*`` (see :func:`security_from_env`). Values are passed through untouched and
            never logged or put in errors. Settings the guarantees rest on (idempotence, acks,
            isolation level, commits, ``bootstrap.servers``, ``client.id``) cannot be overridden:
            :class:`ValueError` names the setting.
        replication_factor: replication of created topics (1 for the single local broker; 3 with
            ``min.insync.replicas=2`` on a real cluster).
        timeout_s: how long an operation waits for the cluster before :class:`KafkaLogError`:
            delivery of an append (``message.timeout.ms``), metadata and topic creation, and a
            read that stops receiving records before its ``stop``.
        topic_prefix: prepended to every stream name to make its topic (``stagetree.plan`` ->
            ``<prefix>stagetree.plan``), so several deployments or tests can share a broker.
            ``partitions`` is keyed by topic.
        read_only: a plain consumer: no producer is made (none asks the broker for a producer
            id, so read-only credentials suffice), no topic is created, and appends raise
            :class:`~events.log.LogError` (``replay verify``, ``stagetree dashboard``).

    Raises:
        ValueError: a bad argument (named).

    Thread safety: appends may come from several threads (serialized by a lock); reads and
    ``end_offset`` from one thread at a time, like every :class:`~events.log.EventLog`.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        client_id: str = "stagetree",
        partitions: Mapping[str, int] | None = None,
        plan_partitions: int = DEFAULT_PLAN_PARTITIONS,
        create_topics: bool = True,
        security: Mapping[str, str] | None = None,
        replication_factor: int = 1,
        timeout_s: float = 60.0,
        topic_prefix: str = "",
        read_only: bool = False,
    ) -> None:
        if not isinstance(bootstrap_servers, str) or not bootstrap_servers.strip():
            raise ValueError(f"`bootstrap_servers` is {bootstrap_servers!r}, but must be 'host:port[,host:port...]'")
        if not isinstance(client_id, str) or not client_id:
            raise ValueError(f"`client_id` is {client_id!r}, but must be a non-empty string")
        if isinstance(plan_partitions, bool) or not isinstance(plan_partitions, int) or plan_partitions < 1:
            raise ValueError(f"`plan_partitions` is {plan_partitions!r}, but must be an int >= 1")
        if topic_prefix:  # it begins every topic name ('.' alone is no topic, but '.stagetree.plan' is)
            _check_topic(topic_prefix + topics.HEARTBEAT)
        self.topic_prefix = topic_prefix
        self.partitions: dict[str, int] = {self.topic(topics.PLAN): plan_partitions}
        for topic, count in (partitions or {}).items():
            _check_topic(topic)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"`partitions[{topic!r}]` is {count!r}, but must be an int >= 1")
            self.partitions[topic] = count
        if isinstance(replication_factor, bool) or not isinstance(replication_factor, int) or replication_factor < 1:
            raise ValueError(f"`replication_factor` is {replication_factor!r}, but must be an int >= 1")
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` is {timeout_s!r}, but must be > 0")
        extra = dict(security or {})
        for setting in extra:
            if setting in _GUARDED:
                raise ValueError(f"`security` sets {setting!r}, which the Kafka transport sets itself")
        self.bootstrap_servers = bootstrap_servers
        self.client_id = client_id
        self.read_only = read_only
        self.create_topics = create_topics and not read_only
        self.replication_factor = replication_factor
        self.timeout_s = float(timeout_s)
        self.security = extra
        self._max_record = int(extra.get("message.max.bytes", 1_000_000)) - _RECORD_OVERHEAD

        base: dict[str, Any] = {
            # Every client is back within about a second of a broker's return (librdkafka's
            # default backs off up to 10 s), so a worker's beats resume before the scheduler
            # role's grace after an outage ends (scheduler/role.py).
            "reconnect.backoff.max.ms": 1000,
            **extra,
            "bootstrap.servers": bootstrap_servers,
            "client.id": client_id,
            "logger": log,
        }
        self._base_conf = base
        self._admin_conf = dict(base)
        self._producer_conf = {
            **base,
            "enable.idempotence": True,
            "acks": "all",
            **ONE_REQUEST_IN_FLIGHT,
            "linger.ms": 2,
            "message.timeout.ms": int(self.timeout_s * 1000),
            "error_cb": self._on_producer_error,
        }
        self._consumer_conf = {
            **base,
            # librdkafka needs a group.id; this one is never joined (assign() only) and never
            # committed to (enable.auto.commit=False, no commit calls).
            "group.id": f"{client_id}-reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "error",
            "enable.partition.eof": True,
            # A read stops at a known offset, so it never waits for new records; but a fetch the
            # broker holds open at the end of a partition delays the next read's first fetch by up
            # to this long (one fetch in flight per broker), so keep it short.
            "fetch.wait.max.ms": 2,
        }
        self._admin: AdminClient | None = None
        self._producer: Producer | None = None
        self._producer_fatal: KafkaError | None = None
        self._consumer: Consumer | None = None
        self._consumer_busy = False
        self._known: dict[str, int] = {}  # topic -> partition count, once every partition has a leader
        self._append_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self.stop_requested = False
        """Set (a plain flag: a signal handler may set it) to make an append that waits for the
        broker give up at its next look, every 0.5 s at most, with :class:`AppendAbandoned`."""
        # Made now: an idempotent producer spends ~0.5 s acquiring its producer id, which then
        # overlaps with whatever the caller does before its first append.
        if not read_only:
            self._get_producer()

    def topic(self, stream: str) -> str:
        """The Kafka topic of ``stream``: ``topic_prefix + stream`` (validated)."""
        return _check_topic(self.topic_prefix + stream)

    def stream_of(self, topic: str) -> str:
        """The stream name of ``topic`` (the prefix removed)."""
        return topic[len(self.topic_prefix):] if self.topic_prefix and topic.startswith(self.topic_prefix) else topic

    def __repr__(self) -> str:  # never the settings: they may hold credentials
        return f"KafkaLog({self.bootstrap_servers!r}, client_id={self.client_id!r})"

    # ------------------------------------------------------------------ clients

    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"{self!r} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise LogError(f"{self!r} was opened read-only")

    def client_conf(self, **settings: Any) -> dict[str, Any]:
        """The settings every client of this log shares (servers, client id, security), plus
        ``settings`` (librdkafka names with ``.`` written as ``_``)."""
        return {**self._base_conf, **{k.replace("_", "."): v for k, v in settings.items()}}

    def _get_admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(self._admin_conf)
        return self._admin

    def probe(self, deadline_s: float = PROBE_DEADLINE_S) -> None:
        """Ask the cluster for its metadata (the list of topics) until it answers, for up to
        ``deadline_s`` seconds (each request waits :data:`PROBE_ATTEMPT_S` at most): the first
        contact of a command, so that an address where nothing answers is reported within
        ``deadline_s`` rather than by the first operation, after ``timeout_s``.

        Raises:
            ValueError: ``deadline_s`` is not > 0.
            LogError: the log is closed.
            KafkaLogError: no answer within ``deadline_s`` seconds; the message names
                ``bootstrap_servers`` and the client's last error (``error``).
        """
        self._check_open()
        if not deadline_s > 0:
            raise ValueError(f"`deadline_s` is {deadline_s!r}, but must be > 0")
        deadline = time.monotonic() + deadline_s
        while True:
            asked = time.monotonic()
            try:
                self._get_admin().list_topics(timeout=max(0.1, min(PROBE_ATTEMPT_S, deadline - asked)))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if time.monotonic() >= deadline:
                    raise KafkaLogError(f"no Kafka broker at {self.bootstrap_servers} answered within "
                                        f"{deadline_s:g} s ({err.str() if isinstance(err, KafkaError) else err})",
                                        error=err) from None
                time.sleep(max(0.0, min(0.5 - (time.monotonic() - asked), deadline - time.monotonic())))

    def _on_producer_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._producer_fatal = err
            log.error("kafka producer %s: fatal error %s; a new producer is made for the next append",
                      self.client_id, err.str())
        else:
            log.debug("kafka producer %s: %s", self.client_id, err.str())

    def _get_producer(self) -> Producer:
        if self._producer is not None and self._producer_fatal is not None:
            # An idempotent producer is unusable after a fatal error; its queue was failed with it.
            self._producer = None
            self._producer_fatal = None
        if self._producer is None:
            self._producer = Producer(self._producer_conf)
        return self._producer

    def _discard_producer(self, producer: Producer) -> None:
        """Drop ``producer`` after a failed append: what is left in its queue is purged (never
        sent later, where a retry could duplicate it) and the next append makes a new producer,
        with a new producer id (a client that cannot get its id back after a broker's restart
        stays stuck; a new one asks afresh)."""
        try:
            producer.purge(in_queue=True, in_flight=True)
            producer.flush(0)
        except KafkaException as exc:  # a producer in a fatal state: it is dropped all the same
            log.debug("kafka producer %s: purge failed: %s", self.client_id, exc)
        if self._producer is producer:
            self._producer = None
            self._producer_fatal = None

    def new_consumer(self, **settings: Any) -> Consumer:
        """A fresh ``read_committed`` consumer that never joins a group nor commits."""
        return Consumer({**self._consumer_conf, "group.id": f"{self.client_id}-reader-{uuid.uuid4().hex}",
                         **settings})

    def _get_consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(self._consumer_conf)
        return self._consumer

    # ------------------------------------------------------------------ topics

    def _partitions_led(self, topic: str) -> int | None:
        """The partition count of ``topic`` when the metadata shows every partition with a
        leader; None when it does not exist (yet)."""
        known = self._known.get(topic)
        if known is not None:
            return known
        try:
            md = self._get_admin().list_topics(topic=topic, timeout=self.timeout_s)
        except KafkaException as exc:
            raise KafkaLogError(f"kafka: metadata of topic {topic!r} from {self.bootstrap_servers}: "
                                f"{exc.args[0]}", topic=topic, error=exc.args[0]) from exc
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return None
        if any(part.leader < 0 for part in meta.partitions.values()):
            return None
        self._known[topic] = len(meta.partitions)
        return self._known[topic]

    def _exists(self, topic: str) -> bool:
        """Whether the cluster metadata shows ``topic`` with every partition led."""
        return self._partitions_led(topic) is not None

    def has_stream(self, stream: str) -> bool:
        """Whether ``stream``'s topic exists (the cluster's metadata shows it, every partition
        led).

        Raises:
            KafkaLogError: the broker did not answer within ``timeout_s``.
        """
        self._check_open()
        return self._exists(self.topic(stream))

    def partition_count(self, stream: str) -> int:
        """Partitions of ``stream``'s topic as the cluster has them (1 for a missing topic).

        Raises:
            KafkaLogError: the broker did not answer within ``timeout_s``.
        """
        self._check_open()
        return self._partitions_led(self.topic(stream)) or 1

    def ensure_topic(self, stream: str) -> None:
        """Create topic ``stream`` if it is missing and wait until the metadata shows it.

        Idempotent: a topic that exists (created by anyone) is left as it is.

        Raises:
            KafkaLogError: it could not be created, or did not appear within ``timeout_s``.
            LogError: the log was opened read-only.
        """
        self._check_writable()
        topic = self.topic(stream)
        if self._exists(topic):
            return
        count = self.partitions.get(topic, 1)
        futures = self._get_admin().create_topics(
            [NewTopic(topic, num_partitions=count, replication_factor=self.replication_factor)],
            request_timeout=self.timeout_s,
        )
        try:
            futures[topic].result(timeout=self.timeout_s)
            log.info("kafka: created topic %s (%d partition(s), replication %d)", topic, count, self.replication_factor)
        except KafkaException as exc:
            err = exc.args[0]
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                raise KafkaLogError(f"kafka: could not create topic {topic!r}: {err}", topic=topic, error=err) from exc
        except Exception as exc:  # concurrent.futures.TimeoutError
            raise KafkaLogError(f"kafka: creating topic {topic!r} took more than {self.timeout_s:g} s",
                                topic=topic, error=repr(exc)) from exc
        deadline = time.monotonic() + self.timeout_s
        while not self._exists(topic):
            if time.monotonic() > deadline:
                raise KafkaLogError(f"kafka: topic {topic!r} was created but not all its partitions have a "
                                    f"leader after {self.timeout_s:g} s", topic=topic, error="no leader")
            time.sleep(0.05)

    def delete_topics(self, *prefixes: str, timeout_s: float | None = None) -> list[str]:
        """Delete every topic of the cluster whose name starts with one of ``prefixes`` (whole
        topic names, the log's ``topic_prefix`` not added), waiting up to ``timeout_s`` seconds
        (default: the log's) for the listing and for each deletion. For what a finished run made
        for itself alone (``stagetree run``'s serve app); a topic another process deletes
        meanwhile is no failure.

        Returns:
            One line per topic that could not be deleted (empty when all were).

        Raises:
            ValueError: no prefix, or an empty one (it would name every topic); ``timeout_s`` <= 0.
            LogError: the log was opened read-only, or is closed.
            KafkaLogError: the broker did not list its topics within ``timeout_s``.
        """
        self._check_writable()
        if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
            raise ValueError(f"`prefixes` is {prefixes!r}, but must be one or more non-empty topic-name prefixes")
        wait = self.timeout_s if timeout_s is None else timeout_s
        if not wait > 0:
            raise ValueError(f"`timeout_s` is {timeout_s!r}, but must be > 0")
        admin = self._get_admin()
        try:
            names = [t for t in admin.list_topics(timeout=wait).topics if t.startswith(prefixes)]
        except KafkaException as exc:
            raise KafkaLogError(f"kafka: listing the topics of {self.bootstrap_servers}: {exc.args[0]}",
                                error=exc.args[0]) from exc
        failed = []
        for topic, future in (admin.delete_topics(names, operation_timeout=wait).items() if names else ()):
            try:
                future.result(timeout=wait)
            except KafkaException as exc:
                err = exc.args[0]
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                    failed.append(f"{topic}: {err}")
            except Exception as exc:  # concurrent.futures.TimeoutError
                failed.append(f"{topic}: not deleted within {wait:g} s ({exc!r})")
            self._known.pop(topic, None)
        return failed

    def _ready(self, stream: str) -> str:
        """The topic of ``stream``, created first when missing and ``create_topics`` allows it."""
        topic = self.topic(stream)
        if not self._exists(topic):
            if not self.create_topics:
                raise KafkaLogError(f"kafka: topic {topic!r} does not exist and create_topics is false",
                                    topic=topic, error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
            self.ensure_topic(stream)
        return topic

    # ------------------------------------------------------------------ writing

    def _check_sizes(self, topic: str, records: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        for i, (kb, vb) in enumerate(records):
            if len(kb) + len(vb) > self._max_record:
                raise KafkaLogError(
                    f"item {i} of the append to {topic!r} has {len(kb) + len(vb)} bytes of key and value, but "
                    f"Kafka records hold at most {self._max_record} (message.max.bytes)", topic=topic,
                    error="too large")
        return list(records)

    def check_writes(self, writes: Sequence[Write]) -> list[tuple[bytes, bytes]]:
        """The ``(key, value)`` bytes of each write, checked without asking the broker: types, and
        sizes against ``message.max.bytes``.

        Raises:
            TypeError: a key is not a str or a value not bytes (the item is named).
            KafkaLogError: a record is too large (the item is named).
        """
        where = ", ".join(sorted({self.topic(w.stream) for w in writes}))
        return self._check_sizes(where, check_items(where, [(w.key, w.value) for w in writes]))

    def resolve(self, writes: Sequence[Write]) -> list[tuple[str, int, bytes, bytes]]:
        """``(topic, partition, key, value)`` of each write, checked (types, sizes, partition in
        range), topics created as needed. Raises as :meth:`append_many`, naming the item."""
        checked = self.check_writes(writes)
        resolved = []
        for i, (w, (kb, vb)) in enumerate(zip(writes, checked)):
            topic = self._ready(w.stream)
            count = self._partitions_led(topic) or 1
            partition = partition_for(w.key, count) if w.partition is None else w.partition
            if not 0 <= partition < count:
                raise ValueError(f"item {i} of the append: partition {partition!r} of topic {topic!r} does not "
                                 f"exist (it has {count})")
            resolved.append((topic, partition, kb, vb))
        return resolved

    def append(self, stream: str, key: str, value: bytes) -> int:
        """Append one record to its key's partition of topic ``stream``; returns its offset
        once the broker acknowledged it (acks=all). Raises as :meth:`append_many`."""
        return self.append_many(stream, [(key, value)])[0]

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        """Append ``(key, value)`` records in order, each to its key's partition
        (:func:`partition_for`); returns their offsets (each within its partition) once every
        one was acknowledged by the broker (acks=all).

        Every item is checked before anything is produced, so bad input appends nothing.

        Raises:
            TypeError: a key is not a str or a value not bytes (the item is named).
            KafkaLogError: a record is larger than ``message.max.bytes``, or the topic is missing
                and ``create_topics`` is false, or it could not be created.
            DeliveryFailed: the broker did not acknowledge every record (``offsets``: those it did).
        """
        self._check_writable()
        topic = self.topic(stream)
        self._check_sizes(topic, check_items(topic, items))
        if not items:
            return []
        records = self.resolve([Write(stream, key, value) for key, value in items])
        with self._append_lock:
            return [offset for _, offset in self._produce(records)]

    def _produce(self, records: list[tuple[str, int, bytes, bytes]]) -> list[tuple[int, int]]:
        producer = self._get_producer()
        reports: list[tuple[KafkaError | None, int]] = [(None, -1)] * len(records)
        done = [False] * len(records)

        def report(i: int) -> Any:
            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                reports[i] = _delivery(err, msg)
                done[i] = True
            return on_delivery

        enqueue_error: BaseException | None = None
        for i, record in enumerate(records):
            try:
                _produce(producer, record, report(i))
            except KafkaException as exc:
                enqueue_error = exc
                records = records[:i]
                break
        deadline = time.monotonic() + self.timeout_s + 5
        while not all(done[: len(records)]):
            producer.flush(0.5)
            if time.monotonic() > deadline or self.stop_requested:
                break
        # the outcome as it stands (copies: a purge below answers what is left, "purged")
        delivered, outcome = done[: len(records)], reports[: len(records)]
        if enqueue_error is not None or not all(delivered) or any(err is not None for err, _ in outcome):
            self._discard_producer(producer)
            if self.stop_requested and not all(delivered):
                raise AppendAbandoned(f"kafka: append to topic {records[0][0]!r} abandoned: the process is "
                                      f"stopping ({sum(delivered)} of {len(records)} record(s) answered)",
                                      topic=records[0][0])
        offsets: list[tuple[int, int]] = []
        for i in range(len(records)):
            err, offset = outcome[i]
            if not delivered[i] or err is not None:
                why = err if err is not None else f"no delivery report within {self.timeout_s:g} s"
                raise DeliveryFailed(
                    f"kafka: append to topic {records[i][0]!r} failed at record {i} of the batch: {why} "
                    f"({len(offsets)} record(s) before it were acknowledged)",
                    topic=records[i][0], error=why, offsets=[o for _, o in offsets])
            offsets.append((records[i][1], offset))
        if enqueue_error is not None:
            err = enqueue_error.args[0]
            topic = records[-1][0] if records else "?"
            raise DeliveryFailed(
                f"kafka: append to topic {topic!r} failed at record {len(records)} of the batch: {err} "
                f"({len(offsets)} record(s) before it were acknowledged)", topic=topic, error=err,
                offsets=[o for _, o in offsets])
        return offsets

    # ------------------------------------------------------------------ reading

    def end_offset(self, stream: str, partition: int = 0) -> int:
        """The high watermark of ``partition`` of ``stream``: the offset the next record will get
        (0 for a topic that does not exist).

        Raises:
            KafkaLogError: the broker did not answer within ``timeout_s``.
        """
        self._check_open()
        topic = self.topic(stream)
        if not self._exists(topic):
            return 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                consumer = self._get_consumer()
                try:
                    _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                                timeout=self.timeout_s)
                    return int(high)
                except KafkaException as exc:
                    err = exc.args[0]
                    if not (_transient(err) and time.monotonic() < deadline):
                        raise KafkaLogError(f"kafka: end offset of topic {topic!r} partition {partition}: {err}",
                                            topic=topic, error=err) from exc
            time.sleep(0.1)

    def read(self, stream: str, start: int = 0, stop: int | None = None, partition: int = 0) -> Iterator[Record]:
        """Records of ``partition`` of ``stream`` with ``start <= offset < stop``, in offset order.

        ``stop`` defaults to the high watermark when ``read`` is called (later appends are not
        waited for); a larger ``stop`` is cut to it. ``chain`` of every record is ``b""``.
        The consumer reads ``read_committed``: records of an open transaction are not delivered
        until it commits, those of an aborted one never; markers leave gaps in the offsets.

        Raises:
            ValueError: ``start`` is negative (at the call).
            KafkaLogError: the records cannot be fetched (while iterating), e.g. ``start`` is
                below the log start offset (records were deleted), or no record arrives for
                ``timeout_s``.
        """
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"`start` is {start!r}, but must be an int >= 0")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int)):
            raise ValueError(f"`stop` is {stop!r}, but must be an int or None")
        if stop is not None and start >= stop:
            self.topic(stream)
            return iter(())
        end = self.end_offset(stream, partition)
        stop = end if stop is None else min(stop, end)
        if start >= stop:
            return iter(())
        return self._read(stream, start, stop, partition)

    def _read(self, stream: str, start: int, stop: int, partition: int) -> Iterator[Record]:
        topic = self.topic(stream)
        with self._lock:
            shared = not self._consumer_busy
            if shared:
                self._consumer_busy = True
                consumer = self._get_consumer()
        if not shared:
            consumer = self.new_consumer()  # another read is still being iterated
        try:
            consumer.assign([TopicPartition(topic, partition, start)])
            position = start
            last_progress = time.monotonic()
            while position < stop:
                self._check_open()
                try:
                    msgs = _take(consumer, min(stop - position, 1000), 0.2)
                except KafkaException as exc:
                    raise KafkaLogError(f"kafka: read of topic {topic!r} at offset {position}: {exc.args[0]}",
                                        topic=topic, error=exc.args[0]) from exc
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            position = max(position, msg.offset())
                            continue
                        raise KafkaLogError(f"kafka: read of topic {topic!r} at offset {position}: {err}",
                                            topic=topic, error=err)
                    offset = msg.offset()
                    if offset >= stop:
                        position = stop
                        break
                    position = offset + 1
                    yield _record(stream, msg)
                if msgs:
                    last_progress = time.monotonic()
                elif position < stop:
                    # Transaction markers take offsets but are never delivered.
                    (tp,) = consumer.position([TopicPartition(topic, partition)])
                    if tp.offset >= 0:
                        position = max(position, tp.offset)
                    if time.monotonic() - last_progress > self.timeout_s:
                        raise KafkaLogError(f"kafka: read of topic {topic!r} stalled at offset {position} "
                                            f"(stop {stop}) for {self.timeout_s:g} s", topic=topic, error="stalled")
        finally:
            if shared:
                try:
                    consumer.unassign()
                except (KafkaException, RuntimeError):  # closed meanwhile
                    pass
                with self._lock:
                    self._consumer_busy = False
            else:
                consumer.close()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Flush the producer (waits up to ``timeout_s`` for outstanding records) and close the
        clients. Idempotent; the log cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._producer is not None:
            left = self._producer.flush(self.timeout_s)
            if left:
                log.warning("kafka: %d record(s) were not delivered when %r closed", left, self)
            self._producer = None
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
        self._admin = None

    def __enter__(self) -> KafkaLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _take(consumer: Consumer, max_records: int, timeout: float) -> list[Message]:
    """Up to ``max_records`` messages of ``consumer`` (records, or events such as a partition's
    end), waiting up to ``timeout`` seconds for the first and not at all for the rest.
    ``Consumer.consume`` with a timeout waits until it has all ``max_records`` or the timeout
    has passed, so a record readable at once came back only after the whole timeout (50 ms on
    every append the SDK folded back; 200 ms before a worker saw a dispatch; the whole timeout at
    the end of every read, where transaction markers take offsets that are never delivered).

    Raises:
        KafkaException: as ``Consumer.poll`` and ``Consumer.consume``.
    """
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *(consumer.consume(num_messages=max_records - 1, timeout=0) if max_records > 1 else ())]


def _record(stream: str, msg: Message) -> Record:
    key, value = msg.key(), msg.value()
    return Record(stream, msg.offset(), "" if key is None else key.decode("utf-8", "replace"),
                  b"" if value is None else value, b"", msg.partition())


def event_writes(stream: str, events: Sequence[Event], partitions: int) -> list[Write]:
    """The writes of ``events`` to ``stream`` (the plan stream): each to its key's partition
    (:func:`events.log.event_key`), a broadcast event (WorkerJoined, WorkerLost) to every one
    of ``partitions``."""
    out = []
    for event in events:
        key, value = event_key(event), encode(event)
        if is_broadcast(event) and partitions > 1:
            out += [Write(stream, key, value, p) for p in range(partitions)]
        else:
            out.append(Write(stream, key, value))
    return out


# --------------------------------------------------------------------------- following


class Follower:
    """Reads partitions of streams of ``log`` as records arrive (``read_committed``), each from
    a given offset: the SDK's, the scheduler's and a worker's view of the topics they follow.

    Args:
        log: the transport (its servers, security and topic prefix are used).
        positions: ``(stream, partition) -> offset`` of the next record to read.
        wait_ms: how long the broker holds a fetch open at the end of a partition
            (``fetch.wait.max.ms``): new records are delivered as soon as they are readable,
            so this only bounds how often an idle follower asks.

    Raises:
        KafkaLogError: from :meth:`poll` when a partition cannot be read (e.g. an offset below
            the log start).

    Thread safety: one thread at a time.
    """

    def __init__(self, log: KafkaLog, positions: Mapping[tuple[str, int], int], *, wait_ms: int = 100) -> None:
        self.log = log
        self.last_error: float | None = None
        """When (``time.monotonic()``) the client last reported the cluster unreachable."""
        self._consumer = log.new_consumer(**{"fetch.wait.max.ms": wait_ms, "auto.offset.reset": "error",
                                             "error_cb": self._on_error})
        self.positions: dict[tuple[str, int], int] = {}
        self._assign(positions)

    def _on_error(self, err: KafkaError) -> None:
        if err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT):
            self.last_error = time.monotonic()
        log.debug("kafka follower: %s", err)

    def _assign(self, positions: Mapping[tuple[str, int], int]) -> None:
        for (stream, partition), offset in positions.items():
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"start offset of {stream!r} partition {partition} is {offset!r}, but must be >= 0")
            self.positions[(stream, partition)] = offset
        self._consumer.assign([TopicPartition(self.log.topic(s), p, o) for (s, p), o in self.positions.items()])

    def follow(self, stream: str, partition: int, start: int) -> None:
        """Also (or again) read ``partition`` of ``stream`` from ``start``."""
        self._assign({(stream, partition): start})

    def poll(self, timeout: float, max_records: int = 1000) -> list[Record]:
        """The records readable now (waiting up to ``timeout`` seconds for the first, no longer:
        :func:`_take`), in offset order per partition."""
        try:
            msgs = _take(self._consumer, max_records, timeout)
        except KafkaException as exc:
            raise KafkaLogError(f"kafka: follow: {exc.args[0]}", error=exc.args[0]) from exc
        out = []
        for msg in msgs:
            err = msg.error()
            stream = self.log.stream_of(msg.topic() or "")
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    key = (stream, msg.partition())
                    self.positions[key] = max(self.positions.get(key, 0), msg.offset())
                    continue
                if _transient(err):
                    log.debug("kafka follower: %s", err)
                    continue
                raise KafkaLogError(f"kafka: follow {msg.topic()!r} partition {msg.partition()}: {err}",
                                    topic=msg.topic(), error=err)
            record = _record(stream, msg)
            self.positions[(stream, record.partition)] = record.offset + 1
            out.append(record)
        return out

    def end_offsets(self, partitions: Iterable[tuple[str, int]] | None = None, timeout_s: float | None = None
                    ) -> dict[tuple[str, int], int]:
        """The high watermark now of every ``(stream, partition)`` in ``partitions`` (default:
        every followed one), asking the broker (an open transaction can keep a ``read_committed``
        reader below it until it ends).

        Raises:
            KafkaLogError: the cluster did not answer within ``timeout_s`` per partition
                (default: the log's timeout).
        """
        timeout = self.log.timeout_s if timeout_s is None else timeout_s
        out = {}
        for stream, partition in (self.positions if partitions is None else partitions):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    _low, high = self._consumer.get_watermark_offsets(
                        TopicPartition(self.log.topic(stream), partition), timeout=timeout, cached=False)
                    break
                except KafkaException as exc:
                    err = exc.args[0]
                    if _transient(err) and time.monotonic() < deadline:
                        time.sleep(0.1)  # e.g. a partition whose leader is being elected
                        continue
                    raise KafkaLogError(f"kafka: end offset of {stream!r} partition {partition}: {err}",
                                        error=err) from exc
            out[(stream, partition)] = int(high)
        return out

    def reached(self, ends: Mapping[tuple[str, int], int]) -> bool:
        """Whether every partition in ``ends`` was read up to its offset there (markers included)."""
        behind = [k for k, end in ends.items() if self.positions.get(k, 0) < end]
        if behind:
            positions = self._consumer.position([TopicPartition(self.log.topic(s), p) for s, p in behind])
            for tp in positions:
                if tp.offset >= 0:
                    key = (self.log.stream_of(tp.topic), tp.partition)
                    self.positions[key] = max(self.positions[key], tp.offset)
        return all(self.positions.get(k, 0) >= end for k, end in ends.items())

    def close(self) -> None:
        try:
            self._consumer.close()
        except RuntimeError:  # closed already
            pass


# --------------------------------------------------------------------------- transactions


class Fenced(KafkaLogError):
    """A producer with the same ``transactional.id`` started after this one: this writer is a
    zombie and must stop writing for its role (nothing of the failed transaction is visible)."""


class ProducerFailed(KafkaLogError):
    """The transactional producer hit a fatal error that is not a fence (e.g. INVALID_TXN_STATE
    when a transaction is ended across a broker restart): nothing of the transaction is visible,
    and the next :meth:`TransactionalAppender.append` starts a new producer with the same
    ``transactional.id`` (which fences any other holder of it)."""


class CommittedLate(KafkaLogError):
    """An append found that an earlier transaction whose commit had timed out was committed after
    all: nothing of the new one was appended."""


class CommitUnknown(KafkaLogError):
    """The producer failed fatally while the outcome of its commit was not known: the
    transaction's records may be in the log or not (readers skip an event id seen before)."""


def _kafka_exception(raised: BaseException) -> KafkaException:
    """The KafkaException behind ``raised``: itself, or the cause of a SystemError that
    confluent-kafka raises when an error was set while a delivery callback ran."""
    if isinstance(raised, KafkaException):
        return raised
    cause = raised.__cause__ or raised.__context__
    if isinstance(cause, KafkaException):
        return cause
    raise raised


class TransactionAborted(KafkaLogError):
    """The transaction could not be committed and was aborted: nothing of it is visible to
    ``read_committed`` readers; the caller may decide again and retry."""


def _produce(producer: Producer, record: tuple[str, int, bytes, bytes], on_delivery: Callable[..., None]) -> None:
    """Enqueue ``(topic, partition, key, value)`` with its trace headers, serving delivery
    reports while the local queue is full.

    Raises:
        KafkaException: the record cannot be enqueued (e.g. larger than the producer allows).
    """
    topic, partition, key, value = record
    while True:
        try:
            producer.produce(topic, value=value, key=key, partition=partition, on_delivery=on_delivery,
                             headers=trace_headers(value))
            return
        except BufferError:  # local queue full: serve delivery reports and retry
            producer.poll(0.05)


_FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})


class TransactionalAppender:
    """The one way a role, a partition's owner or a worker appends what it decided: every
    :meth:`append` is one Kafka transaction (all its records visible to ``read_committed``
    readers at once, or none), written by a producer whose ``transactional.id`` names the
    writer, so a zombie with the same id is fenced by its successor.

    Args:
        log: the transport (servers, security, topic prefix, topic creation).
        transactional_id: who writes (``<prefix>stagetree.scheduler``,
            ``<prefix>stagetree.worker.<id>``, ...): one live producer per id in the cluster.
        timeout_s: how long :meth:`start` and :meth:`append` wait for the cluster
            (default: the log's); a broker that is away for a while is waited for.

    Raises:
        ValueError: an empty ``transactional_id``.

    Thread safety: one thread at a time.
    """

    def __init__(self, log: KafkaLog, transactional_id: str, *, timeout_s: float | None = None) -> None:
        if not isinstance(transactional_id, str) or not transactional_id:
            raise ValueError(f"`transactional_id` is {transactional_id!r}, but must be a non-empty string")
        self.log = log
        self.transactional_id = transactional_id
        self.timeout_s = float(timeout_s if timeout_s is not None else log.timeout_s)
        self._producer: Producer | None = None
        self._fenced: KafkaError | None = None
        self._unresolved: tuple[str, list[tuple[int, int]]] | None = None
        """("commit", positions) or ("abort", []): an end of a transaction asked of the broker
        whose outcome is not known yet (it timed out); the same producer resumes it first."""
        self.retries = 0
        """Attempts of :meth:`append_retrying` that failed and were tried again, since the start."""

    def __repr__(self) -> str:
        return f"TransactionalAppender({self.transactional_id!r})"

    def start(self, stopping: Callable[[], bool] | None = None) -> None:
        """Register the ``transactional.id`` with the cluster: any earlier producer with the same
        id is fenced, and a transaction it left open is aborted now (its records never become
        visible). Call before the first :meth:`append`, and to take a role over.

        Args:
            stopping: asked every second while the cluster does not answer; true gives up.

        Raises:
            KafkaLogError: the cluster did not answer within ``timeout_s``.
            AppendAbandoned: ``stopping()`` became true first.
        """
        self.close()
        conf = {
            **self.log._base_conf,
            "transactional.id": self.transactional_id,
            "enable.idempotence": True,
            "acks": "all",
            **ONE_REQUEST_IN_FLIGHT,
            "linger.ms": 0,
            # A record not acknowledged within the transaction's timeout fails the transaction
            # (aborted; the caller decides again), e.g. while the broker restarts.
            "message.timeout.ms": TRANSACTION_TIMEOUT_MS,
            "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            # Errors reach this callback rather than being raised inside flush() while delivery
            # callbacks run (a fence then surfaced as a SystemError from the callback).
            "error_cb": self._on_error,
        }
        producer = Producer(conf)
        deadline = time.monotonic() + self.timeout_s
        while True:  # a second at a time (librdkafka: a call that timed out may be made again)
            try:
                producer.init_transactions(min(1.0, max(0.1, deadline - time.monotonic())))
                break
            except KafkaException as exc:
                err = exc.args[0]
                if stopping is not None and stopping():
                    raise AppendAbandoned(f"kafka: {self!r} did not start: the process is stopping") from exc
                if isinstance(err, KafkaError) and err.retriable() and time.monotonic() < deadline:
                    continue
                raise KafkaLogError(f"kafka: {self!r} could not start: {err}", error=err) from exc
        self._producer = producer
        self._fenced = None
        self._unresolved = None

    def _on_error(self, err: KafkaError) -> None:
        """The producer's error callback: a fence or a fatal error is also raised by the call it
        fails (begin, produce, commit); others (a broker away) are retried by librdkafka."""
        log.debug("kafka: %r: %s", self, err)

    def _failure(self, raised: BaseException, what: str) -> tuple[KafkaException, object]:
        """The KafkaException behind a failed producer call (:func:`_kafka_exception`) and its
        error, when it is neither a fence nor fatal.

        Raises:
            Fenced, ProducerFailed: a fence, or a fatal error (:meth:`_error`).
        """
        exc = _kafka_exception(raised)
        err = exc.args[0]
        if isinstance(err, KafkaError) and (err.code() in _FENCED_CODES or err.fatal()):
            raise self._error(exc, what) from exc
        return exc, err

    def _error(self, exc: KafkaException, what: str) -> KafkaLogError:
        err = exc.args[0]
        if isinstance(err, KafkaError) and err.code() in _FENCED_CODES:
            self._fenced = err
            return Fenced(f"kafka: {self!r} was fenced ({what}): another producer with this transactional.id "
                          f"started; nothing of this transaction is visible ({err})", error=err)
        if isinstance(err, KafkaError) and err.fatal():
            self.close()  # unusable: the next append starts a new producer
            return ProducerFailed(f"kafka: {self!r}: fatal producer error ({what}): {err}; nothing of this "
                                  "transaction is visible", error=err)
        return KafkaLogError(f"kafka: {self!r}: {what}: {err}", error=err)

    def append(self, writes: Sequence[Write], *, before_commit: Callable[[], None] | None = None,
               stopping: Callable[[], bool] | None = None) -> list[tuple[int, int]]:
        """Append ``writes`` in one transaction; returns ``(partition, offset)`` of each once
        the transaction is committed. ``before_commit`` runs after the records reached the
        broker and before the commit (fault injection: a pause there leaves an open transaction
        that a successor aborts). ``stopping`` is asked every half second while the broker has not
        acknowledged the records: true drops the producer, its transaction never committed.

        Raises:
            TypeError, KafkaLogError, ValueError: a bad write (named); nothing was appended.
            Fenced: a successor took this ``transactional_id`` over; nothing was appended, and
                this appender is unusable (``start`` it again only to take the role back).
            ProducerFailed: a fatal producer error that is not a fence; nothing was appended,
                and the next call starts a new producer.
            TransactionAborted: the transaction failed and was aborted; nothing was appended.
            AppendAbandoned: ``stopping()`` became true; nothing was appended.
            KafkaLogError: the end of an earlier transaction (:meth:`resume`) is not known yet,
                or this one's commit timed out: the next call (or :meth:`resume`) resumes it.
            CommittedLate: the earlier transaction whose commit was in doubt is committed now;
                nothing of this one was appended (a caller that decided from a view without the
                earlier one's records reads them and decides again).
        """
        if self._fenced is not None:
            raise Fenced(f"kafka: {self!r} was fenced earlier ({self._fenced})", error=self._fenced)
        if self._producer is None:
            self.start(stopping)
        producer = self._producer
        assert producer is not None
        records = self.log.resolve(writes)
        if not records:
            return []
        reports: list[tuple[KafkaError | None, int, int] | None] = [None] * len(records)

        def report(i: int) -> Any:
            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                failed, offset = _delivery(err, msg)
                reports[i] = (failed, msg.partition(), offset)
            return on_delivery

        if self._unresolved is not None and self.resume() is not None:  # KafkaLogError: not known yet
            raise CommittedLate(f"kafka: {self!r}: the transaction whose commit was in doubt was committed now; "
                                "nothing of this one was appended (decide again from what is in the log)")
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            raise self._error(exc, "begin") from exc
        committing = False
        try:
            for i, record in enumerate(records):
                _produce(producer, record, report(i))
            deadline = time.monotonic() + self.timeout_s
            while (left := producer.flush(min(0.5, max(0.0, deadline - time.monotonic())))) \
                    and time.monotonic() < deadline:
                if stopping is not None and stopping():
                    self.close()  # never committed: aborted by the broker, or by the next producer
                    raise AppendAbandoned(f"kafka: {self!r}: an append was abandoned: the process is stopping; "
                                          "nothing of it is visible")
            failed = [r for r in reports if r is None or r[0] is not None]
            if left or failed:
                first = failed[0] if failed else None
                raise KafkaException(first[0] if first is not None and first[0] is not None else KafkaError(
                    KafkaError._TIMED_OUT, f"no delivery report within {self.timeout_s:g} s"))
            if before_commit is not None:
                before_commit()
            committing = True
            self._commit(producer)
        except (KafkaException, SystemError) as raised:
            exc, err = self._failure(raised, "append")
            if committing and not (isinstance(err, KafkaError) and err.txn_requires_abort()):
                # the commit may have reached the coordinator: never abort it nor start a new
                # producer (whose registration would complete it), resume it (append_retrying)
                self._unresolved = ("commit", [(r[1], r[2]) for r in reports if r is not None])
                raise KafkaLogError(f"kafka: {self!r}: the commit's outcome is not known yet ({err})",
                                    error=err) from exc
            self._abort(producer, err)
            raise TransactionAborted(f"kafka: {self!r}: the transaction was aborted ({err}); nothing of it is "
                                     "visible", error=err) from exc
        return [(r[1], r[2]) for r in reports if r is not None]

    def _abort(self, producer: Producer, after: object) -> None:
        """Abort the open transaction; one whose abort timed out is resumed by the next
        :meth:`resume` (nothing of it is ever visible).

        Raises:
            Fenced, ProducerFailed: as :meth:`_error`.
            KafkaLogError: the abort is not done yet.
        """
        try:
            producer.abort_transaction(self.timeout_s)
            self._unresolved = None
        except (KafkaException, SystemError) as raised:
            exc, err = self._failure(raised, f"abort after {after}")
            self._unresolved = ("abort", [])
            raise KafkaLogError(f"kafka: {self!r}: abort after {after}: {err}", error=err) from exc

    def resume(self) -> list[tuple[int, int]] | None:
        """Finish the end of a transaction that timed out, on the same producer: a commit asked
        for (its records' ``(partition, offset)`` once it is done, None when the broker aborted it)
        or an abort (None once done). None when nothing is pending.

        Raises:
            Fenced, ProducerFailed: as :meth:`append` (a commit's outcome is then unknown).
            KafkaLogError: still not done (the broker away); call again.
        """
        if self._unresolved is None or self._producer is None:
            return None
        what, positions = self._unresolved
        producer = self._producer
        if what == "abort":
            self._abort(producer, "an earlier failure")
            return None
        try:
            self._commit(producer)
        except (KafkaException, SystemError) as raised:
            exc, err = self._failure(raised, "commit")
            if isinstance(err, KafkaError) and err.txn_requires_abort():
                self._abort(producer, err)
                return None
            raise KafkaLogError(f"kafka: {self!r}: the commit's outcome is not known yet ({err})", error=err) from exc
        self._unresolved = None
        return positions

    def append_retrying(self, writes: Sequence[Write], retry_s: float, *, who: str,
                        stopping: Callable[[], bool] = lambda: False,
                        before_restart: Callable[[], None] | None = None,
                        before_commit: Callable[[], None] | None = None) -> list[tuple[int, int]]:
        """:meth:`append`, tried again a second after each failure for up to ``retry_s`` seconds
        (a broker away or restarting), on the same producer: a failed attempt was aborted (nothing
        of it visible), or its commit's outcome is not known yet and the retry resumes that commit
        (librdkafka: "retry call to resume") rather than append again, so none is written twice.
        A producer is started afresh only after a fatal error (which is not a fence): a new
        registration of the ``transactional.id`` fences whoever holds it, so a writer whose id
        another process took over meanwhile learns it from the broker, not by taking it back.

        Args:
            retry_s: seconds from the first attempt after which a failure is raised.
            who: names the writer in the warning logged for each failed attempt.
            stopping: asked between attempts (every 0.1 s); true gives up.
            before_restart: called before a producer is started afresh after a fatal error
                (a writer checks there that nobody took its id over; it raises to give up).
            before_commit: fault injection, as :meth:`append`'s, for the first attempt only.

        Raises:
            TypeError, KafkaLogError: a bad write (named), never retried; nothing was appended.
            Fenced: another producer registered this ``transactional.id``; never retried.
            CommitUnknown: the producer failed fatally while a commit's outcome was unknown.
            AppendAbandoned: ``stopping()`` became true (a commit in doubt may still complete).
            KafkaLogError: once ``retry_s`` seconds have passed, naming ``who`` and the last
                attempt's error.
        """
        self.log.check_writes(writes)
        deadline = time.monotonic() + retry_s
        restarting = False
        inherited = self._unresolved is not None  # an earlier call's end in doubt: not these writes'
        while True:
            try:
                if self._unresolved is not None and self._producer is None:  # the producer was lost meanwhile
                    self._lost_end(who, None)
                if self._unresolved is not None:  # an attempt's end, on the same producer
                    positions = self.resume()
                    if positions is not None and not inherited:
                        return positions  # this call's attempt was committed
                inherited = False
                if restarting and before_restart is not None:
                    before_restart()
                restarting = False
                hook, before_commit = before_commit, None
                return self.append(writes, stopping=stopping, before_commit=hook)
            except (Fenced, AppendAbandoned, CommitUnknown):
                raise
            except ProducerFailed as exc:
                self._lost_end(who, exc)
                failed: KafkaLogError = exc
                restarting = True
            except KafkaLogError as exc:
                failed = exc
            if time.monotonic() > deadline:
                raise KafkaLogError(f"kafka: {who}: an append failed, tried for {retry_s:g} s: {failed}",
                                    topic=failed.topic, error=failed.error) from failed
            self.retries += 1
            log.warning("kafka: %s: an append failed (retrying for up to %.0f s more): %s", who,
                        max(0.0, deadline - time.monotonic()), failed)
            resume = time.monotonic() + 1.0
            while time.monotonic() < resume:
                if stopping():
                    raise AppendAbandoned(f"kafka: {who}: an append was abandoned: the process is stopping"
                                          ) from failed
                time.sleep(0.1)

    def _lost_end(self, who: str, exc: BaseException | None) -> None:
        """The producer failed (fatally) while an end of a transaction was pending: an abort needs
        nothing more (the next producer's registration aborts that transaction); a commit's
        outcome is unknown for good.

        Raises:
            CommitUnknown: a commit was pending (cleared: the appender goes on with the next call).
        """
        pending, self._unresolved = self._unresolved, None
        if pending is not None and pending[0] == "commit":
            raise CommitUnknown(f"kafka: {who}: the producer failed while a commit's outcome was not known"
                                f"{f' ({exc})' if exc is not None else ''}: its records may be in the log or not"
                                ) from exc

    def _commit(self, producer: Producer) -> None:
        """Commit, retrying what librdkafka says is retriable (a broker away for a while)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                producer.commit_transaction(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.retriable() and time.monotonic() < deadline:
                    log.info("kafka: %r: commit will be retried: %s", self, err)
                    continue
                raise

    def close(self) -> None:
        """Drop the producer (an open transaction is aborted by the broker or a successor)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.flush(0)
            except (KafkaException, RuntimeError, SystemError):
                pass
