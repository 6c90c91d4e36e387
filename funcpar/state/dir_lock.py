"""A directory owned by one process: a lock file holding the owner's pid and host.

Two runs writing one directory (an offload store's, a checkpoint directory) would replace or
read each other's files without a word. The owner creates ``<dir>/<name>`` exclusively
(``O_CREAT | O_EXCL``) and writes ``"<pid> <host>"`` into it. Another live process's lock is
refused (:class:`LockHeld`, naming it); a lock whose pid is gone on this host (a killed run)
is stale and taken over; a holder on another host cannot be checked and counts as live.
Locks of one process on one path are shared and counted (two stores of one run in one
directory), so the file goes when the last of them is released. Creating the file is also the
check that the directory is writable: an ``OSError`` from :meth:`DirLock.acquire` says why not.
"""

from __future__ import annotations

import os
import socket
import threading

__all__ = ["DirLock", "LockHeld", "pid_alive"]

#: Lock path -> number of this process's holders sharing it.
_HELD: dict[str, int] = {}
_HELD_LOCK = threading.Lock()


class LockHeld(RuntimeError):
    """The lock belongs to another live process: ``pid`` on ``host``, file ``path``."""

    def __init__(self, pid: int, host: str, path: str) -> None:
        super().__init__(f"{path} is held by process {pid} on {host}")
        self.pid, self.host, self.path = pid, host, path


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (signal 0 probes without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class DirLock:
    """The lock file ``path`` (module docstring); :meth:`acquire` / :meth:`release`, or a
    context manager."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.held = False

    def acquire(self) -> None:
        """Take the lock: :class:`LockHeld` if another live process holds it, ``OSError`` if
        the file cannot be created (a read-only or missing directory)."""
        me = (os.getpid(), socket.gethostname())
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is None:  # stale (or unreadable): take it over
                    _unlink(self.path)
                    continue
                if holder != me:
                    raise LockHeld(*holder, self.path) from None
                with _HELD_LOCK:
                    _HELD[self.path] = _HELD.get(self.path, 0) + 1
                self.held = True
                return
            try:
                os.write(fd, f"{me[0]} {me[1]}\n".encode())
            finally:
                os.close(fd)
            with _HELD_LOCK:
                _HELD[self.path] = 1
            self.held = True
            return
        raise LockHeld(-1, "unknown", self.path)  # re-created under us three times

    def holder(self) -> tuple[int, str] | None:
        """``(pid, host)`` of a live holder, None when there is none or it is stale."""
        try:
            with open(self.path) as f:
                pid_s, host = f.read().split()
            pid = int(pid_s)
        except (OSError, ValueError):
            return None
        if host == socket.gethostname() and not pid_alive(pid):
            return None
        return pid, host

    def release(self) -> None:
        """Give the lock back (the file goes with this process's last holder of it)."""
        if not self.held:
            return
        self.held = False
        with _HELD_LOCK:
            left = _HELD.get(self.path, 1) - 1
            if left > 0:
                _HELD[self.path] = left
                return
            _HELD.pop(self.path, None)
        try:
            with open(self.path) as f:
                mine = f.read().split()[:1] == [str(os.getpid())]
        except OSError:
            return
        if mine:
            _unlink(self.path)

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
