"""The job's segment as its collector holds it: the exclusive lock that makes a collector the job's only one on this
node (:func:`take_instance_lock`), and, once it is done, the removal of what the job left (:func:`remove_if_done`)."""

from __future__ import annotations

import fcntl
import os
import time

from shmstat.errors import CollectorError
from shmstat.shm.runtime import segment_name
from shmstat.shm.segment import Segment, pid_alive

__all__ = ["HOLD_WAIT_S", "remove_if_done", "take_instance_lock"]

HOLD_WAIT_S = 2.0
"""How long a collector waits for the segment's lock while its holder is not the collector the header names: a look
(``shmstat clean``, a node collector's sweep) holds it for a moment, a collector starting until it serves."""

_RETRY_S = 0.005


def take_instance_lock(segment: Segment) -> int:
    """An exclusive ``flock`` on the segment file itself, held for the collector's life (the returned fd; the
    kernel releases it if the collector dies): the check that one collector serves the job does not depend on
    anyone's runtime directory. Raises :class:`CollectorError` naming the holder's pid if a collector serving the
    job holds it, or if another process holds it for :data:`HOLD_WAIT_S`."""
    path = "/dev/shm" + segment_name(segment.job)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    deadline = time.monotonic() + HOLD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            holder = _flock_holder(fd)
            serving = segment.header().collector_pid  # a SIGKILLed collector's pid stays there
            if (holder and holder == serving) or time.monotonic() >= deadline:
                break
            time.sleep(_RETRY_S)
        except BaseException:
            os.close(fd)
            raise
    os.close(fd)
    pid = holder or (serving if serving > 0 and pid_alive(serving) else 0)
    raise CollectorError(
        f"a collector for job {segment.job!r} is already running on this node (pid {pid or '?'}); stop it first"
    ) from None


def _flock_holder(fd: int) -> int:
    """The pid holding a ``flock`` on the file open as ``fd``, as ``/proc/locks`` lists it (0 if none is listed
    or it cannot be read): the header's pid word may name a collector that died, the kernel's list never does."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 00:1b:5678 0 EOF"; a waiter's has "->" after "1:"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where and fields[4].isdigit():
            return int(fields[4])
    return 0


def remove_if_done(job: str, emitted_everything: bool, not_emitted: str) -> str:
    """Remove ``job``'s segment and lock file if every window was emitted (``emitted_everything``) and no
    process of the job's rank table lives; "" then, otherwise one line saying what was kept (``not_emitted``
    when windows were), why, and how to look and clean."""
    how = f"(inspect: shmstat top --job {job}; remove: shmstat clean {job})"
    if not emitted_everything:
        return f"job {job}'s segment kept: {not_emitted or 'not every window was emitted'} {how}"
    if not os.path.exists("/dev/shm" + segment_name(job)):
        Segment.unlink(job)  # the lock file alone (its last rank may have removed the segment)
        return ""
    if Segment.unlink_if_unused(job):
        return ""
    return f"job {job}'s segment kept: a process of the job started or is still running {how}"
