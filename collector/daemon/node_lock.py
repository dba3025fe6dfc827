"""One node collector per user and runtime directory: :class:`NodeLock`, an exclusive ``flock`` on
:func:`shmstat.shm.runtime.node_lock_path` holding the owner's pid.

A second ``shmstat collect`` serving every job would find every job already served and sit idle, its outputs empty;
it refuses at once instead, naming the first one's pid. The kernel releases the lock of a process that dies, so
a file left by a killed collector never blocks the next one; one that stops cleanly removes the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from shmstat.errors import CollectorError
from shmstat.shm.runtime import node_lock_path
from shmstat.shm.segment import pid_alive

__all__ = ["NodeLock", "node_collector_pid"]


class NodeLock:
    """The node collector's lock, held from :meth:`take` until :meth:`release` (or the process's end)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def take(cls) -> NodeLock:
        """Take the lock and write this process's pid in it; :class:`CollectorError` naming the holder's pid when
        another node collector holds it."""
        path = node_lock_path()
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _pid_in(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "another process"
                raise CollectorError(f"a node collector ({who}) already serves every job of yours on this node; "
                                     "stop it or subscribe to it (shmstat subscribe)") from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # the holder removed it as it let go: the lock that counts is on the file there now
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Remove the file and let the lock go (removed while held: whoever locked the removed file sees it is
        no longer there and locks the new one, so no two processes ever hold the lock that counts)."""
        if self.fd >= 0:
            if _same_file(self.fd, self.path):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        there, mine = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def _pid_in(fd: int) -> int:
    """The pid the lock's holder wrote (0 if it has not yet, or the file holds something else)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def node_collector_pid() -> int | None:
    """The pid of this user's node collector running now (the pid its lock file holds, alive), or None. Read
    without taking the lock, so a look never makes a starting node collector refuse."""
    try:
        fd = os.open(node_lock_path(), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        pid = _pid_in(fd)
    finally:
        os.close(fd)
    return pid if pid and pid_alive(pid) else None

