"""Reading the histograms of many windows at once (the scanner's pass over stats that keep percentiles).

The banks of the pass were already copied and checked (see :mod:`collector.read.scanner`); here the histograms of
those banks are gathered in one NumPy copy, then every bank's ``(seq, wid)`` is gathered again: a histogram is
accepted only when its bank still holds the same ``seq`` and ``wid`` as the copy the window was read from,
which is the seqlock reader of :mod:`shmstat.shm.layout` (bank, histogram, then ``seq``/``wid`` again) for all
banks at once. The result is a :class:`collector.read.hist_batch.HistBatch` (no Python object per window). Headers
a writer cannot produce and banks that changed meanwhile are left to the caller's one-by-one read
(:func:`shmstat.shm.layout_codec.read_bank` with the histogram), which decides as for any bank.
"""

from __future__ import annotations

import numpy as np

from shmstat.histogram import MAX_SCALE, MIN_SCALE
from shmstat.shm import layout as L

from .hist_batch import HistBatch

__all__ = ["read_histograms"]

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
    blocks = np.frombuffer(buf, np.uint32, nblocks * _BLOCK_WORDS, geometry.hist_base)
    words = np.frombuffer(buf, np.int64, len(buf) // 8)
    try:  # whole blocks by row (one memcpy each), not element by element
        raw = blocks.reshape(-1, _BLOCK_WORDS)[(hist_off - geometry.hist_base) // L.HIST_SIZE]
        again = words[(bank_off // 8)[:, None] + np.arange(2)]
    finally:
        del words, blocks  # no array may keep the mapping exported (the segment must stay closable)
    heads = raw[:, :_HEAD_WORDS].copy().view(np.int64)
    counts = raw[:, _COUNTS_FROM:_COUNTS_FROM + 2 * _M]  # the positive ring, then the negative
    scale, zero = heads[:, 0], heads[:, 1]
    pos_lo, pos_hi, neg_lo, neg_hi = heads[:, 2], heads[:, 3], heads[:, 4], heads[:, 5]
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
