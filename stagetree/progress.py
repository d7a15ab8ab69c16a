"""Live progress of a run with rich: stages, trials, per-worker activity, steps saved."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from projections.state import State


def render(state: State, title: str) -> Group:
    """A snapshot of ``state`` as a renderable: totals line plus one row per worker."""
    stages_total = sum(len(d.stages) for d in state.dispatches.values())
    trials = list(state.trials.values())
    done = sum(1 for t in trials if t.status == "done")
    asked = sum(t.steps for t in trials)
    executed = state.stats.executed_steps
    head = Text.assemble(
        (title, "bold"),
        f"  stages {state.stats.stages_finished}/{stages_total}",
        f"  trials {done}/{len(trials)}",
        f"  steps trained {executed}",
        (f"  steps saved {max(0, asked - executed)}", "green"),
        f"  worker-seconds {state.stats.worker_seconds:.1f}",
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

    def __init__(self, state_of: Callable[[], State], title: str, enabled: bool = True) -> None:
        self._state_of = state_of
        self.title = title
        self.live = Live(render(state_of(), title), refresh_per_second=4, transient=False) if enabled else None
        self._due = 0.0  # time.monotonic() of the next snapshot

    def __enter__(self) -> Progress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(render(self._state_of(), self.title))
            self.live.__exit__(*exc)

    def on_fold(self) -> None:
        """Render the state again when the display is due to refresh (4 times a second): a fold
        is milliseconds, and the snapshot is a pass over every trial and dispatch."""
        if self.live is not None:
            now = time.monotonic()
            if now >= self._due:
                self._due = now + 0.25
                self.live.update(render(self._state_of(), self.title))
