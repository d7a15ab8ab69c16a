"""One ``stagetree serve`` per state directory: an exclusive lock a serve holds for its lifetime.

A serve opens a RocksDB store per plan partition it is assigned (``STATE_DIR/plan-<p>``), at
any time while it runs; a second serve on the same directory failed only then, inside faust (a
traceback: RocksDB's ``LOCK`` of ``plan-<p>`` held), or, in the same app, shared the directory
with the first. So a serve takes an exclusive ``flock`` on ``STATE_DIR/serve.lock`` before
anything else and keeps it until it exits; the lock file holds its process id, which a second
serve reports. The kernel releases a ``flock`` when its holder exits, however it ends (kill -9
included), so a lock left by a dead serve never blocks a restart. Linux and other systems with
``flock``, on a local file system.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "serve.lock"
"""The lock file's name in a state directory."""


def mkdir_failure(path: Path, exc: OSError) -> str:
    """Why ``path.mkdir(parents=True, exist_ok=True)`` raised ``exc``, in words: a symbolic
    link whose target does not exist, something that is not a directory, else the system's
    reason ("Permission denied", ...)."""
    if path.is_symlink() and not path.exists():
        return f"it is a symbolic link to {os.readlink(path)!r}, which does not exist"
    if path.exists() and not path.is_dir():
        return "it is not a directory"
    return exc.strerror or str(exc)


class StateDirError(ValueError):
    """A state directory that cannot be used (it cannot be made, or its lock file opened)."""


RUN_LOCK_FILE = "run.lock"
"""The lock file a ``stagetree run`` that starts a serve holds in its ``--out``."""


class StateDirInUse(StateDirError):
    """Another live process holds a state directory's lock: ``state_dir``, and ``pid``, the
    process id the holder wrote there (None when it has not written one yet, or that process
    is gone); ``command``: what the holder is ("serve", "run")."""

    def __init__(self, state_dir: Path, pid: int | None, command: str = "serve") -> None:
        self.state_dir = state_dir
        self.pid = pid
        self.holder = f"another {command} process" + (f" (pid {pid})" if pid is not None else "")
        """Who holds it, in words: "another serve process (pid N)"."""
        super().__init__(f"{'state' if command == 'serve' else 'output'} directory {str(state_dir)!r} is in use by "
                         f"{self.holder}")


class StateDirLock:
    """An exclusive lock on the state directory ``state_dir`` (made if missing), held until
    :meth:`close` or the process's exit; the lock file (``lock_file``) then holds this
    process's id. ``command`` names the holder in :class:`StateDirInUse` ("serve"; a ``run``
    that starts a serve locks its ``--out``: :data:`RUN_LOCK_FILE`, "run").

    The descriptor is not inherited by programs this process executes (a child that is forked
    without executing anything shares the lock).

    Raises:
        StateDirInUse: another process holds it (a live one: a dead holder's lock is gone).
        StateDirError: the directory cannot be made, or the lock file cannot be opened there
            (the reason names the path).
    """

    def __init__(self, state_dir: str | Path, lock_file: str = LOCK_FILE, command: str = "serve") -> None:
        self.state_dir = Path(state_dir)
        path = self.state_dir / lock_file
        if self.state_dir.exists() and not self.state_dir.is_dir():
            raise StateDirError(f"state directory {str(self.state_dir)!r} cannot be used: it is not a directory")
        if path.is_dir():
            raise StateDirError(f"state directory {str(self.state_dir)!r} cannot be used: its {lock_file!r} is a "
                                "directory")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateDirError(f"state directory {str(self.state_dir)!r} cannot be used: "
                                f"{mkdir_failure(self.state_dir, exc)}") from None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateDirError(f"state directory {str(self.state_dir)!r} cannot be used: "
                                f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            raise StateDirInUse(self.state_dir, pid, command) from None
        except OSError as exc:  # a file system without flock
            os.close(fd)
            raise StateDirError(f"state directory {str(self.state_dir)!r}: {str(path)!r} cannot be locked: "
                                f"{exc.strerror or exc}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def close(self) -> None:
        """Release the lock (idempotent). The lock file stays: removing it could let two
        processes lock two different files of the same name."""
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _holder(fd: int) -> int | None:
    """The process id written in the lock file ``fd``, when that process exists (a holder
    that has just taken the lock may not have replaced its predecessor's yet)."""
    try:
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: it exists
        pass
    return pid


def check_free(state_dir: str | Path) -> None:
    """Raise :class:`StateDirInUse` when a live process holds ``state_dir``'s lock; a
    directory without a lock file passes. Nothing is written; the lock is tried (taken for a
    moment when it is free: a serve starting at that very moment may then be refused).

    Raises:
        StateDirInUse: a live process holds it.
    """
    try:
        fd = os.open(Path(state_dir) / LOCK_FILE, os.O_RDONLY)
    except OSError:  # none: no serve ever ran there (or it cannot be read: the serve says why)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StateDirInUse(Path(state_dir), _holder(fd)) from None
    except OSError:
        pass
    finally:
        os.close(fd)
