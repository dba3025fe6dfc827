"""The segment's banks read in bulk, the seqlock reads of the scanner's pass
(:class:`collector.read.scanner.Scanner`): many banks at once (:func:`read_banks`, checked by
:func:`consistent_banks`), those found torn again one by one (:func:`retry_torn`), one window's histogram with its
bank (:func:`read_window_hist`), the cheap look at long-window slots (:func:`long_slots_to_read`) and many windows'
histograms at once (:func:`read_histograms`). They hold no scanner state: each reads the segment it is given. The
bytes are those of :mod:`shmstat.shm.layout` (offsets, word indices and NumPy dtypes from there); one bank or
histogram is decoded by :mod:`shmstat.shm.layout_codec`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shmstat.histogram import MAX_SCALE, MIN_SCALE, Histogram
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.layout_records import StatDescriptor
from shmstat.shm.segment import Segment

from .hist_batch import HistBatch

__all__ = ["consistent_banks", "long_slots_to_read", "read_banks", "read_histograms", "read_window_hist",
           "retry_torn"]

_WORDS = L.BANK_WORDS


def read_banks(segment: Segment, grow: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, wid) of the banks numbered ``grow``, then those banks whole, then (seq, wid) again: three
    copies out of the segment, in this order (the seqlock reader's order, for all banks at once)."""
    geo = segment.geometry
    view = np.frombuffer(segment.buf, L.WORD_DTYPE, geo.max_ranks * geo.max_stats * geo.banks * _WORDS,
                         geo.bank_base).reshape(-1, _WORDS)
    try:
        first = view[grow, :2]
        data = view[grow]
        second = view[grow, :2]
    finally:
        del view  # no array may keep the mapping exported (the segment must stay closable)
    return first, data, second


def consistent_banks(first: np.ndarray, data: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The seqlock check of the copies :func:`read_banks` made, for every bank at once: whether each copy is
    consistent (both ``(seq, wid)`` gathers and the copy agree and ``seq`` is even), and the samples it holds.

    A bank whose ``seq`` no writer can produce (NaN, negative, 2**62 or more: garbage written into the segment) is
    consistent and empty: it holds no window, and it is never read again (no retry can make it consistent, and a
    live writer's bank that stays torn would hold its stat's windows back pass after pass).
    """
    seq_bits = data[:, L.B_SEQ]
    seq = seq_bits.view(L.FLOAT_WORD_DTYPE)
    with np.errstate(invalid="ignore"):
        sane = (seq >= 0) & (seq < 2.0**62)  # not NaN, not negative, not absurd: what a writer can produce
    count = np.where(sane, seq, 0.0).astype(np.int64)
    ok = ~sane | (
        (first[:, 0] == second[:, 0]) & (first[:, 1] == second[:, 1]) & (first[:, 0] == seq_bits)
        & (first[:, 1] == data[:, L.B_WID]) & ((count & 1) == 0)
    )
    return ok, count >> 1


def retry_torn(segment: Segment, retry: np.ndarray, grow: np.ndarray, pos: np.ndarray, data: np.ndarray,
               count: np.ndarray) -> list[int]:
    """Read the banks ``retry`` (indices into the copies of :func:`read_banks`) again one by one, updating
    ``data``/``count`` in place; returns the slot positions whose bank stayed torn."""
    buf, base = segment.buf, segment.geometry.bank_base
    stuck: set[int] = set()
    for j in retry.tolist():
        snap = codec.read_bank(buf, base + int(grow[j]) * L.BANK_SIZE)
        if snap.torn or not 0 <= snap.count < 2**61:
            stuck.add(int(pos[j]))
            continue
        row = data[j]
        f = row.view(L.FLOAT_WORD_DTYPE)
        row[L.B_WID], row[L.B_TS] = snap.wid, snap.last_ts
        f[L.B_SEQ], f[L.B_SUM], f[L.B_MIN], f[L.B_MAX], f[L.B_LAST] = (
            2.0 * snap.count, snap.sum, snap.min, snap.max, snap.last)
        count[j] = snap.count
    return sorted(stuck)


def read_window_hist(segment: Segment, d: StatDescriptor, wid: int, count: int) -> Histogram | None:
    """The histogram of window ``wid`` of a slot, read with its bank under the bank's seqlock; None if the
    bank no longer holds that window as it was read (overwritten since: reported without percentiles)."""
    geo = segment.geometry
    bank = wid % geo.banks
    snap = codec.read_bank(segment.buf, geo.slot_offset(d.local_rank, d.index) + bank * L.BANK_SIZE,
                           hist_offset=geo.hist_offset(d.local_rank, d.hist) + bank * L.HIST_SIZE)
    if snap.torn or snap.wid != wid or snap.count != count:
        return None
    return snap.hist


# ---- Long windows ----
# Which slots of windows over an hour have something to read: the scanner's cheap look before its slow read. A
# window longer than :data:`shmstat.shm.layout.LONG_WINDOW_MS` also closes, for each writer, when the writer filled
# it (``max_samples``), moved to a later window, or ended (:mod:`shmstat.shm.layout`). The scanner looks every
# ``LONG_POLL_MS``; reading every long slot one by one each time would cost ~80 µs per slot (a node with thousands
# of them would spend its time there), so all their banks' ``(seq, wid)`` words are gathered at once and only the
# slots with a window closed past their watermark go on to :meth:`shmstat.shm.reader.SegmentReader.read_slot`, which
# decides by the same rules. A bank torn at that instant reads as not full: the slot is looked at again next poll.


_MIN = np.iinfo(np.int64).min


def long_slots_to_read(read_banks: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]], banks: int,
                       row0: np.ndarray, max_samples: np.ndarray, after: np.ndarray, after_inc: np.ndarray,
                       newest: np.ndarray, gone: np.ndarray, entry_inc: np.ndarray) -> np.ndarray:
    """For long-window slots (first bank ``row0``, ``max_samples``, watermark ``after`` written by incarnation
    ``after_inc``, newest window closed on the wall clock ``newest``, writer ``gone``, entry incarnation
    ``entry_inc``): whether each has a closed window past its watermark, or its watermark window re-written by a
    restarted rank (see :meth:`shmstat.shm.reader.SegmentReader.read_slot`).

    ``read_banks(rows)`` is the scanner's seqlock gather: ``(seq, wid)`` words, the banks, ``(seq, wid)`` again.
    """
    m = len(row0)
    if not m:
        return np.zeros(0, bool)
    first, data, second = read_banks((row0[:, None] + np.arange(banks)).ravel())
    ok, count = consistent_banks(first, data, second)
    wid = data[:, L.B_WID].reshape(m, banks)
    rows = np.arange(m)
    top_bank = wid.argmax(axis=1)
    top = wid[rows, top_bank]
    top_at = rows * banks + top_bank
    full = ok[top_at] & (count[top_at] >= max_samples)
    # a writer never goes back to an older window: all but its newest are closed, that one too when full or gone
    closed = np.maximum(np.where(gone | full, top, np.maximum(top, _MIN + 1) - 1), newest)
    top_inc = data[:, L.B_INC][top_at] & np.int64(2**63 - 1)
    reopened = (after_inc >= 0) & (top == after) & (top_inc != after_inc) & (top_inc == entry_inc) & (top_inc != 0)
    return (closed > after) | (reopened & (closed >= after))


# ---- Reading histograms ----
# Reading the histograms of many windows at once (the scanner's pass over stats that keep percentiles). The banks of
# the pass were already copied and checked (see the module's docstring); here the histograms of those banks
# are gathered in one NumPy copy, then every bank's ``(seq, wid)`` is gathered again: a histogram is accepted only
# when its bank still holds the same ``seq`` and ``wid`` as the copy the window was read from, which is the seqlock
# reader of :mod:`shmstat.shm.layout` (bank, histogram, then ``seq``/``wid`` again) for all banks at once. The
# result is a :class:`collector.read.hist_batch.HistBatch` (no Python object per window). Headers a writer cannot
# produce and banks that changed meanwhile are left to the caller's one-by-one read
# (:func:`shmstat.shm.layout_codec.read_bank` with the histogram), which decides as for any bank.


_M = L.HIST_BUCKETS
_BLOCK_WORDS = L.HIST_SIZE // 4
_COUNTS_FROM = L.HIST_COUNTS // 4
_HEAD_WORDS = L.HI_NEG_INF // 4 + 2  # the header's 8-byte fields, as 4-byte words
assert L.HIST_COUNTS % 8 == 0 and L.HIST_SIZE % 8 == 0  # the counts are also read as 64-bit words


def read_histograms(buf: memoryview, geometry: L.Geometry, hist_off: np.ndarray, bank_off: np.ndarray,
                    seq_bits: np.ndarray, wid: np.ndarray) -> HistBatch:
    """The histograms at byte offsets ``hist_off`` of the banks at ``bank_off`` whose checked copy had
    ``seq_bits`` (the seq word's 64 bits) and ``wid``, one row each; a row without one (``present`` False) is
    the caller's to read again."""
    if not len(hist_off):
        return HistBatch.empty(0)
    nblocks = geometry.max_ranks * geometry.hist_slots * geometry.banks
    blocks = np.frombuffer(buf, L.HIST_COUNT_DTYPE, nblocks * _BLOCK_WORDS, geometry.hist_base)
    words = np.frombuffer(buf, L.WORD_DTYPE, len(buf) // 8)
    try:  # whole blocks by row (one memcpy each), not element by element
        raw = blocks.reshape(-1, _BLOCK_WORDS)[(hist_off - geometry.hist_base) // L.HIST_SIZE]
        again = words[(bank_off // 8)[:, None] + np.array([L.B_SEQ, L.B_WID])]
    finally:
        del words, blocks  # no array may keep the mapping exported (the segment must stay closable)
    heads = raw[:, :_HEAD_WORDS].copy().view(L.WORD_DTYPE)
    counts = raw[:, _COUNTS_FROM:_COUNTS_FROM + 2 * _M]  # the positive ring, then the negative
    scale, zero = heads[:, L.HI_SCALE // 8], heads[:, L.HI_ZERO // 8]
    pos_lo, pos_hi = heads[:, L.HI_POS_LO // 8], heads[:, L.HI_POS_HI // 8]
    neg_lo, neg_hi = heads[:, L.HI_NEG_LO // 8], heads[:, L.HI_NEG_HI // 8]
    pos_inf, neg_inf = heads[:, L.HI_POS_INF // 8], heads[:, L.HI_NEG_INF // 8]
    with np.errstate(over="ignore"):  # a span past 2**63 wraps negative: refused like any span over M
        pos_span, neg_span = pos_hi - pos_lo, neg_hi - neg_lo
    sane = ((scale >= MIN_SCALE) & (scale <= MAX_SCALE) & (zero >= 0) & (pos_inf >= 0) & (neg_inf >= 0)
            & ((pos_lo > pos_hi) | ((pos_span >= 0) & (pos_span < _M)))
            & ((neg_lo > neg_hi) | ((neg_span >= 0) & (neg_span < _M))))
    ok = sane & (again[:, 0] == seq_bits) & (again[:, 1] == wid)
    # non-zero counts found two at a time (as 64-bit words), then split
    found = np.flatnonzero(raw.view(np.uint64))  # the whole copy at once (headers too, dropped just below)
    rows, pairs = np.divmod(found, _BLOCK_WORDS // 2)
    mine = (pairs >= _COUNTS_FROM // 2) & ok[rows]
    rows, pairs = rows[mine], pairs[mine] - _COUNTS_FROM // 2
    rows, cols = np.repeat(rows, 2), (2 * pairs[:, None] + (0, 1)).ravel()
    values = counts[rows, cols]
    keep = values != 0
    rows, cols, values = rows[keep], cols[keep], values[keep]
    negative = cols >= _M
    position = cols % _M
    lo = np.where(negative, neg_lo[rows], pos_lo[rows])
    index = lo + (position - lo) % _M  # the one index in [lo, lo + M) stored at that position of the ring
    return HistBatch(ok, np.where(ok, scale, 0), np.where(ok, zero, 0), rows, negative, index,
                     values.astype(np.int64), np.where(ok, pos_inf, 0), np.where(ok, neg_inf, 0))
