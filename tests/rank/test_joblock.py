"""The job lock (flock on /dev/shm/shmstat.<job>.lock): stalled holders are waited for, dead ones cost nothing,
two processes never hold it at once, and nothing of it is left behind."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading

import posix_ipc
import pytest
from kit.procs import REPO

from shmstat.errors import ConfigError
from shmstat.job.rank import RankAttachment
from shmstat.shm.runtime import lock_path, semaphore_name, validate_job
from shmstat.shm.segment import Segment

FORK = mp.get_context("fork")


def _hold(job: str, held, release) -> None:
    from shmstat.shm._joblock import JobLock

    with JobLock(job).held():
        held.set()
        release.wait(60)


def _take(job: str, started, acquired) -> None:
    from shmstat.shm._joblock import JobLock

    started.set()
    with JobLock(job).held():
        acquired.set()


def _lock_is_free(job: str) -> bool:
    fd = os.open(lock_path(job), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_stalled_holder_is_waited_for_not_presumed_dead(job):
    Segment.open(job).close()
    held, release, started, acquired = FORK.Event(), FORK.Event(), FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold, args=(job, held, release))
    holder.start()
    assert held.wait(20)
    os.kill(holder.pid, signal.SIGSTOP)
    taker = FORK.Process(target=_take, args=(job, started, acquired))
    try:
        taker.start()
        assert started.wait(20)
        # Longer than the old semaphore's 3 s timeout: the taker must still be waiting.
        assert not acquired.wait(3.5)
        assert taker.is_alive()
        os.kill(holder.pid, signal.SIGCONT)
        release.set()
        assert acquired.wait(20)
        holder.join(20)
        taker.join(20)
        assert holder.exitcode == 0 and taker.exitcode == 0
    finally:
        for p in (holder, taker):
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join()


def test_a_holder_killed_while_holding_frees_the_lock_at_once(job):
    Segment.open(job).close()
    held, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold, args=(job, held, release))
    holder.start()
    assert held.wait(20)
    assert not _lock_is_free(job)
    holder.kill()
    holder.join(20)
    assert _lock_is_free(job)  # the kernel dropped it with the process: no timeout to wait out
    seg = Segment.open(job)
    with seg.locked():
        att = RankAttachment.register(seg, rank=0, local_rank=0)
    assert att.incarnation == 1
    seg.close()


def _claim(job: str, barrier, results) -> None:
    try:
        seg = Segment.open(job)
        RankAttachment.register(seg, rank=0, local_rank=0)
        results.put("won")
    except ConfigError:
        results.put("lost")
    except BaseException as exc:
        results.put(repr(exc))
    results.close()
    results.join_thread()
    barrier.wait(60)  # every racer stays alive until all have claimed


def test_racing_processes_never_both_hold_a_rank(job):
    racers, rounds = 4, 40
    for _ in range(rounds):
        barrier, results = FORK.Barrier(racers), FORK.Queue()
        procs = [FORK.Process(target=_claim, args=(job, barrier, results)) for _ in range(racers)]
        for p in procs:
            p.start()
        outcome = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert outcome == ["lost"] * (racers - 1) + ["won"]
    seg = Segment.open(job, create=False)
    try:
        assert seg.rank(0).incarnation == rounds  # one winner per round, no lost update
    finally:
        seg.close()


def _count_under_lock(job: str, counter: mmap.mmap, threads: int, rounds: int) -> None:
    seg = Segment.open(job)
    word = ctypes.c_int64.from_buffer(counter)

    def work() -> None:
        for _ in range(rounds):
            with seg.locked(), seg.locked():  # re-entrant within a thread
                v = word.value
                os.sched_yield()
                word.value = v + 1

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os._exit(0)


def test_threads_of_forked_processes_exclude_each_other(job):
    seg = Segment.open(job)
    counter = mmap.mmap(-1, 8)
    procs, threads, rounds = 3, 4, 150
    # Fork while this process holds the lock: the children must not inherit the holding.
    with seg.locked():
        ps = [FORK.Process(target=_count_under_lock, args=(job, counter, threads, rounds)) for _ in range(procs)]
        for p in ps:
            p.start()
        assert int.from_bytes(counter[:8], "little") == 0
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    assert int.from_bytes(counter[:8], "little") == procs * threads * rounds
    seg.close()


def test_unlink_removes_lock_file_and_legacy_semaphore(job):
    Segment.open(job).close()
    sem = posix_ipc.Semaphore(semaphore_name(job), posix_ipc.O_CREAT, mode=0o600, initial_value=1)
    sem.close()
    assert os.path.exists(lock_path(job)) and os.path.exists(f"/dev/shm/sem.shmstat.{job}.lock")
    assert Segment.unlink(job)
    assert not os.path.exists(lock_path(job))
    assert not os.path.exists(f"/dev/shm/sem.shmstat.{job}.lock")
    assert not os.path.exists(f"/dev/shm/shmstat.{job}")


def test_job_ids_ending_in_lock_are_refused():
    with pytest.raises(ConfigError, match=r"not ending in '\.lock'"):
        validate_job("train.lock")
    assert validate_job("train.locks") == "train.locks"


def test_a_symlinked_or_foreign_mode_lock_file_is_refused(job, tmp_path):
    from shmstat.errors import SegmentError

    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, lock_path(job))
    try:
        with pytest.raises(SegmentError, match="lock file"):
            Segment.open(job)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path(job))
    fd = os.open(lock_path(job), os.O_CREAT | os.O_WRONLY, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)
    with pytest.raises(SegmentError, match="lock file"):
        Segment.open(job)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path(job))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


def test_ls_does_not_wait_for_a_stalled_lock_holder(job):
    Segment.open(job).close()
    held, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold, args=(job, held, release))
    holder.start()
    try:
        assert held.wait(20)
        os.kill(holder.pid, signal.SIGSTOP)
        out = _cli("ls")  # the timeout of 60 s fails the test if ls waited for the lock
        assert out.returncode == 0, out.stderr
        assert job in out.stdout
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        release.set()
        holder.join(20)


def test_clean_removes_orphaned_lock_files_and_semaphores_but_not_held_ones(job):
    from kit.support import unique_job

    orphan, busy = job, unique_job()
    Segment.open(orphan).close()
    posix_ipc.unlink_shared_memory(f"/shmstat.{orphan}")  # as if its last process died before cleaning
    posix_ipc.Semaphore(semaphore_name(orphan), posix_ipc.O_CREAT, mode=0o600, initial_value=1).close()
    assert orphan in Segment.leftover_jobs()
    held, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold, args=(busy, held, release))
    holder.start()
    try:
        assert held.wait(20)
        assert busy in Segment.leftover_jobs()
        out = _cli("clean", orphan)
        assert out.returncode == 0, out.stderr
        assert not os.path.exists(lock_path(orphan))
        assert not os.path.exists(f"/dev/shm/sem.shmstat.{orphan}.lock")
        out = _cli("clean", busy)
        assert out.returncode == 0, out.stderr
        assert os.path.exists(lock_path(busy))  # a process holds it right now: kept
    finally:
        release.set()
        holder.join(20)
        Segment.unlink(busy)
    assert not os.path.exists(lock_path(busy))


def test_one_thread_locking_through_two_segments_of_a_job_does_not_wait_for_itself(job):
    first = Segment.open(job)
    try:
        with first.locked():
            second = Segment.open(job)  # takes the job lock again, from the same thread
            with second.locked():
                pass
            second.close()
    finally:
        first.close()
