"""Rank processes for the percentile tests (spawn-safe functions)."""

from __future__ import annotations

import json
import os
import time

import numpy as np


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
