"""Rank processes for the writer tests (spawn-safe functions): threads sharing a Stat, re-created Stats and kept
bound adds, forked children and spawn/forkserver workers that inherit the rank's environment. Each writes the
number and the sum of the samples it added to a JSON file, for exact reconciliation with the collector's rows."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import threading

WINDOW_S = 0.05


def _env(job: str, pure: bool) -> None:
    os.environ["SHMSTAT_JOB"] = job
    os.environ["SHMSTAT_RANK"] = "0"
    from shmstat._backend import backend

    # the rank inherited the test's backend (tests/conftest.py: backend) and chose it when it imported shmstat
    assert backend().name == ("python" if pure else "c"), backend().name


def as_rank(rank: int, target, *args) -> None:
    """A rank body for ``shmstat_job.run_ranks``: ``target(*args)`` (the rank is in the environment already)."""
    target(*args)


def _done(out: str, count: int, total: float) -> None:
    import shmstat

    with open(out + ".tmp", "w") as f:
        json.dump({"count": count, "sum": total}, f)
    os.replace(out + ".tmp", out)
    shmstat.shutdown()


def threads_on_one_stat(job: str, pure: bool, threads: int, per_thread: int, out: str) -> None:
    """``threads`` threads add to one Stat (thread i adds i + 1.0, per_thread times)."""
    _env(job, pure)
    import shmstat
    from shmstat import Aggregation as A

    stat = shmstat.Stat("shared", [A.COUNT, A.SUM], WINDOW_S, group="w")
    start = threading.Barrier(threads)

    def run(i: int) -> None:
        start.wait()
        add = stat.add
        for _ in range(per_thread):
            add(i + 1.0)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    _done(out, threads * per_thread, per_thread * sum(i + 1.0 for i in range(threads)))


def recreated_stats(job: str, pure: bool, n: int, out: str) -> None:
    """Stats re-created per call, closed and re-created, and bound adds kept after their Stat is gone."""
    _env(job, pure)
    import shmstat
    from shmstat import Aggregation as A

    def stat() -> shmstat.Stat:
        return shmstat.Stat("loss", [A.COUNT, A.SUM], WINDOW_S, group="w")

    for _ in range(n):  # a helper that builds the Stat on every call
        stat().add(1.0)
    for _ in range(n):  # add, close, re-create
        s = stat()
        s.add(2.0)
        s.close()
    kept = [stat().add for _ in range(3)]  # only the bound method is kept; the Stats are collected
    gc.collect()
    other = stat()
    for _ in range(n):
        for add in kept:
            add(3.0)
        other.add(4.0)
    _done(out, 2 * n + 4 * n, n * 1.0 + n * 2.0 + 3 * n * 3.0 + n * 4.0)


def fork_with_bound_add(job: str, pure: bool, n: int, out: str) -> None:
    """The rank binds ``add`` then forks; parent adds 1.0, child 1000.0 through the same bound add (and the child
    a Stat of its own too); the child must write slots of its own, never the parent's."""
    _env(job, pure)
    import shmstat
    from shmstat import Aggregation as A

    add = shmstat.Stat("forked", [A.COUNT, A.SUM], WINDOW_S, group="w").add
    for _ in range(n):
        add(1.0)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for _ in range(n):
                add(1000.0)
            own = shmstat.Stat("forked", [A.COUNT, A.SUM], WINDOW_S, group="w")
            for _ in range(n):
                own.add(1000.0)
            shmstat.shutdown()
            code = 0
        finally:
            os._exit(code)
    for _ in range(n):
        add(1.0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _done(out, 4 * n, 2 * n * 1.0 + 2 * n * 1000.0)


def _worker(n: int, value: float) -> None:
    """A DataLoader-style worker: inherits SHMSTAT_* from its rank and creates its own Stat."""
    import shmstat
    from shmstat import Aggregation as A

    stat = shmstat.Stat("loader", [A.COUNT, A.SUM], WINDOW_S, group="w")
    for _ in range(n):
        stat.add(value)
    shmstat.shutdown()


def rank_with_workers(job: str, pure: bool, n: int, rounds: int, out: str) -> None:
    """The rank adds; in each round a spawn, a forkserver and a fork worker add too (re-created every round)."""
    _env(job, pure)
    import shmstat
    from shmstat import Aggregation as A

    stat = shmstat.Stat("loader", [A.COUNT, A.SUM], WINDOW_S, group="w")
    count, total = 0, 0.0
    for r in range(rounds):
        workers = [
            mp.get_context(method).Process(target=_worker, args=(n, 10.0 ** (r % 3)))
            for method in ("spawn", "forkserver", "fork")
        ]
        for w in workers:
            w.start()
        for _ in range(n):
            stat.add(0.5)
        for w in workers:
            w.join(60)
            assert w.exitcode == 0, f"worker exit code {w.exitcode}"
        count += n + 3 * n
        total += n * 0.5 + 3 * n * 10.0 ** (r % 3)
    _done(out, count, total)


def _racing_creator(go, n: int, group: str) -> None:
    """A worker of the rank (spawn, forkserver or fork) that creates the Stat ``raced`` the moment ``go`` is set."""
    import shmstat
    from shmstat import Aggregation as A

    assert go.wait(120), "the rank never said go"
    stat = shmstat.Stat("raced", [A.COUNT, A.SUM], WINDOW_S, group=group)
    for _ in range(n):
        stat.add(1.0)
    shmstat.shutdown()


def creators_racing_on_one_stat(job: str, pure: bool, threads: int, n: int, rounds: int, out: str) -> None:
    """Per round, at one signal: ``threads`` threads of the rank, a child the rank forks from one more thread, and
    a spawn, a forkserver and a fork worker all create the Stat ``raced`` (the round's group) and add ``n`` each.
    (Workers started before their rank attached: tests/rank/test_pool_workers.py.)"""
    _env(job, pure)
    import shmstat

    # attached before any thread forks (also: a child forked while another thread imports a module, as the first
    # attach does, waits forever for that module's import lock, a CPython hazard of fork in a threaded process)
    assert shmstat.init() is not None
    count = 0
    for r in range(rounds):
        count += _racing_round(f"round{r}", threads, n)
    _done(out, count, float(count))


def _create_and_add(go, group: str, n: int, errors: list[BaseException]) -> None:
    import shmstat
    from shmstat import Aggregation as A

    try:
        assert go.wait(120), "the rank never said go"
        stat = shmstat.Stat("raced", [A.COUNT, A.SUM], WINDOW_S, group=group)
        for _ in range(n):
            stat.add(1.0)
    except BaseException as exc:  # reported by the rank: a thread's failure must fail the test
        errors.append(exc)


def _fork_a_creator(go, group: str, n: int, forked: list[int]) -> None:
    assert go.wait(120), "the rank never said go"
    pid = os.fork()
    if pid == 0:  # the child of a thread, while the rank's other threads create the same Stat
        import shmstat

        code = 1
        try:
            _create_and_add(go, group, n, [])
            shmstat.shutdown()
            code = 0
        finally:
            os._exit(code)
    forked.append(pid)


def _racing_round(group: str, threads: int, n: int) -> int:
    """One round of :func:`creators_racing_on_one_stat`; the samples it added."""
    go = mp.get_context("spawn").Event()
    workers = [mp.get_context(method).Process(target=_racing_creator, args=(go, n, group))
               for method in ("spawn", "forkserver", "fork")]
    for w in workers:
        w.start()
    errors: list[BaseException] = []
    forked: list[int] = []
    pool = [threading.Thread(target=_create_and_add, args=(go, group, n, errors)) for _ in range(threads)]
    pool.append(threading.Thread(target=_fork_a_creator, args=(go, group, n, forked)))
    for t in pool:
        t.start()
    go.set()
    for t in pool:
        t.join()
    assert not errors, errors
    for pid in forked:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked creator failed"
    for w in workers:
        w.join(120)
        assert w.exitcode == 0, f"worker exit code {w.exitcode}"
    return (threads + 1 + len(workers)) * n
