"""The event contract: every fact stagetree records is one of these immutable events.

An event is a frozen pydantic model. On the wire (orjson, see :mod:`events.codec`) it is an
envelope ``{"type", "version", "event_id", "producer", "ts", "trace", "payload"}`` where the
payload holds the event's own fields. ``ts`` is wall-clock seconds since the epoch, captured by
the producer at the edge; reducers and the scheduler never read it for decisions (DESIGN.md,
"The event log"). Type names and field names are append-only: a new field gets a default, a
changed meaning gets a new schema version and an upcaster in the codec.

Units: steps are optimizer updates counted from 0 (a checkpoint "at step s" holds the state after
s updates); seconds are wall-clock seconds measured by the producer; sizes are bytes.
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from events.decisions import Decision, ReleasedResult
from events.hp import HP, check_computable

HEADER_FIELDS = ("event_id", "producer", "ts", "trace")

Steps = Annotated[int, Field(ge=0, le=2**63 - 1)]
Ident = Annotated[str, Field(min_length=1, pattern=r"^[^\x00-\x1f\x7f]+$")]
"""An identifier (study, trial, plan key, node, dispatch, worker): non-empty, no control characters."""
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


TRIAL_PLAN_SEPARATOR = "/trial/"
"""A ``--no-merge`` run (mode ``trial``) gives every trial a search plan of its own, keyed
``<plan key>/trial/<trial id>`` (:func:`base_plan_key` gives ``<plan key>`` back)."""


def base_plan_key(plan_key: str) -> str:
    """The shared part of a plan key: ``<key>`` of a trial-mode key ``<key>/trial/<trial id>``
    (the study's plan key, which its StudyStarted names), else the key itself."""
    return plan_key.split(TRIAL_PLAN_SEPARATOR, 1)[0]


def new_event_id() -> str:
    """A random 128-bit event id as 32 hex characters."""
    return uuid.uuid4().hex


class Event(BaseModel):
    """Base of every event: the header fields shared by all types.

    Attributes:
        event_id: unique id; consumers apply an event id once (redelivery is a no-op).
        producer: who wrote it (``sdk:<study>``, ``coordinator``, ``worker:<id>``, ...).
        ts: wall-clock seconds since the epoch at the producer; informational only.
        trace: W3C trace context (``traceparent``/``tracestate``) or None.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: ClassVar[str] = ""
    version: ClassVar[int] = 1

    event_id: Ident = Field(default_factory=new_event_id)
    producer: str = ""
    ts: float = 0.0
    trace: dict[str, str] | None = None

    def payload(self) -> dict[str, Any]:
        """The event's own fields as JSON-ready data (everything but the header)."""
        return self.model_dump(mode="json", exclude=set(HEADER_FIELDS))


# --------------------------------------------------------------------------- study / trials


class StudyStarted(Event):
    """A study run began (or resumed) against a plan.

    ``mode`` is "merged" (trials share a search plan) or "trial" (every trial gets its own plan:
    the papers' trial-based baseline). ``seed`` seeds model initialisation and data order.
    """

    type: ClassVar[str] = "StudyStarted"
    study_id: Ident
    name: str
    plan_key: Ident
    mode: Literal["merged", "trial"]
    workers: NonNegativeInt
    seed: int
    trainer: str
    metric: str | None = None
    metric_mode: Literal["max", "min"] | None = None
    study_file: str | None = None
    """Path of the study file the run imported (what ``replay reexecute`` rebuilds the trainer from)."""
    tuner_settings: dict[str, Any] | None = None
    """The study's tuner as JSON data (:meth:`stagetree.tuners.Tuner.settings`: its class, the
    version of its decision rules, its arguments and a digest of its space): what its decisions
    depend on besides the results. A ``--resume`` with other settings is refused, and ``replay
    verify`` compares them with the study file's tuner before recomputing the decisions. None
    when the run recorded none (a study run from code without a Tuner, or a log written before
    the field existed)."""


class StudyFinished(Event):
    """A study run ended with its tuner's answer. ``end_to_end_seconds`` covers every incarnation.

    ``best_metric`` is the tuner's metric of ``best_trial`` at ``best_step`` (steps): the step of
    the evaluation the tuner chose, which is the trial's last step for most tuners but may be an
    earlier one (MLtunerTuner answers with the best evaluation along its main line). None when
    there is no answer, and in logs written before the field existed.

    ``plan_key`` is the study's plan key (the one its StudyStarted names), so that on a
    partitioned plan stream the event lands in the partition that holds the study; None in logs
    written before the field existed (the event is then keyed by study id)."""

    type: ClassVar[str] = "StudyFinished"
    study_id: Ident
    best_trial: str | None
    best_metric: float | None
    end_to_end_seconds: float = Field(ge=0)
    plan_key: Ident | None = None
    best_step: Steps | None = None


class TrialSubmitted(Event):
    """A request: train ``hp`` up to ``steps`` and report the metrics there (Hippo §4.1).

    Every hyper-parameter value at steps ``[0, steps)`` must be computable (a float in range, an
    int within 64 bits; :func:`events.hp.check_computable`), else the event is invalid.

    Submitting the same ``trial_id`` again with more steps extends the trial (a promotion);
    with the same steps it is a no-op. ``plan_key`` names the search plan the trial joins: the
    study's plan key, or in a ``--no-merge`` run the trial's own (:data:`TRIAL_PLAN_SEPARATOR`).
    """

    type: ClassVar[str] = "TrialSubmitted"
    study_id: Ident
    trial_id: Ident
    plan_key: Ident
    seed: int
    hp: dict[str, HP]
    steps: Annotated[int, Field(gt=0, le=2**63 - 1)]

    @field_validator("hp")
    @classmethod
    def _non_empty(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("`hp` is {}, but must name at least one hyper-parameter")
        return v

    @model_validator(mode="after")
    def _computable(self) -> TrialSubmitted:
        """Every value the trial trains with (steps ``[0, steps)``) can be computed."""
        check_computable(self.hp, self.steps)
        return self


class TrialCancelled(Event):
    """The trial no longer needs results; requests nobody else waits on are dropped.

    ``plan_key`` is the trial's plan key (routes the event to its plan's partition); None in
    logs written before the field existed."""

    type: ClassVar[str] = "TrialCancelled"
    study_id: Ident
    trial_id: Ident
    plan_key: Ident | None = None


# --------------------------------------------------------------------------- scheduling


class CheckpointSource(BaseModel):
    """Where a dispatched path starts: the checkpoint of ``node_id`` at ``step``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    node_id: Ident
    step: Steps
    ref: Sha256


class StageSpec(BaseModel):
    """One stage of a dispatched path: train ``node_id``'s config from ``from_step`` to ``to_step``.

    ``hp`` is the node's hyper-parameter configuration (functions of the global step);
    ``evaluate`` asks for metrics at ``to_step``. A stage with ``from_step == to_step`` only
    evaluates. A checkpoint is saved at every stage end (the papers' central checkpoints).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    node_id: Ident
    hp: dict[str, HP]
    from_step: Steps
    to_step: Steps
    evaluate: bool

    @field_validator("to_step")
    @classmethod
    def _ordered(cls, v: int, info: Any) -> int:
        start = info.data.get("from_step")
        if start is not None and v < start:
            raise ValueError(f"`to_step` is {v}, but must be >= from_step {start}")
        return v


PartitionOffsets = dict[NonNegativeInt, Annotated[int, Field(ge=-1)]]
"""Partition of ``stagetree.plan`` -> offset of the last record of it folded (-1: none)."""


class DecisionEvent(Event):
    """Base of the events a decider appends (a scheduling decision, a worker declared lost, a
    tuner's decision, an eviction): each records the log prefix it was decided from, so a
    replay recomputes (or re-checks) it from exactly that prefix (DESIGN.md invariant 3).

    Attributes:
        decided_at: on an unpartitioned plan stream (embedded mode), the offset of the last
            event the decider had folded (-1: nothing, or not recorded).
        decided_at_partitions: on a partitioned plan stream (Kafka), the offset of the last
            folded record of *every* partition (a global decision's prefix is this vector);
            None on an unpartitioned stream and in logs written before the field existed.
        rules: the version of the decider's rules (see the field).

    Offsets may have gaps (Kafka transaction markers take offsets of their own): a prefix is
    named by the last offset applied, never by a count.
    """

    decided_at: int = Field(default=-1, ge=-1)
    decided_at_partitions: PartitionOffsets | None = None
    rules: int | None = Field(default=None, ge=1)
    """The version of its decider's rules (``scheduler.decide.RULES``, ``scheduler.eviction.RULES``,
    ``scheduler.inflight.RULES``), so that ``replay verify`` tells a decision taken under other
    rules from an edited one. None in logs written before the field (2026-11-28), and on decisions whose
    rules are recorded elsewhere (a tuner's, in its study's ``tuner_settings``) or that follow no
    rules but liveness (WorkerLost)."""


class StageDispatched(DecisionEvent):
    """A scheduling decision: run ``stages`` (one critical path, in order) on ``worker_id``.

    ``decided_at`` is the offset of the last ``stagetree.plan`` event the scheduler had folded
    (``decided_at_partitions``: of every partition, on a partitioned stream), so a replay
    recomputes the decision from exactly that prefix. ``source`` is None when the
    path starts from a fresh initialisation at step 0. ``policy`` is the scheduling policy that
    decided it (``scheduler.decide.POLICIES``, HIPPO_SPEC §3.7); logs written before the field
    existed decode as "critical-path", the only policy there was.
    """

    type: ClassVar[str] = "StageDispatched"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident
    seed: int
    decided_at: int = Field(ge=-1)
    source: CheckpointSource | None
    stages: list[StageSpec] = Field(min_length=1)
    policy: Literal["critical-path", "bfs", "most-children"] = "critical-path"


class StageStarted(Event):
    """A worker began training a stage of a dispatch. ``plan_key`` is the dispatch's plan key
    (routes the event to its plan's partition); None in logs written before the field existed."""

    type: ClassVar[str] = "StageStarted"
    dispatch_id: Ident
    worker_id: Ident
    node_id: Ident
    from_step: Steps
    to_step: Steps
    plan_key: Ident | None = None


class PathTrained(Event):
    """A worker trained the last stage of dispatch ``dispatch_id`` and handed its checkpoint to
    its writer: the worker is free for the next dispatch, while the path's end batches (each with
    its verified CheckpointSaved and its StageFinished) follow once the writes are verified
    (issue 15 goal 2: a path's end no longer holds its worker for the write, hash and sync).

    Until they do, the dispatch stays running: its stages keep their running ranges (nothing is
    dispatched twice) and its worker's loss still releases it. A worker whose writes were done
    by the time the path ended sends no PathTrained (its last batch ends the dispatch).
    """

    type: ClassVar[str] = "PathTrained"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident


class CheckpointSaved(Event):
    """A checkpoint object was written and verified (sha256) before this event was published."""

    type: ClassVar[str] = "CheckpointSaved"
    dispatch_id: Ident
    plan_key: Ident
    node_id: Ident
    step: Steps
    ref: Sha256
    size: PositiveInt


class MetricsReported(Event):
    """Evaluation metrics of ``node_id`` at ``step`` (first report wins)."""

    type: ClassVar[str] = "MetricsReported"
    dispatch_id: Ident
    plan_key: Ident
    node_id: Ident
    step: Steps
    metrics: dict[str, float | None]

    @field_validator("metrics", mode="before")
    @classmethod
    def _non_finite_as_null(cls, v: Any) -> Any:
        """NaN and infinities (a diverged model) cannot be written as JSON: recorded as null."""
        if isinstance(v, dict):
            return {k: None if isinstance(x, float) and not math.isfinite(x) else x for k, x in v.items()}
        return v


class StageFinished(Event):
    """A stage completed. ``seconds`` is the worker time it held (load, train, evaluate, save);
    ``train_seconds`` the part spent in optimizer steps (the per-step profile)."""

    type: ClassVar[str] = "StageFinished"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident
    node_id: Ident
    from_step: Steps
    to_step: Steps
    seconds: float = Field(ge=0)
    train_seconds: float = Field(ge=0)


class StageFailed(Event):
    """A stage could not run. ``kind``: "error" (the trainer raised; waiting trials fail),
    "checkpoint_corrupt" / "checkpoint_missing" (the source checkpoint ``ref`` is dropped from the
    plan and recomputed), "storage" (the checkpoint store kept failing, e.g. a full disk: an
    infrastructure fault; the path is handed back and dispatched again, no trial fails)."""

    type: ClassVar[str] = "StageFailed"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident
    node_id: Ident
    from_step: Steps
    to_step: Steps
    kind: Literal["error", "checkpoint_corrupt", "checkpoint_missing", "storage"]
    error: str
    ref: Sha256 | None = None


class StageStopped(Event):
    """A stage ended before its ``to_step`` because its path was preempted (:class:`PathPreempted`):
    the weights reached ``step`` (``from_step <= step < to_step``); a CheckpointSaved at ``step``
    precedes it when the worker kept them. It ends the dispatch. ``seconds`` / ``train_seconds``
    as in :class:`StageFinished`; the steps trained are ``step - from_step``."""

    type: ClassVar[str] = "StageStopped"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident
    node_id: Ident
    from_step: Steps
    to_step: Steps
    step: Steps
    seconds: float = Field(ge=0)
    train_seconds: float = Field(ge=0)


# --------------------------------------------------------------------------- in-flight and storage decisions


class PathPreempted(DecisionEvent):
    """A scheduling decision: no trial needs the rest of the running path ``dispatch_id`` (a
    cancellation, a stop by the tuner). Its worker trains on up to ``until_step`` of stage
    ``until_stage`` (an index into the dispatch's stages) when some trial still needs those
    steps, else (``until_stage`` None) stops at its next step boundary; it keeps a checkpoint of
    what it trained and reports :class:`StageStopped` (or finishes normally if it had got there).

    ``decided_at``: the offset of the last plan-stream event the scheduler had folded (a replay
    recomputes the decision from that prefix).
    """

    type: ClassVar[str] = "PathPreempted"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident
    decided_at: int = Field(ge=-1)
    until_stage: NonNegativeInt | None = None
    until_step: Steps | None = None
    reason: str = ""
    checkpoint_budget: PositiveInt | None = None
    """The checkpoint budget of the scheduling pass that decided it (None: unbounded)."""


class CheckpointRequested(DecisionEvent):
    """A scheduling decision: a request puts a boundary inside a stage of the running path
    ``dispatch_id``; its worker saves a checkpoint of ``node_id`` at ``step`` when it reaches it
    (and reports the metrics there when ``evaluate``), so the new branch resumes from it instead
    of retraining the prefix (the split-during-execution case, HIPPO_SPEC §10.1). A worker that
    has passed ``step`` ignores it and the branch is trained from the nearest checkpoint.

    ``checkpoint_budget`` is the budget it was decided under (None: unbounded), ``decided_at`` as
    in :class:`PathPreempted`.
    """

    type: ClassVar[str] = "CheckpointRequested"
    dispatch_id: Ident
    worker_id: Ident
    plan_key: Ident
    node_id: Ident
    step: Steps
    evaluate: bool = False
    decided_at: int = Field(ge=-1)
    checkpoint_budget: PositiveInt | None = None


class CheckpointEvicted(DecisionEvent):
    """A storage decision: the checkpoint ``ref`` of ``node_id`` at ``step`` leaves the plan to keep
    the checkpoint bytes within ``checkpoint_budget`` (bytes), chosen by the cost-benefit rule of
    ``scheduler.eviction`` (TreeML thesis §4.2.2, after Nectar); ``reason`` is its evidence. The
    object is deleted from the store only after this event is durable; requests that needed it
    are trained again from the nearest kept checkpoint. ``decided_at`` as in
    :class:`PathPreempted`; the evictions of one decision are appended together."""

    type: ClassVar[str] = "CheckpointEvicted"
    plan_key: Ident
    node_id: Ident
    step: Steps
    ref: Sha256
    size: PositiveInt
    decided_at: int = Field(ge=-1)
    checkpoint_budget: PositiveInt
    reason: str = ""
    policy: Literal["critical-path", "bfs", "most-children"] = "critical-path"
    """The scheduling policy of the dispatch it made room for."""


class WorkerJoined(Event):
    """A worker (one per device) is ready for dispatches."""

    type: ClassVar[str] = "WorkerJoined"
    worker_id: Ident
    device: str


COORDINATOR_RESTARTED = "coordinator restarted"
"""The ``reason`` of the WorkerLost events with which an embedded coordinator that opens a log
declares lost the workers the run before it left alive (a killed run): the first events of a
new incarnation of the run (:func:`projections.summary.elapsed` ends a killed one before them)."""


class WorkerLost(DecisionEvent):
    """A worker is gone (process died, heartbeat timed out, coordinator restarted, the worker
    drained on SIGTERM); its unfinished stages are dispatched again from the last checkpoints.

    When ``stagetree serve`` declares it (a heartbeat timeout: a decision taken by a clock and
    recorded), it records the prefix it decided from (:class:`DecisionEvent`); ``replay verify``
    checks that the worker was alive there. A worker's own goodbye records none."""

    type: ClassVar[str] = "WorkerLost"
    worker_id: Ident
    reason: str


# --------------------------------------------------------------------------- tuner decisions


class TunerDecided(DecisionEvent):
    """A tuner's decision (:mod:`events.decisions`: draw, promote, continue, stop, exploit,
    keep, retune, answer), appended by the SDK before the requests it causes.

    ``decided_at`` is the offset of the last ``stagetree.plan`` event the study's runtime had
    folded when its tuner decided (as in StageDispatched; on a partitioned stream, the last of
    the study's own partition, and ``decided_at_partitions`` that of every partition: the
    results of a ``--no-merge`` study's trials are in their own plans' partitions), so
    ``replay verify --study`` re-runs the tuner and recomputes the decision from exactly that
    prefix. ``released`` lists the results handed to an asynchronous tuner since its previous
    decision, in the order it was given them (arrival or causal order; empty for synchronous
    tuners). ``tuner`` is the tuner's class name. ``plan_key`` is the study's plan key, so that
    on a partitioned stream the decision lands in the partition that holds the study; None in
    logs written before the field existed (the event is then keyed by study id).
    """

    type: ClassVar[str] = "TunerDecided"
    study_id: Ident
    tuner: str
    decided_at: int = Field(ge=-1)
    decision: Decision
    released: list[ReleasedResult] = Field(default_factory=list)
    plan_key: Ident | None = None


class LogSealed(Event):
    """The hash chain of ``stream`` (of its ``partition``) after the record at ``offset`` (hex;
    sha256 or HMAC-SHA256 per ``algorithm``), written by whoever folds the stream for the
    deployment (on Kafka: ``stagetree serve``'s scheduler role, one seal per partition, in its
    fenced transactions). ``replay verify`` recomputes the chain and checks every seal."""

    type: ClassVar[str] = "LogSealed"
    stream: str
    offset: int = Field(ge=0)
    chain: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    algorithm: Literal["sha256", "hmac-sha256"]
    partition: NonNegativeInt | None = None
    """The partition of ``stream`` whose chain this is (each partition of a partitioned stream
    has a chain of its own); None: an unpartitioned stream (partition 0)."""


class DeadLettered(Event):
    """An event that could not be decoded or applied, kept with the reason (stream
    ``stagetree.deadletter``; built by :func:`events.deadletter.dead_letter`).

    ``stream``/``offset``: where the record is (offset -1: in no log, e.g. a worker pipe).
    ``reason``: why, capped. ``raw``: the start of the record's bytes decoded as UTF-8 (with
    replacement), capped; ``sha256`` and ``size`` (bytes) identify the whole record (None in
    letters written before these fields existed).
    """

    type: ClassVar[str] = "DeadLettered"
    stream: str
    offset: int
    reason: str
    raw: str
    sha256: Sha256 | None = None
    size: NonNegativeInt | None = None
    partition: NonNegativeInt | None = None
    """The partition of ``stream`` the record was in (None: unpartitioned, or not from a stream)."""


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        StudyStarted,
        StudyFinished,
        TrialSubmitted,
        TrialCancelled,
        StageDispatched,
        StageStarted,
        CheckpointSaved,
        MetricsReported,
        StageFinished,
        StageFailed,
        WorkerJoined,
        WorkerLost,
        DeadLettered,
        LogSealed,
        StageStopped,
        PathTrained,
        PathPreempted,
        CheckpointRequested,
        CheckpointEvicted,
        TunerDecided,
    )
}
