"""The job lock: ``flock`` on ``/dev/shm/shmstat.<job>.lock``, serialising creation and registration.

The kernel drops a ``flock`` when its holder dies, so a stalled holder is waited for (never presumed dead) and a
dead one costs nothing. A ``flock`` belongs to an open file description, which ``fork`` shares: the file is
opened per acquisition (depth 0 -> 1) and closed on the last release, and a child forked while its parent held
the lock closes the inherited descriptor without unlocking. Within a process one re-entrant lock per job keeps
threads (and nested calls) from opening a second description, which would conflict with the first.

The lock file may be unlinked (``Segment.unlink``, a failed creation) while someone waits on it; a taker therefore
checks, once it holds the lock, that the path still names the inode it locked, and starts over if not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat as _stat
import threading
from collections.abc import Iterator

from .errors import SegmentError
from .runtime import lock_path

__all__ = ["JobLock", "job_lock"]

_registry: dict[str, JobLock] = {}
_registry_guard = threading.Lock()


class JobLock:
    """The job's lock as seen by this process (get it with :func:`job_lock`; one per job per process)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.path = lock_path(job)
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd = -1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the job lock (re-entrant); waits as long as another process holds it."""
        with self._thread_lock:
            if self._depth == 0:
                self._fd = self._take()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fd, self._fd = self._fd, -1
                    with contextlib.suppress(OSError):
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)

    def remove_file(self) -> None:
        """Unlink the lock file (waiters notice and retry on the next file); absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _take(self) -> int:
        while True:
            fd = _open_lock_file(self.path, self.job)
            try:
                _flock_retrying(fd)
                st = os.fstat(fd)
                try:
                    now = os.stat(self.path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
            except BaseException:
                os.close(fd)
                raise
            if now is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                return fd
            os.close(fd)  # the file was removed while we waited: lock the one the path names now

    def _after_fork_in_child(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # close only: LOCK_UN would release the parent's lock too
        self._fd = -1
        self._depth = 0
        self._thread_lock = threading.RLock()


def job_lock(job: str) -> JobLock:
    """This process's lock object for ``job``."""
    with _registry_guard:
        lock = _registry.get(job)
        if lock is None:
            lock = _registry[job] = JobLock(job)
        return lock


def _open_lock_file(path: str, job: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentError(f"lock file {path} is a symbolic link; remove it") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise SegmentError(
                f"lock file {path} of job {job!r} belongs to another user; pick another job id"
            ) from None
        raise SegmentError(f"cannot open the lock file {path} ({exc.strerror}); check /dev/shm") from None
    st = os.fstat(fd)
    problem = None
    if not _stat.S_ISREG(st.st_mode):
        problem = f"lock file {path} is not a regular file; remove it"
    elif st.st_uid != os.getuid():
        problem = f"lock file {path} belongs to uid {st.st_uid}, not you; pick another job id"
    elif st.st_mode & 0o077:
        problem = f"lock file {path} is accessible to other users (mode {st.st_mode & 0o777:o}); remove it"
    if problem:
        os.close(fd)
        raise SegmentError(problem)
    return fd


def _flock_retrying(fd: int) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        except InterruptedError:  # pragma: no cover - PEP 475 retries already; kept for old kernels' EINTR
            continue


def _reset_after_fork() -> None:
    global _registry_guard
    _registry_guard = threading.Lock()
    for lock in _registry.values():
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_after_fork)
