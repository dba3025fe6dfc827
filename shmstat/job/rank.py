"""Registering in a job's segment: as one rank, or as an extra writer of a rank (a forked child, a worker).

A slot has exactly one writer process. A rank's own process takes the rank entry ``local_rank``; a process
that writes samples for that rank without being it (a child forked by the rank, a spawn/forkserver worker
that inherited the rank's environment, as DataLoader workers do) takes a *writer entry*: a rank entry of its
own, taken from the top of the table, whose ``writer_of`` names the rank. The collector sums a rank's writer
entries into that rank's rows, so per-rank figures stay per rank and nothing is written by two processes.

Room runs out: a writer takes a free entry, or that of a writer that exited whose windows were emitted, or, when
there is neither, that of a writer that exited before a collector emitted its windows (non-persistent DataLoader
workers with no collector: a new writer every epoch), counting the samples it held as dropped in its rank's
entry. A process that finds no entry at all gets an attachment *without* one (``local_rank == -1``): its Stats
count their samples as dropped (:func:`shmstat.job._degrade.add_counter`) and nothing raises.

Within one process a :class:`SlotKey` (name, group, window, max_samples, aggregations) has one slot and one writer:
a Stat re-created under the same key continues it, so closing and re-creating Stats loses nothing, and a slot
is never handed to another stat while this process lives (a kept bound ``add`` may still write it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import CapacityError, ConfigError, SegmentError
from ..shm import layout as L
from ..shm import layout_codec as codec
from ..shm.layout_records import RankInfo
from ..shm.segment import Segment, pid_alive
from ._degrade import add_counter, warn_once

__all__ = ["EntryHeldError", "RankAttachment", "SegmentRemoved", "SlotKey", "unemitted_samples"]


class SegmentRemoved(SegmentError):
    """The job's segment this process opened was removed before it registered in it (a node collector let the job
    go meanwhile, every process of it gone): :func:`shmstat.job.attach.init` opens it again."""


class EntryHeldError(ConfigError):
    """The rank entry asked for is held by another live process (two processes given the same LOCAL_RANK)."""

class SlotKey(NamedTuple):
    """What makes two Stats of one process the same slot (and one writer): equal in all five fields."""

    name: str
    group: str
    window_ms: int
    max_samples: int
    agg_mask: int


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
    index: dict[SlotKey, int] = field(default_factory=dict)
    """Published descriptors of this entry by key (built once at registration; O(1) allocation after)."""
    writers: dict[tuple[str, str, int, int, int], Any] = field(default_factory=dict)
    """The one writer of each slot in this process (shared by every Stat and bound ``add`` of that key)."""
    gone: bool = False
    """Set once the segment was found removed from /dev/shm while this process wrote it (every writer drops)."""

    @property
    def owner_local_rank(self) -> int:
        """The local rank whose rows this process's samples count in (-1: a rank that got no entry)."""
        return self.local_rank if self.writer_of < 0 else self.writer_of

    @property
    def has_entry(self) -> bool:
        """Whether this process holds an entry (else every sample it adds is dropped and counted)."""
        return self.local_rank >= 0

    @property
    def drop_offset(self) -> int:
        """Byte offset of the counter this process's dropped samples go to: its rank's ``dropped``, or the
        header's when its rank has no entry."""
        owner = self.owner_local_rank
        return L.H_DROPPED if owner < 0 else self.segment.geometry.rank_offset(owner) + L.R_DROPPED

    @classmethod
    def without_entry(cls, segment: Segment, *, rank: int, world_size: int, writer_of: int = -1) -> RankAttachment:
        """An attachment holding no entry (the table is full): counts this process as refused (its rank's
        ``writers_refused``, or the header's ``ranks_refused`` for a rank) and drops every sample it adds."""
        if writer_of >= 0:
            add_counter(segment, segment.geometry.rank_offset(writer_of) + L.R_WRITERS_REFUSED)
        else:
            add_counter(segment, L.H_RANKS_REFUSED)
        return cls(segment, -1, rank, world_size, os.getpid(), 0, writer_of)

    @classmethod
    def register(
        cls, segment: Segment, *, rank: int, local_rank: int, world_size: int = 1, pid: int | None = None,
        clock_ns: int | None = None, inherited: bool = False,
    ) -> RankAttachment:
        """Take rank entry ``local_rank`` for this process, bumping its incarnation; pre-fault the rank's slots.

        A worker of the rank becomes a writer of that rank instead (see :meth:`register_writer`), whatever the
        order they attach in: a process that ``inherited`` the rank's identity unchanged from the process that
        started it (a forked child, a multiprocessing worker: see :func:`shmstat.job.attach.init`), and a process
        whose ancestor holds the entry (a worker started by the rank that inherited its environment). A rank
        whose entry a process it started took first (a worker not seen as one) writes for itself from a writer
        entry, and says so once. Raises :class:`CapacityError` if ``local_rank`` is beyond the segment's rank
        capacity (:func:`shmstat.init` then attaches the rank without an entry) and :class:`EntryHeldError` if
        another live process, neither its ancestor nor its descendant, holds the entry.
        """
        geo = segment.geometry
        if not 0 <= local_rank < geo.max_ranks:
            raise CapacityError(
                f"local rank {local_rank} does not fit the segment of job {segment.job!r} (max {geo.max_ranks} "
                f"ranks per node); start the job with SHMSTAT_MAX_RANKS={max(2 * geo.max_ranks, local_rank + 1)} "
                "(shmstat collect/run: --max-ranks)"
            )
        own = pid is None
        if own and inherited:
            return cls.register_writer(segment, owner_local_rank=local_rank, rank=rank, world_size=world_size)
        pid = os.getpid() if pid is None else pid
        now = time.time_ns() if clock_ns is None else clock_ns
        with segment.locked():
            if not segment.linked():
                raise SegmentRemoved(f"segment of job {segment.job!r} removed before this process registered")
            info = segment.rank(local_rank)
            if info.state == L.RankState.ACTIVE and info.pid not in (pid, 0) and pid_alive(info.pid):
                owner = info.writer_of - 1 if info.is_writer else local_rank
                if own and _is_ancestor(info.pid):
                    return cls.register_writer(segment, owner_local_rank=owner)
                if own and _is_ancestor(pid, of=info.pid):
                    warn_once("order", (
                        f"local rank {local_rank} of job {segment.job!r} is held by pid {info.pid}, a process this "
                        "rank started that attached before it and did not inherit the rank's variables as they "
                        "are now; the rank writes from an entry of its own and every sample still counts in "
                        f"rank {rank}'s rows, but the rank's joining and exit follow pid {info.pid}: attach the "
                        "rank (a Stat or shmstat.init()) before it starts workers"), segment)
                    return cls.register_writer(segment, owner_local_rank=owner, rank=rank, world_size=world_size)
                raise EntryHeldError(
                    f"local rank {local_rank} of job {segment.job!r} is held by live pid {info.pid}; "
                    "give each process its own LOCAL_RANK"
                )
            att = cls._take(segment, local_rank, info, rank, world_size, pid, now, writer_of=-1)
        att.prefault()
        return att

    @classmethod
    def register_writer(cls, segment: Segment, *, owner_local_rank: int, rank: int | None = None,
                        world_size: int | None = None) -> RankAttachment:
        """Take a writer entry for this process, writing samples for rank entry ``owner_local_rank``, as global
        ``rank`` of ``world_size`` (default: as the rank's entry says; given when the rank may not have taken its
        entry yet, which stays free for it).

        Never raises for lack of room. Writer entries come from the top of the table: a free entry, or that of
        a writer whose process is gone and whose windows were all emitted; when there is neither, the entry of
        a gone writer holding the fewest samples no collector emitted yet (those samples are counted as
        dropped in its rank's entry, and the job warns once). With no entry left at all (every one held by a
        live process) the attachment returned holds none: the process's samples are dropped and counted.
        """
        geo = segment.geometry
        pid, now = os.getpid(), time.time_ns()
        with segment.locked():
            owner = segment.rank(owner_local_rank)
            rank = owner.rank if rank is None else rank
            world_size = owner.world_size if world_size is None else world_size
            chosen: tuple[int, RankInfo] | None = None
            fallback: tuple[int, int, RankInfo] | None = None  # (samples lost, entry, info)
            for i in range(geo.max_ranks - 1, -1, -1):
                if i == owner_local_rank:
                    continue
                info = segment.rank(i)
                if info.state == L.RankState.FREE:
                    chosen = (i, info)
                    break
                if not info.is_writer or pid_alive(info.pid):
                    continue
                lost = unemitted_samples(segment, info)
                if lost == 0:
                    chosen = (i, info)
                    break
                if fallback is None or lost < fallback[0]:
                    fallback = (lost, i, info)
            if chosen is None and fallback is not None:
                lost, i, info = fallback
                gone_owner = info.writer_of - 1
                if 0 <= gone_owner < geo.max_ranks:
                    add_counter(segment, geo.rank_offset(gone_owner) + L.R_DROPPED, lost)
                warn_once("takeover", (
                    f"job {segment.job!r} has no free entry for another writer of rank {rank} (forked or "
                    f"spawned workers; {geo.max_ranks} entries) and no collector emitted the windows of the "
                    "workers that exited: their entries are reused and the samples they held are counted as "
                    "dropped (see 'shmstat ls'); run 'shmstat collect' on the node to keep them"), segment)
                chosen = (i, info)
            if chosen is None:
                warn_once("writers", (
                    f"job {segment.job!r} has no free entry for another writer of rank {rank} (a forked or "
                    f"spawned worker): all {geo.max_ranks} entries are held by live processes; this worker's "
                    f"samples are dropped and counted (see 'shmstat ls'); start the job with "
                    f"SHMSTAT_MAX_RANKS={2 * geo.max_ranks}"), segment)
                return cls.without_entry(segment, rank=rank, world_size=world_size, writer_of=owner_local_rank)
            i, info = chosen
            if info.state != L.RankState.FREE:
                _forget_unemitted(segment, info)  # none but a bank left odd by a death, or the ones counted above
            att = cls._take(segment, i, info, rank, world_size, pid, now, writer_of=owner_local_rank)
        att.prefault()
        return att

    @classmethod
    def _take(cls, segment: Segment, i: int, info: RankInfo, rank: int, world_size: int, pid: int, now: int,
              *, writer_of: int) -> RankAttachment:
        """Write entry ``i`` for this process (job lock held) and index the descriptors it already has."""
        incarnation = (info.incarnation + 1) & (2**63 - 1)
        codec.write_rank_entry(segment.buf, segment.geometry, i, pid=pid, incarnation=incarnation, rank=rank,
                               world_size=world_size, now_ns=now, writer_of=writer_of)
        segment.bump_entries_epoch()
        att = cls(segment, i, rank, world_size, pid, incarnation, writer_of)
        for d in segment.descriptors(i):  # an earlier incarnation's stats: reused under the same key
            att.index.setdefault(SlotKey(d.name, d.group, d.window_ms, d.max_samples, d.agg_mask), d.index)
        return att

    def prefault(self) -> None:
        """Touch every page of this entry's slots once, so no ``Stat.add`` pays a page fault."""
        if self.local_rank < 0:
            return
        for start, end in (self.segment.geometry.rank_slots_span(self.local_rank),
                           self.segment.geometry.rank_hist_span(self.local_rank)):
            bytes(self.segment.buf[start:end:mmap.PAGESIZE])
        d0 = self.segment.geometry.desc_offset(self.local_rank, 0)
        bytes(self.segment.buf[d0 : d0 + self.segment.geometry.max_stats * L.DESC_SIZE : mmap.PAGESIZE])

    def allocate_stat(self, name: str, group: str, window_ms: int, max_samples: int, agg_mask: int,
                      flags: int = 0, before: int = -1) -> int:
        """The descriptor index of this stat key: the one already published for it, else a new one (O(1); looked
        up again under the job lock, so threads asking for one key at once get one descriptor); a
        stat with a percentile aggregation gets a histogram of the entry's table too. ``flags`` (e.g.
        :data:`~shmstat.shm.layout.FLAG_HIGHER_IS_BETTER`) are those of the first Stat of the key. A new slot's
        watermark (``emitted_wid``) starts at ``before``, the window before the first one it can hold, so a
        window lost before any collector emitted one is counted like any other (-1: none).

        Raises :class:`CapacityError` when the entry's stat or histogram table is full, or the process holds no
        entry; nothing is written then (the caller counts the refusal, see :meth:`refuse_stat`).
        """
        key = SlotKey(name, group, window_ms, max_samples, agg_mask)
        found = self.index.get(key)
        if found is not None:
            return found
        name_b = codec.encode_name(name, L.MAX_NAME_BYTES, "stat name")
        group_b = codec.encode_name(group, L.MAX_GROUP_BYTES, "stat group")
        seg, geo = self.segment, self.segment.geometry
        if self.local_rank < 0:
            raise CapacityError(f"this process holds no entry of job {seg.job!r}")
        with seg.locked():
            # again, under the lock: taking it (flock) releases the GIL, and another thread of this process may
            # have published the key meanwhile; one key, one descriptor
            found = self.index.get(key)
            if found is not None:
                return found
            nstats = min(seg.rank(self.local_rank).nstats, geo.max_stats)
            if nstats >= geo.max_stats:
                raise CapacityError(
                    f"rank {self.rank} has used all {geo.max_stats} stat slots of job {seg.job!r}; "
                    f"start the job with SHMSTAT_MAX_STATS={2 * geo.max_stats} (shmstat collect/run: "
                    f"--max-stats {2 * geo.max_stats})"
                )
            hist = -1
            if agg_mask & L.PERCENTILE_BITS:
                hist = codec.rank_nhist(seg.buf, geo, self.local_rank)
                if hist >= geo.hist_slots:
                    raise CapacityError(
                        f"rank {self.rank} keeps percentiles for {geo.hist_slots} stats of job {seg.job!r} "
                        f"already; start the job with SHMSTAT_MAX_PERCENTILE_STATS={max(2 * geo.hist_slots, 16)} "
                        f"(shmstat collect/run: --max-percentile-stats {max(2 * geo.hist_slots, 16)})"
                    )
                codec.write_rank_nhist(seg.buf, geo, self.local_rank, hist + 1)
            codec.write_descriptor(
                seg.buf, geo, self.local_rank, nstats, name=name_b, group=group_b, window_ms=window_ms,
                max_samples=max_samples, agg_mask=agg_mask, incarnation=self.incarnation, flags=flags, hist=hist,
                emitted_wid=before,
            )
            codec.write_rank_nstats(seg.buf, geo, self.local_rank, nstats + 1)
            seg.bump_entries_epoch()
            self.index[key] = nstats
        return nstats

    def refuse_stat(self, name: str, kind: str, why: str) -> None:
        """Count a Stat that got no slot (its rank's ``stats_refused``) and report it once per job and ``kind``
        (``stats``, ``percentiles``, ``lock``)."""
        owner = self.owner_local_rank
        seg = self.segment
        if owner >= 0:
            add_counter(seg, seg.geometry.rank_offset(owner) + L.R_STATS_REFUSED)
        if self.local_rank < 0:
            return  # the process itself got no entry: that was reported already
        try:
            with seg.locked():
                warn_once(kind, f"Stat {name!r} gets no slot and its samples are dropped and counted (see 'shmstat "
                          f"ls'): {why}", seg)
        except Exception:  # the lock file is unusable: report it from this process anyway
            warn_once(kind, f"Stat {name!r} gets no slot and its samples are dropped and counted: {why}")

    def hist_offset(self, index: int) -> int:
        """Byte offset of bank 0's histogram of descriptor ``index`` of this entry, -1 if it keeps none."""
        geo = self.segment.geometry
        hist = codec.descriptor_hist(self.segment.buf, geo, self.local_rank, index)
        return geo.hist_offset(self.local_rank, hist - 1) if 0 < hist <= geo.hist_slots else -1

    def word(self, field_offset: int) -> int:
        """Index into ``segment.i64`` of one 8-byte field of this entry."""
        return (self.segment.geometry.rank_offset(self.local_rank) + field_offset) // 8

    def record_events_end(self, end: int, incarnation: int) -> None:
        """This process's publisher closed with items numbered below ``end`` (under ``incarnation``) that no
        collector acknowledged: recorded in its entry, where the next collector finds it and counts what it did
        not receive as a gap. A no-op for a process holding no entry."""
        if self.local_rank >= 0 and self.segment.rank(self.local_rank).pid == self.pid:
            with contextlib.suppress(ValueError, TypeError):  # the mapping was closed meanwhile
                self.segment.record_events_end(self.local_rank, end, incarnation)

    def mark_exited(self) -> None:
        """Mark this entry as cleanly exited (its windows stay readable)."""
        if self.local_rank >= 0 and self.segment.rank(self.local_rank).pid == self.pid:
            self.segment.set_rank_state(self.local_rank, L.RankState.EXITED)

    def detach(self) -> None:
        """Mark exited and unmap."""
        with contextlib.suppress(Exception):
            self.mark_exited()
        self.segment.close()


def _unemitted_banks(segment: Segment, info: RankInfo) -> list[tuple[int, int]]:
    """(byte offset of the bank, samples it holds) of every bank of a gone writer's entry that holds data no
    collector emitted (the writer is gone: nothing changes these banks meanwhile)."""
    geo = segment.geometry
    out = []
    for d in segment.descriptors(info.local_rank):
        slot = geo.slot_offset(info.local_rank, d.index)
        for b in range(geo.banks):
            off = slot + b * L.BANK_SIZE
            seq, wid = codec.bank_seq_wid(segment.buf, off)
            if seq >= 1.0 and seq == seq and wid > d.emitted_wid:
                out.append((off, int(seq) >> 1 if seq < 2.0**62 else 0))
    return out


def unemitted_samples(segment: Segment, info: RankInfo) -> int:
    """Samples in a gone writer's entry that no collector emitted (a bank the writer died writing counts its
    complete samples)."""
    return sum(n for _off, n in _unemitted_banks(segment, info))


def _forget_unemitted(segment: Segment, info: RankInfo) -> None:
    """Empty the banks of a gone writer whose entry is taken over (their samples were counted as dropped), so a
    collector never emits them under the new writer's rank."""
    for off, _n in _unemitted_banks(segment, info):
        codec.empty_bank(segment.buf, off)


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (read from /proc, no dependency); 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _is_ancestor(pid: int, *, of: int | None = None) -> bool:
    """Whether ``pid`` is the parent, grandparent, ... of process ``of`` (default: this process)."""
    current = os.getppid() if of is None else _parent(of)
    for _ in range(64):
        if current == pid:
            return True
        if current <= 1:
            return False
        current = _parent(current)
    return False
