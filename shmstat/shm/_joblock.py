"""The job lock: ``flock`` on a file beside the segment, serialising creation and registration in it.

The kernel drops a ``flock`` when its holder dies, so a dead holder is recovered at once and a stalled one is
waited for: nothing is presumed from a timeout. Locks belong to open file descriptions, which a forked child
shares with its parent, so every process opens the file itself (checked by pid); threads of one process are
serialised by a re-entrant thread lock around the file lock. A lock file unlinked and re-created while a
process waited is detected (inode changed) and taken again, so two holders never hold two different files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import weakref
from collections.abc import Iterator

from ..errors import SegmentError
from .runtime import lock_path

__all__ = ["JobLock", "job_lock"]

_live: weakref.WeakSet[JobLock] = weakref.WeakSet()
_by_job: dict[str, JobLock] = {}
_registry = threading.Lock()


def job_lock(job: str) -> JobLock:
    """This process's one lock of ``job``: every Segment of the job shares it, so a thread that holds the lock
    through one Segment and locks again through another re-enters instead of waiting for itself."""
    with _registry:
        lock = _by_job.get(job)
        if lock is None:
            lock = _by_job[job] = JobLock(job)
        return lock


class JobLock:
    """The lock of one job, usable as ``with lock.held(): ...`` from any thread of any process."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.path = lock_path(job)
        self._fd = -1
        self._pid = 0
        self._depth = 0
        self._thread_lock = threading.RLock()
        _live.add(self)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the job lock (re-entrant within a thread); waits as long as another live process holds it."""
        with self._thread_lock:
            if self._depth == 0:
                self._acquire()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _acquire(self) -> None:
        while True:
            fd = self._file()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return
            # the file was removed (``shmstat clean``) while we waited: lock the one that is there now
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._close()

    def _file(self) -> int:
        if self._fd >= 0 and self._pid == os.getpid():
            return self._fd
        self._close()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SegmentError(f"cannot open the lock file of job {self.job!r} ({self.path}): {exc.strerror}") from exc
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            os.close(fd)
            raise SegmentError(f"the lock file {self.path} belongs to another user or is open to them; "
                               "pick another job id")
        self._fd, self._pid = fd, os.getpid()
        return fd

    def _close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # in a forked child this copy never held the lock: the parent's stays
        self._fd, self._pid = -1, 0

    def close(self) -> None:
        """Close this process's descriptor of the lock file (the lock must not be held)."""
        with self._thread_lock:
            if self._depth == 0 and self._pid == os.getpid():
                self._close()


def _after_fork_in_child() -> None:
    # A thread of the parent may have held a thread lock at the fork; the child has only this thread.
    global _registry
    _registry = threading.Lock()
    for lock in list(_live):
        lock._thread_lock = threading.RLock()
        lock._depth = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
