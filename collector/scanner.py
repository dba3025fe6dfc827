"""The scanner: finds every rank's closed windows in the segment and merges them per (group, stat, window).

Each slot's watermark (the newest window already emitted) lives in the segment, in the descriptor's
``emitted_wid``: a restarted collector resumes where the previous one stopped, so no window still in the
ring is lost and none is emitted twice. The watermark is written right after the rows were handed to the
handlers (a crash between the two can repeat at most that one pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shmstat.layout import RankInfo, RankState, StatDescriptor
from shmstat.reader import SegmentReader, WindowRead
from shmstat.segment import Segment

from .merge import Summary, WindowRow, merge_all

__all__ = ["ScanResult", "Scanner"]

StatKey = tuple[str, str, int, int]
"""(group, name, window_ms, agg_mask): the stats that merge across ranks."""


@dataclass
class ScanResult:
    """What one pass produced: rows in window order (merged row first, then one per rank) and counters."""

    rows: list[WindowRow] = field(default_factory=list)
    windows_read: int = 0
    overwritten: int = 0
    torn: int = 0


@dataclass
class _Slot:
    info: RankInfo
    desc: StatDescriptor
    after_wid: int


class Scanner:
    """Reads closed windows from every slot of a segment; ``scan(now)`` never returns a window twice."""

    def __init__(self, segment: Segment, grace_ns: int, *, is_alive: Callable[[int], bool] | None = None) -> None:
        self.segment = segment
        self.reader = SegmentReader(segment)
        self.grace_ns = grace_ns
        self.is_alive = is_alive
        self._slots: dict[int, dict[int, _Slot]] = {}
        self._known_nstats: dict[int, tuple[int, int]] = {}
        self._next_due: dict[int, int] = {}
        self._pending: list[tuple[_Slot, int]] = []

    def refresh(self) -> list[RankInfo]:
        """Pick up new ranks and newly published descriptors; returns the current rank entries."""
        ranks = self.reader.ranks()
        for info in ranks:
            slots = self._slots.setdefault(info.local_rank, {})
            for slot in slots.values():
                slot.info = info
            key = (info.nstats, info.incarnation)
            if self._known_nstats.get(info.local_rank) == key:
                continue
            self._known_nstats[info.local_rank] = key
            for desc in self.reader.descriptors(info.local_rank):
                if desc.index not in slots:
                    slots[desc.index] = _Slot(info, desc, desc.emitted_wid)
        return ranks

    def _all_slots(self) -> list[_Slot]:
        return [slot for slots in self._slots.values() for slot in slots.values()]

    def due(self, now_ns: int) -> bool:
        """Whether some window length has a window that closed since the last pass."""
        return any(now_ns >= t for t in self._next_due.values()) or not self._next_due

    def next_due_ns(self) -> int | None:
        """Wall-clock ns when the next window closes (None if no stat is known yet)."""
        return min(self._next_due.values()) if self._next_due else None

    def scan(self, now_ns: int, *, final: bool = False) -> ScanResult:
        """Read every window closed at ``now_ns`` (all windows with data if ``final``), merged and per rank.

        Call :meth:`commit` with the result once the rows were dispatched.
        """
        self.refresh()
        result = ScanResult()
        by_key: dict[tuple[StatKey, int], list[tuple[WindowRead, _Slot]]] = {}
        self._pending = []
        all_slots = self._all_slots()
        for slot in all_slots:
            desc = slot.desc
            wns = desc.window_ns
            if not final and now_ns < self._next_due.get(wns, 0):
                continue
            at = now_ns if not final else (now_ns // wns + 2) * wns + self.grace_ns
            alive = False if slot.info.state == RankState.DIED else None
            read = self.reader.read_slot(slot.info, desc, at, self.grace_ns, slot.after_wid, writer_alive=alive)
            result.overwritten += read.overwritten
            for w in read.windows:
                key = (desc.group, desc.name, desc.window_ms, desc.agg_mask)
                by_key.setdefault((key, w.wid), []).append((w, slot))
                result.windows_read += 1
                result.torn += w.torn
            if read.safe_wid > slot.after_wid:
                self._pending.append((slot, read.safe_wid))
        for slot in all_slots:
            wns = slot.desc.window_ns
            self._next_due[wns] = ((now_ns - self.grace_ns) // wns + 1) * wns + self.grace_ns
        for ((group, name, window_ms, mask), wid) in sorted(by_key, key=lambda k: (k[1], k[0])):
            parts = by_key[((group, name, window_ms, mask), wid)]
            per_rank = [
                WindowRow(group, name, wid, window_ms, mask, w.rank,
                          Summary(w.count, w.sum, w.min, w.max, w.last, w.last_ts, w.torn))
                for w, _ in sorted(parts, key=lambda p: p[0].rank)
            ]
            merged = merge_all(r.summary for r in per_rank)
            result.rows.append(WindowRow(group, name, wid, window_ms, mask, None, merged, ranks=len(parts)))
            result.rows.extend(per_rank)
        return result

    def commit(self) -> None:
        """Record in the segment that the last scan's windows were emitted."""
        for slot, wid in self._pending:
            slot.after_wid = wid
            self.segment.set_emitted_wid(slot.desc.local_rank, slot.desc.index, wid)
        self._pending = []

    def forget_rank(self, local_rank: int) -> None:
        """Drop cached descriptors of a rank entry (after it was re-registered)."""
        self._known_nstats.pop(local_rank, None)
