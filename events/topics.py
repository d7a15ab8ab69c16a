"""Stream (Kafka topic) names. One totally ordered plan stream, keyed by plan key (DESIGN.md)."""

PLAN = "stagetree.plan"
"""Every event that changes a search plan or study: keyed by plan key (worker events by worker id)."""

DISPATCH = "stagetree.dispatch"
"""StageDispatched copies for workers, keyed by worker id."""

DEADLETTER = "stagetree.deadletter"
"""DeadLettered events: what could not be decoded or applied, with the reason."""

HEARTBEAT = "stagetree.heartbeat"
"""Worker liveness beats (Kafka mode), keyed by worker id; not part of the plan's history: the
serve process turns a missed beat into a WorkerLost event on the plan stream."""

ALL = (PLAN, DISPATCH, DEADLETTER, HEARTBEAT)

OPTUNA = "stagetree.optuna"
"""Optuna's journal (``stagetree.integration.optuna``): one record per journal operation, keyed
by a unique request id; not part of a plan's history, not read by the projector. In a run
directory it is hash-chained like every stream; on Kafka its topic is ``<prefix>stagetree.optuna``."""
