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
banks are in :mod:`collector.read.bank_reads`); a slot whose bank stays torn goes through
:meth:`shmstat.shm.reader.SegmentReader.read_slot`, which decides by the writer's liveness. Everything else (which
windows are closed and new, how far a slot's watermark may move, windows lost to a ring that wrapped) is computed on
the arrays with exactly ``read_slot``'s rules (``tests/collector/test_scanner_vectorised.py`` checks that), and only
the windows of groups someone consumes become Python objects: :meth:`Scanner.scan` takes ``want(group)``, and the
windows of other groups (a null handler, no subscriber) are counted and committed but never built. A pass over 64k
slots takes ~8 ms.

Slots of windows over an hour (:attr:`shmstat.shm.layout_records.StatDescriptor.is_long`) are looked at every
``LONG_POLL_MS``: their windows also close, per writer, by ``max_samples`` and by the writer's end
(:mod:`shmstat.shm.layout`), so they are not left waiting for a wall-clock end days away. One gather over their banks
finds those with such a window (:mod:`collector.read.long_windows`); only these are read one by one with ``read_slot``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from shmstat.shm import layout as L
from shmstat.shm.layout import RankState
from shmstat.shm.layout_records import RankInfo
from shmstat.shm.reader import SegmentReader
from shmstat.shm.segment import Segment, pid_alive

from .bank_reads import read_banks, read_hist, retry_torn
from .column_merge import Parts, merge_parts
from .hist_batch import HistBatch
from .hist_reader import read_histograms
from .long_windows import long_slots_to_read
from .scan_result import DurableMarks, ScanResult, distinct
from .slot_table import MergeKey, Slot, SlotTable

__all__ = ["DurableMarks", "MergeKey", "ScanResult", "Scanner"]  # all but Scanner: defined in slot_table, scan_result

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
        table = self._current_table()
        if table.slots:
            self._scan_table(table, now_ns, final, want, result)
        for wns in table.window_lengths:
            due = ((now_ns - self.grace_ns) // wns + 1) * wns + self.grace_ns
            if wns > _LONG_NS:  # closed by count or by the writer's end too: looked at every LONG_POLL_MS
                due = min(due, now_ns + _LONG_POLL_NS)
            self._next_due[wns] = due
        return result

    # -- the vectorised pass ------------------------------------------------------------------------------------
    def _scan_table(self, t: SlotTable, now_ns: int, final: bool, want: Callable[[str], bool] | None,
                    result: ScanResult) -> None:
        banks = self.segment.geometry.banks
        wns = t.wns
        # Long-window slots go the slow way (read_slot decides which of their windows the writer closed).
        if final:  # every window with data, the open one too: read_slot's ``at = (now // wns + 2) * wns + grace``
            newest = now_ns // wns + 1
            todo = (newest > t.after) | t.long
        else:
            newest = (now_ns - self.grace_ns) // wns - 1
            todo = (newest > t.after) | t.long
            for w in t.window_lengths:
                if now_ns < self._next_due.get(w, 0):
                    todo &= wns != w
        li = np.flatnonzero(todo & t.long)
        if len(li):  # only the long-window slots with a window closed past their watermark are read
            gone, inc = self._writers()
            todo[li] = long_slots_to_read(partial(read_banks, self.segment), banks, t.row0[li], t.max_samples[li],
                                          t.after[li], t.after_inc[li], newest[li], gone[t.lr[li]], inc[t.lr[li]])
        idx = np.flatnonzero(todo)
        if not len(idx):
            return
        newest, after = newest[idx], t.after[idx]
        n = len(idx)
        # The banks that can hold a window in (after, newest]: bank w % K of each such w (all K once the gap
        # reaches K). In steady state that is one bank per slot.
        is_long = t.long[idx]
        depth = np.where(is_long, 0, np.minimum(newest - after, banks))
        parts = [np.flatnonzero(depth > d) for d in range(int(depth.max()))]
        pos = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        bank = np.concatenate([(newest[p] - d) % banks for d, p in enumerate(parts)]) if parts else pos
        grow = t.row0[idx[pos]] + bank  # bank numbers counted from BANK_BASE
        first, data, second = read_banks(self.segment, grow)
        seq_bits = data[:, L.B_SEQ]
        seq = seq_bits.view(np.float64)
        with np.errstate(invalid="ignore"):
            sane = (seq >= 0) & (seq < 2.0**62)  # not NaN, not negative, not absurd: what a writer can produce
        count = np.where(sane, seq, 0.0).astype(np.int64)  # a bank of garbage reads as empty
        ok = ~sane | (
            (first[:, 0] == second[:, 0]) & (first[:, 1] == second[:, 1]) & (first[:, 0] == seq_bits)
            & (first[:, 1] == data[:, L.B_WID]) & ((count & 1) == 0)
        )
        count >>= 1
        slow = is_long.copy()  # slots left to read_slot (long windows; a bank stayed torn holding a candidate)
        wid = data[:, L.B_WID]
        if not ok.all():
            cand = (wid > after[pos]) & (wid <= newest[pos])
            retry = np.flatnonzero(~ok & cand)
            if len(retry):
                slow[retry_torn(self.segment, retry, grow, pos, data, count)] = True
        keep = (count > 0) & (wid > after[pos]) & (wid <= newest[pos]) & ~slow[pos]
        fs, fdata, fcount = pos[keep], data[keep], count[keep]  # found windows: slot position, bank, count
        fgrow = grow[keep]
        # windows whose bank already holds a later one, read_slot's count over (after, safe] (every bank holding
        # such a window was read above: all K once the gap reaches K)
        safe = newest
        bank_wid = np.full((n, banks), np.iinfo(np.int64).min // 2, np.int64)  # (halved: no overflow below)
        bank_wid[pos, bank] = np.maximum(wid, np.iinfo(np.int64).min // 2)
        counted = (after >= 0) & ~slow
        for b in range(banks):  # the windows of (after, safe] in bank b older than what it holds (windows_of_bank)
            hi = np.minimum(safe, bank_wid[:, b] - 1)
            n_b = (hi - b) // banks - (after - b) // banks
            result.overwritten += int(np.where(counted & (hi > after), n_b, 0).sum())
        adv = (safe > after) & ~slow
        pend_idx, pend_wid = [idx[adv]], [safe[adv]]
        result.windows_read += len(fs)
        collected: list[Parts] = []
        skipped: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        wanted_group = np.array([want is None or bool(want(g)) for g in t.groups], bool)
        rank_of = np.zeros(self.segment.geometry.max_ranks, np.int64)  # local rank -> global rank
        for lr, info in self._infos.items():
            rank_of[lr] = info.rank
        if len(fs):
            wanted = wanted_group[t.group_id[idx[fs]]]
            if not wanted.all():
                skip = ~wanted
                skipped.append((t.key_id[idx[fs[skip]]], fdata[skip, L.B_WID], rank_of[t.lr[idx[fs[skip]]]]))
                fs, fdata, fcount, fgrow = fs[wanted], fdata[wanted], fcount[wanted], fgrow[wanted]
            if len(fs):
                collected.append(self._collect(t, idx[fs], fdata, fcount, fgrow, rank_of))
        held: dict[int, int] = {}  # key id -> first window a live writer's torn bank holds back
        for pos in np.flatnonzero(slow).tolist():
            i = int(idx[pos])
            safe_wid = self._read_python(t, i, now_ns, final, result, collected, skipped, pend_idx, pend_wid,
                                         wanted_group)
            if not is_long[pos] and safe_wid < int(newest[pos]) and int(newest[pos]) - safe_wid < banks - 2:
                kid = int(t.key_id[i])
                held[kid] = min(held.get(kid, safe_wid + 1), safe_wid + 1)
        pend_i, pend_w = np.concatenate(pend_idx), np.concatenate(pend_wid)
        found = Parts.concat(collected) if collected else None
        if held:
            found, pend_w = self._hold_back(t, held, found, skipped, pend_i, pend_w, result)
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

    def _collect(self, t: SlotTable, slot_idx: np.ndarray, fdata: np.ndarray, fcount: np.ndarray, fgrow: np.ndarray,
                 rank_of: np.ndarray) -> Parts:
        """The found windows of the vectorised read as :class:`Parts` (histograms read for stats keeping them)."""
        n = len(slot_idx)
        sel = np.flatnonzero(t.hist[slot_idx] >= 0)
        hist = self._histograms(t, slot_idx[sel], fdata[sel], fgrow[sel])
        pieces = [(sel, hist)]
        need = sel[~hist.present]  # read again one by one
        if len(need):
            again = [read_hist(self.segment, t.slots[int(slot_idx[k])].desc, int(fdata[k, L.B_WID]), int(fcount[k]))
                     for k in need.tolist()]
            pieces = [(sel[hist.present], hist[hist.present]), (need, HistBatch.from_histograms(again))]
        f = fdata.view(np.float64)
        return Parts(t.key_id[slot_idx], rank_of[t.lr[slot_idx]], slot_idx, fdata[:, L.B_WID], fcount,
                     f[:, L.B_SUM], f[:, L.B_MIN], f[:, L.B_MAX], f[:, L.B_LAST], fdata[:, L.B_TS],
                     np.zeros(n, bool), HistBatch.assemble(n, pieces))

    def _histograms(self, t: SlotTable, slot_idx: np.ndarray, fdata: np.ndarray, fgrow: np.ndarray) -> HistBatch:
        """The histograms of found windows of stats that keep percentiles (one row each), read in one vectorised
        pass (:func:`collector.read.hist_reader.read_histograms`); a row without one is to be read again."""
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
                    t.key_id[i:i + 1], np.array([w.rank], np.int64), np.array([i], np.int64),
                    np.array([w.wid], np.int64), np.array([w.count], np.int64), np.array([w.sum], np.float64),
                    np.array([w.min], np.float64), np.array([w.max], np.float64), np.array([w.last], np.float64),
                    np.array([w.last_ts], np.int64), np.array([w.torn], bool),
                    HistBatch.from_histograms([w.hist])))
            else:
                skipped.append((np.array([t.key_id[i]], np.int64), np.array([w.wid], np.int64),
                                np.array([w.rank], np.int64)))
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
        t = self._table
        if t is not None and pending_inc:
            t.after_inc[list(pending_inc)] = list(pending_inc.values())
        if pending is None or t is None or not len(pending[0]):
            if t is not None and pending_inc and self._dirty:
                t.sync_back()
            return DurableMarks(np.zeros(0, np.int64), np.zeros(0, np.int64))
        which, wids = pending
        t.after[which] = wids
        if self._dirty:  # slots were added since the scan: the next table is built from the slot objects
            t.sync_back()
        return DurableMarks(t.emitted_word[which], np.asarray(wids, np.int64))

