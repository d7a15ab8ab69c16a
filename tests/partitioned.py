"""A plan stream as a Kafka deployment with several plan partitions holds it, made from the
records of an unpartitioned one (an embedded or simulated run): for tests of the readers of a
partitioned stream (the dashboard, ``replay verify --study``) that need no broker."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

from events.codec import decode, encode
from events.kafka_log import partition_for
from events.log import Record, event_key, is_broadcast
from events.models import TunerDecided


def separating(keys: Iterable[str], at_least: int = 3) -> int:
    """The smallest partition count >= ``at_least`` that puts every one of ``keys`` in a
    partition of its own."""
    unique = set(keys)
    return next(n for n in range(max(at_least, len(unique)), 1024)
                if len({partition_for(k, n) for k in unique}) == len(unique))


def as_partitioned(records: Iterable[Record], count: int) -> list[Record]:
    """``records`` (one stream, in offset order) spread over ``count`` partitions as the Kafka
    transport writes them: each to its key's partition, WorkerJoined and WorkerLost to every
    one, offsets per partition with gaps (transaction markers take offsets). A tuner decision
    is rewritten to record the same prefix in the new offsets: its own partition's last offset
    in ``decided_at`` and every partition's in ``decided_at_partitions``."""
    out: list[Record] = []
    seen: dict[int, tuple[list[int], list[int]]] = {p: ([], []) for p in range(count)}  # old, new offsets

    def prefix(partition: int, old: int) -> int:
        olds, news = seen[partition]
        i = bisect_right(olds, old)
        return news[i - 1] if i else -1

    for r in records:
        event = decode(r.value)
        for p in range(count) if is_broadcast(event) else [partition_for(event_key(event), count)]:
            value = r.value
            if isinstance(event, TunerDecided):
                value = encode(event.model_copy(update={
                    "decided_at": prefix(p, event.decided_at),
                    "decided_at_partitions": {q: prefix(q, event.decided_at) for q in range(count)}}))
            olds, news = seen[p]
            olds.append(r.offset)
            news.append(news[-1] + 2 if news else 1)
            out.append(Record(r.stream, news[-1], r.key, value, b"", p))
    return out
