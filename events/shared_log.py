"""A run directory's embedded log, shared by several processes of one machine.

RocksDB lets one process open a database for writing (DESIGN.md "Processes": embedded mode has
one owner of the log). :class:`SharedEmbeddedLog` keeps that rule and lets other processes in:
the first handle that needs the log becomes its **owner**: it takes an exclusive ``flock`` on
``<log dir>.lock``, opens the :class:`~events.log.EmbeddedLog` for writing and serves the
other handles over a Unix socket; every other handle (in this process or another one) is a
**client** and sends its appends and reads there. The owner is the log's one writer, so offsets
stay dense, every append is one durable WriteBatch and the hash chain is written as always.

When the owner closes (or its process exits, or is killed), the lock is released and the socket
disappears; the next client operation makes one of the remaining handles the owner (it reopens
the log, RocksDB recovering its write-ahead log). An append whose connection broke before the
reply is retried only when the stream holds no record equal to the batch's first one from the
last offset this handle saw, so with unique keys a batch lands exactly once.

Limits: one machine (a Unix socket, Linux's abstract namespace, peers of the same user only,
checked with ``SO_PEERCRED``), a local file system that supports ``flock``; a process holding the
log without this class (a running ``stagetree run`` coordinator) keeps every handle waiting for
``timeout_s`` and then failing with :class:`~events.log.LogLocked`. Fork-safe: a forked child
never uses the parent's database or lock (its first operation makes it a client).
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import os
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from events.log import EmbeddedLog, LogError, LogLocked, Record, check_items

_FRAME = struct.Struct(">Q")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_FRAME = 1 << 34


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = orjson.dumps(message)
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if n > _MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes is larger than {_MAX_FRAME}")
    message = orjson.loads(_recv_exact(sock, n))
    if not isinstance(message, dict):
        raise ConnectionError("a frame is not a JSON object")
    return message


def _records_json(records: list[Record]) -> list[list[Any]]:
    return [[r.offset, r.key, _b64(r.value), r.chain.hex()] for r in records]


def _records_from_json(stream: str, rows: list[list[Any]]) -> list[Record]:
    return [Record(stream, int(o), k, _unb64(v), bytes.fromhex(c)) for o, k, v, c in rows]


class _Owner:
    """This process's ownership of a log: the flock, the open database and the socket server."""

    def __init__(self, path: Path, secret: bytes | None, lock_fd: int, address: str | bytes) -> None:
        self.pid = os.getpid()
        self.path = path.resolve()
        self.lock_fd = lock_fd
        self.address = address
        self.log = EmbeddedLog(path, secret=secret)  # LogLocked: held by a foreign process
        self.mutex = threading.Lock()
        self.closed = False
        self.conns: set[socket.socket] = set()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if isinstance(address, str) and os.path.exists(address):
                os.unlink(address)  # a dead owner's socket file (we hold the lock)
            self.listener.bind(address)
            self.listener.listen(64)
            self.listener.settimeout(0.5)
        except OSError:
            self.listener.close()
            self.log.close()
            raise
        _OWNERS.add(self)
        self.acceptor = threading.Thread(target=self._accept, name=f"stagetree-log-owner {path}", daemon=True)
        self.acceptor.start()

    # every use of the database holds ``mutex``; ``close`` takes it too, so no operation runs
    # on a closed database

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        with self.mutex:
            self._check()
            return self.log.append_many(stream, items)

    def read(self, stream: str, start: int, stop: int | None) -> list[Record]:
        with self.mutex:
            self._check()
            return list(self.log.read(stream, start, stop))

    def end_offset(self, stream: str) -> int:
        with self.mutex:
            self._check()
            return self.log.end_offset(stream)

    def _check(self) -> None:
        if self.closed:
            raise _Retry("the owner of the log closed")

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not _same_user(conn):
                conn.close()
                continue
            conn.settimeout(None)
            self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                request = _recv(conn)
                try:
                    reply = self._answer(request)
                except _Retry as exc:
                    reply = {"ok": False, "retry": True, "error": str(exc)}
                except (LogError, ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "retry": False, "error": f"{type(exc).__name__}: {exc}"}
                _send(conn, reply)
        except (OSError, ConnectionError, orjson.JSONDecodeError):
            pass
        finally:
            self.conns.discard(conn)
            conn.close()

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op, stream = request["op"], request["stream"]
        if op == "append":
            items = [(str(k), _unb64(v)) for k, v in request["items"]]
            return {"ok": True, "offsets": self.append_many(stream, items)}
        if op == "read":
            stop = request.get("stop")
            return {"ok": True, "records": _records_json(self.read(stream, int(request["start"]),
                                                                   None if stop is None else int(stop)))}
        if op == "end":
            return {"ok": True, "end": self.end_offset(stream)}
        raise ValueError(f"unknown operation {op!r}")

    def close(self) -> None:
        """Stop serving, close the database, release the lock (in the owning process only)."""
        if self.pid != os.getpid():
            return
        with self.mutex:
            if self.closed:
                return
            self.closed = True
            if self.acceptor is not threading.current_thread():
                try:  # wake the accept loop at once; the address is free once accept() returned
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                        wake.settimeout(1.0)
                        wake.connect(self.address)
                except OSError:
                    pass
                self.acceptor.join(timeout=5)
            self.listener.close()
            for conn in list(self.conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.log.close()
            os.close(self.lock_fd)  # releases the flock
        _OWNERS.discard(self)

    def abandon_after_fork(self) -> None:
        """In a forked child: drop this process's copies of the lock and the socket, without
        releasing the parent's lock or touching its database."""
        self.closed = True
        try:
            os.close(self.lock_fd)
            self.listener.close()
        except OSError:
            pass


_OWNERS: weakref.WeakSet[_Owner] = weakref.WeakSet()


def owned_here(path: str | Path) -> bool:
    """Whether this process owns the embedded log at ``path`` (a :class:`SharedEmbeddedLog`
    opened here holds it: e.g. an Optuna journal storage a study file built on import). Such a
    log cannot be opened again in this process, nor tested with :func:`events.log.held_elsewhere`
    (which would drop this process's own locks on it)."""
    where = Path(path).resolve()
    return any(o.pid == os.getpid() and not o.closed and o.path == where for o in list(_OWNERS))


_HANDLES: weakref.WeakSet[SharedEmbeddedLog] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for owner in list(_OWNERS):
        owner.abandon_after_fork()
    _OWNERS.clear()
    for handle in list(_HANDLES):
        handle._mutex = threading.RLock()  # another thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _same_user(conn: socket.socket) -> bool:
    if not hasattr(socket, "SO_PEERCRED"):
        return True  # a path socket's file mode (0600 directory of the user) guards it instead
    try:
        _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return False
    return uid == os.getuid()


class _Retry(Exception):
    """The owner is going away: the operation was not applied; try again."""


class _Client:
    def __init__(self, address: str | bytes, timeout_s: float) -> None:
        self.pid = os.getpid()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(address)
        except OSError:
            self.sock.close()
            raise

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        _send(self.sock, request)
        reply = _recv(self.sock)
        if not reply.get("ok"):
            if reply.get("retry"):
                raise _Retry(reply.get("error", ""))
            raise LogError(f"the owner of the log refused {request['op']!r}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.pid == os.getpid():
            self.sock.close()


class SharedEmbeddedLog:
    """The :class:`~events.log.EventLog` of a run directory's embedded log for several processes.

    Args:
        path: the log directory (``RUN_DIR/log``; created by the first owner if absent).
        secret: HMAC key of the hash chain, as for :class:`~events.log.EmbeddedLog` (needed by
            whichever handle becomes the owner).
        timeout_s: how long an operation waits for the log (an owner to connect to, or the lock
            and the database to become free) before raising :class:`~events.log.LogLocked`.

    Every operation blocks until it is durable (appends: a synced RocksDB WriteBatch in the
    owner). Handles are thread-safe and picklable (the pickle carries the path, the secret and
    the timeout, never a connection), and may be used in forked children.

    Raises:
        LogLocked: no owner could be reached and the log could not be opened within ``timeout_s``
            (another process holds it, e.g. a running ``stagetree run``).
        LogError: the owner refused an operation, or ``secret`` does not match the log.
    """

    def __init__(self, path: str | Path, *, secret: bytes | None = None, timeout_s: float = 60.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` is {timeout_s!r}, but must be > 0")
        self.path = Path(path).resolve()
        self.secret = secret or None
        self.timeout_s = float(timeout_s)
        self._mutex = threading.RLock()
        self._owner: _Owner | None = None
        self._client: _Client | None = None
        self._seen = 0  # per stream would be finer; the smallest offset any stream could need
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        _HANDLES.add(self)

    def __repr__(self) -> str:
        return f"SharedEmbeddedLog({str(self.path)!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "secret": self.secret, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], secret=state["secret"], timeout_s=state["timeout_s"])  # type: ignore[misc]

    @property
    def address(self) -> str | bytes:
        """The owner's socket: an abstract name on Linux, else ``<log dir>.sock``."""
        if sys.platform.startswith("linux"):
            return b"\0stagetree-log-" + hashlib.sha256(str(self.path).encode()).hexdigest()[:40].encode()
        return str(self.path) + ".sock"

    @property
    def is_owner(self) -> bool:
        """Whether this handle is the log's owner now (its one writer, serving the others)."""
        return self._owner is not None and self._owner.pid == os.getpid() and not self._owner.closed

    # ------------------------------------------------------------------ roles

    def _role(self, deadline: float) -> _Owner | _Client:
        if self._closed:
            raise LogError(f"{self!r} is closed")
        if self.is_owner:
            assert self._owner is not None
            return self._owner
        if self._client is not None and self._client.pid == os.getpid():
            return self._client
        self._owner = self._client = None  # stale: closed, or inherited over a fork
        pause = 0.005
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                try:
                    self._client = _Client(self.address, self.timeout_s)
                    return self._client
                except OSError:
                    pass  # the owner is starting or going away
            else:
                try:
                    self._owner = _Owner(self.path, self.secret, fd, self.address)
                except LogLocked:
                    os.close(fd)  # a process outside this protocol holds the database
                except OSError as exc:
                    os.close(fd)
                    if exc.errno != errno.EADDRINUSE:
                        raise
                    # the previous owner's socket outlived its lock for a moment (a process exit
                    # closes the lock first): try again
                except BaseException:
                    os.close(fd)
                    raise
                else:
                    self._finalizer = weakref.finalize(self, self._owner.close)
                    return self._owner
            if time.monotonic() > deadline:
                raise LogLocked(f"the log at {self.path} could not be reached within {self.timeout_s:g} s: "
                                "no owner answered and it is held open by a process that does not share it "
                                "(a running `stagetree run`?)")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _do(self, local: Any, request: dict[str, Any]) -> Any:
        """Run an operation as the owner (``local(owner)``) or through it (``request``), retrying
        on a lost owner until ``timeout_s``; returns the local result or the reply."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            role = self._role(deadline)
            try:
                if isinstance(role, _Owner):
                    return local(role)
                return role.call(request)
            except (_Retry, OSError, ConnectionError):
                self._drop_client()
                if time.monotonic() > deadline:
                    raise LogLocked(f"the owner of the log at {self.path} went away and no handle took it "
                                    f"over within {self.timeout_s:g} s") from None
                time.sleep(0.01)

    # ------------------------------------------------------------------ EventLog

    def append(self, stream: str, key: str, value: bytes) -> int:
        """Append one record; returns its offset once it is durable."""
        return self.append_many(stream, [(key, value)])[0]

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        """Append records atomically (all or none) in order; returns their offsets.

        Raises:
            TypeError: a key is not a str or a value not bytes (nothing is appended).
        """
        items = [(key.decode("utf-8"), value) for key, value in check_items(stream, items)]
        if not items:
            return []
        request = {"op": "append", "stream": stream, "items": [[k, _b64(v)] for k, v in items]}
        with self._mutex:
            deadline = time.monotonic() + self.timeout_s
            uncertain = False
            while True:
                role = self._role(deadline)
                try:
                    if uncertain:  # an earlier attempt may have landed before its connection broke
                        landed = self._find(role, stream, items[0])
                        if landed is not None:
                            offsets = list(range(landed, landed + len(items)))
                            break
                    if isinstance(role, _Owner):
                        offsets = role.append_many(stream, items)
                    else:
                        uncertain = True
                        offsets = [int(o) for o in role.call(request)["offsets"]]
                    break
                except _Retry:
                    self._drop_client()
                except (OSError, ConnectionError):
                    self._drop_client()
                if time.monotonic() > deadline:
                    raise LogLocked(f"the owner of the log at {self.path} went away and no handle took it "
                                    f"over within {self.timeout_s:g} s (the append may have landed)")
                time.sleep(0.01)
            self._seen = max(self._seen, offsets[-1] + 1)
            return offsets

    def _find(self, role: _Owner | _Client, stream: str, item: tuple[str, bytes]) -> int | None:
        """The offset of a record equal to ``item`` from the last offset this handle saw on."""
        if isinstance(role, _Owner):
            records = role.read(stream, self._seen, None)
        else:
            reply = role.call({"op": "read", "stream": stream, "start": self._seen})
            records = _records_from_json(stream, reply["records"])
        return next((r.offset for r in records if (r.key, r.value) == item), None)

    def read(self, stream: str, start: int = 0, stop: int | None = None, partition: int = 0) -> Iterator[Record]:
        """Records of ``stream`` with ``start <= offset < stop`` (stop: the end when called).
        ``partition`` must be 0: an embedded log's streams have one partition."""
        EmbeddedLog._only_partition(partition)
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"`start` is {start!r}, but must be an int >= 0")
        with self._mutex:
            result = self._do(lambda owner: owner.read(stream, start, stop),
                              {"op": "read", "stream": stream, "start": start, "stop": stop})
        if isinstance(result, dict):
            result = _records_from_json(stream, result["records"])
        if result:
            self._seen = max(self._seen, result[-1].offset + 1)
        return iter(result)

    def partition_count(self, stream: str) -> int:
        """1: an embedded log's streams have one partition."""
        return 1

    def end_offset(self, stream: str, partition: int = 0) -> int:
        """The offset the next append to ``stream`` will get (``partition`` must be 0)."""
        EmbeddedLog._only_partition(partition)
        with self._mutex:
            result = self._do(lambda owner: owner.end_offset(stream), {"op": "end", "stream": stream})
        return int(result["end"]) if isinstance(result, dict) else int(result)

    def close(self) -> None:
        """Give up the log: an owner stops serving and releases it (a client of this process or
        another takes over at its next operation). Idempotent."""
        with self._mutex:
            self._closed = True
            self._drop_client()
            if self._finalizer is not None:
                self._finalizer()  # closes the owner, once
                self._finalizer = None
            self._owner = None

    def __enter__(self) -> SharedEmbeddedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
