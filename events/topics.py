"""Stream (Kafka topic) names. The plan stream is keyed by plan key, one partition per group of
plans, so one partition holds a plan's whole history (DESIGN.md "The event log")."""

import re

DEFAULT_PLAN_PARTITIONS = 8
"""Partitions of ``stagetree.plan`` when a Kafka deployment creates it (``--plan-partitions``;
fixed at creation, read from the cluster afterwards)."""

PLAN = "stagetree.plan"
"""Every event that changes a search plan or study: keyed by plan key; WorkerJoined and
WorkerLost (keyed by worker id) go to every partition (events.log.BROADCAST)."""

DISPATCH = "stagetree.dispatch"
"""Embedded mode: StageDispatched copies for workers, keyed by worker id. On Kafka each worker
has a stream of its own (:func:`dispatch_stream`)."""

DEADLETTER = "stagetree.deadletter"
"""DeadLettered events: what could not be decoded or applied, with the reason."""

HEARTBEAT = "stagetree.heartbeat"
"""Worker liveness beats (Kafka mode), keyed by worker id, one partition: its owner in the
serve app's group holds the scheduler role and turns a missed beat into a WorkerLost event."""

ALL = (PLAN, DEADLETTER, HEARTBEAT)
"""The streams a Kafka deployment creates up front (workers create their dispatch streams)."""

TOPIC_PART = re.compile(r"[A-Za-z0-9._-]{1,200}")
"""What may be part of a Kafka topic name (1 to 200 characters of A-Z a-z 0-9 . _ -): a topic
prefix, a worker id (its dispatch topic), a serve app id (faust's topics)."""


def dispatch_stream(worker_id: str) -> str:
    """The stream a worker reads its dispatches (and a notice that it was declared lost) from,
    on Kafka: ``stagetree.dispatch.<worker id>``, so a worker reads only its own records.

    Raises:
        ValueError: ``worker_id`` cannot be part of a Kafka topic name (1 to 200 characters of
            A-Z a-z 0-9 . _ -).
    """
    if not isinstance(worker_id, str) or not TOPIC_PART.fullmatch(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1 to 200 characters of A-Z a-z 0-9 . _ - "
                         "(it names the worker's dispatch topic on Kafka)")
    return f"{DISPATCH}.{worker_id}"


OPTUNA = "stagetree.optuna"
"""Optuna's journal (``stagetree.integration.optuna``): one record per journal operation, keyed
by a unique request id; not part of a plan's history, not read by the projector. In a run
directory it is hash-chained like every stream; on Kafka its topic is ``<prefix>stagetree.optuna``."""
