"""Projected state: the search plans of the papers plus study, trial, worker and dispatch status.

Everything here is plain data with a canonical JSON form (``to_json``/``from_json``), so a
projection persisted in RocksDB and one rebuilt from the log compare byte for byte.

Search plan (Hippo §3.2, HIPPO_SPEC §1.3): a forest of append-only nodes. A node is one
hyper-parameter configuration (functions of the global step) that starts at ``start_step``
under its parent; ``ckpt`` maps step -> checkpoint, ``metrics`` step -> metrics, ``requests``
step -> trials waiting for metrics there, ``running`` the step ranges of in-flight dispatches,
and ``profile_*`` the measured training time (seconds per step = seconds / steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from events.hp import HPConfig, config_from_json, config_to_json


@dataclass
class Checkpoint:
    """A verified checkpoint object: ``ref`` is its sha256, ``size`` in bytes."""

    ref: str
    size: int


@dataclass
class Node:
    """One search-plan node (never split or deleted)."""

    node_id: str
    plan_key: str
    parent_id: str | None
    start_step: int
    depth: int
    hp: HPConfig
    children: list[str] = field(default_factory=list)
    ckpt: dict[int, Checkpoint] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    requests: dict[int, list[str]] = field(default_factory=dict)
    running: list[tuple[str, int, int]] = field(default_factory=list)
    profile_steps: int = 0
    profile_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "plan_key": self.plan_key,
            "parent_id": self.parent_id,
            "start_step": self.start_step,
            "depth": self.depth,
            "hp": config_to_json(self.hp),
            "children": list(self.children),
            "ckpt": [[s, c.ref, c.size] for s, c in sorted(self.ckpt.items())],
            "metrics": [[s, dict(sorted(m.items()))] for s, m in sorted(self.metrics.items())],
            "requests": [[s, list(w)] for s, w in sorted(self.requests.items())],
            "running": [list(r) for r in self.running],
            "profile_steps": self.profile_steps,
            "profile_seconds": self.profile_seconds,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> Node:
        return cls(
            node_id=o["node_id"],
            plan_key=o["plan_key"],
            parent_id=o["parent_id"],
            start_step=o["start_step"],
            depth=o["depth"],
            hp=config_from_json(o["hp"]),
            children=list(o["children"]),
            ckpt={s: Checkpoint(ref, size) for s, ref, size in o["ckpt"]},
            metrics={s: dict(m) for s, m in o["metrics"]},
            requests={s: list(w) for s, w in o["requests"]},
            running=[(d, a, b) for d, a, b in o["running"]],
            profile_steps=o["profile_steps"],
            profile_seconds=o["profile_seconds"],
        )

    def checkpoint_at(self, step: int) -> Checkpoint | None:
        return self.ckpt.get(step)

    def sec_per_step(self) -> float | None:
        """Measured training seconds per step, or None before any measurement."""
        return self.profile_seconds / self.profile_steps if self.profile_steps else None


@dataclass
class Plan:
    """A search plan: the nodes of one plan key, with the model-initialisation seed, and the
    steps trained and worker-seconds spent on it (finished stages)."""

    plan_key: str
    seed: int
    roots: list[str] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    executed_steps: int = 0
    worker_seconds: float = 0.0
    revision: int = field(default=0, init=False, compare=False, repr=False)
    """Mutation counter, bumped by the reducer whenever anything of the plan changes (its nodes,
    requests, running ranges, checkpoints, metrics, profiles). Not persisted: a plan rebuilt
    from its records starts again at 0 with an empty :attr:`cache`."""
    cache: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False)
    """Derived data memoised per plan object (the scheduler's choice per :attr:`revision`, the
    child index of ``search_plan.place``, the scheduler's stage-tree index); never persisted,
    never part of equality."""
    changed: set[str] = field(default_factory=set, init=False, compare=False, repr=False)
    """Ids of the nodes the reducer touched since the scheduler's stage-tree index last read
    them (``scheduler.stage_index``, which empties it). Not persisted. Code that mutates a node
    outside the reducer must add its id here (or clear :attr:`cache`)."""
    profile_revision: int = field(default=0, init=False, compare=False, repr=False)
    """Bumped by the reducer whenever a node's measured profile changes (``profile_steps``,
    ``profile_seconds``), so the plan's totals are summed again only then. Not persisted."""

    def meta_json(self) -> dict[str, Any]:
        return {"plan_key": self.plan_key, "seed": self.seed, "roots": list(self.roots),
                "executed_steps": self.executed_steps, "worker_seconds": self.worker_seconds}

    def new_node_id(self) -> str:
        return f"n{len(self.nodes)}"


@dataclass
class Trial:
    """A trial: one configuration of a study. ``requests`` maps steps asked -> terminal node;
    ``results`` steps -> metrics reported there."""

    trial_id: str
    study_id: str
    plan_key: str
    hp: HPConfig
    steps: int
    requests: dict[int, str] = field(default_factory=dict)
    results: dict[int, dict[str, float]] = field(default_factory=dict)
    answered: dict[int, int] = field(default_factory=dict)  # steps -> ordinal of the answer (Stats.answers)
    status: str = "pending"  # pending | done | failed | cancelled
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "study_id": self.study_id,
            "plan_key": self.plan_key,
            "hp": config_to_json(self.hp),
            "steps": self.steps,
            "requests": [[s, n] for s, n in sorted(self.requests.items())],
            "results": [[s, dict(sorted(m.items()))] for s, m in sorted(self.results.items())],
            "answered": [[s, o] for s, o in sorted(self.answered.items())],
            "status": self.status,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> Trial:
        return cls(
            trial_id=o["trial_id"],
            study_id=o["study_id"],
            plan_key=o["plan_key"],
            hp=config_from_json(o["hp"]),
            steps=o["steps"],
            requests={s: n for s, n in o["requests"]},
            results={s: dict(m) for s, m in o["results"]},
            answered={s: a for s, a in o.get("answered", [])},
            status=o["status"],
            error=o["error"],
        )


@dataclass
class Decided:
    """A tuner decision naming a trial, as the reducer recorded it under that trial: the
    ``offset`` of its TunerDecided event, the study and tuner, the prefix it was decided from
    (``decided_at``), the trial's ``role`` in it (``events.decisions``: "trial", "donor", "new",
    "branch_of") and the decision's JSON form."""

    offset: int
    study_id: str
    tuner: str
    decided_at: int
    role: str
    decision: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "study_id": self.study_id, "tuner": self.tuner,
                "decided_at": self.decided_at, "role": self.role, "decision": self.decision}

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> Decided:
        return cls(o["offset"], o["study_id"], o["tuner"], o["decided_at"], o["role"], dict(o["decision"]))


@dataclass
class Worker:
    """A worker: ``dispatch_id`` the path it is training (None: idle), ``writing`` the paths it
    trained (PathTrained) whose end batches have not all come yet, in dispatch order: its loss
    releases those too."""

    worker_id: str
    device: str
    alive: bool = True
    dispatch_id: str | None = None
    writing: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        # "writing" only when there is some: the records of a log without PathTrained events stay
        # byte for byte what they were (exports carry their projection's digest)
        return {"worker_id": self.worker_id, "device": self.device, "alive": self.alive,
                "dispatch_id": self.dispatch_id, **({"writing": list(self.writing)} if self.writing else {})}

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> Worker:
        return cls(o["worker_id"], o["device"], o["alive"], o["dispatch_id"], list(o.get("writing", [])))


@dataclass
class Dispatch:
    """A dispatched path: its stages ``(node_id, from_step, to_step)`` in order, the checkpoint
    ``source`` (ref) it starts from (None: a fresh start), the checkpoints its worker was asked to
    save inside its stages (``requested``: ``(node_id, step, evaluate)``), and, once preempted,
    how far it may still train (``until``: ``(stage index, step)``, or ``(-1, -1)``: stop now).
    Whether its worker has trained it to the end and is writing its end batches (PathTrained) is
    its worker's :attr:`Worker.writing` (``projections.queries.handed_on``)."""

    dispatch_id: str
    worker_id: str
    plan_key: str
    stages: list[tuple[str, int, int]]
    finished: int = 0
    status: str = "running"  # running | done | failed | lost | preempted
    source: str | None = None
    requested: list[tuple[str, int, bool]] = field(default_factory=list)
    until: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "dispatch_id": self.dispatch_id,
            "worker_id": self.worker_id,
            "plan_key": self.plan_key,
            "stages": [list(s) for s in self.stages],
            "finished": self.finished,
            "status": self.status,
            "source": self.source,
            "requested": [list(r) for r in self.requested],
            "until": list(self.until) if self.until is not None else None,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> Dispatch:
        until = o.get("until")
        return cls(
            dispatch_id=o["dispatch_id"],
            worker_id=o["worker_id"],
            plan_key=o["plan_key"],
            stages=[(n, a, b) for n, a, b in o["stages"]],
            finished=o["finished"],
            status=o["status"],
            source=o.get("source"),
            requested=[(n, s, e) for n, s, e in o.get("requested", [])],
            until=(until[0], until[1]) if until is not None else None,
        )


@dataclass
class StoredObject:
    """A checkpoint object of the store (content-addressed by its sha256 ``ref``): its ``size``
    in bytes and how many plan places (node, step) reference it. An object no place references
    is garbage: evicted, or dropped as corrupt; its deletion is due."""

    size: int
    references: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "references": self.references}


@dataclass
class Stats:
    """Running totals: steps trained in finished stages, worker-seconds (held time)."""

    executed_steps: int = 0
    worker_seconds: float = 0.0
    stages_finished: int = 0
    dispatches: int = 0
    answers: int = 0
    checkpoint_bytes: int = 0
    """Bytes of the checkpoint objects the plans reference now (what the store keeps)."""
    peak_checkpoint_bytes: int = 0
    evictions: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "executed_steps": self.executed_steps,
            "worker_seconds": self.worker_seconds,
            "stages_finished": self.stages_finished,
            "dispatches": self.dispatches,
            "answers": self.answers,
            "checkpoint_bytes": self.checkpoint_bytes,
            "peak_checkpoint_bytes": self.peak_checkpoint_bytes,
            "evictions": self.evictions,
        }


@dataclass
class Rejection:
    """A plan-stream record the fold could not use (dead-lettered): the reason (capped), and the
    sha256 and size (bytes) of the record, which stays in the log at its offset."""

    reason: str
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, o: Any) -> Rejection:
        if isinstance(o, str):  # projections written before rejections kept a hash
            return cls(o, "", 0)
        return cls(o["reason"], o["sha256"], o["size"])


@dataclass
class State:
    """The whole projection of the plan stream (or of one partition of it). ``offset`` is the
    last folded offset (-1: none); ``chain`` the stream's hash chain up to it, kept by the
    projector (hex)."""

    plans: dict[str, Plan] = field(default_factory=dict)
    trials: dict[str, Trial] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)
    dispatches: dict[str, Dispatch] = field(default_factory=dict)
    studies: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    seen: set[str] = field(default_factory=set)
    rejected: dict[int, Rejection] = field(default_factory=dict)
    objects: dict[str, StoredObject] = field(default_factory=dict)
    """Every checkpoint object ever saved, by ref (see :class:`StoredObject`)."""
    decided: dict[str, list[Decided]] = field(default_factory=dict)
    """trial id -> the tuner decisions naming it, in log order (TunerDecided events)."""
    offset: int = -1
    chain: str = "0" * 64  # hash chain of the plan stream after ``offset`` (events.log.chain_next)
    offsets: dict[int, int] | None = None
    """When this state is the merged view of a partitioned plan stream
    (:func:`projections.partitions.merge`): the offset of every partition's last folded record,
    the prefix a decision taken from it records; None for the fold of one stream. Not persisted."""
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """Derived data memoised per state object (``projections.queries.running_dispatches``); never
    persisted, never part of equality."""

    def node(self, plan_key: str, node_id: str) -> Node | None:
        plan = self.plans.get(plan_key)
        return plan.nodes.get(node_id) if plan else None

    def idle_workers(self) -> list[str]:
        """Alive workers with no dispatch in flight, sorted by id."""
        return sorted(w.worker_id for w in self.workers.values() if w.alive and w.dispatch_id is None)
