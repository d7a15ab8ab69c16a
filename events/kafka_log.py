"""The Kafka log transport: the :class:`~events.log.EventLog` protocol on confluent-kafka.

Each stream is a Kafka topic, and this transport writes and reads **partition 0** of every
topic. ``stagetree.plan`` therefore is one totally ordered sequence, as DESIGN.md "The event
log" requires ("one partition holds a plan's whole history"); a topic may be created with more
partitions (``partitions=``) for the per-plan projectors that come later, but this transport
still uses only partition 0 of it.

Guarantees, compared with :class:`~events.log.EmbeddedLog`:

* **Offsets** are Kafka's offsets of partition 0: dense and increasing from 0, because every
  producer of these topics is non-transactional (a transaction's commit marker would take an
  offset of its own). ``append``/``append_many`` return the offsets the broker assigned, taken
  from the delivery reports; for a single writer they are consecutive.
* **Durability**: the producer is idempotent with ``acks=all``; an append returns only after the
  broker acknowledged every record (``min.insync.replicas`` replicas hold it), so a crash of the
  writing process afterwards loses nothing.
* **Order and duplicates**: the idempotent producer keeps the order of one ``append_many`` and
  never writes a record twice because of its own retries. A *process* that crashes and appends
  again can write an event twice; consumers recognize that by ``event_id`` (the reducer applies
  a redelivered event once).
* **Atomicity** of ``append_many`` is weaker than RocksDB's WriteBatch: every item is validated
  (types, size) before anything is produced, so bad input leaves nothing behind; but a broker
  failure in the middle of a batch may leave a prefix of it in the log (raised as
  :class:`DeliveryFailed` with the offsets that did land). Kafka transactions would make batches
  atomic, but their commit markers break dense offsets.
* **Hash chain**: records read from Kafka have ``chain == b""``; on Kafka the chain is kept by
  seal events, not per record.

Reads use one consumer per :class:`KafkaLog` (re-assigned for each :meth:`KafkaLog.read`; a read
started while another is still being iterated gets a consumer of its own), with
``enable.auto.commit=False``, ``isolation.level=read_committed`` and no group membership: the
consumer never commits offsets; consumers that need a durable position keep it with their
effect (the projection store keeps its offset in the same WriteBatch as its state).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from events.log import LogError, Record, check_items

log = logging.getLogger(__name__)

PARTITION = 0
"""The one partition of each topic this transport reads and writes."""

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")

# Settings the transport's guarantees rest on: `security` may not override them.
_GUARDED = frozenset({
    "bootstrap.servers", "client.id", "group.id", "enable.idempotence", "acks", "request.required.acks",
    "transactional.id", "isolation.level", "enable.auto.commit", "enable.auto.offset.store",
    "auto.offset.reset", "max.in.flight.requests.per.connection", "max.in.flight", "retries",
    "message.send.max.retries", "enable.partition.eof",
})

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


def _check_topic(stream: str) -> str:
    if not isinstance(stream, str) or not _TOPIC_NAME.fullmatch(stream) or stream in (".", ".."):
        raise ValueError(f"stream {stream!r} is not a valid Kafka topic name "
                         "(1 to 249 characters of A-Z a-z 0-9 . _ -, not '.' or '..')")
    return stream


class KafkaLog:
    """An :class:`~events.log.EventLog` on Apache Kafka (confluent-kafka / librdkafka).

    Args:
        bootstrap_servers: ``host:port[,host:port...]`` of the brokers.
        client_id: ``client.id`` of the producer, consumer and admin client (shows in broker logs).
        partitions: partition count per topic, used when a topic is created (default 1 each).
            Only partition 0 is ever written or read; ``stagetree.plan`` must keep its history in
            one partition, so give it more only together with per-plan projectors.
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
        self.partitions: dict[str, int] = {}
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
        if topic_prefix:
            _check_topic(topic_prefix)
        self.topic_prefix = topic_prefix
        self.bootstrap_servers = bootstrap_servers
        self.client_id = client_id
        self.read_only = read_only
        self.create_topics = create_topics and not read_only
        self.replication_factor = replication_factor
        self.timeout_s = float(timeout_s)
        self._max_record = int(extra.get("message.max.bytes", 1_000_000)) - _RECORD_OVERHEAD

        base: dict[str, Any] = {
            **extra,
            "bootstrap.servers": bootstrap_servers,
            "client.id": client_id,
            "logger": log,
        }
        self._admin_conf = dict(base)
        self._producer_conf = {
            **base,
            "enable.idempotence": True,
            "acks": "all",
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
        self._known: set[str] = set()
        self._append_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        # Made now: an idempotent producer spends ~0.5 s acquiring its producer id, which then
        # overlaps with whatever the caller does before its first append.
        if not read_only:
            self._get_producer()

    def topic(self, stream: str) -> str:
        """The Kafka topic of ``stream``: ``topic_prefix + stream`` (validated)."""
        return _check_topic(self.topic_prefix + stream)

    def __repr__(self) -> str:  # never the settings: they may hold credentials
        return f"KafkaLog({self.bootstrap_servers!r}, client_id={self.client_id!r})"

    # ------------------------------------------------------------------ clients

    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"{self!r} is closed")

    def _get_admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(self._admin_conf)
        return self._admin

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

    def _new_consumer(self) -> Consumer:
        return Consumer({**self._consumer_conf, "group.id": f"{self.client_id}-reader-{uuid.uuid4().hex}"})

    def _get_consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(self._consumer_conf)
        return self._consumer

    # ------------------------------------------------------------------ topics

    def _exists(self, topic: str) -> bool:
        """Whether the cluster metadata shows ``topic`` with a led partition 0."""
        if topic in self._known:
            return True
        try:
            md = self._get_admin().list_topics(topic=topic, timeout=self.timeout_s)
        except KafkaException as exc:
            raise KafkaLogError(f"kafka: metadata of topic {topic!r} from {self.bootstrap_servers}: "
                                f"{exc.args[0]}", topic=topic, error=exc.args[0]) from exc
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            return False
        part = meta.partitions.get(PARTITION)
        if part is None or part.leader < 0:
            return False
        self._known.add(topic)
        return True

    def ensure_topic(self, stream: str) -> None:
        """Create topic ``stream`` if it is missing and wait until the metadata shows it.

        Idempotent: a topic that exists (created by anyone) is left as it is.

        Raises:
            KafkaLogError: it could not be created, or did not appear within ``timeout_s``.
            LogError: the log was opened read-only.
        """
        self._check_open()
        if self.read_only:
            raise LogError(f"{self!r} was opened read-only")
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
                raise KafkaLogError(f"kafka: topic {topic!r} was created but its partition {PARTITION} has no "
                                    f"leader after {self.timeout_s:g} s", topic=topic, error="no leader")
            time.sleep(0.05)

    # ------------------------------------------------------------------ writing

    def append(self, stream: str, key: str, value: bytes) -> int:
        """Append one record to partition 0 of topic ``stream``; returns its offset once the
        broker acknowledged it (acks=all). Raises as :meth:`append_many`."""
        return self.append_many(stream, [(key, value)])[0]

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        """Append ``(key, value)`` records in order; returns their offsets once every one was
        acknowledged by the broker (acks=all).

        Every item is checked before anything is produced, so bad input appends nothing.

        Raises:
            TypeError: a key is not a str or a value not bytes (the item is named).
            KafkaLogError: a record is larger than ``message.max.bytes``, or the topic is missing
                and ``create_topics`` is false, or it could not be created.
            DeliveryFailed: the broker did not acknowledge every record (``offsets``: those it did).
        """
        self._check_open()
        if self.read_only:
            raise LogError(f"{self!r} was opened read-only")
        topic = self.topic(stream)
        records = check_items(topic, items)
        for i, (kb, vb) in enumerate(records):
            if len(kb) + len(vb) > self._max_record:
                raise KafkaLogError(
                    f"item {i} of the append to {topic!r} has {len(kb) + len(vb)} bytes of key and value, but "
                    f"Kafka records hold at most {self._max_record} (message.max.bytes)", topic=topic,
                    error="too large")
        if not records:
            return []
        if not self._exists(topic):
            if not self.create_topics:
                raise KafkaLogError(f"kafka: topic {topic!r} does not exist and create_topics is false",
                                    topic=topic, error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
            self.ensure_topic(stream)
        with self._append_lock:
            return self._produce(topic, records)

    def _produce(self, topic: str, records: list[tuple[bytes, bytes]]) -> list[int]:
        producer = self._get_producer()
        reports: list[tuple[KafkaError | None, int]] = [(None, -1)] * len(records)
        done = [False] * len(records)

        def report(i: int) -> Any:
            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                reports[i] = (err, msg.offset() if err is None else -1)
                done[i] = True
            return on_delivery

        enqueue_error: BaseException | None = None
        for i, (kb, vb) in enumerate(records):
            while True:
                try:
                    producer.produce(topic, value=vb, key=kb, partition=PARTITION, on_delivery=report(i),
                                     headers=trace_headers(vb))
                    break
                except BufferError:  # local queue full: serve delivery reports and retry
                    producer.poll(0.05)
                except KafkaException as exc:
                    enqueue_error = exc
                    break
            if enqueue_error is not None:
                records = records[:i]
                break
        deadline = time.monotonic() + self.timeout_s + 5
        while not all(done[: len(records)]):
            producer.flush(0.5)
            if time.monotonic() > deadline:
                break
        offsets: list[int] = []
        for i in range(len(records)):
            err, offset = reports[i]
            if not done[i] or err is not None:
                why = err if err is not None else f"no delivery report within {self.timeout_s:g} s"
                raise DeliveryFailed(
                    f"kafka: append to topic {topic!r} failed at record {i} of the batch: {why} "
                    f"({len(offsets)} record(s) before it were acknowledged)",
                    topic=topic, error=why, offsets=offsets)
            offsets.append(offset)
        if enqueue_error is not None:
            err = enqueue_error.args[0]
            raise DeliveryFailed(
                f"kafka: append to topic {topic!r} failed at record {len(records)} of the batch: {err} "
                f"({len(offsets)} record(s) before it were acknowledged)", topic=topic, error=err, offsets=offsets)
        return offsets

    # ------------------------------------------------------------------ reading

    def end_offset(self, stream: str) -> int:
        """The high watermark of partition 0 of ``stream``: the offset the next record will get
        (0 for a topic that does not exist).

        Raises:
            KafkaLogError: the broker did not answer within ``timeout_s``.
        """
        self._check_open()
        topic = self.topic(stream)
        if not self._exists(topic):
            return 0
        with self._lock:
            consumer = self._get_consumer()
            try:
                _low, high = consumer.get_watermark_offsets(TopicPartition(topic, PARTITION), timeout=self.timeout_s)
            except KafkaException as exc:
                raise KafkaLogError(f"kafka: end offset of topic {topic!r}: {exc.args[0]}",
                                    topic=topic, error=exc.args[0]) from exc
        return int(high)

    def read(self, stream: str, start: int = 0, stop: int | None = None) -> Iterator[Record]:
        """Records of partition 0 of ``stream`` with ``start <= offset < stop``, in offset order.

        ``stop`` defaults to the high watermark when ``read`` is called (later appends are not
        waited for); a larger ``stop`` is cut to it. ``chain`` of every record is ``b""``.
        The consumer reads ``read_committed``: records of a foreign producer's open transaction
        are not delivered until it ends (stagetree's producers use no transactions).

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
        end = self.end_offset(stream)
        stop = end if stop is None else min(stop, end)
        if start >= stop:
            return iter(())
        return self._read(stream, start, stop)

    def _read(self, stream: str, start: int, stop: int) -> Iterator[Record]:
        topic = self.topic(stream)
        with self._lock:
            shared = not self._consumer_busy
            if shared:
                self._consumer_busy = True
                consumer = self._get_consumer()
        if not shared:
            consumer = self._new_consumer()  # another read is still being iterated
        try:
            consumer.assign([TopicPartition(topic, PARTITION, start)])
            position = start
            last_progress = time.monotonic()
            while position < stop:
                self._check_open()
                try:
                    msgs = consumer.consume(num_messages=min(stop - position, 1000), timeout=0.2)
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
                    key = msg.key()
                    value = msg.value()
                    yield Record(stream, offset, "" if key is None else key.decode("utf-8", "replace"),
                                 b"" if value is None else value, b"")
                if msgs:
                    last_progress = time.monotonic()
                elif position < stop:
                    # Transaction markers of foreign producers take offsets but are never delivered.
                    (tp,) = consumer.position([TopicPartition(topic, PARTITION)])
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
