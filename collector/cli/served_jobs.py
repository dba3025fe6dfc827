"""Where ``shmstat subscribe`` finds collectors: given endpoints, the endpoint of a job (``--job``), or every
job a collector serves on this node (neither: the node collector's jobs, and those of ``shmstat run`` and
``shmstat collect --job``).

A collector binds a job's publish socket at :func:`shmstat.shm.runtime.publish_endpoint` (an ``ipc://`` path in
the owner-only runtime directory) while it serves the job and removes it when it stops; the job's segment is in
``/dev/shm`` from the first rank or collector on until the job is over, and its header names the collector
serving it (0 once the last one emitted every window, -1 when it left windows for a next one). So the jobs served
now are the segments of this user whose publish socket exists, and :func:`job_over` tells a job that ended.
"""

from __future__ import annotations

import os
import stat

from shmstat.errors import ShmstatError
from shmstat.shm.layout import RankState
from shmstat.shm.runtime import publish_endpoint, segment_name
from shmstat.shm.segment import Segment, pid_alive
from shmstat.shm.shm_entries import SHM_DIR, entry_problem, scan_shm

__all__ = ["job_over", "served_jobs", "socket_identity"]


def socket_identity(endpoint: str) -> int | None:
    """The inode of an ``ipc://`` endpoint's socket file when it is this user's socket (a collector bound it);
    None when it is missing or not ours. A collector that binds the endpoint anew makes a new inode."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        st = os.lstat(endpoint[len("ipc://"):])
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or entry_problem(st, expect="socket") is not None:
        return None
    return st.st_ino


def job_over(job: str) -> bool:
    """Whether ``job`` is over, at a look (no lock taken): its segment is gone, or no collector serves it, no
    rank of it is active and the last collector did not leave windows for a next one."""
    if not os.path.lexists(SHM_DIR + segment_name(job)):
        return True
    try:
        seg = Segment.open(job, create=False, wait=False)
    except (ShmstatError, OSError, ValueError):
        return False  # being created, or not ours to read: not known to be over
    try:
        collector = seg.header().collector_pid
        if collector == -1 or (collector > 0 and pid_alive(collector)):
            return False
        return not any(r.state == RankState.ACTIVE and pid_alive(r.pid) for r in seg.ranks())
    finally:
        seg.close()


def served_jobs() -> dict[str, str]:
    """``{job: publish endpoint}`` for every job of this user on this node whose collector's publish socket is
    there now (entries of other users and odd files are left out, unsaid: ``shmstat ls`` says them)."""
    jobs = {}
    for job in scan_shm().segments:
        endpoint = publish_endpoint(job)
        if socket_identity(endpoint) is not None:
            jobs[job] = endpoint
    return jobs
