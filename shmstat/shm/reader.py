"""Reading closed windows out of a job's segment (what the collector, ``shmstat top`` and tests use).

A window ``W`` of a stat with window length ``w`` ends at ``(W + 1) * w`` ns; it is *closed* once ``now`` is
past its end plus a grace period, or, for a window longer than an hour, once its writer closed it (by
``max_samples``, by moving to a later window, or by ending: see :mod:`shmstat.shm.layout`). Only closed windows are
returned, each at most once per ``after_wid`` watermark the caller keeps (the collector keeps it in the
descriptor's ``emitted_wid``). A window read is a :class:`~shmstat.shm.layout_records.BankSnapshot` (its figures, its
window id and the incarnation that wrote it); the slot it is of is the caller's (the rank entry and descriptor it
passed). :class:`SlotRead` is what one read of a slot found.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import layout as L
from . import layout_codec as codec
from .layout_records import BankSnapshot, RankInfo, StatDescriptor
from .segment import Segment, pid_alive

__all__ = ["SegmentReader", "SlotRead", "windows_of_bank"]

_log = logging.getLogger("shmstat")
_MAX_WARNED = 10_000  # entries remembered for count-once and warn-once
_MAX_COUNT = 1 << 61  # samples a bank's seq (a float64, 2 * count) can count exactly


@dataclass(frozen=True)
class SlotRead:
    """What one pass over a slot found: closed windows in order, how far it is safe to advance, and losses."""

    windows: list[BankSnapshot]
    """The slot's closed windows, oldest first (``torn``: the writer died mid-add)."""
    safe_wid: int
    """Every window up to here is settled: emitted above, empty, or lost. Windows after it wait for later."""
    overwritten: int
    """Windows in (after_wid, safe_wid] whose bank was already reused by a later window (data lost)."""


class SegmentReader:
    """Read-only view of a segment for collectors: ranks, descriptors and closed windows with torn-read retry."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.geometry = segment.geometry
        self.bad_ranks = 0
        """Rank entries skipped because their content is unusable (counted once per entry and incarnation)."""
        self.bad_descriptors = 0
        """Descriptors skipped because their content is unusable (counted once per descriptor)."""
        self._warned: set[tuple[object, ...]] = set()

    def ranks(self) -> list[RankInfo]:
        """Every rank entry that was ever used and can be trusted; unusable ones are skipped and counted."""
        out = []
        for info in self.segment.ranks():
            problem = codec.rank_problem(info, self.geometry)
            if problem is None:
                out.append(info)
            elif self._first(("rank", info.local_rank, info.incarnation, info.pid)):
                self.bad_ranks += 1
                _log.warning("job %s: rank entry %d skipped: %s", self.segment.job, info.local_rank, problem)
        return out

    def descriptors(self, local_rank: int) -> list[StatDescriptor]:
        """Published stat descriptors of a rank that can be used; unusable ones are skipped and counted."""
        out = []
        for desc in self.segment.descriptors(local_rank):
            problem = codec.descriptor_problem(desc, self.geometry)
            if problem is None:
                out.append(desc)
            elif self._first(("desc", local_rank, desc.index, desc.incarnation, desc.window_ms, desc.agg_mask)):
                self.bad_descriptors += 1
                _log.warning("job %s: stat descriptor %d of rank entry %d skipped: %s", self.segment.job,
                             desc.index, local_rank, problem)
        return out

    def _first(self, key: tuple[object, ...]) -> bool:
        """Whether ``key`` is seen for the first time (memory stays bounded: past the cap the set starts over,
        so a flood of garbage may be counted again, never grows the collector)."""
        if key in self._warned:
            return False
        if len(self._warned) >= _MAX_WARNED:
            self._warned.clear()
        self._warned.add(key)
        return True

    def read_slot(
        self, info: RankInfo, desc: StatDescriptor, now_ns: int, grace_ns: int, after_wid: int,
        writer_alive: bool | None = None, after_inc: int = -1,
    ) -> SlotRead:
        """Closed windows of one slot newer than ``after_wid``, oldest first.

        A bank that stays torn while its writer lives is not returned, and ``safe_wid`` stops before it,
        so it is read again on a later pass; a dead writer's torn bank is returned flagged ``torn``.

        ``after_inc`` (long windows only): the incarnation that wrote window ``after_wid`` when it was emitted
        (-1: unknown). A rank restarted inside a long window its predecessor's end closed writes that window
        again from empty; that bank (of the entry's current incarnation) is returned once more, closed by the
        same rules, so the restarted rank's samples are emitted too (as a second row of that window).
        """
        wns = desc.window_ns
        newest_closed = (now_ns - grace_ns) // wns - 1
        if newest_closed <= after_wid and not desc.is_long:
            return SlotRead([], after_wid, 0)
        banks = self.geometry.banks
        base = self.geometry.slot_offset(info.local_rank, desc.index)
        hist0 = self.geometry.hist_offset(info.local_rank, desc.hist) if desc.hist >= 0 else None
        snaps = [codec.read_bank(self.segment.buf, base + b * L.BANK_SIZE,
                             hist_offset=None if hist0 is None else hist0 + b * L.HIST_SIZE) for b in range(banks)]
        lowest = after_wid + 1  # the oldest window to look at
        if desc.is_long:
            newest_closed = max(newest_closed, _closed_by_writer(info, desc, snaps, writer_alive))
            if after_inc >= 0 and any(snap.wid == after_wid and snap.incarnation not in (after_inc, 0)
                                      and snap.incarnation == info.incarnation for snap in snaps):
                lowest = after_wid  # re-opened by a restarted rank
            if newest_closed < lowest:
                return SlotRead([], after_wid, 0)
        safe = newest_closed
        found: list[BankSnapshot] = []
        for snap in snaps:
            if not lowest <= snap.wid <= newest_closed or not 0 <= snap.count < _MAX_COUNT:
                continue  # (a count no writer reaches: garbage written into the segment, read as empty)
            if snap.torn:
                alive = pid_alive(info.pid) if writer_alive is None else writer_alive
                if alive:  # a live writer mid-add (or stopped there): read it again on a later pass
                    safe = min(safe, snap.wid - 1)
                    continue
            if snap.count > 0 or snap.torn:
                found.append(snap)
        # Windows whose bank already holds a later one (the collector fell behind the ring), however far back
        # the watermark is. An empty window looks the same, so this is an upper bound on windows lost.
        overwritten = 0
        if after_wid >= 0:
            for b, snap in enumerate(snaps):
                overwritten += windows_of_bank(after_wid + 1, min(safe, snap.wid - 1), b, banks)
        windows = [snap for snap in sorted(found, key=lambda s: s.wid) if snap.wid <= safe]
        return SlotRead(windows, safe, overwritten)


def windows_of_bank(lo: int, hi: int, bank: int, banks: int) -> int:
    """How many windows ``w`` in ``[lo, hi]`` live in bank ``bank`` (``w % banks == bank``); 0 if ``hi < lo``."""
    if hi < lo:
        return 0
    return (hi - bank) // banks - (lo - 1 - bank) // banks


def _closed_by_writer(info: RankInfo, desc: StatDescriptor, snaps: list[BankSnapshot],
                      writer_alive: bool | None) -> int:
    """The newest window of a long-window slot (:attr:`~shmstat.shm.layout_records.StatDescriptor.is_long`) that its
    writer has closed before the wall-clock end: every window once the writer is gone (entry exited or died, process
    dead), else every window before the writer's newest one (a writer never goes back to an older window), and
    that newest one too once it holds ``max_samples`` samples (the writer discards the window's later adds)."""
    top = max(snap.wid for snap in snaps)
    if top < 0:
        return -1
    alive = writer_alive
    if alive is None:
        alive = info.state == L.RankState.ACTIVE and pid_alive(info.pid)
    if not alive:
        return top
    newest = next(snap for snap in snaps if snap.wid == top)
    full = not newest.torn and newest.count >= desc.max_samples
    return top if full else top - 1
