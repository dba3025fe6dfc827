"""``shmstat demo``: a small job on this node — a collector and a few ranks — printing aggregated windows.

Each rank adds a simulated step time (rank 1 is a straggler) and a data-loader wait to two Stats, and logs
an event per simulated epoch. The collector merges the ranks per window and prints one line per merged
window and the slowest rank's mean beside it, and a ``straggler:`` line once it flags rank 1 (with three ranks
or more: against two, the median is their mean and rank 1 scores 0.81, above the 0.75 threshold).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import uuid
from typing import IO

from elastic.metrics import MetricData, MetricHandler

from ..daemon.collector import Collector, CollectorConfig
from ..handlers.console import StragglerLines, straggler_line

__all__ = ["DemoTableHandler", "demo"]

_GROUP = "demo"


class DemoTableHandler(StragglerLines, MetricHandler):
    """Prints merged windows as table rows, with the per-rank extreme of the mean beside them, and the collector's
    straggler lines (:func:`collector.handlers.console.straggler_line`)."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self._pending: dict[tuple[float, str], dict] = {}
        self.lines = 0

    def emit(self, metric_data: MetricData) -> None:
        """Collect one row; the line for a window is printed on :meth:`flush`."""
        start = getattr(metric_data, "window_start", None)
        if start is None:
            return
        stat, _, agg = metric_data.name.rpartition(".")
        row = self._pending.setdefault((start, stat), {"ranks": {}})
        rank = getattr(metric_data, "rank", None)
        if rank is None:
            row[agg] = metric_data.value
        elif agg == "mean":
            row["ranks"][rank] = metric_data.value

    def say_straggler(self, name: str, job: str, data: dict[str, str | int | float | bool]) -> None:
        """Print the line of a straggler flagged or recovered."""
        print(straggler_line(name, data), file=self.out, flush=True)

    def flush(self) -> None:
        """Print the windows collected since the last flush."""
        for (start, stat), row in sorted(self._pending.items()):
            stamp = time.strftime("%H:%M:%S", time.localtime(start)) + f".{int(start * 1000) % 1000:03d}"
            slowest = max(row["ranks"].items(), key=lambda kv: kv[1], default=(None, 0.0))
            print(
                f"{stamp}  {_GROUP}/{stat:14s} count={row.get('count', 0):>6.0f}  mean={row.get('mean', 0):8.3f}  "
                f"min={row.get('min', 0):8.3f}  max={row.get('max', 0):8.3f}"
                + (f"  p50={row['p50']:8.3f}  p99={row['p99']:8.3f}" if "p99" in row else "")
                + f"  slowest rank={slowest[0]} (mean {slowest[1]:.3f})",
                file=self.out, flush=True,
            )
            self.lines += 1
        self._pending.clear()


def _rank_main(job: str, rank: int, world: int, seconds: float, window_ms: int, endpoint: str) -> None:
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world, endpoint=endpoint)
    aggs = [A.COUNT, A.MEAN, A.MIN, A.MAX]
    step = shmstat.Stat("step_ms", [*aggs, A.P50, A.P99], window_ms / 1000, group=_GROUP)
    wait = shmstat.Stat("loader_wait_ms", aggs, window_ms / 1000, group=_GROUP)
    rng = random.Random(rank)
    slow = 1.6 if rank == 1 else 1.0
    end = time.monotonic() + seconds
    epoch = 0
    while time.monotonic() < end:
        for _ in range(50):
            step.add(rng.gauss(10.0, 1.0) * slow)
            wait.add(abs(rng.gauss(1.0, 0.5)))
        time.sleep(0.01)
        if rng.random() < 0.05:
            epoch += 1
            shmstat.log_event(shmstat.Event("epoch", datetime.datetime.now(), {"epoch": epoch, "rank": rank}))
    shmstat.shutdown()


def demo(*, ranks: int = 3, seconds: float = 3.0, window_ms: int = 500, out: IO[str] | None = None) -> int:
    """Run the demo job and print its aggregated windows; returns 0. Raises :class:`ConfigError` for a bad
    option before anything starts."""
    from shmstat.errors import ConfigError
    from shmstat.shm.layout import DEFAULT_BANKS, MAX_WINDOW_MS, min_window_ms

    if not 1 <= ranks <= 64:
        raise ConfigError(f"--ranks must be between 1 and 64, got {ranks}")
    if not 0 < seconds <= 24 * 3600:
        raise ConfigError(f"--seconds must be more than 0 and at most a day, got {seconds}")
    if not min_window_ms(DEFAULT_BANKS) <= window_ms <= MAX_WINDOW_MS:
        raise ConfigError(f"--window-ms must be between {min_window_ms(DEFAULT_BANKS)} and {MAX_WINDOW_MS}, "
                          f"got {window_ms}")
    out = out if out is not None else sys.stdout
    job = f"demo-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    table = DemoTableHandler(out)
    collector = Collector(
        CollectorConfig(job=job, handlers={"*": "null"}), handler_objects={_GROUP: table}
    )  # its notes on stderr
    print(f"demo job {job}: {ranks} ranks for {seconds:.0f} s, {window_ms} ms windows; "
          f"subscribe with: shmstat subscribe --job {job}", file=out, flush=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(job, r, ranks, seconds, window_ms, collector.ingest_endpoint))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()

    def watch() -> None:
        for p in procs:
            p.join()
        collector.request_stop()

    threading.Thread(target=watch, daemon=True).start()
    collector.run()
    from shmstat.shm.segment import Segment

    Segment.unlink(job)
    c = collector.counters()
    print(f"done: {c['windows_emitted']} merged windows, {c['events_relayed']} events relayed, "
          f"{c['frames_rejected']} frames rejected", file=out, flush=True)
    return 0
