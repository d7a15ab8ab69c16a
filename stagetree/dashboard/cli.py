"""``stagetree dashboard SOURCE [--host 127.0.0.1] [--port 8080]``, and starting it beside a run
(``stagetree run --dashboard [PORT]``)."""

from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from events.keys import KEY_ENV, secret_from

DEFAULT_PORT = 8080
READY = "dashboard: "
"""What the command's one line on standard output starts with, before the page's address."""


class DashboardError(ValueError):
    """Bad input for the dashboard (a source it cannot read, a port it cannot listen on)."""


def _ranged(cast: Any, low: float, high: float, what: str) -> Any:
    """An argparse type: ``cast(value)`` within ``[low, high]``, else an error saying ``what``."""

    def parse(value: str) -> Any:
        try:
            number = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
        return number

    return parse


port_number = _ranged(int, 0, 65535, "a port number 0..65535")
"""An argparse type: a TCP port 0..65535 (0: any free port)."""
poll_seconds = _ranged(float, 0.05, 60, "seconds between 0.05 and 60")
"""An argparse type: seconds between polls, 0.05 to 60."""


def listen(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (port 0: any free port).

    Raises:
        DashboardError: the address cannot be listened on (in use, not this machine's), naming
            the flag and the value.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        why = exc.strerror or exc
        # the host's fault, not the port's: a name that does not resolve (getaddrinfo's errors are
        # negative, whether raised as gaierrors or, by create_server, as plain OSErrors) or an
        # address not this machine's
        if (exc.errno or 0) < 0 or exc.errno == errno.EADDRNOTAVAIL:
            raise DashboardError(f"--host {host}: cannot listen on {host}:{port} ({why})") from None
        raise DashboardError(f"{flag} {port}: cannot listen on {host}:{port} ({why})") from None


def address(sock: socket.socket) -> str:
    """The page's address for a listening socket: ``http://HOST:PORT/``."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


async def serve(where: str, sock: socket.socket, *, secret: bytes | None = None, poll_seconds: float = 0.5,
                announce: Any = print) -> None:
    """Serve the dashboard of ``where`` on the listening ``sock`` until SIGINT or SIGTERM.

    Raises:
        SourceError: ``where`` cannot be read, or ``secret`` is not its keyed log's key (see
            :func:`open_dashboard_source`), before anything is served.
    """
    import asyncio

    from aiohttp import web

    from stagetree.dashboard.server import DashboardServer, is_loopback
    from stagetree.dashboard.source import open_dashboard_source

    source = open_dashboard_source(where, secret)
    host = sock.getsockname()[0]
    server = DashboardServer(source, bind_host=host, poll_seconds=poll_seconds)
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.SockSite(runner, sock, shutdown_timeout=1.0).start()
        announce(f"{READY}{address(sock)} ({source.label})")
        if source.kind == "run" and not Path(where).exists():  # a run about to start, or a mistyped path
            announce(f"warning: {where} does not exist (yet): waiting for a run to write its log there")
        if not is_loopback(host):
            announce(f"warning: listening on {host}, not a loopback address: anyone who can reach this machine "
                     "can read the study")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def cmd_dashboard(args: argparse.Namespace, console: Any = None) -> int:
    """Handle ``stagetree dashboard``. Exit code 0 when stopped, 2 bad input (source, port, a
    ``--log-key`` that is not the keyed log's own), before anything is served."""
    import asyncio

    from stagetree.dashboard.source import SourceError

    try:
        sock = listen(args.host, args.port)
        try:
            asyncio.run(serve(args.source, sock, secret=secret_from(args.log_key), poll_seconds=args.poll,
                              announce=lambda text: print(text, flush=True)))
        finally:
            sock.close()
    except (DashboardError, SourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``stagetree dashboard``."""
    p.add_argument("source", help="run directory, JSONL export (stagetree log export) or kafka://BOOTSTRAP[/PREFIX]")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                   help=f"port to listen on (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--log-key", help="HMAC secret of the log's hash chain, for verify (default: $STAGETREE_LOG_KEY)")
    p.add_argument("--poll", type=poll_seconds, default=0.5,
                   help="seconds between reads of the source (default 0.5; 0.05 to 60)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``dashboard`` to the ``stagetree`` subcommands."""
    p = sub.add_parser("dashboard", help="a live web page of a study: stage tree, workers, curves, trials")
    add_arguments(p)
    p.set_defaults(func=cmd_dashboard)


def main(argv: list[str] | None = None) -> int:
    """``python -m stagetree.dashboard SOURCE ...``: the command without the rest of ``stagetree``
    (no torch is imported: how ``stagetree run --dashboard`` starts it, in about a second)."""
    p = argparse.ArgumentParser(prog="stagetree dashboard", description="A live web page of a study.")
    add_arguments(p)
    return cmd_dashboard(p.parse_args(argv))


class Beside:
    """A dashboard process started beside a run (``stagetree run --dashboard [PORT]``): it
    follows ``where`` (the run directory, or the deployment's ``kafka://`` address) on
    127.0.0.1 and stops with the run.

    Args:
        where: the dashboard's source.
        port: the port (0: any free port); checked with :func:`reserve` before the run starts.
        secret: the log key, handed to the process in its environment (never on its command line).
    """

    def __init__(self, where: str, port: int, secret: bytes | None = None) -> None:
        self.where = where
        self.port = port
        self.secret = secret
        self.proc: subprocess.Popen[str] | None = None
        self.url: str | None = None

    def start(self, timeout: float = 60.0) -> str:
        """Start the process and wait until it listens; returns the page's address.

        Raises:
            DashboardError: it exited or did not listen within ``timeout`` seconds.
        """
        env = dict(os.environ)
        if self.secret:
            env[KEY_ENV] = self.secret.decode()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stagetree.dashboard", self.where, "--host", "127.0.0.1",
             "--port", str(self.port)], stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        # The process prints one line once it listens, or exits (then the read gives "").
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith(READY):
            self.stop()
            raise DashboardError(f"--dashboard {self.port}: the dashboard did not start "
                                 f"(exit code {self.proc.poll()}); see its message above")
        self.url = line[len(READY):].split()[0]
        return self.url

    def stop(self, linger_seconds: float = 1.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s), ``linger_seconds`` after the run's
        last event, so that open pages receive it (the dashboard polls every 0.5 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            time.sleep(linger_seconds)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def reserve(port: int) -> int:
    """Check that 127.0.0.1:``port`` can be listened on, before a run creates anything; returns
    the port to use (a free one for 0).

    Raises:
        DashboardError: it is in use (naming ``--dashboard`` and the port).
    """
    sock = listen("127.0.0.1", port, flag="--dashboard")
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()
