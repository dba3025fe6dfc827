"""Liveness: which ranks joined, exited or died, and what each costs (CPU, RSS), from psutil."""

from __future__ import annotations

import os
import select
from dataclasses import dataclass

import psutil

from shmstat.shm.layout import RankState
from shmstat.shm.layout_records import RankInfo
from shmstat.shm.segment import Segment

__all__ = ["Lifecycle", "Liveness", "RankUsage"]


@dataclass(frozen=True)
class Lifecycle:
    """A rank lifecycle change: ``joined``, ``exited`` or ``died``."""

    state: str
    local_rank: int
    rank: int
    pid: int
    incarnation: int

    def to_wire(self) -> dict[str, object]:
        """The map published on ``rank/<state>``."""
        return {"state": self.state, "rank": self.rank, "local_rank": self.local_rank, "pid": self.pid,
                "incarnation": self.incarnation}


@dataclass(frozen=True)
class RankUsage:
    """CPU (percent of one core since the previous sample) and resident memory of one rank process."""

    rank: int
    cpu_percent: float
    rss_bytes: int


class Liveness:
    """Tracks rank entries across polls; reports each (local rank, incarnation) joining and ending once."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._seen: dict[int, tuple[int, str, Lifecycle | None]] = {}  # local_rank -> (incarnation, state, joining)
        self._procs: dict[tuple[int, int], psutil.Process] = {}
        # a pidfd per live rank process: it reads as ready once the process ended (zombie or gone), so a look at
        # every rank is one poll() instead of reading /proc twice per rank
        self._pidfds: dict[tuple[int, int], int] = {}
        self._ended = select.poll()
        self._ended_fds: set[int] = set()  # the pidfds that read as ended at the last poll

    def poll(self, ranks: list[RankInfo]) -> list[Lifecycle]:
        """Compare the rank table with the last poll; dead pids of active entries are marked ``died``."""
        out: list[Lifecycle] = []
        live_keys = {(info.pid, info.start_ns) for info in ranks}
        for key in [k for k in self._procs if k not in live_keys]:  # bounded by the table, whatever churns
            del self._procs[key]
        for key in [k for k in self._pidfds if k not in live_keys]:
            self._forget_pidfd(key)
        self._ended_fds = {fd for fd, _ in self._ended.poll(0)} if self._pidfds else set()
        for info in ranks:
            inc, reported, joined = self._seen.get(info.local_rank, (-1, "", None))
            if info.incarnation != inc:
                if reported == "joined" and joined is not None:
                    # re-registered between two looks: the previous process ended unseen (a restart right after a
                    # SIGKILL, as a launcher makes), and it left no exit mark, which the new one overwrote
                    out.append(Lifecycle("died", joined.local_rank, joined.rank, joined.pid, joined.incarnation))
                reported = ""
            if info.state == RankState.ACTIVE:
                if not reported:
                    reported = "joined"
                    joined = self._event("joined", info)
                    out.append(joined)
                if not self._alive(info):
                    self.segment.set_rank_state(info.local_rank, RankState.DIED)
                    reported = "died"
                    out.append(self._event("died", info))
            elif info.state == RankState.EXITED and reported not in ("exited", "died"):
                if not reported:
                    joined = self._event("joined", info)
                    out.append(joined)
                reported = "exited"
                out.append(self._event("exited", info))
            elif info.state == RankState.DIED and reported != "died":
                reported = "died"
                out.append(self._event("died", info))
            self._seen[info.local_rank] = (info.incarnation, reported, joined)
        # a writer entry (a rank's forked child or worker) is tracked like a rank, but it is not a rank: its
        # joining and ending are not rank lifecycle events
        writers = {info.local_rank for info in ranks if info.is_writer}
        return [change for change in out if change.local_rank not in writers]

    def _event(self, state: str, info: RankInfo) -> Lifecycle:
        return Lifecycle(state, info.local_rank, info.rank, info.pid, info.incarnation)

    def _process(self, info: RankInfo) -> psutil.Process | None:
        key = (info.pid, info.start_ns)
        proc = self._procs.get(key)
        if proc is None:
            try:
                proc = psutil.Process(info.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return None
            self._procs[key] = proc
        return proc

    def _alive(self, info: RankInfo) -> bool:
        key = (info.pid, info.start_ns)
        fd = self._pidfds.get(key)
        if fd is not None:
            return fd not in self._ended_fds
        if not self._alive_by_proc(info):
            return False
        try:  # alive now: from here on its pidfd says when it ends (the process is the one psutil checked)
            fd = os.pidfd_open(info.pid)
        except (AttributeError, OSError):  # no pidfd here (old kernel, other platform): /proc every time
            return True
        self._pidfds[key] = fd
        self._ended.register(fd, select.POLLIN)
        return True

    def _forget_pidfd(self, key: tuple[int, int]) -> None:
        fd = self._pidfds.pop(key)
        self._ended.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        """Close the pidfds held (idempotent)."""
        for key in list(self._pidfds):
            self._forget_pidfd(key)

    def _alive_by_proc(self, info: RankInfo) -> bool:
        proc = self._process(info)
        if proc is None:
            return False
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def usage(self, ranks: list[RankInfo]) -> list[RankUsage]:
        """CPU and RSS of every active rank (processes that vanished meanwhile are skipped)."""
        out = []
        for info in ranks:
            if info.state != RankState.ACTIVE or info.is_writer:
                continue
            proc = self._process(info)
            if proc is None:
                continue
            try:
                with proc.oneshot():
                    out.append(RankUsage(info.rank, proc.cpu_percent(None), proc.memory_info().rss))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    @staticmethod
    def self_usage() -> tuple[float, int]:
        """CPU seconds used and RSS bytes of the collector process itself."""
        proc = psutil.Process(os.getpid())
        t = proc.cpu_times()
        return t.user + t.system, proc.memory_info().rss
