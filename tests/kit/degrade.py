"""Rank programs for tests/rank/test_no_collector.py: run as ``python -m kit.degrade SCENARIO ARGS...`` in a process
configured by the environment (SHMSTAT_JOB, ...), with no collector. Each prints one JSON line of what it saw
and exits normally (so its exit path, atexit included, is the real one)."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import sys
import threading
from typing import Any

import shmstat
from elastic.metrics import prof, put_metric
from shmstat import Aggregation as A
from shmstat.shm.segment import Segment


def _job() -> str:
    return os.environ["SHMSTAT_JOB"]


def _unemitted_samples(seg: Segment) -> int:
    """Samples the writer entries of the table still hold that no collector emitted."""
    geo = seg.geometry
    held = 0
    for r in seg.ranks():
        if not r.is_writer:
            continue
        for d in seg.descriptors(r.local_rank):
            for b in range(geo.banks):
                snap = seg.read_bank(r.local_rank, d.index, b)
                if snap.count and snap.wid > d.emitted_wid:
                    held += snap.count
    return held


# ------------------------------------------------------------------------ epochs of non-persistent workers


def _epoch_worker(k: int) -> None:
    stat = shmstat.Stat("batch", [A.COUNT, A.SUM], 60.0, group="loader")
    for _ in range(k):
        stat.add(1.0)


def epochs(n_epochs: int, workers: int, k: int) -> dict[str, Any]:
    """A rank whose DataLoader-like fork workers (a new process per worker per epoch) each record ``k`` samples."""
    import psutil

    me = psutil.Process()
    ctx = mp.get_context("fork")
    main = shmstat.Stat("step", [A.COUNT], 60.0)
    path = "/dev/shm/shmstat." + _job()
    size0 = os.stat(path).st_size
    warm = max(5, n_epochs // 10)
    rss_warm = 0
    codes: set[int | None] = set()
    for epoch in range(n_epochs):
        procs = [ctx.Process(target=_epoch_worker, args=(k,)) for _ in range(workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            codes.add(p.exitcode)
            p.close()
        main.add(1.0)
        if epoch + 1 == warm:
            rss_warm = me.memory_info().rss
    rss_end = me.memory_info().rss
    size1 = os.stat(path).st_size
    seg = Segment.open(_job(), create=False)
    try:
        dropped = sum(r.dropped for r in seg.ranks()) + seg.header().dropped
        held = _unemitted_samples(seg)
        entries = len(seg.ranks())
    finally:
        seg.close()
    return {"codes": sorted(c for c in codes if c is not None), "added": n_epochs * workers * k, "dropped": dropped,
            "held": held, "size0": size0, "size1": size1, "rss_warm": rss_warm, "rss_end": rss_end,
            "entries": entries}


# ------------------------------------------------------------------ the whole rank API, everywhere it runs


@prof(group="kit")
def _profiled() -> int:
    return 1


def _use_api(n: int) -> None:
    """Every rank API call: a Stat and ``n`` adds, a percentile Stat and ``n`` adds, an event, a metric, @prof."""
    stat = shmstat.Stat("api", [A.COUNT, A.SUM], 60.0)
    pct = shmstat.Stat("api.pct", [A.P50], 60.0)
    for i in range(n):
        stat.add(float(i))
        pct.add(float(i))
    shmstat.log_event(shmstat.Event("kit.event", datetime.datetime.now(), {"n": n}))
    put_metric("kit.metric", n, "kit")
    _profiled()


def _child(n: int) -> None:
    _use_api(n)


def api_everywhere(n: int, threads: int) -> dict[str, Any]:
    """The API in this process, in ``threads`` threads, in a fork child and in a spawn child; 2 adds per call of
    :func:`_use_api` per sample (a plain and a percentile Stat)."""
    _use_api(n)
    pool = [threading.Thread(target=_use_api, args=(n,)) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    codes = []
    for method in ("fork", "spawn"):
        p = mp.get_context(method).Process(target=_child, args=(n,))
        p.start()
        p.join()
        codes.append(p.exitcode)
    return {"codes": codes, "stats": _stats()}


def _stats() -> dict[str, Any]:
    s = shmstat.stats()
    path = "/dev/shm/shmstat." + _job()
    seg = Segment.open(_job(), create=False, wait=False) if os.path.exists(path) else None  # a look: no lock
    out: dict[str, Any] = {"process_dropped": s.dropped_samples, "attached": s.attached}
    if seg is not None:
        try:
            h = seg.header()
            ranks = seg.ranks()
            out.update(header_dropped=h.dropped, ranks_refused=h.ranks_refused,
                       rank_dropped=sum(r.dropped for r in ranks), stats_refused=sum(r.stats_refused for r in ranks),
                       writers_refused=sum(r.writers_refused for r in ranks))
        finally:
            seg.close()
    return out


# ------------------------------------------------------------------------------- live workers fill the table


def _live_worker(n: int, ready: Any, done: Any) -> None:
    ready.wait()  # every worker is alive before any registers
    stat = shmstat.Stat("w", [A.COUNT], 60.0)
    for _ in range(n):
        stat.add(1.0)
    done.wait()  # and stays alive until every one has registered


def live_workers(workers: int, n: int) -> dict[str, Any]:
    """``workers`` fork workers alive at once, each adding ``n`` samples."""
    ctx = mp.get_context("fork")
    shmstat.Stat("main", [A.COUNT], 60.0).add(1.0)
    ready, done = ctx.Barrier(workers), ctx.Barrier(workers)
    procs = [ctx.Process(target=_live_worker, args=(n, ready, done)) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return {"codes": [p.exitcode for p in procs], "stats": _stats()}


# ------------------------------------------------------------------------- the segment removed mid-run


def removed(n: int, threads: int) -> dict[str, Any]:
    """Adds, then the segment is removed from /dev/shm (as ``rm`` would), then the API everywhere."""
    before = shmstat.Stat("before", [A.COUNT], 60.0)
    before.add(1.0)
    os.unlink("/dev/shm/shmstat." + _job())
    for _ in range(n):
        before.add(1.0)  # still the old slot until the removal is noticed: written into the orphaned mapping
    result = api_everywhere(n, threads)
    for _ in range(n):
        before.add(1.0)
    result["after"] = shmstat.stats().dropped_samples
    return result


def _worker_across_the_removal(n: int, go: Any, out: Any) -> None:
    """A spawn worker alive when the segment is removed: a Stat before, then (told the segment is gone) a new one
    of ``n`` samples, which it finds the segment gone when it creates; reports what it dropped."""
    shmstat.Stat("w.before", [A.COUNT], 60.0).add(1.0)
    out.put("attached")
    assert go.wait(120)
    stat = shmstat.Stat("w.after", [A.COUNT], 60.0)
    for _ in range(n):
        stat.add(1.0)
    out.put(shmstat.stats().dropped_samples)


def _worker_after_the_removal(n: int, out: Any) -> None:
    """A spawn worker started after its rank found the segment removed."""
    stat = shmstat.Stat("w.late", [A.COUNT], 60.0)
    for _ in range(n):
        stat.add(1.0)
    out.put((shmstat.stats().dropped_samples, os.path.exists("/dev/shm/shmstat." + _job())))


def removed_with_workers(n: int, workers: int) -> dict[str, Any]:
    """``workers`` spawn workers alive across the removal of the segment, then ``workers`` started after it;
    each adds ``n`` samples after the removal."""
    ctx = mp.get_context("spawn")
    shmstat.Stat("before", [A.COUNT], 60.0).add(1.0)
    go, out = ctx.Event(), ctx.Queue()
    alive = [ctx.Process(target=_worker_across_the_removal, args=(n, go, out)) for _ in range(workers)]
    for p in alive:
        p.start()
    assert [out.get(timeout=120) for _ in alive] == ["attached"] * workers
    os.unlink("/dev/shm/shmstat." + _job())
    after = shmstat.Stat("after", [A.COUNT], 60.0)  # the rank notices the removal here
    for _ in range(n):
        after.add(1.0)
    go.set()
    across = sorted(out.get(timeout=120) for _ in alive)
    for p in alive:
        p.join()
    late = [ctx.Process(target=_worker_after_the_removal, args=(n, out)) for _ in range(workers)]
    for p in late:
        p.start()
    started_after = [out.get(timeout=120) for _ in late]
    for p in late:
        p.join()
    return {"codes": [p.exitcode for p in alive + late], "rank": shmstat.stats().dropped_samples, "across": across,
            "late": [d for d, _ in started_after], "late_made_it": any(made for _, made in started_after)}


def lock_unusable(n: int, threads: int) -> dict[str, Any]:
    """Adds, then the job's lock file is replaced by one open to other users (which shmstat refuses to lock),
    then the API everywhere."""
    from shmstat.shm.runtime import lock_path

    before = shmstat.Stat("before", [A.COUNT], 60.0)
    before.add(1.0)
    path = lock_path(_job())
    os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)
    result = api_everywhere(n, threads)
    for _ in range(n):
        before.add(1.0)  # a slot taken before: still written
    return result


# ---------------------------------------------------------------------- workers exit before their rank


def _spawn_worker(n: int) -> None:
    stat = shmstat.Stat("w", [A.COUNT], 60.0)
    for _ in range(n):
        stat.add(1.0)


def workers_exit_first(n: int) -> dict[str, Any]:
    """A spawn worker (its exit runs atexit) and a plain fork child exiting through the interpreter (atexit too)
    leave the segment of their live rank in place."""
    stat = shmstat.Stat("main", [A.COUNT], 60.0)
    stat.add(1.0)
    p = mp.get_context("spawn").Process(target=_spawn_worker, args=(n,))
    p.start()
    p.join()
    pid = os.fork()
    if pid == 0:
        _spawn_worker(n)
        sys.exit(0)  # through the interpreter's exit: atexit runs in this child
    _, status = os.waitpid(pid, 0)
    path = "/dev/shm/shmstat." + _job()
    still = os.path.exists(path)
    stat.add(1.0)
    return {"codes": [p.exitcode, os.waitstatus_to_exitcode(status)], "still_there": still}


def _event_worker(i: int) -> None:
    shmstat.log_event(shmstat.Event("loader.batch", datetime.datetime.now(), {"i": i}))
    put_metric("loader.batches", 1, "loader")


def event_epochs(n_epochs: int, workers: int) -> dict[str, Any]:
    """A rank whose DataLoader-like fork workers (new processes every epoch) each log an event and put a metric;
    the seconds each epoch took, workers' exits included."""
    import time

    ctx = mp.get_context("fork")
    shmstat.log_event(shmstat.Event("rank.start", datetime.datetime.now(), {}))
    took = []
    for _ in range(n_epochs):
        t0 = time.monotonic()
        procs = [ctx.Process(target=_event_worker, args=(w,)) for w in range(workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        took.append(time.monotonic() - t0)
    return {"codes": sorted({p.exitcode for p in procs}), "took": took}


def simple(n: int) -> dict[str, Any]:
    """One rank of a job: a Stat and ``n`` adds."""
    stat = shmstat.Stat("s", [A.COUNT], 60.0)
    for _ in range(n):
        stat.add(1.0)
    return {"ok": True}


if __name__ == "__main__":
    scenario = sys.argv[1]
    args = [int(a) for a in sys.argv[2:]]
    print(json.dumps(globals()[scenario](*args)), flush=True)
