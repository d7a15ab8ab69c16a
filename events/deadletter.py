"""Dead letters: what could not be decoded or applied, kept with the reason (DESIGN.md "The event
log": unknown or invalid events never crash a consumer and are never silently dropped).

One rule everywhere (the projector, the embedded coordinator's worker pipes, a Kafka worker's
dispatch records, ``serve``'s heartbeats): a record that cannot be used becomes a
:class:`~events.models.DeadLettered` event built by :func:`dead_letter`, with the reason capped
at :data:`REASON_LIMIT` characters, the sha256 and size of the record's bytes, and at most
:data:`RAW_LIMIT` characters of them (decoded as UTF-8 with replacement). The record itself is
never copied whole: a record of a log stream stays where it is (``stream``, ``offset``), and the
hash identifies it.
"""

from __future__ import annotations

import hashlib

from events.models import DeadLettered, new_event_id

REASON_LIMIT = 1000
"""Characters of a dead letter's reason kept (a validation error may quote the whole value)."""
RAW_LIMIT = 4096
"""Characters of the raw record kept in a dead letter (its sha256 and size are kept whole)."""


def cap(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and a note of how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def dead_letter(stream: str, offset: int, raw: bytes, reason: str, producer: str,
                partition: int | None = None) -> DeadLettered:
    """The dead letter of the record at ``offset`` of ``stream`` (``offset`` -1: a record that is
    in no log, such as a message on a worker pipe), in ``partition`` of a partitioned stream.

    A letter about a log record has the id ``dl-<stream>-<offset>`` (``dl-<stream>-<partition>-
    <offset>`` in a partition), so publishing it twice (a crash between committing and
    publishing) gives the same event, which consumers apply once.
    """
    if offset < 0:
        event_id = new_event_id()
    else:
        event_id = f"dl-{stream}-{offset}" if partition is None else f"dl-{stream}-{partition}-{offset}"
    return DeadLettered(
        event_id=event_id,
        producer=producer,
        stream=stream,
        offset=offset,
        reason=cap(reason, REASON_LIMIT),
        raw=cap(bytes(raw).decode("utf-8", "replace"), RAW_LIMIT),
        sha256=hashlib.sha256(raw).hexdigest(),
        size=len(raw),
        partition=partition,
    )
