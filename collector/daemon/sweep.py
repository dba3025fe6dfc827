"""Removing a segment of this user that no process uses any more (``shmstat clean``, the node collector's sweep).

A segment is removed only when, checked while holding both its locks without waiting for either:

- it is a regular file owned by this user (never another user's entry, never a directory, FIFO or link);
- no collector serves it (the collector's exclusive ``flock`` on the segment file is free, and the collector pid
  in its header is not a live process);
- no process is registering in it (its job lock is free);
- no process recorded in its rank table is alive (zombies count as alive until reaped: conservative), and, for
  a segment with no rank entry at all, it is older than ``empty_grace_s`` (a rank may be between creating the
  segment and registering in it).

A segment this user owns but cannot read (another layout version, truncated, bad magic) is removable on the
same conditions minus the rank table: nothing can attach to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat as _stat
import time
from dataclasses import dataclass

import posix_ipc

from shmstat.errors import LayoutMismatchError, ShmstatError
from shmstat.shm.runtime import lock_path, segment_name
from shmstat.shm.segment import Segment, pid_alive
from shmstat.shm.shm_entries import SHM_DIR, entry_problem

__all__ = ["Verdict", "remove_if_dead", "remove_leftover_locks"]


@dataclass(frozen=True)
class Verdict:
    """What :func:`remove_if_dead` did: ``removed``, or why not (``reason``); ``live`` when a process of the job
    (rank, writer or collector) is alive or is registering right now."""

    removed: bool
    reason: str = ""
    live: bool = False


def remove_if_dead(job: str, *, empty_grace_s: float | None = None) -> Verdict:
    """Remove ``job``'s segment and lock file if no process uses them (see the module docstring); never waits
    for a lock and never raises for what is in ``/dev/shm``. ``empty_grace_s`` None removes a segment with no
    rank entry at once (``shmstat clean``: the user asked)."""
    try:
        return _remove_if_dead(job, empty_grace_s)
    except (OSError, ValueError, posix_ipc.Error) as exc:  # e.g. the entry changed under us
        return Verdict(False, f"not removed ({exc})", live=True)


def _remove_if_dead(job: str, empty_grace_s: float | None) -> Verdict:
    path = f"{SHM_DIR}/shmstat.{job}"
    try:
        seg_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return Verdict(False, "no segment")
    except OSError as exc:
        return Verdict(False, f"cannot open it ({exc.strerror})")
    lock_fd = -1
    try:
        problem = entry_problem(os.fstat(seg_fd))
        if problem is not None:
            return Verdict(False, problem)
        # A job whose processes live is kept without taking its locks: looks again and again (a node collector's
        # sweep, shmstat clean in a loop) held the segment's lock so much of the time that, on a loaded machine, a
        # collector starting for the job waited past its hold wait and was refused.
        in_use = _live_processes(job)
        if in_use:
            return Verdict(False, in_use, live=True)
        try:
            fcntl.flock(seg_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Verdict(False, "a collector serves it", live=True)
        lock_fd, why = _take_job_lock(job)
        if lock_fd < 0:
            return Verdict(False, why, live=why.startswith("a process"))
        why_kept, live = _why_kept(job, empty_grace_s)
        if why_kept:
            return Verdict(False, why_kept, live=live)
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(segment_name(job))
        _unlink_held_lock(job, lock_fd)
        return Verdict(True)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        os.close(seg_fd)


def _take_job_lock(job: str) -> tuple[int, str]:
    """The job lock taken without waiting (the file created if missing): its fd, or -1 and why not."""
    try:
        fd = os.open(lock_path(job), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        return -1, f"its lock file cannot be opened ({exc.strerror})"
    problem = entry_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        return -1, f"its lock file is {problem}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1, "a process is registering in it right now"
    return fd, ""


def _live_processes(job: str) -> str:
    """Why a live process of the job keeps its segment (its collector, a process of its rank table), "" when none
    is seen or the segment cannot be read: read without the locks, so it may only keep (the removal is decided
    again under both locks)."""
    try:
        seg = Segment.open(job, create=False, wait=False)
    except (ShmstatError, OSError, ValueError):
        return ""
    try:
        return _why_live(seg)
    except (OSError, ValueError):
        return ""
    finally:
        seg.close()


def _why_live(seg: Segment) -> str:
    """The live collector or rank-table processes of ``seg``, as a reason; "" if none."""
    header = seg.header()
    if header.collector_pid and header.collector_pid != os.getpid() and pid_alive(header.collector_pid):
        return f"its collector (pid {header.collector_pid}) is alive"
    alive = sorted({r.pid for r in seg.ranks() if r.pid and pid_alive(r.pid)})
    if alive:
        return "live process" + ("es " if len(alive) > 1 else " ") + ", ".join(map(str, alive[:5]))
    return ""


def _why_kept(job: str, empty_grace_s: float | None) -> tuple[str, bool]:
    """Why the segment must stay ("" when it may go) and whether that is because a process may use it; both
    locks are held by the caller."""
    try:
        seg = Segment.open(job, create=False, wait=False)
    except LayoutMismatchError:
        return "", False  # ours, but nothing can attach to it: no process of this layout uses it
    except (ShmstatError, OSError, ValueError) as exc:
        return f"unreadable ({exc})", True
    try:
        live = _why_live(seg)
        if live:
            return live, True
        header = seg.header()
        if not seg.ranks() and empty_grace_s is not None and time.time_ns() - header.created_ns < empty_grace_s * 1e9:
            return "no rank registered in it yet", True
        return "", False
    finally:
        seg.close()


def _unlink_held_lock(job: str, fd: int) -> None:
    """Remove the lock file we hold (a waiter finds it gone and takes the next one: :mod:`shmstat.shm._joblock`),
    and an older version's semaphore if it is ours."""
    path = lock_path(job)
    with contextlib.suppress(OSError):
        st, now = os.fstat(fd), os.lstat(path)
        if (st.st_ino, st.st_dev) == (now.st_ino, now.st_dev):
            os.unlink(path)
    _unlink_old_semaphore(job)


def _unlink_old_semaphore(job: str) -> None:
    sem = f"{SHM_DIR}/sem.shmstat.{job}.lock"
    with contextlib.suppress(OSError):
        st = os.lstat(sem)
        if _stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            os.unlink(sem)


def remove_leftover_locks(job: str) -> None:
    """Remove ``job``'s lock file (when free) and older semaphore, each only if it is this user's regular file;
    for a job with no segment (``shmstat clean``'s leftovers)."""
    try:
        fd = os.open(lock_path(job), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            if entry_problem(os.fstat(fd)) is None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _unlink_held_lock(job, fd)
                return
        except BlockingIOError:
            return  # held right now: a process is registering
        finally:
            os.close(fd)
    _unlink_old_semaphore(job)
