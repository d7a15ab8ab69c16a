"""``stagetree dashboard``: a live web page of a study, read-only, over the projections.

While a study runs (or afterwards, or from an export, or on a Kafka deployment) the page shows
the stage tree with shared and running stages and the selected trial's path, a timeline of the
workers, the learning curves of every trial with promotions and stops marked, a sortable trial
table, and the figures of the summary (merge rate p, total / unique / executed steps,
worker-seconds and what merging saved, idle worker time) with ``replay verify`` on demand.
It updates over server-sent events, never reloading the page.

A package along its seams: :mod:`.source` (reading a run directory, an export or Kafka without
writing), :mod:`.views` (what the page shows, pure functions of the fold), :mod:`.server` (the
aiohttp application and its security defaults), :mod:`.cli` (the command, and starting it beside
a run); the page itself is ``static/`` (Plotly.js draws the charts).
"""

from typing import Any

# The command's parser imports this package: what serving needs (aiohttp, the fold) is imported
# when first used.
_HOMES = {
    "Beside": "stagetree.dashboard.cli", "register": "stagetree.dashboard.cli", "reserve": "stagetree.dashboard.cli",
    "DashboardServer": "stagetree.dashboard.server", "DashboardSource": "stagetree.dashboard.source",
    "SourceError": "stagetree.dashboard.source", "open_dashboard_source": "stagetree.dashboard.source",
    "LiveProjection": "stagetree.dashboard.views", "studies": "stagetree.dashboard.views",
    "study_view": "stagetree.dashboard.views",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _HOMES:
        raise AttributeError(f"module 'stagetree.dashboard' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "Beside",
    "DashboardServer",
    "DashboardSource",
    "LiveProjection",
    "SourceError",
    "open_dashboard_source",
    "register",
    "reserve",
    "studies",
    "study_view",
]
