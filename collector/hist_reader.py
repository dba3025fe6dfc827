"""Reading the histograms of many windows at once (the scanner's pass over stats that keep percentiles).

The banks of the pass were already copied and checked (see :mod:`collector.scanner`); here the histograms of
those banks are gathered in one NumPy copy, then every bank's ``(seq, wid)`` is gathered again: a histogram is
accepted only when its bank still holds the same ``seq`` and ``wid`` as the copy the window was read from,
which is the seqlock reader of :mod:`shmstat.layout` (bank, histogram, then ``seq``/``wid`` again) for all
banks at once. Headers a writer cannot produce and banks that changed meanwhile are left to the caller's
one-by-one read (:func:`shmstat.layout.read_bank` with the histogram), which decides as for any bank.
"""

from __future__ import annotations

import numpy as np

from shmstat import layout as L
from shmstat.histogram import MAX_SCALE, MIN_SCALE, Histogram

__all__ = ["read_histograms"]

_M = L.HIST_BUCKETS
_HEAD_WORDS = np.arange(6)
_COUNT_WORDS = np.arange(2 * _M)


def read_histograms(buf: memoryview, geometry: L.Geometry, hist_off: np.ndarray, bank_off: np.ndarray,
                    seq_bits: np.ndarray, wid: np.ndarray) -> list[Histogram | None]:
    """The histograms at byte offsets ``hist_off`` of the banks at ``bank_off`` whose checked copy had
    ``seq_bits`` (the seq word's 64 bits) and ``wid``; None where the caller must read the bank again."""
    n = len(hist_off)
    out: list[Histogram | None] = [None] * n
    if not n:
        return out
    words = np.frombuffer(buf, np.int64, len(buf) // 8)
    quads = np.frombuffer(buf, np.uint32, len(buf) // 4)
    try:
        heads = words[(hist_off // 8)[:, None] + _HEAD_WORDS]
        counts = quads[((hist_off + L.HIST_COUNTS) // 4)[:, None] + _COUNT_WORDS]
        again = words[(bank_off // 8)[:, None] + np.arange(2)]
    finally:
        del words, quads  # no array may keep the mapping exported (the segment must stay closable)
    scale, zero = heads[:, 0], heads[:, 1]
    pos_lo, pos_hi, neg_lo, neg_hi = heads[:, 2], heads[:, 3], heads[:, 4], heads[:, 5]
    with np.errstate(over="ignore"):
        sane = ((scale >= MIN_SCALE) & (scale <= MAX_SCALE) & (zero >= 0)
                & ((pos_lo > pos_hi) | (pos_hi - pos_lo < _M)) & ((neg_lo > neg_hi) | (neg_hi - neg_lo < _M)))
    ok = sane & (again[:, 0] == seq_bits) & (again[:, 1] == wid)
    rows, cols = np.nonzero(counts)
    keep = ok[rows]
    rows, cols = rows[keep], cols[keep]
    negative = cols >= _M
    position = cols % _M
    lo = np.where(negative, neg_lo[rows], pos_lo[rows])
    index = lo + (position - lo) % _M  # the one index in [lo, lo + M) stored at that position of the ring
    values = counts[rows, cols].tolist()
    index_list, negative_list = index.tolist(), negative.tolist()
    bounds = np.searchsorted(rows, np.arange(n + 1)).tolist()
    scales, zeros = scale.tolist(), zero.tolist()
    for r in np.flatnonzero(ok).tolist():
        h = Histogram(scales[r], zeros[r])
        pos, neg = h.pos, h.neg
        for j in range(bounds[r], bounds[r + 1]):
            (neg if negative_list[j] else pos)[index_list[j]] = values[j]
        out[r] = h
    return out
