"""Rank processes for the percentile tests (spawn-safe functions)."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from shmstat.histogram import Histogram


def rank_samples(rank: int, n: int) -> np.ndarray:
    """The samples rank ``rank`` adds: lognormal step times, rank 3 with a long tail (deterministic)."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.lognormal(np.log(20.0), 0.4 if rank != 3 else 1.2, n)
    return x


def percentile_rank(job: str, rank: int, world: int, n: int, window_ms: int, out: str) -> None:
    """Add ``rank_samples(rank, n)`` to a stat with P50/P90/P99/P999, recording each sample's window."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    seen = [0]

    def clock() -> int:
        seen[0] = time.time_ns()
        return seen[0]

    stat = shmstat.Stat("step_ms", [A.COUNT, A.SUM, A.P50, A.P90, A.P99, A.P999, A.MAX], window_ms / 1000,
                        group="train", clock=clock)
    wns = window_ms * 1_000_000
    windows: dict[str, list[float]] = {}
    for i, v in enumerate(rank_samples(rank, n).tolist()):
        stat.add(v)
        windows.setdefault(str(seen[0] // wns * wns / 1e9), []).append(v)
        if i % 64 == 0:
            time.sleep(0.0005)
    with open(out + ".tmp", "w") as f:
        json.dump(windows, f)
    os.replace(out + ".tmp", out)
    shmstat.shutdown()


def percentile_rank_main(rank: int, job: str, world: int, n: int, window_ms: int, out_dir: str) -> None:
    """:func:`percentile_rank` as a rank body for ``shmstat_job.run_ranks`` (tally in ``out_dir/r<rank>.json``)."""
    percentile_rank(job, rank, world, n, window_ms, os.path.join(out_dir, f"r{rank}.json"))


def busy_writer(job: str, seconds: float, ready: str) -> None:
    """Add values spanning a wide range as fast as possible (forcing scale changes inside windows)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0)
    stat = shmstat.Stat("hot", [A.COUNT, A.P99], 0.05)
    rng = np.random.default_rng(7)
    values = (10.0 ** rng.uniform(-6, 6, 4096)).tolist()
    open(ready, "w").close()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for v in values:
            stat.add(v)
    shmstat.shutdown()


def histogram_bytes(job: str, pure: bool, values: list[float]) -> bytes:
    """The histogram bytes of one window of ``values`` written by the C or the pure-Python writer (a fresh
    process); the job's segment is removed afterwards."""
    import subprocess
    import sys

    from kit.procs import REPO
    from shmstat import _backend
    from shmstat.shm.segment import Segment

    code = (
        "import sys, shmstat; from math import inf; from shmstat import Aggregation as A\n"
        f"shmstat.init({job!r}, rank=0)\n"
        "t = [1_700_000_000_000_000_000]\n"
        "s = shmstat.Stat('h', [A.P50], 3600.0, clock=lambda: t[0])\n"
        f"for v in {values!r}: s.add(v)\n"
        "seg = shmstat.job._state.STATE.attachment.segment\n"
        "d = seg.descriptors(0)[0]\n"
        "off = seg.geometry.hist_offset(0, d.hist) + ((t[0] // 3_600_000_000_000) % seg.geometry.banks) * 2240\n"
        "sys.stdout.write(bytes(seg.buf[off:off + 2240]).hex())\n"
        "shmstat.shutdown()\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO, **{_backend.VARIABLE: "1" if pure else "0"})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    Segment.unlink(job)
    return bytes.fromhex(r.stdout)


def issue_window(world: int, seed: int = 25) -> list[list[float]]:
    """Issue 25's window split over ``world`` ranks: 4,240 step times around 98.8 ms (p99 near 134) with 3
    ``+inf`` and 2 ``-inf`` among them, shuffled (deterministic); rank ``r``'s samples are element ``r``."""
    rng = np.random.default_rng(seed)
    values = [*rng.lognormal(np.log(98.8), 0.13, 4240).tolist(), *([math.inf] * 3), *([-math.inf] * 2)]
    order = rng.permutation(len(values))
    every = [values[i] for i in order.tolist()]
    return [every[r::world] for r in range(world)]


def nonfinite_rank(job: str, rank: int, world: int, window_ms: int, out: str) -> None:
    """Add rank ``rank``'s part of :func:`issue_window` as fast as it can on the wall clock, recording each
    sample's window (as :func:`percentile_rank`) in ``out``."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    seen = [0]

    def clock() -> int:
        seen[0] = time.time_ns()
        return seen[0]

    stat = shmstat.Stat("step_ms", [A.COUNT, A.SUM, A.MIN, A.MAX, A.P50, A.P99], window_ms / 1000, group="train",
                        clock=clock)
    wns = window_ms * 1_000_000
    windows: dict[str, list[float]] = {}
    for v in issue_window(world)[rank]:
        stat.add(v)
        windows.setdefault(str(seen[0] // wns * wns / 1e9), []).append(v)
    with open(out + ".tmp", "w") as f:
        json.dump(windows, f)  # inf as Infinity: json.load reads it back
    os.replace(out + ".tmp", out)
    shmstat.shutdown()


def fixed_window_rank(job: str, rank: int, world: int, t_ns: int, values: list[float], ready: str, leave: str) -> None:
    """Add ``values`` to a P50/P99 stat of 1 s windows at the injected time ``t_ns`` (one window), without a
    collector (the test reads the segment itself); then create ``ready`` and stay registered until ``leave``
    exists."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world, publish=False)
    stat = shmstat.Stat("step_ms", [A.COUNT, A.MIN, A.MAX, A.P50, A.P99], 1.0, group="train", clock=lambda: t_ns)
    for v in values:
        stat.add(v)
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(leave) and time.monotonic() < deadline:
        time.sleep(0.01)
    shmstat.shutdown()


def hist_of(values: list[float]) -> Histogram:
    """A histogram holding ``values``, added one by one."""
    h = Histogram()
    for v in values:
        h.add(v)
    return h


def exact_quantile(x: list[float], q: float) -> float:
    """The order statistic of rank ceil(q n) (numpy's ``inverted_cdf``), what a histogram's quantile estimates."""
    return float(np.quantile(np.array(x), q, method="inverted_cdf"))
