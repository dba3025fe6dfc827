"""``shmstat ls`` and ``shmstat clean``: looking at and tidying this node's segments (``shmstat top`` is in
:mod:`collector.top`)."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

from shmstat.errors import ConfigError, SegmentError, ShmstatError
from shmstat.layout import RankState
from shmstat.runtime import runtime_dir, validate_job
from shmstat.segment import Segment, pid_alive

__all__ = ["SegmentInfo", "clean", "list_segments", "segment_info"]


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
    dropped: int = 0
    """Samples the job's processes could not write (no room, segment removed): header and rank entries."""
    refused: tuple[int, int, int] = (0, 0, 0)
    """(ranks, writer processes, stats) that got no room in the segment."""

    @property
    def live(self) -> bool:
        """Whether any process of the job still runs on this node."""
        return self.collector_alive or self.ranks_alive > 0


def segment_info(job: str) -> SegmentInfo:
    """Inspect a job's segment without changing it (an unreadable one is reported with its error)."""
    try:
        seg = Segment.open(job, create=False, wait=False)  # a look: never waits for another job's lock
    except ShmstatError as exc:
        size = 0
        with contextlib.suppress(OSError):
            size = os.stat(f"/dev/shm/shmstat.{job}").st_size
        return SegmentInfo(job, size, 0, 0, 0, False, str(exc))
    try:
        ranks = seg.ranks()
        alive = sum(1 for r in ranks if r.state == RankState.ACTIVE and pid_alive(r.pid))
        h = seg.header()
        dropped = h.dropped + sum(r.dropped for r in ranks)
        refused = (h.ranks_refused, sum(r.writers_refused for r in ranks), sum(r.stats_refused for r in ranks))
        return SegmentInfo(job, h.total_size, alive, len(ranks), h.collector_pid, pid_alive(h.collector_pid),
                           dropped=dropped, refused=refused)
    finally:
        seg.close()


def list_segments() -> int:
    """Print every segment of this node: job, ranks alive, collector, size."""
    jobs = Segment.list_jobs()
    if not jobs:
        print("no shmstat segments on this node")
        return 0
    print(f"{'JOB':40s} {'RANKS':>9s} {'COLLECTOR':>12s} {'SIZE':>10s} {'DROPPED':>9s}")
    for job in jobs:
        i = segment_info(job)
        coll = f"{i.collector_pid} up" if i.collector_alive else "-"
        note = f"  ({i.error})" if i.error else ""
        if any(i.refused):
            ranks, writers, stats = i.refused
            note += f"  (no room for {ranks} rank(s), {writers} worker(s), {stats} stat(s))"
        print(f"{job:40s} {i.ranks_alive:>4d}/{i.ranks_total:<4d} {coll:>12s} {i.size / 2**20:>8.1f}MB "
              f"{i.dropped:>9d}{note}")
    return 0


_RUNTIME_SUFFIXES = (".ingest", ".publish", ".collector.lock")


def clean(job: str | None) -> int:
    """Remove segments (one job or all) whose processes are all gone, refusing a live one, and what jobs with
    no segment left behind: lock files, semaphores of older versions, the runtime directory's socket files."""
    segments = Segment.list_jobs()
    leftovers = sorted(j for j in set(Segment.leftover_jobs()) | _runtime_leftovers(segments) if _valid(j))
    if job is not None:
        validate_job(job)
        if job not in segments and job not in leftovers:
            raise ConfigError(f"no segment for job {job!r} on this node (see 'shmstat ls')")
        segments = [j for j in segments if j == job]
        leftovers = [j for j in leftovers if j == job]
    removed = 0
    for j in segments:
        info = segment_info(j)
        if info.live:
            if job:
                raise SegmentError(f"job {j!r} still has live processes; stop them before cleaning it")
            print(f"kept {j} (live)")
            continue
        Segment.unlink(j)
        _remove_runtime_files(j)
        print(f"removed {j}")
        removed += 1
    for j in leftovers:  # no segment: no collector or rank can be using these
        Segment.unlink(j)
        _remove_runtime_files(j)
        print(f"removed leftovers of {j}")
    if job is None:
        print(f"{removed} stale segment(s) removed, leftovers of {len(leftovers)} job(s) removed")
    return 0


def _valid(job: str) -> bool:
    try:
        validate_job(job)
    except ConfigError:
        return False
    return True


def _runtime_leftovers(segments: list[str]) -> set[str]:
    """Jobs with files in the runtime directory but no segment."""
    try:
        names = os.listdir(runtime_dir())
    except OSError:
        return set()
    out = set()
    for n in names:
        for suffix in _RUNTIME_SUFFIXES:
            if n.endswith(suffix) and n[: -len(suffix)] not in segments:
                out.add(n[: -len(suffix)])
    return out


def _remove_runtime_files(job: str) -> None:
    for suffix in _RUNTIME_SUFFIXES:
        path = os.path.join(runtime_dir(), job + suffix)
        if not _socket_in_use(path):  # a live collector's socket (e.g. under a hashed name) stays
            with contextlib.suppress(OSError):
                os.unlink(path)


def _socket_in_use(path: str) -> bool:
    """Whether a process listens on the Unix socket at ``path``."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
