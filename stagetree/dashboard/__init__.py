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

from stagetree.dashboard.cli import Beside, register, reserve
from stagetree.dashboard.server import DashboardServer
from stagetree.dashboard.source import DashboardSource, SourceError, open_dashboard_source
from stagetree.dashboard.views import LiveProjection, studies, study_view

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
