"""When a segment counts as unused (``collector.daemon.sweep.remove_if_dead``, behind ``shmstat clean`` and the node
collector's sweep): a live rank, a collector holding the segment, a process holding the job lock, or a fresh
segment in which no rank registered yet each keep it; once none is left it goes with its lock file."""

from __future__ import annotations

import fcntl
import os
import signal

from kit.procs import spawn
from kit.support import wait_for
from kit.sweep import rank_main

from collector.daemon.sweep import remove_if_dead
from shmstat.shm import layout as L
from shmstat.shm.runtime import lock_path
from shmstat.shm.segment import Segment


def _gone(job: str) -> bool:
    return not os.path.lexists(f"/dev/shm/shmstat.{job}") and not os.path.lexists(lock_path(job))


def test_a_live_rank_keeps_the_segment_until_it_is_killed_and_reaped(job, tmp_path):
    ready = str(tmp_path / "ready")
    proc = spawn(rank_main, job, 0, ready)
    try:
        wait_for(lambda: os.path.exists(ready), 60, what="the rank to register")
        kept = remove_if_dead(job)
        assert not kept.removed and kept.live and str(proc.pid) in kept.reason
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    assert remove_if_dead(job).removed and _gone(job)


def test_a_look_at_a_job_whose_rank_lives_leaves_the_segments_lock_alone(job, tmp_path):
    """A look at a job in use decides by its live processes, without the segment's lock: with the lock held (a
    collector starting), the look names the live rank, not the lock. Looks in a loop (a sweep, ``shmstat clean``)
    held that lock so much of the time that a collector starting on a loaded machine was refused
    (tests/system/test_collector_restart.py)."""
    ready = str(tmp_path / "ready")
    proc = spawn(rank_main, job, 0, ready)
    fd = -1
    try:
        wait_for(lambda: os.path.exists(ready), 60, what="the rank to register")
        fd = os.open(f"/dev/shm/shmstat.{job}", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        kept = remove_if_dead(job)
        assert (kept.removed, kept.live, kept.reason) == (False, True, f"live process {proc.pid}")
    finally:
        if fd >= 0:
            os.close(fd)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    assert remove_if_dead(job).removed and _gone(job)


def test_a_collector_holding_the_segment_keeps_it(job):
    Segment.open(job).close()
    fd = os.open(f"/dev/shm/shmstat.{job}", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a serving collector holds
        kept = remove_if_dead(job)
        assert (kept.removed, kept.live, kept.reason) == (False, True, "a collector serves it")
    finally:
        os.close(fd)
    assert remove_if_dead(job).removed and _gone(job)


def test_a_process_holding_the_job_lock_keeps_it(job):
    Segment.open(job).close()
    fd = os.open(lock_path(job), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a rank registering
        kept = remove_if_dead(job)
        assert (kept.removed, kept.live) == (False, True) and "registering" in kept.reason
    finally:
        os.close(fd)
    assert remove_if_dead(job).removed and _gone(job)


def test_a_segment_no_rank_registered_in_is_kept_during_its_grace(job):
    Segment.open(job).close()
    kept = remove_if_dead(job, empty_grace_s=3600)
    assert not kept.removed and "no rank registered" in kept.reason
    assert os.path.exists(f"/dev/shm/shmstat.{job}")
    assert remove_if_dead(job, empty_grace_s=0).removed and _gone(job)


def test_an_unreadable_segment_of_yours_goes_when_no_process_holds_it(job):
    seg = Segment.open(job)
    seg.buf[L.H_MAGIC : L.H_MAGIC + 8] = b"NOTOURS!"  # another layout, say: nothing can attach to it
    seg.close()
    assert remove_if_dead(job).removed and _gone(job)
    assert remove_if_dead(job).reason == "no segment"
