"""``shmstat ls``, ``shmstat clean`` and ``shmstat top``: looking at and tidying this node's segments."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass

from shmstat.errors import ConfigError, SegmentError, ShmstatError
from shmstat.layout import RankState
from shmstat.reader import SegmentReader
from shmstat.runtime import runtime_dir, validate_job
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


def top(job: str, *, interval_s: float = 1.0, iterations: int | None = None) -> int:
    """Refresh a per-rank table of the job: state, pid, incarnation, and each stat's latest closed window."""
    if not 0 < interval_s <= 3600:
        raise ConfigError(f"--interval must be more than 0 and at most 3600 seconds, got {interval_s:g}")
    if iterations is not None and iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {iterations}")
    seg = Segment.open(job, create=False)
    reader = SegmentReader(seg)
    n = 0
    try:
        while iterations is None or n < iterations:
            now = time.time_ns()
            lines = [f"job {job}  {time.strftime('%H:%M:%S')}  (each stat's last closed window: start and length)",
                     f"{'RANK':>4s} {'STATE':7s} {'PID':>8s} {'INC':>3s}  {'STAT':32s} {'COUNT':>8s} {'MEAN':>12s}"
                     f"  {'WINDOW':>18s}"]
            for info in reader.ranks():
                descs = reader.descriptors(info.local_rank) or [None]
                for d in descs:
                    head = f"{info.rank:>4d} {info.state_name:7s} {info.pid:>8d} {info.incarnation:>3d}"
                    if d is None:
                        lines.append(head)
                        continue
                    read = reader.read_slot(info, d, now, 0, -1)  # the newest closed window in the ring, any age
                    w = read.windows[-1] if read.windows else None
                    count = w.count if w else 0
                    mean = w.sum / w.count if w and w.count else 0.0
                    when = _window_label(w.wid, w.window_ns) if w else "-"
                    lines.append(f"{head}  {d.group + '/' + d.name:32.32s} {count:>8d} {mean:>12.4g}  {when:>18s}")
            if sys.stdout.isatty():
                print("\x1b[2J\x1b[H", end="")
            print("\n".join(lines), flush=True)
            n += 1
            if iterations is None or n < iterations:
                time.sleep(interval_s)
    finally:
        seg.close()
    return 0


def _window_label(wid: int, window_ns: int) -> str:
    """``HH:MM:SS.mmm +LEN`` for a window: its local start time and its length."""
    start_s = wid * window_ns / 1e9
    ms = int(start_s * 1000) % 1000
    length_ms = window_ns / 1e6
    length = f"{length_ms / 1000:g}s" if length_ms >= 1000 else f"{length_ms:g}ms"
    return f"{time.strftime('%H:%M:%S', time.localtime(start_s))}.{ms:03d} +{length}"
