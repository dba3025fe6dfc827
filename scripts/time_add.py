"""Time the rank's hot path: ``Stat.add`` in-process and attached, next to an empty method call.

Usage: ``python scripts/time_add.py`` (prints ns per call, best of 7 rounds). ``scripts/bench.py`` is the full
side-by-side benchmark against the anchors.
"""

from __future__ import annotations

import datetime as dt
import platform
import sys
import timeit
import uuid

import shmstat
from shmstat import Aggregation as A
from shmstat.segment import Segment

N = 200_000


class _Floor:
    def f(self, v: float) -> None:
        pass


def per_call_ns(stmt: str, env: dict) -> float:
    """Best of 7 rounds of N calls, in ns per call."""
    return min(timeit.repeat(stmt, globals=env, number=N, repeat=7)) / N * 1e9


def main() -> None:
    aggs = [A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN]
    floor = _Floor()
    local = shmstat.Stat("local", aggs, dt.timedelta(seconds=60))
    job = f"time-add-{uuid.uuid4().hex[:8]}"
    shmstat.init(job, rank=0, publish=False)
    try:
        shared = shmstat.Stat("shared", aggs, dt.timedelta(seconds=60))
        shared_value = shmstat.Stat("shared_v", [*aggs, A.VALUE], dt.timedelta(seconds=60))
        env = {"floor": floor, "local": local, "shared": shared, "shared_value": shared_value}
        print(f"python {platform.python_version()} ({sys.executable}), {platform.machine()}")
        for label, stmt in (
            ("empty method call", "floor.f(1.5)"),
            ("Stat.add in-process", "local.add(1.5)"),
            ("Stat.add attached", "shared.add(1.5)"),
            ("Stat.add attached, with VALUE", "shared_value.add(1.5)"),
        ):
            print(f"{label:32s} {per_call_ns(stmt, env):8.1f} ns")
    finally:
        shmstat.shutdown()
        Segment.unlink(job)


if __name__ == "__main__":
    main()
