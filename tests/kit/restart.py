"""Processes that hold a job's segment lock beside its collectors, for tests/system/test_collector_restart.py:
:func:`sweeper` looks at the job as ``shmstat clean`` and a node collector's sweep do, again and again;
:func:`lock_holder` holds the lock as a collector does while it starts."""

from __future__ import annotations

import fcntl
import os
import time


def sweeper(job: str, stop_path: str, out_path: str) -> None:
    """Run the sweep's look at ``job`` (:func:`collector.daemon.sweep.remove_if_dead`, which takes the segment's
    lock without waiting while it checks) until ``stop_path`` appears; writes how many looks it took and whether
    any removed the segment (none may: the job's ranks live)."""
    from collector.daemon.sweep import remove_if_dead

    looks = removed = 0
    while not os.path.exists(stop_path):
        removed += remove_if_dead(job).removed
        looks += 1
    with open(out_path, "w") as f:
        f.write(f"{looks} {removed}\n")


def lock_holder(job: str, held_path: str, stop_path: str) -> None:
    """Hold ``job``'s segment lock (as a collector does from its start) until ``stop_path`` appears; creates
    ``held_path`` once it holds it."""
    from shmstat.shm.runtime import segment_name

    fd = os.open("/dev/shm" + segment_name(job), os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    open(held_path, "w").close()
    while not os.path.exists(stop_path):
        time.sleep(0.01)
    os.close(fd)
