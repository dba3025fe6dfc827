"""Registering in a job's segment: as one rank, or as an extra writer of a rank (a forked child, a worker).

A slot has exactly one writer process. A rank's own process takes the rank entry ``local_rank``; a process
that writes samples for that rank without being it (a child forked by the rank, a spawn/forkserver worker
that inherited the rank's environment, as DataLoader workers do) takes a *writer entry*: a rank entry of its
own, taken from the top of the table, whose ``writer_of`` names the rank. The collector sums a rank's writer
entries into that rank's rows, so per-rank figures stay per rank and nothing is written by two processes.

Within one process a stat key (name, group, window, max_samples, aggregations) has one slot and one writer:
a Stat re-created under the same key continues it, so closing and re-creating Stats loses nothing, and a slot
is never handed to another stat while this process lives (a kept bound ``add`` may still write it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from . import layout as L
from .errors import CapacityError, ConfigError
from .segment import Segment, pid_alive

__all__ = ["RankAttachment", "StatKey"]

StatKey = tuple[str, str, int, int, int]
"""(name, group, window_ms, max_samples, agg_mask): what makes two Stats of one process the same stat."""

_ENTRY = struct.Struct("<qQqqqqq")  # pid, incarnation, rank, local_rank, world_size, start_ns, heartbeat_ns


@dataclass
class RankAttachment:
    """This process's registration in a job: its entry (a rank's own or a writer entry), incarnation, slots."""

    segment: Segment
    local_rank: int
    """The entry this process writes: the rank's own, or the writer entry it took."""
    rank: int
    world_size: int
    pid: int
    incarnation: int
    writer_of: int = -1
    """The local rank this process writes for when it holds a writer entry; -1 for the rank's own process."""
    index: dict[StatKey, int] = field(default_factory=dict)
    """Published descriptors of this entry by key (built once at registration; O(1) allocation after)."""
    writers: dict[int, Any] = field(default_factory=dict)
    """The one writer of each slot in this process (shared by every Stat and bound ``add`` of that key)."""

    @property
    def owner_local_rank(self) -> int:
        """The local rank whose rows this process's samples count in."""
        return self.local_rank if self.writer_of < 0 else self.writer_of

    @classmethod
    def register(
        cls, segment: Segment, *, rank: int, local_rank: int, world_size: int = 1, pid: int | None = None,
        clock_ns: int | None = None,
    ) -> RankAttachment:
        """Take rank entry ``local_rank`` for this process, bumping its incarnation; pre-fault the rank's slots.

        A process whose ancestor holds the entry (a worker started by the rank that inherited its environment)
        becomes a writer of that rank instead (see :meth:`register_writer`). Raises :class:`CapacityError` if
        ``local_rank`` is beyond the segment's rank capacity and :class:`ConfigError` if another live process
        holds the entry.
        """
        geo = segment.geometry
        if not 0 <= local_rank < geo.max_ranks:
            raise CapacityError(
                f"local rank {local_rank} does not fit the segment of job {segment.job!r} (max {geo.max_ranks} "
                "ranks per node); start the job with a larger --max-ranks"
            )
        own = pid is None
        pid = os.getpid() if pid is None else pid
        now = time.time_ns() if clock_ns is None else clock_ns
        with segment.locked():
            info = segment.rank(local_rank)
            if info.state == L.RankState.ACTIVE and info.pid not in (pid, 0) and pid_alive(info.pid):
                if own and _is_ancestor(info.pid):
                    owner = info.writer_of - 1 if info.is_writer else local_rank
                    return cls.register_writer(segment, owner_local_rank=owner)
                raise ConfigError(
                    f"local rank {local_rank} of job {segment.job!r} is held by live pid {info.pid}; "
                    "give each process its own LOCAL_RANK"
                )
            att = cls._take(segment, local_rank, info, rank, world_size, pid, now, writer_of=-1)
        att.prefault()
        return att

    @classmethod
    def register_writer(cls, segment: Segment, *, owner_local_rank: int) -> RankAttachment:
        """Take a writer entry for this process, writing samples for rank entry ``owner_local_rank``.

        Writer entries come from the top of the table: a free entry, or the entry of a writer that exited and
        whose windows were all emitted. Raises :class:`CapacityError` when there is none.
        """
        geo = segment.geometry
        pid, now = os.getpid(), time.time_ns()
        with segment.locked():
            owner = segment.rank(owner_local_rank)
            for i in range(geo.max_ranks - 1, -1, -1):
                if i == owner_local_rank:
                    continue
                info = segment.rank(i)
                if info.state == L.RankState.FREE or (info.is_writer and _recyclable(segment, info)):
                    att = cls._take(segment, i, info, owner.rank, owner.world_size, pid, now,
                                    writer_of=owner_local_rank)
                    break
            else:
                raise CapacityError(
                    f"no free entry in job {segment.job!r} for another writer of rank {owner.rank} (a forked child "
                    f"or worker; {geo.max_ranks} entries in use, exited writers are reused once a collector has "
                    "emitted their windows); start the job with a larger --max-ranks"
                )
        att.prefault()
        return att

    @classmethod
    def _take(cls, segment: Segment, i: int, info: L.RankInfo, rank: int, world_size: int, pid: int, now: int,
              *, writer_of: int) -> RankAttachment:
        """Write entry ``i`` for this process (job lock held) and index the descriptors it already has."""
        off = segment.geometry.rank_offset(i)
        incarnation = (info.incarnation + 1) & (2**63 - 1)
        _ENTRY.pack_into(segment.buf, off + L.R_PID, pid, incarnation, rank, i, world_size, now, now)
        struct.pack_into("<Q", segment.buf, off + L.R_WRITER_OF, writer_of + 1)
        struct.pack_into("<Q", segment.buf, off + L.R_STATE, L.RankState.ACTIVE)
        att = cls(segment, i, rank, world_size, pid, incarnation, writer_of)
        for d in segment.descriptors(i):  # an earlier incarnation's stats: reused under the same key
            att.index.setdefault((d.name, d.group, d.window_ms, d.max_samples, d.agg_mask), d.index)
        return att

    def prefault(self) -> None:
        """Touch every page of this entry's slots once, so no ``Stat.add`` pays a page fault."""
        for start, end in (self.segment.geometry.rank_slots_span(self.local_rank),
                           self.segment.geometry.rank_hist_span(self.local_rank)):
            bytes(self.segment.buf[start:end:mmap.PAGESIZE])
        d0 = self.segment.geometry.desc_offset(self.local_rank, 0)
        bytes(self.segment.buf[d0 : d0 + self.segment.geometry.max_stats * L.DESC_SIZE : mmap.PAGESIZE])

    def allocate_stat(self, name: str, group: str, window_ms: int, max_samples: int, agg_mask: int,
                      flags: int = 0) -> int:
        """The descriptor index of this stat key: the one already published for it, else a new one (O(1)); a
        stat with a percentile aggregation gets a histogram of the entry's table too. ``flags`` (e.g.
        :data:`~shmstat.layout.FLAG_HIGHER_IS_BETTER`) are those of the first Stat of the key.

        Raises :class:`CapacityError` when the entry's stat or histogram table is full; nothing is written then.
        """
        key = (name, group, window_ms, max_samples, agg_mask)
        found = self.index.get(key)
        if found is not None:
            return found
        name_b = L.encode_name(name, L.MAX_NAME_BYTES, "stat name")
        group_b = L.encode_name(group, L.MAX_GROUP_BYTES, "stat group")
        seg, geo = self.segment, self.segment.geometry
        with seg.locked():
            nstats = min(seg.rank(self.local_rank).nstats, geo.max_stats)
            if nstats >= geo.max_stats:
                raise CapacityError(
                    f"rank {self.rank} has used all {geo.max_stats} stat slots of job {seg.job!r}; "
                    "create fewer distinct stats or start the job with a larger --max-stats"
                )
            hist = -1
            if agg_mask & L.PERCENTILE_BITS:
                entry = geo.rank_offset(self.local_rank)
                (hist,) = struct.unpack_from("<Q", seg.buf, entry + L.R_NHIST)
                if hist >= geo.hist_slots:
                    raise CapacityError(
                        f"rank {self.rank} keeps percentiles for {geo.hist_slots} stats of job {seg.job!r} "
                        "already; ask for percentiles on fewer stats or start the job with a larger "
                        "--max-percentile-stats"
                    )
                struct.pack_into("<Q", seg.buf, entry + L.R_NHIST, hist + 1)
            L.write_descriptor(
                seg.buf, geo, self.local_rank, nstats, name=name_b, group=group_b, window_ms=window_ms,
                max_samples=max_samples, agg_mask=agg_mask, incarnation=self.incarnation, flags=flags, hist=hist,
            )
            struct.pack_into("<Q", seg.buf, geo.rank_offset(self.local_rank) + L.R_NSTATS, nstats + 1)
        self.index[key] = nstats
        return nstats

    def hist_offset(self, index: int) -> int:
        """Byte offset of bank 0's histogram of descriptor ``index`` of this entry, -1 if it keeps none."""
        geo = self.segment.geometry
        (hist,) = struct.unpack_from("<q", self.segment.buf, geo.desc_offset(self.local_rank, index) + L.D_HIST)
        return geo.hist_offset(self.local_rank, hist - 1) if 0 < hist <= geo.hist_slots else -1

    def word(self, field_offset: int) -> int:
        """Index into ``segment.i64`` of one 8-byte field of this entry."""
        return (self.segment.geometry.rank_offset(self.local_rank) + field_offset) // 8

    def heartbeat(self, now_ns: int) -> None:
        """Record that this process is alive (done on window roll-over, never per sample)."""
        self.segment.i64[self.word(L.R_HEARTBEAT)] = now_ns

    def mark_exited(self) -> None:
        """Mark this entry as cleanly exited (its windows stay readable)."""
        if self.segment.rank(self.local_rank).pid == self.pid:
            self.segment.set_rank_state(self.local_rank, L.RankState.EXITED)

    def detach(self) -> None:
        """Mark exited and unmap."""
        with contextlib.suppress(Exception):
            self.mark_exited()
        self.segment.close()


def _recyclable(segment: Segment, info: L.RankInfo) -> bool:
    """A writer entry whose process is gone and whose every window with data was emitted by a collector."""
    if pid_alive(info.pid):
        return False
    geo = segment.geometry
    for d in segment.descriptors(info.local_rank):
        for b in range(geo.banks):
            snap = segment.read_bank(info.local_rank, d.index, b)
            if (snap.count > 0 or snap.torn) and snap.wid > d.emitted_wid:
                return False
    return True


def _is_ancestor(pid: int) -> bool:
    """Whether ``pid`` is this process's parent, grandparent, ... (read from /proc, no dependency)."""
    current = os.getppid()
    for _ in range(64):
        if current == pid:
            return True
        if current <= 1:
            return False
        try:
            with open(f"/proc/{current}/stat", "rb") as f:
                stat = f.read()
            current = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False
