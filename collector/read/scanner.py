"""The scanner: finds every rank's closed windows in the segment and merges them per (group, stat, window).

Each slot's watermark (the newest window already emitted) lives in the segment, in the descriptor's
``emitted_wid``: a restarted collector resumes where the previous one stopped, so no window still in the
ring is lost and none is emitted twice. :meth:`Scanner.advance` moves the watermark in memory at once and
returns it as :class:`DurableMarks`, which the collector writes into the segment only once every handler took
the pass (:mod:`collector.daemon.commits`): a collector killed before re-emits that pass when restarted.

How a pass reads (vectorised with NumPy, because a node can hold 64k slots and the pass runs every window): for
every slot with a window that closed since its watermark, only the banks that can hold such a window are read (bank
``w % K`` of each window ``w`` past the watermark: one bank per slot in steady state). Their ``(seq, wid)`` words
are gathered, then the banks are copied whole, then ``(seq, wid)`` gathered again: three separate copies, in this
order, which is the seqlock reader of :mod:`shmstat.shm.layout` applied to all banks at once (x86-64 keeps the
copies in order; the order *inside* one copy does not matter). A bank is consistent when both gathers and the copy
agree on ``seq`` and ``wid`` and ``seq`` is even. The few candidate banks that are not (a rank was writing them at
that instant) are read again one by one with :func:`shmstat.shm.layout_codec.read_bank`'s retry loop (these reads of
banks are :mod:`collector.read.bank_reads`); a slot whose bank stays torn goes through
:meth:`shmstat.shm.reader.SegmentReader.read_slot`, which decides by the writer's liveness. Everything else (which
windows are closed and new, how far a slot's watermark may move, windows lost to a ring that wrapped) is computed on
the arrays with exactly ``read_slot``'s rules (``tests/collector/read/test_scanner_vectorised.py`` checks that), and
only the windows of groups someone consumes become Python objects: :meth:`Scanner.scan` takes ``want(group)``, and the
windows of other groups (a null handler, no subscriber) are counted and committed but never built. A pass over 64k
slots takes ~8 ms.

Slots of windows over an hour (:attr:`shmstat.shm.layout_records.StatDescriptor.is_long`) are looked at every
``LONG_POLL_MS``: their windows also close, per writer, by ``max_samples`` and by the writer's end
(:mod:`shmstat.shm.layout`), so they are not left waiting for a wall-clock end days away. One gather over their banks
finds those with such a window (:func:`long_slots_to_read`); only these are read one by one with ``read_slot``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np

from shmstat.aggregation import PERCENTILE_MASK
from shmstat.shm import layout as L
from shmstat.shm.layout import RankState
from shmstat.shm.layout_records import RankInfo, StatDescriptor
from shmstat.shm.reader import SegmentReader
from shmstat.shm.segment import Segment, pid_alive

from .bank_reads import consistent_banks, long_slots_to_read, read_banks, read_histograms, read_window_hist, retry_torn
from .columns import Columns, Parts, StatTable, merge_parts
from .hist_batch import HistBatch
from .rows import WindowRow

__all__ = [
    "DurableMarks",
    "MergeKey",
    "ScanResult",
    "Scanner",
    "Slot",
    "SlotTable",
    "distinct",
]

_LONG_NS = L.LONG_WINDOW_MS * 1_000_000
_LONG_POLL_NS = L.LONG_POLL_MS * 1_000_000


class Scanner:
    """Reads closed windows from every slot of a segment; ``scan(now)`` never returns a window twice."""

    def __init__(self, segment: Segment, grace_ns: int) -> None:
        self.segment = segment
        self.reader = SegmentReader(segment)
        self.job_start_ns = segment.header().created_ns
        """When the job's segment was created (passed on in every pass's columns)."""
        self.grace_ns = grace_ns
        self._slots: dict[int, dict[int, Slot]] = {}
        self._infos: dict[int, RankInfo] = {}  # the latest entry of each local rank (read every step)
        self._known_nstats: dict[int, tuple[int, int]] = {}
        self._next_due: dict[int, int] = {}
        self._table: SlotTable | None = None
        self._dirty = True
        self._pending: tuple[np.ndarray, np.ndarray] | None = None
        self._pending_inc: dict[int, int] = {}  # long-window slot -> incarnation of its emitted newest window
        self._pending_lost = 0  # windows the last scan found lost to the ring (committed with its watermarks)
        self.resume_ns = segment.dispatched_ns()
        """What the previous collector may have dispatched (see :meth:`_not_again`): windows ended by then."""

    def refresh(self) -> list[RankInfo]:
        """Pick up new ranks and newly published descriptors; returns the current rank entries."""
        ranks = self.reader.ranks()
        for info in ranks:
            slots = self._slots.setdefault(info.local_rank, {})
            self._infos[info.local_rank] = info
            key = (info.nstats, info.incarnation)
            if self._known_nstats.get(info.local_rank) == key:
                continue
            self._known_nstats[info.local_rank] = key
            for desc in self.reader.descriptors(info.local_rank):
                if desc.index not in slots:
                    if self._table is not None and not self._dirty:
                        self._table.sync_back()
                    self._dirty = True
                    slots[desc.index] = Slot(desc, desc.emitted_wid)
        return ranks

    def _all_slots(self) -> list[Slot]:
        return [slot for _, slots in sorted(self._slots.items()) for _, slot in sorted(slots.items())]

    def _current_table(self) -> SlotTable:
        if self._dirty or self._table is None:
            self._table = SlotTable(self._all_slots(), self.segment.geometry)
            self._dirty = False
        return self._table

    def due(self, now_ns: int) -> bool:
        """Whether some window length has a window that closed since the last pass."""
        if not self._next_due:  # no window length known yet: a pass is useful only once slots appeared
            return self._dirty or self._table is None
        return any(now_ns >= t for t in self._next_due.values())

    def shortest_window_ns(self) -> int | None:
        """The shortest window length of the stats known so far (None before any)."""
        return min(self._next_due) if self._next_due else None

    def next_due_ns(self) -> int | None:
        """Wall-clock ns when the next window closes (None if no stat is known yet)."""
        return min(self._next_due.values()) if self._next_due else None

    def scan(self, now_ns: int, *, final: bool = False, want: Callable[[str], bool] | None = None) -> ScanResult:
        """Read every window closed at ``now_ns`` (all windows with data if ``final``), merged and per rank.

        ``want(group)`` says whether rows of a group are to be built (default: every group); windows of the
        other groups are only counted (``skipped_windows``, ``skipped_rows``). Call :meth:`commit` with the
        result once the rows were dispatched.
        """
        self.refresh()
        result = ScanResult()
        self._pending = None
        self._pending_inc = {}
        self._pending_lost = 0
        table = self._current_table()
        if table.slots:
            self._scan_table(table, now_ns, final, want, result)
            result.dispatch_until_ns = (now_ns - self.grace_ns if not final else
                                        max((now_ns // w + 2) * w for w in table.window_lengths))
        for wns in table.window_lengths:
            due = ((now_ns - self.grace_ns) // wns + 1) * wns + self.grace_ns
            if wns > _LONG_NS:  # closed by count or by the writer's end too: looked at every LONG_POLL_MS
                due = min(due, now_ns + _LONG_POLL_NS)
            self._next_due[wns] = due
        self._pending_lost = result.overwritten
        return result

    # -- the vectorised pass ------------------------------------------------------------------------------------
    def _scan_table(self, t: SlotTable, now_ns: int, final: bool, want: Callable[[str], bool] | None,
                    result: ScanResult) -> None:
        """One pass over the table: the slots with a window to read, their candidate banks read at once, the
        windows lost to the ring counted, the found windows gathered (the slow path for the rest), then merged."""
        idx, newest = self._slots_to_read(t, now_ns, final)
        if not len(idx):
            return
        newest, after = newest[idx], t.after[idx]
        read = self._read_candidates(t, idx, newest, after)
        keep = (read.samples > 0) & (read.wid > after[read.pos]) & (read.wid <= newest[read.pos]) & ~read.slow[read.pos]
        found_pos, found_data, found_count = read.pos[keep], read.data[keep], read.samples[keep]
        found_grow = read.grow[keep]
        held_now = _held_now(len(idx), read, self.segment.geometry.banks)
        result.overwritten += self._lost_to_the_ring(after, newest, held_now, read.slow, self.segment.geometry.banks)
        adv = (newest > after) & ~read.slow  # read_slot's safe window is the newest closed one here
        pend_idx, pend_wid = [idx[adv]], [newest[adv]]
        result.windows_read += len(found_pos)
        wanted_group = np.array([want is None or bool(want(g)) for g in t.groups], bool)
        collected, skipped = self._gather(t, idx[found_pos], found_data, found_count, found_grow, wanted_group)
        held = self._read_slow_slots(t, idx, newest, read.slow, t.long[idx], now_ns, final, result, collected,
                                     skipped, pend_idx, pend_wid, wanted_group)
        pend_i, pend_w = np.concatenate(pend_idx), np.concatenate(pend_wid)
        if final and len(pend_i):  # (a restarted rank writes the windows after its slot's newest in this slot)
            pend_w = np.minimum(pend_w, np.maximum(t.after[pend_i], self._newest_held(t, pend_i)))
        self._finish(t, held, collected, skipped, pend_i, pend_w, now_ns, result, _Ring(idx, held_now, read.slow))

    def _newest_held(self, t: SlotTable, slot_idx: np.ndarray) -> np.ndarray:
        """Per slot: the newest window any of its banks holds. A last pass moves a watermark no further: moved to
        the window after ``now`` it would hide the windows the slot's next incarnation (a rank restarted, the same
        entry and stat) writes there from the next collector, neither emitted nor counted."""
        banks = self.segment.geometry.banks
        _first, data, _second = read_banks(self.segment, (t.row0[slot_idx][:, None] + np.arange(banks)).ravel())
        return data[:, L.B_WID].astype(np.int64).reshape(-1, banks).max(axis=1)

    def _slots_to_read(self, t: SlotTable, now_ns: int, final: bool) -> tuple[np.ndarray, np.ndarray]:
        """The table positions of the slots with a window to read now, and each slot's newest window that may be
        read (closed, or with data if ``final``). Long-window slots are read only when their writer closed one."""
        wns = t.wns
        if final:  # every window with data, the open one too: read_slot's ``at = (now // wns + 2) * wns + grace``
            newest = now_ns // wns + 1
            todo = (newest > t.after) | t.long
        else:
            newest = (now_ns - self.grace_ns) // wns - 1
            todo = (newest > t.after) | t.long
            for w in t.window_lengths:
                if now_ns < self._next_due.get(w, 0):
                    todo &= wns != w
        long_slots = np.flatnonzero(todo & t.long)
        if len(long_slots):  # only the long-window slots with a window closed past their watermark are read
            gone, inc = self._writers()
            li = long_slots
            todo[li] = long_slots_to_read(partial(read_banks, self.segment), self.segment.geometry.banks, t.row0[li],
                                          t.max_samples[li], t.after[li], t.after_inc[li], newest[li],
                                          gone[t.lr[li]], inc[t.lr[li]])
        return np.flatnonzero(todo), newest

    def _read_candidates(self, t: SlotTable, idx: np.ndarray, newest: np.ndarray, after: np.ndarray) -> _Candidates:
        """Read, in one vectorised copy, the banks that can hold a window in (after, newest] of each slot: bank
        ``w % K`` of each such ``w`` (all K once the gap reaches K; one bank per slot in steady state), and check
        each copy's seqlock words. A candidate bank that stays torn sends its slot to the slow path."""
        banks = self.segment.geometry.banks
        is_long = t.long[idx]
        depth = np.where(is_long, 0, np.minimum(newest - after, banks))
        parts = [np.flatnonzero(depth > d) for d in range(int(depth.max()))]
        pos = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        bank = np.concatenate([(newest[p] - d) % banks for d, p in enumerate(parts)]) if parts else pos
        grow = t.row0[idx[pos]] + bank  # bank numbers counted from BANK_BASE
        first, data, second = read_banks(self.segment, grow)
        ok, count = consistent_banks(first, data, second)
        slow = is_long.copy()  # slots left to read_slot (long windows; a bank stayed torn holding a candidate)
        wid = data[:, L.B_WID]
        if not ok.all():
            cand = (wid > after[pos]) & (wid <= newest[pos])
            retry = np.flatnonzero(~ok & cand)
            if len(retry):
                slow[retry_torn(self.segment, retry, grow, pos, data, count)] = True
        return _Candidates(pos, bank, grow, data, count, wid, slow)

    @staticmethod
    def _lost_to_the_ring(after: np.ndarray, newest: np.ndarray, bank_wid: np.ndarray, slow: np.ndarray,
                          banks: int) -> int:
        """Windows of (after, newest] whose bank already holds a later one (read_slot's count; every bank that can
        hold such a window was read: all K once the gap reaches K)."""
        counted = (after >= 0) & ~slow
        lost = 0
        for b in range(banks):  # the windows of (after, newest] in bank b older than what it holds
            hi = np.minimum(newest, bank_wid[:, b] - 1)
            n_b = (hi - b) // banks - (after - b) // banks
            lost += int(np.where(counted & (hi > after), n_b, 0).sum())
        return lost

    def _rank_of(self) -> np.ndarray:
        """Local rank -> global rank (a writer entry's is the rank it writes for)."""
        rank_of = np.zeros(self.segment.geometry.max_ranks, np.int64)
        for lr, info in self._infos.items():
            rank_of[lr] = info.rank
        return rank_of

    def _gather(self, t: SlotTable, slot_idx: np.ndarray, data: np.ndarray, count: np.ndarray, grow: np.ndarray,
                wanted_group: np.ndarray) -> tuple[list[Parts], list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """The found windows of the vectorised read: those of wanted groups as :class:`Parts` (histograms read),
        the others only as (key, window, rank), to be counted."""
        collected: list[Parts] = []
        skipped: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if not len(slot_idx):
            return collected, skipped
        rank_of = self._rank_of()
        wanted = wanted_group[t.group_id[slot_idx]]
        if not wanted.all():
            skip = ~wanted
            skipped.append((t.key_id[slot_idx[skip]], data[skip, L.B_WID], rank_of[t.lr[slot_idx[skip]]]))
            slot_idx, data, count, grow = slot_idx[wanted], data[wanted], count[wanted], grow[wanted]
        if len(slot_idx):
            collected.append(self._collect(t, slot_idx, data, count, grow, rank_of))
        return collected, skipped

    def _read_slow_slots(self, t: SlotTable, idx: np.ndarray, newest: np.ndarray, slow: np.ndarray,
                         is_long: np.ndarray, now_ns: int, final: bool, result: ScanResult, collected: list[Parts],
                         skipped: list[tuple[np.ndarray, np.ndarray, np.ndarray]], pend_idx: list[np.ndarray],
                         pend_wid: list[np.ndarray], wanted_group: np.ndarray) -> dict[int, int]:
        """The slots left to the slow path, one by one (:meth:`_read_python`); returns, per stat key, the first
        window a live writer's torn bank holds back (see :meth:`_hold_back`)."""
        banks = self.segment.geometry.banks
        held: dict[int, int] = {}
        for pos in np.flatnonzero(slow).tolist():
            i = int(idx[pos])
            safe_wid = self._read_python(t, i, now_ns, final, result, collected, skipped, pend_idx, pend_wid,
                                         wanted_group)
            if not is_long[pos] and safe_wid < int(newest[pos]) and int(newest[pos]) - safe_wid < banks - 2:
                kid = int(t.key_id[i])
                held[kid] = min(held.get(kid, safe_wid + 1), safe_wid + 1)
        return held

    def _finish(self, t: SlotTable, held: dict[int, int], collected: list[Parts],
                skipped: list[tuple[np.ndarray, np.ndarray, np.ndarray]], pend_i: np.ndarray, pend_w: np.ndarray,
                now_ns: int, result: ScanResult, ring: _Ring) -> None:
        """What a torn bank holds back and what the previous collector may have emitted left out, the watermarks
        to move kept for :meth:`advance`, the skipped windows counted, the rest merged into the pass's columns."""
        found = Parts.concat(collected) if collected else None
        if held:
            found, pend_w = self._hold_back(t, held, found, skipped, pend_i, pend_w, result)
        if found is not None and self.resume_ns:
            found = self._not_again(t, found, now_ns, result, ring)
        self._pending = (pend_i, pend_w)
        if skipped:
            ks, ws, rs = (np.concatenate([part[n] for part in skipped]) for n in range(3))
            result.skipped_windows += distinct(ks, ws)
            result.skipped_rows += distinct(ks, ws) + distinct(ks, ws, rs)  # a rank's writers: one row
        if found is not None and len(found.wid):
            result.columns = merge_parts(self.segment.job, found, t.stats, self.job_start_ns)

    def _writers(self) -> tuple[np.ndarray, np.ndarray]:
        """Per local rank: whether the entry's writer can write no more (exited, died, or its process is gone),
        and the entry's incarnation."""
        alive = pid_alive
        gone = np.ones(self.segment.geometry.max_ranks, bool)
        inc = np.zeros(self.segment.geometry.max_ranks, np.int64)
        for lr, info in self._infos.items():
            gone[lr] = info.state != RankState.ACTIVE or not alive(info.pid)
            inc[lr] = info.incarnation & (2**63 - 1)
        return gone, inc

    @staticmethod
    def _hold_back(t: SlotTable, held: dict[int, int], found: Parts | None,
                   skipped: list[tuple[np.ndarray, np.ndarray, np.ndarray]], pend_i: np.ndarray, pend_w: np.ndarray,
                   result: ScanResult) -> tuple[Parts | None, np.ndarray]:
        """A live writer stalled mid-add (torn bank) holds back, for every rank, the windows of its stat from the
        one it is writing on, so that each merged window is still emitted once and whole; stalls of K-2 windows
        or more are not waited for (the others' windows must not be overwritten meanwhile). Drops those windows
        from this pass and returns what is left and the watermarks clamped below them (never below where they
        were)."""
        first = np.full(len(t.keys), 1 << 62, np.int64)  # key id -> first window held back
        for kid, w in held.items():
            first[kid] = w
        if found is not None:
            drop = found.wid >= first[found.key]
            result.windows_read -= int(drop.sum())  # read again, and counted then
            result.torn -= int(found.torn[drop].sum())
            found = found.take(~drop)
        for n, (ks, ws, rs) in enumerate(skipped):
            keep = ws < first[ks]
            result.windows_read -= int((~keep).sum())
            skipped[n] = (ks[keep], ws[keep], rs[keep])
        limit = first[t.key_id[pend_i]] - 1
        return found, np.maximum(np.minimum(pend_w, limit), t.after[pend_i])

    def _not_again(self, t: SlotTable, found: Parts, now_ns: int, result: ScanResult, ring: _Ring) -> Parts:
        """Leave out the windows the previous collector may have emitted already (ended by the time it last
        dispatched, after its committed watermark: it died before it committed them) that the ring overwrote in
        one of their stat's writers: a slot of the stat read in this pass whose bank ``w % K`` holds window
        ``w + K`` or later. Emitted again they would be only the part of the window the other banks still hold (an
        exited worker's slot, say): a second, smaller row of a window the handlers may have whole. They are
        counted as overwritten instead. The others are emitted again whole, the same rows (the jsonl handler skips
        those it holds: :mod:`collector.handlers.jsonl`); whether they are old by the clock does not matter, a
        writer that paused has not reused the bank. A stat with a slot read the slow way (a bank stayed torn, a long
        window) shows no bank here: its windows are left out once a writer may have reused the bank by the clock."""
        wns = t.wns[found.slot]
        again = np.flatnonzero((found.wid + 1) * wns <= self.resume_ns)
        if not len(again):
            return found
        banks = self.segment.geometry.banks
        key, wid = found.key[again], found.wid[again]
        newest = np.full((len(t.keys), banks), _NO_WINDOW, np.int64)  # per stat and bank: the latest window held
        fast = ~ring.slow
        np.maximum.at(newest, t.key_id[ring.idx[fast]], ring.held_now[fast])
        unread = np.zeros(len(t.keys), bool)
        unread[t.key_id[ring.idx[ring.slow]]] = True
        by_clock = wid <= now_ns // wns[again] - banks + 1  # (a writer's clock may be in window w + K by now)
        lost = (newest[key, wid % banks] >= wid + banks) | (unread[key] & by_clock)
        risky = np.zeros(len(found.wid), bool)
        risky[again[lost]] = True
        if not risky.any():
            return found
        result.overwritten += int(risky.sum())
        result.windows_read -= int(risky.sum())
        return found.take(~risky)

    def _collect(self, t: SlotTable, slot_idx: np.ndarray, fdata: np.ndarray, fcount: np.ndarray, fgrow: np.ndarray,
                 rank_of: np.ndarray) -> Parts:
        """The found windows of the vectorised read as :class:`Parts` (histograms read for stats keeping them)."""
        n = len(slot_idx)
        sel = np.flatnonzero(t.hist[slot_idx] >= 0)
        hist = self._histograms(t, slot_idx[sel], fdata[sel], fgrow[sel])
        pieces = [(sel, hist)]
        need = sel[~hist.present]  # read again one by one
        if len(need):
            again = [read_window_hist(self.segment, t.slots[int(slot_idx[k])].desc, int(fdata[k, L.B_WID]),
                                      int(fcount[k])) for k in need.tolist()]
            pieces = [(sel[hist.present], hist[hist.present]), (need, HistBatch.from_histograms(again))]
        f = fdata.view(L.FLOAT_WORD_DTYPE)
        return Parts(t.key_id[slot_idx], rank_of[t.lr[slot_idx]], slot_idx, fdata[:, L.B_WID], fcount,
                     f[:, L.B_SUM], f[:, L.B_MIN], f[:, L.B_MAX], f[:, L.B_LAST], fdata[:, L.B_TS],
                     np.zeros(n, bool), HistBatch.assemble(n, pieces))

    def _histograms(self, t: SlotTable, slot_idx: np.ndarray, fdata: np.ndarray, fgrow: np.ndarray) -> HistBatch:
        """The histograms of found windows of stats that keep percentiles (one row each), read in one vectorised
        pass (:func:`read_histograms`); a row without one is to be read again."""
        geo = self.segment.geometry
        wid = fdata[:, L.B_WID]
        hist_off = geo.hist_base + ((t.lr[slot_idx] * geo.hist_slots + t.hist[slot_idx]) * geo.banks
                                    + wid % geo.banks) * L.HIST_SIZE
        bank_off = geo.bank_base + fgrow * L.BANK_SIZE
        return read_histograms(self.segment.buf, geo, hist_off, bank_off, fdata[:, L.B_SEQ], wid)

    def _read_python(self, t: SlotTable, i: int, now_ns: int, final: bool, result: ScanResult,
                     collected: list[Parts], skipped: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                     pend_idx: list[np.ndarray],
                     pend_wid: list[np.ndarray], wanted_group: np.ndarray) -> int:
        """One slot the slow way (a bank stayed torn): :meth:`SegmentReader.read_slot` decides. Returns the
        newest window of the slot that is settled (emitted now or before)."""
        slot = t.slots[i]
        desc, after = slot.desc, int(t.after[i])
        wns = desc.window_ns
        at = now_ns if not final else (now_ns // wns + 2) * wns + self.grace_ns
        info = self._infos[desc.local_rank]
        alive = False if info.state == RankState.DIED else None
        read = self.reader.read_slot(info, desc, at, self.grace_ns, after, writer_alive=alive,
                                     after_inc=int(t.after_inc[i]))
        if desc.is_long:  # which incarnation the slot's newest settled window is of, once committed
            at_safe = [w.incarnation for w in read.windows if w.wid == read.safe_wid]
            if at_safe:
                self._pending_inc[i] = at_safe[-1] & (2**63 - 1)  # (u64 in the bank: garbage may be larger)
            elif read.safe_wid > after:
                self._pending_inc[i] = -1
        result.overwritten += read.overwritten
        wanted = bool(wanted_group[t.group_id[i]])
        for w in read.windows:
            result.windows_read += 1
            result.torn += w.torn
            if wanted:
                collected.append(Parts(
                    t.key_id[i:i + 1], np.array([info.rank], np.int64), np.array([i], np.int64),
                    np.array([w.wid], np.int64), np.array([w.count], np.int64), np.array([w.sum], np.float64),
                    np.array([w.min], np.float64), np.array([w.max], np.float64), np.array([w.last], np.float64),
                    np.array([w.last_ts], np.int64), np.array([w.torn], bool),
                    HistBatch.from_histograms([w.hist])))
            else:
                skipped.append((np.array([t.key_id[i]], np.int64), np.array([w.wid], np.int64),
                                np.array([info.rank], np.int64)))
        if read.safe_wid > after:
            pend_idx.append(np.array([i], np.int64))
            pend_wid.append(np.array([read.safe_wid], np.int64))
        return read.safe_wid

    def commit(self) -> None:
        """Record in the segment, at once, that the last scan's windows were emitted (:meth:`advance`, then
        :meth:`DurableMarks.write`)."""
        self.advance().write(self.segment)

    def advance(self) -> DurableMarks:
        """Move the in-memory watermarks past the last scan's windows (the next scan never returns them) and
        return what is still to be written into the segment, which a collector does only once every handler
        took the pass (:mod:`collector.daemon.commits`): a collector that dies before re-emits it when restarted."""
        pending, self._pending = self._pending, None
        pending_inc, self._pending_inc = self._pending_inc, {}
        lost, self._pending_lost = self._pending_lost, 0
        t = self._table
        if t is not None and pending_inc:
            t.after_inc[list(pending_inc)] = list(pending_inc.values())
        if pending is None or t is None or not len(pending[0]):
            if t is not None and pending_inc and self._dirty:
                t.sync_back()
            return DurableMarks(np.zeros(0, np.int64), np.zeros(0, np.int64), lost)
        which, wids = pending
        t.after[which] = wids
        if self._dirty:  # slots were added since the scan: the next table is built from the slot objects
            t.sync_back()
        return DurableMarks(t.emitted_word[which], np.asarray(wids, np.int64), lost)


# ---- The slots the scanner knows ----
# The scanner's table of known slots: each slot's descriptor and watermark, and all of them as NumPy arrays in a
# fixed order (what the vectorised pass computes on), with the merge key that makes slots of several ranks one stat.


class MergeKey(NamedTuple):
    """What makes slots of several ranks one stat that merges across ranks (max_samples may differ)."""

    group: str
    name: str
    window_ms: int
    agg_mask: int


@dataclass
class Slot:
    """One known slot of the segment: its descriptor and its watermark (the newest window emitted)."""

    desc: StatDescriptor
    after_wid: int
    after_inc: int = -1
    """Long windows: the incarnation that wrote window ``after_wid`` when it was emitted (-1: unknown)."""


class SlotTable:
    """The known slots as arrays, in a fixed order (rebuilt when slots are added)."""

    def __init__(self, slots: list[Slot], geometry: L.Geometry) -> None:
        self.slots = slots
        n = len(slots)
        banks = geometry.banks
        lr = np.fromiter((s.desc.local_rank for s in slots), np.int64, n)
        si = np.fromiter((s.desc.index for s in slots), np.int64, n)
        self.lr = lr
        self.row0 = (lr * geometry.max_stats + si) * banks  # first bank of each slot, counted from BANK_BASE
        self.emitted_word = (geometry.desc_base + (lr * geometry.max_stats + si) * L.DESC_SIZE + L.D_EMITTED) // 8
        self.wns = np.fromiter((s.desc.window_ns for s in slots), np.int64, n)
        self.long = np.fromiter((s.desc.is_long for s in slots), bool, n)
        """Slots of windows over an hour: read one by one, they also close by count and by their writer's end."""
        self.max_samples = np.fromiter((s.desc.max_samples for s in slots), np.int64, n)
        self.hist = np.fromiter((s.desc.hist for s in slots), np.int64, n)
        """Each slot's histogram index in its rank's table (-1: the stat keeps no percentiles)."""
        self.after = np.fromiter((s.after_wid for s in slots), np.int64, n)
        self.after_inc = np.fromiter((s.after_inc for s in slots), np.int64, n)
        keys: dict[MergeKey, int] = {}
        self.keys = keys
        """Merge key -> its id in :attr:`key_id`."""
        groups: dict[str, int] = {}
        merge_keys = [MergeKey(s.desc.group, s.desc.name, s.desc.window_ms, s.desc.agg_mask) for s in slots]
        self.key_id = np.fromiter((keys.setdefault(k, len(keys)) for k in merge_keys), np.int64, n)
        self.group_id = np.fromiter((groups.setdefault(s.desc.group, len(groups)) for s in slots), np.int64, n)
        first_slot: dict[MergeKey, int] = {}  # the first slot of a stat: its descriptor's flags speak for the stat
        for i, k in enumerate(merge_keys):
            first_slot.setdefault(k, i)
        order = np.empty(len(keys), np.int64)
        order[[keys[k] for k in sorted(keys)]] = np.arange(len(keys))
        self.stats = StatTable(
            np.array([k.group for k in keys] + [None], object)[:-1],
            np.array([k.name for k in keys] + [None], object)[:-1],
            np.array([k.window_ms for k in keys], np.int64).reshape(-1),
            np.array([k.agg_mask for k in keys], np.int64).reshape(-1),
            np.array([slots[first_slot[k]].desc.higher_is_better for k in keys], bool).reshape(-1),
            np.array([bool(k.agg_mask & PERCENTILE_MASK) for k in keys], bool).reshape(-1), order,
            np.array([slots[first_slot[k]].desc.wait for k in keys], bool).reshape(-1),
        )
        """The stats, by key id (for :func:`collector.read.columns.merge_parts`)."""
        self.groups = list(groups)
        self.window_lengths = sorted(set(self.wns.tolist()))

    def sync_back(self) -> None:
        """Write the array watermarks back into the slot objects (before the table is rebuilt)."""
        for slot, after, inc in zip(self.slots, self.after.tolist(), self.after_inc.tolist(), strict=True):
            slot.after_wid, slot.after_inc = after, inc


_NO_WINDOW = np.iinfo(np.int64).min // 2
"""A bank not read (halved: window arithmetic on it does not overflow)."""


def _held_now(n: int, read: _Candidates, banks: int) -> np.ndarray:
    """Per slot read (``n``) and bank: the window the bank held when read (:data:`_NO_WINDOW` if not read)."""
    bank_wid = np.full((n, banks), _NO_WINDOW, np.int64)
    bank_wid[read.pos, read.bank] = np.maximum(read.wid, _NO_WINDOW)
    return bank_wid


class _Ring(NamedTuple):
    """What one pass saw of its slots' rings: which slots (table positions), the window each bank held, and
    which slots were read the slow way (their banks not known here)."""

    idx: np.ndarray
    held_now: np.ndarray
    slow: np.ndarray


class _Candidates(NamedTuple):
    """The candidate banks one pass read (:meth:`Scanner._read_candidates`), one entry per bank read."""

    pos: np.ndarray
    """The position, among the slots read, of each bank's slot."""
    bank: np.ndarray
    grow: np.ndarray
    """Bank numbers counted from the segment's first bank."""
    data: np.ndarray
    samples: np.ndarray
    wid: np.ndarray
    slow: np.ndarray
    """Per slot read (not per bank): left to the slow path."""


# ---- What a pass produced ----
# What one pass of :class:`Scanner` produced (:class:`ScanResult`), the watermarks it leaves to write into the
# segment (:class:`DurableMarks`), and the count of distinct rows its counters are computed with.


@dataclass
class ScanResult:
    """What one pass produced: its rows as :class:`Columns` (window order, merged row first, then one per rank)
    and counters; :attr:`rows` gives the same rows as :class:`WindowRow` objects (built on first use).

    ``skipped_windows`` / ``skipped_rows``: merged windows / rows (merged and per rank) of groups the caller's
    ``want`` declined; they were read, counted and are committed like the others, but never built.
    """

    columns: Columns = field(default_factory=lambda: Columns.empty(""))
    dispatch_until_ns: int = 0
    """Windows ended by this wall-clock ns may be in this pass (see :meth:`Segment.set_dispatched`)."""
    windows_read: int = 0
    overwritten: int = 0
    torn: int = 0
    skipped_windows: int = 0
    skipped_rows: int = 0
    _rows: list[WindowRow] | None = field(default=None, repr=False)

    @property
    def rows(self) -> list[WindowRow]:
        """The rows as :class:`WindowRow` objects (built from :attr:`columns` once, on first use)."""
        if self._rows is None:
            self._rows = self.columns.to_rows()
        return self._rows


def distinct(*columns: np.ndarray) -> int:
    """Number of distinct rows of equally long integer columns."""
    if not len(columns[0]):
        return 0
    order = np.lexsort(columns[::-1])
    change = np.zeros(len(order) - 1, bool)
    for col in columns:
        c = col[order]
        change |= c[1:] != c[:-1]
    return 1 + int(change.sum())


_COUNT_MAX = (1 << 63) - 1
"""The most a count word of the segment holds."""


class DurableMarks(NamedTuple):
    """Watermarks of one pass still to be written into the segment: ``emitted_wid`` words and their values, and
    the windows the pass found lost to the ring (before those watermarks)."""

    words: np.ndarray
    """Indices of the descriptors' ``emitted_wid`` words, counted in 8-byte words from the segment's start."""
    wids: np.ndarray
    lost: int = 0
    """Windows lost to the ring that these watermarks move past: added to the header's ``overwritten`` with them."""

    def then(self, later: DurableMarks) -> DurableMarks:
        """These watermarks followed by ``later``'s: one set, the later value of each word kept (watermarks only
        move forward, so that is the larger one), the windows lost of both."""
        words, wids = np.concatenate([self.words, later.words]), np.concatenate([self.wids, later.wids])
        order = np.lexsort((wids, words))
        words, wids = words[order], wids[order]
        last = np.ones(len(words), bool)
        last[:-1] = words[1:] != words[:-1]
        return DurableMarks(words[last], wids[last], self.lost + later.lost)

    def write(self, segment: Segment) -> None:
        """Write the watermarks into ``segment`` (a restarted collector resumes after them), and add the windows
        lost to the header's count in the same store: counted once the watermark moved past them, never before (a
        collector killed in between would leave them to the next one, which counts them again) nor after."""
        if not len(self.words) and not self.lost:
            return
        buf = segment.buf
        words = np.frombuffer(buf, L.WORD_DTYPE, len(buf) // 8)
        try:
            at, values = self.words, self.wids
            if self.lost:
                # saturated: garbage window ids in a hostile segment can make the count pass what a word holds
                total = min(max(int(words[L.H_OVERWRITTEN // 8]), 0) + self.lost, _COUNT_MAX)
                at = np.append(at, L.H_OVERWRITTEN // 8)
                values = np.append(values.astype(np.int64), np.int64(total))
            words[at] = values
        finally:
            del words
