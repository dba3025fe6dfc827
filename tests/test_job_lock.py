"""The job lock (flock beside the segment): a stalled holder is waited for, never presumed dead; a dead holder
is recovered at once; racing processes never both hold one rank; clean removes the lock file."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from _support import wait_for

from shmstat.errors import ConfigError
from shmstat.rank import RankAttachment
from shmstat.runtime import lock_path
from shmstat.segment import Segment


def _hold(job: str, held_path: str, release_path: str) -> None:
    seg = Segment.open(job)
    with seg.locked():
        open(held_path, "w").close()
        while not os.path.exists(release_path):
            time.sleep(0.005)


def _take(job: str, got_path: str) -> None:
    seg = Segment.open(job)
    with seg.locked():
        open(got_path, "w").close()


def test_a_stalled_holder_is_waited_for_past_any_timeout(job, tmp_path):
    held, release, got = (str(tmp_path / n) for n in ("held", "release", "got"))
    ctx = mp.get_context("fork")
    holder = ctx.Process(target=_hold, args=(job, held, release))
    holder.start()
    wait_for(lambda: os.path.exists(held), 20, what="holder took the lock")
    os.kill(holder.pid, signal.SIGSTOP)
    waiter = ctx.Process(target=_take, args=(job, got))
    waiter.start()
    try:
        # the version with a semaphore presumed the holder dead after 3 s and went ahead
        waiter.join(4.0)
        assert waiter.is_alive() and not os.path.exists(got), "the waiter took a lock a live process holds"
        open(release, "w").close()
        os.kill(holder.pid, signal.SIGCONT)
        waiter.join(20)
        assert waiter.exitcode == 0 and os.path.exists(got)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.join(20)
        waiter.kill()


def test_a_holder_killed_while_holding_is_recovered_at_once(job, tmp_path):
    held, got = str(tmp_path / "held"), str(tmp_path / "got")
    ctx = mp.get_context("fork")
    holder = ctx.Process(target=_hold, args=(job, held, str(tmp_path / "never")))
    holder.start()
    wait_for(lambda: os.path.exists(held), 20, what="holder took the lock")
    waiter = ctx.Process(target=_take, args=(job, got))
    waiter.start()
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(20)
    waiter.join(20)
    assert waiter.exitcode == 0 and os.path.exists(got)


def _claim(job: str, start: mp.synchronize.Event, done: mp.synchronize.Event, results: mp.Queue) -> None:
    seg = Segment.open(job)
    start.wait(20)
    try:
        RankAttachment.register(seg, rank=0, local_rank=0)
        results.put(os.getpid())
    except ConfigError:
        results.put(0)
    done.wait(20)  # stay alive (holding the rank, if we got it) until every claimant has tried


def test_racing_processes_never_both_hold_one_rank(job):
    ctx = mp.get_context("fork")
    for _ in range(20):
        start, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_claim, args=(job, start, done, results)) for _ in range(4)]
        for p in procs:
            p.start()
        start.set()
        got = [results.get(timeout=20) for _ in procs]
        done.set()
        for p in procs:
            p.join(20)
        assert sum(1 for g in got if g) == 1, got
    seg = Segment.open(job)
    assert seg.rank(0).incarnation == 20
    seg.close()


def test_unlink_removes_the_lock_file_and_a_waiter_then_locks_the_new_one(job):
    seg = Segment.open(job)
    with seg.locked():
        pass
    assert os.path.exists(lock_path(job))
    seg.close()
    Segment.unlink(job)
    assert not os.path.exists(lock_path(job))
    seg = Segment.open(job)
    with seg.locked():
        assert os.stat(lock_path(job)).st_mode & 0o777 == 0o600
    seg.close()


def test_job_ids_cannot_name_a_lock_file():
    import pytest

    with pytest.raises(ConfigError, match="lock"):
        Segment.open("x.lock")
