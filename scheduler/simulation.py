"""Instant in-memory execution of a plan: the real reducer and scheduler, simulated workers.

Used by the property tests of the scheduler (and by the cluster simulator): every dispatched
path "trains" at once, saving a checkpoint at each stage end (a fake but unique sha256 per
(plan, node, step)) and reporting metrics that are a pure function of the trained step range,
so the scheduling logic runs exactly as in production without torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from events.hp import HPConfig
from events.models import (
    CheckpointSaved,
    Event,
    MetricsReported,
    StageDispatched,
    StageFinished,
    TrialSubmitted,
    WorkerJoined,
)
from projections.reducer import apply
from projections.state import State
from scheduler.decide import decide


def fake_ref(plan_key: str, node_id: str, step: int) -> str:
    """A stable sha256 standing in for the checkpoint of ``node_id`` at ``step``."""
    return hashlib.sha256(f"{plan_key}/{node_id}/{step}".encode()).hexdigest()


@dataclass
class Simulation:
    """Drive the reducer and ``decide`` with ``workers`` instantly-finishing workers.

    Attributes:
        trained: every ``(plan_key, node_id, from_step, to_step)`` range trained, in order.
        events: every event applied, in log order.
    """

    workers: int = 2
    state: State = field(default_factory=State)
    trained: list[tuple[str, str, int, int]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i in range(self.workers):
            self.emit(WorkerJoined(worker_id=f"w{i}", device="sim"))

    def emit(self, event: Event) -> None:
        apply(self.state, event, self.state.offset + 1)
        self.events.append(event)

    def submit(self, trial_id: str, hp: HPConfig, steps: int, plan_key: str = "plan", seed: int = 0) -> None:
        self.emit(TrialSubmitted(study_id="sim", trial_id=trial_id, plan_key=plan_key, seed=seed, hp=hp, steps=steps))

    def execute(self, dispatch: StageDispatched) -> None:
        """Finish every stage of ``dispatch`` at once."""
        for spec in dispatch.stages:
            self.trained.append((dispatch.plan_key, spec.node_id, spec.from_step, spec.to_step))
            ref = fake_ref(dispatch.plan_key, spec.node_id, spec.to_step)
            self.emit(CheckpointSaved(dispatch_id=dispatch.dispatch_id, plan_key=dispatch.plan_key,
                                      node_id=spec.node_id, step=spec.to_step, ref=ref, size=1))
            if spec.evaluate:
                self.emit(MetricsReported(dispatch_id=dispatch.dispatch_id, plan_key=dispatch.plan_key,
                                          node_id=spec.node_id, step=spec.to_step,
                                          metrics={"step": float(spec.to_step)}))
            steps = spec.to_step - spec.from_step
            self.emit(StageFinished(dispatch_id=dispatch.dispatch_id, worker_id=dispatch.worker_id,
                                    plan_key=dispatch.plan_key, node_id=spec.node_id,
                                    from_step=spec.from_step, to_step=spec.to_step,
                                    seconds=float(steps), train_seconds=float(steps)))

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
