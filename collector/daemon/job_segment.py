"""The job's segment as its collector holds it: the exclusive lock that makes a collector the job's only one on this
node (:func:`take_instance_lock`), and, once it is done, the removal of what the job left (:func:`remove_if_done`)."""

from __future__ import annotations

import fcntl
import os

from shmstat.errors import CollectorError
from shmstat.shm.runtime import segment_name
from shmstat.shm.segment import Segment

__all__ = ["remove_if_done", "take_instance_lock"]


def take_instance_lock(segment: Segment) -> int:
    """An exclusive ``flock`` on the segment file itself, held for the collector's life (the returned fd; the
    kernel releases it if the collector dies): the check that one collector serves the job does not depend on
    anyone's runtime directory. Raises :class:`CollectorError` naming the holder's pid if another holds it."""
    path = "/dev/shm" + segment_name(segment.job)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = segment.header().collector_pid
        holder: int | str = pid if pid > 0 else "?"
        raise CollectorError(
            f"a collector for job {segment.job!r} is already running on this node (pid {holder}); stop it first"
        ) from None
    return fd


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
