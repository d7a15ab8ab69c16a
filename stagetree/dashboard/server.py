"""The dashboard's web server (aiohttp): the page, its scripts, and the live views over
server-sent events.

Routes (all read-only; nothing here writes a log, a projection or a file):

* ``GET /``: the page; ``GET /static/{dashboard.js,dashboard.css,plotly.min.js}`` (Plotly.js is
  served from the ``plotly`` Python package, so nothing is fetched from the internet);
* ``GET /api/view?study=ID``: the page's whole payload once (JSON): the source, the studies,
  the study's view (:func:`stagetree.dashboard.views.study_view`), the last audit;
* ``GET /api/stream?study=ID``: the same payload as a server-sent event (``event: update``)
  every time the log grew or an audit finished (at most one per ``push_seconds``, or per twice
  the time the last payload took to compute), and a comment every 15 s to keep the connection
  open; the page never reloads;
* ``POST /api/verify``: run ``replay verify`` now (one at a time, off the event loop); needs the
  header ``X-Stagetree-Request: verify``, so no other site can start one from a user's browser.

Security defaults: every response carries a Content-Security-Policy allowing only this
server's own scripts (no inline script, no other origin), ``nosniff``, no referrer and no
framing; a server bound to a loopback address answers only requests whose ``Host`` is a
loopback name (so a web page cannot reach it through DNS rebinding); no secret (the log key,
Kafka or S3 credentials) is ever part of a response: the page gets the source's label, the
folded state and verify's verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from stagetree.dashboard.source import DashboardSource
from stagetree.dashboard.views import LiveProjection, default_study, studies, study_view

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
KEEPALIVE_SECONDS = 15.0
VERIFY_HEADER = "X-Stagetree-Request"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""Only this server's own scripts run; Plotly sets inline styles on what it draws."""

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def plotly_js() -> Path:
    """The Plotly.js bundle shipped inside the ``plotly`` Python package.

    Raises:
        FileNotFoundError: the ``plotly`` package is missing or has no bundle.
    """
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError:
        raise FileNotFoundError("the `plotly` package is not installed (pip install plotly)") from None
    if not path.is_file():
        raise FileNotFoundError(f"the `plotly` package has no {path.name} at {path}")
    return path


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is a loopback address."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8080`` -> ``::1``)."""
    if host.startswith("["):
        return host[1:host.index("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


class DashboardServer:
    """Follows ``source`` into a :class:`LiveProjection` and serves the page.

    Args:
        source: where the plan stream comes from (read-only).
        bind_host: the address the server listens on: a loopback one restricts the ``Host``
            header to loopback names.
        poll_seconds: how often the source is asked for new records (seconds).
        push_seconds: the least time between two updates sent to one page (seconds).
    """

    def __init__(self, source: DashboardSource, *, bind_host: str = "127.0.0.1", poll_seconds: float = 0.5,
                 push_seconds: float = 0.5) -> None:
        self.source = source
        self.live = LiveProjection()
        self.bind_host = bind_host
        self.poll_seconds = poll_seconds
        self.push_seconds = push_seconds
        self.audit: dict[str, Any] | None = None
        self.error: str | None = None
        self.version = 0  # bumped by every fold, audit and source error: what the pages follow
        self.payload_seconds = 0.0  # how long the last payload took to compute
        self._changed = asyncio.Condition()
        self._verify_lock = asyncio.Lock()
        self._payloads: dict[str | None, tuple[int, bytes]] = {}
        self._follower: asyncio.Task[None] | None = None
        self._plotly = plotly_js()

    # ------------------------------------------------------------------ following the source

    async def _bump(self) -> None:
        self.version += 1
        async with self._changed:
            self._changed.notify_all()

    async def follow(self) -> None:
        """Poll the source for ever: fold what arrived, wake the pages. A failing source is
        reported on the page and polled again with a growing pause (up to 10 s)."""
        loop = asyncio.get_running_loop()
        pause = self.poll_seconds
        while True:
            try:
                records = await loop.run_in_executor(None, self.source.poll)
            except Exception as exc:  # noqa: BLE001 - any failure of the source is shown, then retried
                message = f"reading {self.source.label} failed: {type(exc).__name__}: {exc}"
                if message != self.error:
                    log.warning("%s", message)
                    self.error = message
                    await self._bump()
                pause = min(10.0, pause * 2)
            else:
                pause = self.poll_seconds
                if self.error is not None:
                    self.error = None
                    await self._bump()
                if self.live.fold(records):
                    await self._bump()
            if not self.source.live and self.error is None:
                return  # an export: everything is folded
            await asyncio.sleep(pause)

    # ------------------------------------------------------------------ the payload

    def payload(self, study: str | None) -> bytes:
        """The page's payload for ``study`` (None: the default study), cached per version."""
        cached = self._payloads.get(study)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        started = time.perf_counter()
        chosen = study if study is not None else default_study(self.live)
        view, problem = None, None
        if chosen is not None:
            try:
                view = study_view(self.live, chosen, self.source.label, time.time() if self.source.live else None)
            except KeyError:
                problem = "the log holds no study of this name (yet)"
            except Exception as exc:  # noqa: BLE001 - a defect must not take the server down
                log.exception("the view of study %r failed", chosen)
                problem = f"the view could not be computed: {type(exc).__name__}: {exc}"
        body = orjson.dumps({
            "version": self.version,
            "source": {"label": self.source.label, "kind": self.source.kind, "live": self.source.live,
                       "error": self.error, "records": self.live.records},
            "studies": studies(self.live),
            "study": chosen,
            "view": view,
            "problem": problem,
            "audit": self.audit,
        })
        self._payloads[study] = (self.version, body)
        self.payload_seconds = time.perf_counter() - started
        if len(self._payloads) > 64:
            self._payloads = {study: self._payloads[study]}
        return body

    # ------------------------------------------------------------------ handlers

    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def no_icon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        files = {"dashboard.js": STATIC / "dashboard.js", "dashboard.css": STATIC / "dashboard.css",
                 "plotly.min.js": self._plotly}
        if name not in files:
            raise web.HTTPNotFound()
        return web.FileResponse(files[name], headers={"Cache-Control": "no-cache"})

    async def view(self, request: web.Request) -> web.Response:
        return web.Response(body=self.payload(request.query.get("study")), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        study = request.query.get("study")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        sent = -1
        try:
            while True:
                if self.version != sent:
                    sent = self.version
                    await response.write(b"event: update\ndata: " + self.payload(study) + b"\n\n")
                    # A large study's view takes a while (448 trials: about 0.2 s): pushing at
                    # most every two such times leaves the loop free half of the time at least.
                    await asyncio.sleep(max(self.push_seconds, 2 * self.payload_seconds))
                    continue
                if not await self._wait_past(sent, KEEPALIVE_SECONDS):
                    await response.write(b": keep-alive\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    async def _wait_past(self, version: int, timeout: float) -> bool:
        """Wait until :attr:`version` differs from ``version``; False after ``timeout`` seconds."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version != version), timeout)
            except TimeoutError:
                return False
        return True

    async def verify(self, request: web.Request) -> web.Response:
        if request.headers.get(VERIFY_HEADER) != "verify":
            return _json({"error": f"send the header {VERIFY_HEADER}: verify"}, status=403)
        if self._verify_lock.locked():
            return _json({"error": "a verification is already running"}, status=409)
        async with self._verify_lock:
            started = time.time()
            self.audit = {"running": True, "started": started}
            await self._bump()
            try:
                result = await asyncio.get_running_loop().run_in_executor(None, self.source.verify)
            except Exception as exc:  # noqa: BLE001 - shown on the page as the audit's outcome
                result = {"ok": False, "checks": [], "first_failure": None,
                          "error": f"verify could not run: {type(exc).__name__}: {exc}"}
            self.audit = {**result, "running": False, "started": started, "seconds": time.time() - started}
            await self._bump()
        return _json(self.audit)

    # ------------------------------------------------------------------ the application

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Refuse requests naming another host when bound to loopback (DNS rebinding)."""
        if is_loopback(self.bind_host) and not is_loopback(host_name(request.host or "")):
            return web.Response(status=421, text="this dashboard answers only requests for a loopback host")
        return await handler(request)

    @staticmethod
    async def _headers(request: web.Request, response: web.StreamResponse) -> None:
        """The security headers of every response (sent before a stream's first byte too)."""
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Cross-Origin-Resource-Policy"] = "same-origin"

    def app(self) -> web.Application:
        """The aiohttp application; following the source starts and stops with it."""
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self.index)
        app.router.add_get("/favicon.ico", self.no_icon)
        app.router.add_get("/static/{name}", self.static)
        app.router.add_get("/api/view", self.view)
        app.router.add_get("/api/stream", self.stream)
        app.router.add_post("/api/verify", self.verify)

        async def start(_: web.Application) -> None:
            self._follower = asyncio.create_task(self.follow())

        async def stop(_: web.Application) -> None:
            if self._follower is not None:
                self._follower.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._follower
            await asyncio.get_running_loop().run_in_executor(None, self.source.close)

        app.on_response_prepare.append(self._headers)
        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        return app
