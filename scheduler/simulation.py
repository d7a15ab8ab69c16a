"""Instant in-memory execution of a plan: the real reducer and scheduler, simulated workers.

Used by the property tests of the scheduler (and by the cluster simulator): every dispatched
path "trains" at once through the one event sequence of a dispatch
(:func:`events.execution.run_path`), saving a checkpoint at each stage that trained (a fake but
unique sha256 per (plan, node, step)) and reporting metrics that are a pure function of the
trained step range, so the scheduling logic runs exactly as in production without torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from events.execution import Saved, run_path
from events.hp import HPConfig
from events.models import Event, StageDispatched, StageSpec, TrialSubmitted, WorkerJoined
from projections.reducer import apply
from projections.state import State
from scheduler.decide import decide


def fake_ref(plan_key: str, node_id: str, step: int) -> str:
    """A stable sha256 standing in for the checkpoint of ``node_id`` at ``step``."""
    return hashlib.sha256(f"{plan_key}/{node_id}/{step}".encode()).hexdigest()


class _Instant:
    """A :class:`~events.execution.PathBackend` that trains nothing: a step of a node takes
    ``sim.step_seconds(plan_key, node_id)`` seconds of a virtual clock (default one), a
    checkpoint is :func:`fake_ref`, the metrics are ``{"step": step}``."""

    def __init__(self, sim: Simulation, dispatch: StageDispatched) -> None:
        self.sim, self.d = sim, dispatch
        self.at, self.clock, self.stored, self.node = 0, 0.0, False, dispatch.stages[0].node_id

    def begin(self, d: StageDispatched) -> None:
        self.at, self.stored = (d.source.step, True) if d.source is not None else (0, False)

    def step(self) -> int:
        return self.at

    def train(self, spec: StageSpec, until: int, interrupt: Callable[[], bool]) -> None:
        self.sim.trained.append((self.d.plan_key, spec.node_id, self.at, until))
        seconds = 1.0 if self.sim.step_seconds is None else self.sim.step_seconds(self.d.plan_key, spec.node_id)
        self.clock += (until - self.at) * seconds
        self.stored = self.stored and until == self.at
        self.at, self.node = until, spec.node_id

    def evaluate(self, spec: StageSpec, step: int) -> dict[str, float]:
        return {"step": float(step)}

    def save(self, waited: bool = False) -> Saved | None:
        if self.stored:
            return None
        self.stored = True
        return Saved(fake_ref(self.d.plan_key, self.node, self.at), 1)

    def abandon(self) -> None:
        self.stored = False

    def now(self) -> float:
        return self.clock


@dataclass
class Simulation:
    """Drive the reducer and ``decide`` with ``workers`` instantly-finishing workers.

    Attributes:
        trained: every ``(plan_key, node_id, from_step, to_step)`` range trained, in order.
        events: every event applied, in log order.
        step_seconds: seconds a step of ``(plan_key, node_id)`` takes (None: one second).
    """

    workers: int = 2
    state: State = field(default_factory=State)
    trained: list[tuple[str, str, int, int]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    step_seconds: Callable[[str, str], float] | None = None

    def __post_init__(self) -> None:
        for i in range(self.workers):
            self.emit(WorkerJoined(worker_id=f"w{i}", device="sim"))

    def emit(self, event: Event) -> None:
        apply(self.state, event, self.state.offset + 1)
        self.events.append(event)

    def submit(self, trial_id: str, hp: HPConfig, steps: int, plan_key: str = "plan", seed: int = 0) -> None:
        self.emit(TrialSubmitted(study_id="sim", trial_id=trial_id, plan_key=plan_key, seed=seed, hp=hp, steps=steps))

    def execute(self, dispatch: StageDispatched) -> None:
        """Finish every stage of ``dispatch`` at once, with the events a worker emits
        (:func:`events.execution.run_path`)."""
        run_path(dispatch, _Instant(self, dispatch), lambda events: [self.emit(e) for e in events],
                 dispatch.worker_id)

    def dispatch_all(self) -> list[StageDispatched]:
        """Append every decision the scheduler makes now (until no worker is idle or nothing is ready)."""
        out = []
        while (decision := decide(self.state)) is not None:
            self.emit(decision)
            out.append(decision)
        return out

    def run(self) -> None:
        """Dispatch and finish work, oldest dispatch first, until nothing is left to do."""
        queue: list[StageDispatched] = []
        while True:
            queue.extend(self.dispatch_all())
            if not queue:
                return
            self.execute(queue.pop(0))
