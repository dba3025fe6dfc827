"""``shmstat ls``, ``shmstat clean`` and ``shmstat top``: looking at and tidying this node's segments."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

from shmstat.errors import ConfigError, SegmentError, ShmstatError
from shmstat.layout import RankState
from shmstat.reader import SegmentReader
from shmstat.runtime import runtime_dir
from shmstat.segment import Segment, pid_alive

__all__ = ["SegmentInfo", "clean", "list_segments", "segment_info", "top"]


@dataclass(frozen=True)
class SegmentInfo:
    """One job's segment as ``shmstat ls`` shows it."""

    job: str
    size: int
    ranks_alive: int
    ranks_total: int
    collector_pid: int
    collector_alive: bool
    error: str | None = None

    @property
    def live(self) -> bool:
        """Whether any process of the job still runs on this node."""
        return self.collector_alive or self.ranks_alive > 0


def segment_info(job: str) -> SegmentInfo:
    """Inspect a job's segment without changing it or waiting for its lock (an unreadable one is reported with
    its error)."""
    try:
        seg = Segment.open(job, create=False, wait=False)
    except ShmstatError as exc:
        size = 0
        with contextlib.suppress(OSError):
            size = os.stat(f"/dev/shm/shmstat.{job}").st_size
        return SegmentInfo(job, size, 0, 0, 0, False, str(exc))
    try:
        ranks = seg.ranks()
        alive = sum(1 for r in ranks if r.state == RankState.ACTIVE and pid_alive(r.pid))
        h = seg.header()
        return SegmentInfo(job, h.total_size, alive, len(ranks), h.collector_pid, pid_alive(h.collector_pid))
    finally:
        seg.close()


def list_segments() -> int:
    """Print every segment of this node: job, ranks alive, collector, size."""
    jobs = Segment.list_jobs()
    if not jobs:
        print("no shmstat segments on this node")
        return 0
    print(f"{'JOB':40s} {'RANKS':>9s} {'COLLECTOR':>12s} {'SIZE':>10s}")
    for job in jobs:
        i = segment_info(job)
        coll = f"{i.collector_pid} up" if i.collector_alive else "-"
        note = f"  ({i.error})" if i.error else ""
        print(f"{job:40s} {i.ranks_alive:>4d}/{i.ranks_total:<4d} {coll:>12s} {i.size / 2**20:>8.1f}MB{note}")
    return 0


def clean(job: str | None) -> int:
    """Remove segments (one job or all) whose processes are all gone, refusing a live one, and the lock files and
    legacy semaphores left without a segment."""
    jobs = [job] if job else Segment.list_jobs()
    leftovers = [j for j in Segment.leftover_jobs() if job in (None, j)]
    for j in leftovers:
        if Segment.remove_leftovers(j):
            print(f"removed the lock of {j}")
    if job and job not in Segment.list_jobs():
        if leftovers:
            return 0
        raise ConfigError(f"no segment for job {job!r} on this node (see 'shmstat ls')")
    removed = 0
    for j in jobs:
        info = segment_info(j)
        if info.live:
            if job:
                raise SegmentError(f"job {j!r} still has live processes; stop them before cleaning it")
            print(f"kept {j} (live)")
            continue
        Segment.unlink(j)
        for suffix in (".ingest", ".collector.lock"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(runtime_dir(), j + suffix))
        print(f"removed {j}")
        removed += 1
    if not job:
        print(f"{removed} stale segment(s) removed")
    return 0


def top(job: str, *, interval_s: float = 1.0, iterations: int | None = None) -> int:
    """Refresh a per-rank table of the job: state, pid, incarnation, and each stat's latest closed window."""
    seg = Segment.open(job, create=False)
    reader = SegmentReader(seg)
    n = 0
    try:
        while iterations is None or n < iterations:
            now = time.time_ns()
            lines = [f"job {job}  {time.strftime('%H:%M:%S')}",
                     f"{'RANK':>4s} {'STATE':7s} {'PID':>8s} {'INC':>3s}  {'STAT':32s} {'COUNT':>8s} {'MEAN':>12s}"]
            for info in reader.ranks():
                descs = reader.descriptors(info.local_rank) or [None]
                for d in descs:
                    head = f"{info.rank:>4d} {info.state_name:7s} {info.pid:>8d} {info.incarnation:>3d}"
                    if d is None:
                        lines.append(head)
                        continue
                    read = reader.read_slot(info, d, now, 0, (now // d.window_ns) - seg.geometry.banks - 1)
                    w = read.windows[-1] if read.windows else None
                    count = w.count if w else 0
                    mean = w.sum / w.count if w and w.count else 0.0
                    lines.append(f"{head}  {d.group + '/' + d.name:32.32s} {count:>8d} {mean:>12.4g}")
            if sys.stdout.isatty():
                print("\x1b[2J\x1b[H", end="")
            print("\n".join(lines), flush=True)
            n += 1
            if iterations is None or n < iterations:
                time.sleep(interval_s)
    finally:
        seg.close()
    return 0
