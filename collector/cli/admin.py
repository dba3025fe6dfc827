"""``shmstat ls`` and ``shmstat clean``: looking at and tidying this node's segments (``shmstat top`` is in
:mod:`collector.cli.top`)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
from dataclasses import dataclass

from shmstat.errors import ConfigError, SegmentError, ShmstatError
from shmstat.shm.layout import RankState
from shmstat.shm.layout_codec import rank_problem
from shmstat.shm.runtime import runtime_dir, validate_job
from shmstat.shm.segment import Segment, pid_alive
from shmstat.shm.shm_entries import SHM_DIR, Skipped, entry_problem, other_users_line, own_skipped_lines, scan_shm

from ..daemon.job_pass import drop_counters
from ..daemon.sweep import remove_if_dead, remove_leftover_locks

__all__ = ["LS_COLUMNS", "LS_LEGEND", "SegmentInfo", "clean", "list_segments", "segment_info"]


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
    writers_alive: int = 0
    """Extra writer processes of ranks (forked or spawned children, DataLoader workers) still running."""
    writers_total: int = 0
    """Extra writer entries in the rank table (:attr:`ranks_total` counts ranks only)."""

    @property
    def live(self) -> bool:
        """Whether any process of the job still runs on this node."""
        return self.collector_alive or self.ranks_alive > 0 or self.writers_alive > 0


def segment_info(job: str) -> SegmentInfo:
    """Inspect a job's segment without changing it (an unreadable one is reported with its error)."""
    try:
        seg = Segment.open(job, create=False, wait=False)  # a look: never waits for another job's lock
    except (ShmstatError, OSError, ValueError) as exc:  # ValueError: posix_ipc on what changed since the scan
        size = 0
        with contextlib.suppress(OSError):
            size = os.lstat(f"{SHM_DIR}/shmstat.{job}").st_size
        return SegmentInfo(job, size, 0, 0, 0, False, str(exc))
    try:
        geometry = seg.geometry
        entries = [r for r in seg.ranks() if rank_problem(r, geometry) is None]  # (what a collector reads)
        ranks = [r for r in entries if not r.is_writer]
        writers = [r for r in entries if r.is_writer]

        def alive(of: list) -> int:
            return sum(1 for r in of if r.state == RankState.ACTIVE and pid_alive(r.pid))

        h = seg.header()
        drops = drop_counters(seg)  # the collector's own figures of them
        refused = (drops["no_room_ranks"], drops["no_room_workers"], drops["no_room_stats"])
        return SegmentInfo(job, h.total_size, alive(ranks), len(ranks), h.collector_pid, pid_alive(h.collector_pid),
                           dropped=drops["samples_dropped"], refused=refused, writers_alive=alive(writers),
                           writers_total=len(writers))
    finally:
        seg.close()


LS_COLUMNS = ("JOB", "RANKS", "WRITERS", "COLLECTOR", "SIZE", "DROPPED")
"""The columns of ``shmstat ls``: RANKS and WRITERS are ``alive/registered`` ranks, and extra writer processes of
ranks (forked or spawned children such as DataLoader workers, which write their rank's samples); DROPPED counts
samples."""


LS_LEGEND = ("(RANKS and WRITERS: alive/registered, the writers being ranks' worker processes; COLLECTOR: its pid if "
             "it runs; DROPPED: samples ranks could not write)")
"""The line under ``shmstat ls``'s table that says what its columns count."""


def list_segments() -> int:
    """Print every segment of this user on this node (:data:`LS_COLUMNS`): job, ranks and extra writers alive of
    those registered, collector, size, samples dropped; then, on stderr, one line for each of this user's entries
    named like a segment that is not one, and one line that counts other users' entries, all left alone."""
    scan = scan_shm()
    jobs = scan.segments
    if not jobs:
        print("no shmstat segments of yours on this node")
    else:
        job_h, ranks_h, writers_h, coll_h, size_h, dropped_h = LS_COLUMNS
        print(f"{job_h:40s} {ranks_h:>9s} {writers_h:>9s} {coll_h:>12s} {size_h:>10s} {dropped_h:>9s}")
    for job in jobs:
        i = segment_info(job)
        coll = f"{i.collector_pid} up" if i.collector_alive else "-"
        note = f"  ({i.error})" if i.error else ""
        if any(i.refused):
            ranks, writers, stats = i.refused
            note += f"  (no room for {ranks} rank(s), {writers} worker(s), {stats} stat(s))"
        print(f"{job:40s} {f'{i.ranks_alive}/{i.ranks_total}':>9s} {f'{i.writers_alive}/{i.writers_total}':>9s} "
              f"{coll:>12s} {i.size / 2**20:>8.1f}MB {i.dropped:>9d}{note}")
    if jobs:
        print(LS_LEGEND)
    _say_skipped(scan.skipped)
    return 0


_RUNTIME_SUFFIXES = (".ingest", ".publish", ".collector.lock")


def clean(job: str | None) -> int:
    """Remove this user's segments (one job or all) that no process uses
    (:func:`collector.daemon.sweep.remove_if_dead`),
    refusing a live one, and what jobs with no segment left behind: lock files, semaphores of older versions, the
    runtime directory's socket files. Entries that are not this user's regular files (or, in the runtime
    directory, sockets) are skipped with one line each, never touched."""
    scan = scan_shm()
    segments = scan.segments
    runtime, runtime_skipped = _runtime_entries()
    leftovers = sorted(j for j in set(Segment.leftover_jobs()) | set(runtime)
                       if not os.path.lexists(f"{SHM_DIR}/shmstat.{j}"))  # whoever's segment it is: not leftovers
    skipped = scan.skipped + runtime_skipped
    if job is not None:
        validate_job(job)
        mine = [s for s in scan.skipped if s.path == f"{SHM_DIR}/shmstat.{job}"]
        if mine:
            raise SegmentError(f"{mine[0].path} is {mine[0].reason}: not cleaned")
        if job not in segments and job not in leftovers:
            raise ConfigError(f"no segment for job {job!r} on this node (see 'shmstat ls')")
        segments = [j for j in segments if j == job]
        leftovers = [j for j in leftovers if j == job]
        skipped = [s for s in skipped if _names_job(s.path, job)]
    _say_skipped(skipped)
    removed = 0
    for j in segments:
        verdict = remove_if_dead(j)
        if not verdict.removed:
            if job and verdict.live:
                raise SegmentError(f"job {j!r} still has live processes ({verdict.reason}); stop them before "
                                   "cleaning it")
            print(f"kept {j} ({verdict.reason})")
            continue
        _remove_runtime_files(j, runtime.get(j, []))
        print(f"removed {j}")
        removed += 1
    for j in leftovers:  # no segment: no collector or rank can be using these
        remove_leftover_locks(j)
        _remove_runtime_files(j, runtime.get(j, []))
        print(f"removed leftovers of {j}")
    if job is None:
        print(f"{removed} stale segment(s) removed, leftovers of {len(leftovers)} job(s) removed")
    return 0


def _say_skipped(skipped: list[Skipped]) -> None:
    for line in own_skipped_lines(skipped):
        print(line, file=sys.stderr)
    others = other_users_line(skipped)
    if others is not None:
        print(others, file=sys.stderr)


def _names_job(path: str, job: str) -> bool:
    name = os.path.basename(path)
    return job in (name.removeprefix("sem.").removeprefix("shmstat.").removesuffix(".lock"),
                   *(name.removesuffix(sfx) for sfx in _RUNTIME_SUFFIXES))


def _runtime_entries() -> tuple[dict[str, list[str]], list[Skipped]]:
    """This user's files in the runtime directory by job (sockets for the endpoints, a regular file for the
    older collector lock), and the entries of those names that are something else or someone else's."""
    try:
        base = runtime_dir()
        entries = list(os.scandir(base))
    except (OSError, ShmstatError):
        return {}, []
    out: dict[str, list[str]] = {}
    skipped: list[Skipped] = []
    for entry in sorted(entries, key=lambda e: e.name):
        for suffix in _RUNTIME_SUFFIXES:
            job = entry.name[: -len(suffix)]
            if not entry.name.endswith(suffix) or not _valid(job):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                break
            problem = entry_problem(st, expect="file" if suffix == ".collector.lock" else "socket")
            if problem is None:
                out.setdefault(job, []).append(entry.path)
            else:
                skipped.append(Skipped(entry.path, problem))
            break
    return out, skipped


def _valid(job: str) -> bool:
    try:
        validate_job(job)
    except ConfigError:
        return False
    return True


def _remove_runtime_files(job: str, paths: list[str]) -> None:
    for path in paths:
        if not _socket_in_use(path):  # a live collector's socket (e.g. under a hashed name) stays
            with contextlib.suppress(OSError):
                os.unlink(path)


def _socket_in_use(path: str) -> bool:
    """Whether a process listens on the Unix socket at ``path`` (a regular file: no)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
