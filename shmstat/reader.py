"""Reading closed windows out of a job's segment (what the collector, ``shmstat top`` and tests use).

A window ``W`` of a stat with window length ``w`` ends at ``(W + 1) * w`` ns; it is *closed* once ``now`` is
past its end plus a grace period. Only closed windows are returned, each at most once per ``after_wid``
watermark the caller keeps (the collector keeps it in the descriptor's ``emitted_wid``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout as L
from .segment import Segment, pid_alive

__all__ = ["SegmentReader", "SlotRead", "WindowRead"]


@dataclass(frozen=True)
class WindowRead:
    """One closed window of one rank's stat, as read from its bank."""

    local_rank: int
    rank: int
    stat_index: int
    wid: int
    window_ns: int
    count: int
    sum: float
    min: float
    max: float
    last: float
    last_ts: int
    incarnation: int
    torn: bool = False
    """The writer died in the middle of an add: the numbers may miss (part of) that one sample."""

    @property
    def start_ns(self) -> int:
        """Start of the window, wall-clock ns."""
        return self.wid * self.window_ns

    @property
    def end_ns(self) -> int:
        """End of the window (exclusive), wall-clock ns."""
        return (self.wid + 1) * self.window_ns


@dataclass(frozen=True)
class SlotRead:
    """What one pass over a slot found: closed windows in order, how far it is safe to advance, and losses."""

    windows: list[WindowRead]
    safe_wid: int
    """Every window up to here is settled: emitted above, empty, or lost. Windows after it wait for later."""
    overwritten: int
    """Windows in (after_wid, safe_wid] whose bank was already reused by a later window (data lost)."""


class SegmentReader:
    """Read-only view of a segment for collectors: ranks, descriptors and closed windows with torn-read retry."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.geometry = segment.geometry

    def ranks(self) -> list[L.RankInfo]:
        """Every rank entry that was ever used."""
        return self.segment.ranks()

    def descriptors(self, local_rank: int) -> list[L.StatDescriptor]:
        """Published stat descriptors of a rank."""
        return self.segment.descriptors(local_rank)

    def read_slot(
        self, info: L.RankInfo, desc: L.StatDescriptor, now_ns: int, grace_ns: int, after_wid: int,
        writer_alive: bool | None = None,
    ) -> SlotRead:
        """Closed windows of one slot newer than ``after_wid``, oldest first.

        A bank that stays torn while its writer lives is not returned, and ``safe_wid`` stops before it,
        so it is read again on a later pass; a dead writer's torn bank is returned flagged ``torn``.
        """
        wns = desc.window_ns
        newest_closed = (now_ns - grace_ns) // wns - 1
        if newest_closed <= after_wid:
            return SlotRead([], after_wid, 0)
        banks = self.geometry.banks
        base = self.geometry.slot_offset(info.local_rank, desc.index)
        first = max(after_wid + 1, newest_closed - banks + 1)
        # Windows older than the ring (the collector was away too long) cannot be told apart from empty ones.
        overwritten = 0
        windows: list[WindowRead] = []
        for wid in range(first, newest_closed + 1):
            snap = L.read_bank(self.segment.buf, base + (wid % banks) * L.BANK_SIZE)
            if snap.wid > wid and not snap.torn:
                overwritten += 1  # its bank already holds a later window
                continue
            if snap.wid != wid:
                continue  # no sample in that window
            if snap.torn:
                alive = pid_alive(info.pid) if writer_alive is None else writer_alive
                if alive:  # a live writer mid-add (or stopped there): read it again on a later pass
                    return SlotRead(windows, wid - 1, overwritten)
            if snap.count > 0 or snap.torn:
                windows.append(
                    WindowRead(
                        info.local_rank, info.rank, desc.index, wid, wns, snap.count, snap.sum, snap.min,
                        snap.max, snap.last, snap.last_ts, snap.incarnation, snap.torn,
                    )
                )
        return SlotRead(windows, newest_closed, overwritten)
