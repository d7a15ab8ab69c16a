"""Live progress of a run with rich: stages, trials, per-worker activity, steps saved."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from projections.queries import study_needs
from projections.state import State


def render(state: State, title: str, study_id: str | None = None) -> Group:
    """A snapshot of ``state`` as a renderable: totals line plus one row per worker.

    The totals are ``study_id``'s when given (its trials; the stages, steps and worker-seconds
    of its plans, as its summary counts them), else the whole log's (a deployment runs other
    studies beside it). Stages: finished / finished plus those the running dispatches still
    hold (a lost or preempted dispatch's rest is dispatched again: counted once, there). Steps
    saved: the steps the trials asked minus the unique steps of their requests' paths (what
    merging spares, known from the plan before they train) or, once more were trained
    (checkpoints evicted and recomputed), minus the steps trained."""
    trials = [t for t in state.trials.values() if study_id is None or t.study_id == study_id]
    keys = {t.plan_key for t in trials}
    dispatches = [d for d in state.dispatches.values() if study_id is None or d.plan_key in keys]
    plans = [p for k, p in state.plans.items() if k in keys]
    finished = state.stats.stages_finished if study_id is None else sum(d.finished for d in dispatches)
    outstanding = sum(len(d.stages) - d.finished for d in dispatches if d.status == "running")
    done = sum(1 for t in trials if t.status == "done")
    asked = sum(t.steps for t in trials)
    unique = sum(end - start for start, end in study_needs(state, study_id).values())
    executed = state.stats.executed_steps if study_id is None else sum(p.executed_steps for p in plans)
    seconds = state.stats.worker_seconds if study_id is None else sum(p.worker_seconds for p in plans)
    head = Text.assemble(
        (title, "bold"),
        f"  stages {finished}/{finished + outstanding}",
        f"  trials {done}/{len(trials)}",
        f"  steps trained {executed}",
        (f"  steps saved {max(0, asked - max(unique, executed))}", "green"),
        f"  worker-seconds {seconds:.1f}",
    )
    table = Table(box=None, show_header=True, header_style="dim")
    table.add_column("worker")
    table.add_column("device")
    table.add_column("activity")
    for w in sorted(state.workers.values(), key=lambda w: w.worker_id):
        if not w.alive:
            activity = "[red]lost[/red]"
        elif w.dispatch_id is None:
            activity = "idle"
        else:
            d = state.dispatches[w.dispatch_id]
            node, a, b = d.stages[min(d.finished, len(d.stages) - 1)]
            activity = f"{w.dispatch_id}: stage {d.finished + 1}/{len(d.stages)} {node} steps {a}->{b}"
        table.add_row(w.worker_id, w.device, activity)
    return Group(head, table)


class Progress:
    """Refreshes a rich Live display whenever the coordinator folds events."""

    def __init__(self, state_of: Callable[[], State], title: str, enabled: bool = True,
                 study_id: str | None = None) -> None:
        self._state_of = state_of
        self.title = title
        self.study_id = study_id  # the totals of this study only (see render)
        self.live = Live(render(state_of(), title, study_id), refresh_per_second=4, transient=False,
                         console=Console(emoji=False)) if enabled else None  # a study named "x:smile:" as given
        self._due = 0.0  # time.monotonic() of the next snapshot

    def __enter__(self) -> Progress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(render(self._state_of(), self.title, self.study_id))
            self.live.__exit__(*exc)
            if not self.live.console.is_terminal:  # rich leaves its last line open there: the
                self.live.console.line()  # next output (the result) went onto the table's last row

    def on_fold(self) -> None:
        """Render the state again when the display is due to refresh (4 times a second): a fold
        is milliseconds, and the snapshot is a pass over every trial and dispatch."""
        if self.live is not None:
            now = time.monotonic()
            if now >= self._due:
                self._due = now + 0.25
                self.live.update(render(self._state_of(), self.title, self.study_id))
