"""A rank that starts a process pool before its own first Stat, as a DataLoader does at its first batch (tests/rank/
test_pool_workers.py). A function rank (``pool_rank``: its rank's variables set in Python after its start, as the
testing plugin and ``mp.spawn`` launchers do) or a script rank (``python pool_workers.py METHOD POOL OUT``, also
under torchrun: its variables given at exec, as torchrun and ``shmstat run`` do). The rank writes what it and its
workers added and logged to a JSON file, for exact reconciliation with the collector's rows and events."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import sys

import shmstat  # imported first, as a training script does; no Stat, event or metric yet
from shmstat import Aggregation as A

WINDOW_S = 0.05
TASKS = 8
PER_TASK = 500
OWN = 100


def _rank() -> int:
    return int(os.environ.get("SHMSTAT_RANK", os.environ.get("RANK", "-1")))


def _entry() -> tuple[int, int]:
    """(entry held, local rank written for) of this process's attachment; (-2, -2) when it is not attached."""
    from shmstat.job._state import STATE

    att = STATE.attachment
    if att is None or att.pid != os.getpid():
        return -2, -2
    return att.local_rank, att.owner_local_rank


def work(task: int) -> tuple[int, int, int]:
    """A pool task: ``PER_TASK`` samples of ``pool/work``, one event and one put metric; returns its pid and
    :func:`_entry`."""
    from elastic.metrics import put_metric

    rank = _rank()
    stat = shmstat.Stat("pool/work", [A.COUNT, A.SUM], WINDOW_S, group="pool")
    for _ in range(PER_TASK):
        stat.add(float(rank + 1))
    shmstat.log_event(shmstat.Event("pool.task", datetime.datetime.now(), {"task": task}))
    put_metric("pool.metric", task, "pool")
    return (os.getpid(), *_entry())


def _pool(method: str, kind: str, workers: int):  # type: ignore[no-untyped-def]
    ctx = mp.get_context(method)
    if kind == "executor":
        return concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx)
    return contextlib.closing(ctx.Pool(workers))  # closed and joined as a DataLoader ends its workers


def main(method: str, kind: str, out: str) -> None:
    """Start the pool, let its workers add first, then the rank's own Stat, event and metric, then more tasks."""
    from elastic.metrics import put_metric

    rank = _rank()
    with _pool(method, kind, 4) as pool:
        pids = list(pool.map(work, range(TASKS // 2)))  # the workers attach before the rank does
        own = shmstat.Stat("pool/own", [A.COUNT, A.SUM], WINDOW_S, group="pool")
        for _ in range(OWN):
            own.add(1.0)
        shmstat.log_event(shmstat.Event("pool.rank", datetime.datetime.now(), {"rank": rank}))
        put_metric("pool.rank_metric", rank, "pool")
        pids += list(pool.map(work, range(TASKS // 2, TASKS)))
        if kind == "pool":
            pool.close()
            pool.join()
    tally = {"pid": os.getpid(), "entry": _entry(), "workers": sorted(set(pids)), "work": TASKS * PER_TASK,
             "work_sum": TASKS * PER_TASK * float(rank + 1), "own": OWN, "task_events": TASKS, "rank_events": 1}
    with open(out + ".tmp", "w") as f:
        json.dump(tally, f)
    os.replace(out + ".tmp", out)
    shmstat.shutdown()


def pool_rank(rank: int, method: str, kind: str, out_dir: str) -> None:
    """A function rank of the testing plugin (``run_ranks``)."""
    main(method, kind, os.path.join(out_dir, f"rank{rank}.json"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], os.path.join(sys.argv[3], f"rank{_rank()}.json"))


def _last_words(task: int, n: int) -> None:
    """A worker that logs ``n`` events and ends (no ``shmstat.shutdown()``), as a DataLoader worker ends."""
    for i in range(n):
        shmstat.log_event(shmstat.Event("pool.last", datetime.datetime.now(), {"task": task, "i": i}))


def ending_workers(rank: int, method: str, workers: int, n: int) -> None:
    """A function rank that never attaches itself: its ``multiprocessing`` workers log ``n`` events each."""
    procs = [mp.get_context(method).Process(target=_last_words, args=(w, n)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode


_SUBPROCESS_WORKER = """
import sys, shmstat
stat = shmstat.Stat("sub/work", [shmstat.Aggregation.COUNT], 0.05)
for _ in range(int(sys.argv[1])):
    stat.add(1.0)
print("added", flush=True)
sys.stdin.read()
shmstat.shutdown()
"""


def rank_with_subprocess_worker(rank: int, n: int) -> None:
    """A function rank that starts a plain subprocess worker (not ``multiprocessing``: not seen as a worker), which
    attaches first and takes the rank's entry; then the rank adds ``n`` samples of its own."""
    import subprocess

    worker = subprocess.Popen([sys.executable, "-c", _SUBPROCESS_WORKER, str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None and worker.stdout.readline() == "added\n"
    own = shmstat.Stat("sub/own", [A.COUNT], WINDOW_S)
    for _ in range(n):
        own.add(1.0)
    assert _entry()[1] == rank, _entry()  # it writes for its rank
    worker.communicate("", timeout=60)
    assert worker.returncode == 0
    shmstat.shutdown()
