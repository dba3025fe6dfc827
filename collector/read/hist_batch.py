"""The histograms of many windows at once, as arrays: :class:`HistBatch` (merge and quantiles without one Python
object per window).

A batch holds ``n`` rows, each a window's :class:`shmstat.histogram.Histogram` or nothing: per row ``present``,
``scale``, ``zero`` and the infinities' counts ``pos_inf`` / ``neg_inf``; and every non-zero bucket of every row
as one entry of four equal-length arrays (``row``, ``negative``, ``index``, ``count``), sorted by row. Merging
rows and reading quantiles follow :func:`shmstat.histogram.merge_histograms` and :meth:`Histogram.quantiles`
exactly (same scale, same buckets, same floats: the bucket estimate is :func:`shmstat.histogram.bucket_estimate`'s
on arrays); the differential test is ``tests/collector/read/test_hist_batch.py``. :meth:`HistBatch.histograms` builds
the objects for whoever wants them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmstat.histogram import FACTORS, FRACTIONS, MAX_BUCKETS, MAX_SCALE, MIN_SCALE, Histogram

__all__ = ["HistBatch"]

_I64 = np.int64
_DBL_MAX = np.finfo(np.float64).max
_FRACTION_TABLE = np.ones((MAX_SCALE - MIN_SCALE + 1, 2 ** MAX_SCALE))
for _s, _fr in FRACTIONS.items():
    _FRACTION_TABLE[_s - MIN_SCALE, :len(_fr)] = _fr
_FACTOR_TABLE = np.array([FACTORS[s] for s in range(MIN_SCALE, MAX_SCALE + 1)])


@dataclass(frozen=True, eq=False)
class HistBatch:
    """``n`` rows of histograms (see the module docstring); build with :meth:`empty`, :meth:`from_histograms`,
    :meth:`assemble` or :meth:`merge_groups`."""

    present: np.ndarray
    """Whether the row has a histogram (bool)."""
    scale: np.ndarray
    zero: np.ndarray
    row: np.ndarray
    """Each entry's row (int64, sorted)."""
    negative: np.ndarray
    """Whether the entry is a bucket of negative values (bool)."""
    index: np.ndarray
    """The entry's bucket index at its row's scale (int64)."""
    count: np.ndarray
    """The entry's count (int64, > 0)."""
    pos_inf: np.ndarray
    """Per row: samples equal to ``+inf`` (int64)."""
    neg_inf: np.ndarray
    """Per row: samples equal to ``-inf`` (int64)."""

    def __len__(self) -> int:
        """Number of rows."""
        return len(self.present)

    @classmethod
    def empty(cls, n: int) -> HistBatch:
        """``n`` rows without histograms."""
        none = np.zeros(0, _I64)
        return cls(np.zeros(n, bool), np.zeros(n, _I64), np.zeros(n, _I64), none, np.zeros(0, bool), none, none,
                   np.zeros(n, _I64), np.zeros(n, _I64))

    @classmethod
    def from_histograms(cls, hists: Sequence[Histogram | None]) -> HistBatch:
        """A batch of ``hists`` (None: a row without one)."""
        n = len(hists)
        present, scale, zero = np.zeros(n, bool), np.zeros(n, _I64), np.zeros(n, _I64)
        pos_inf, neg_inf = np.zeros(n, _I64), np.zeros(n, _I64)
        row: list[int] = []
        negative: list[bool] = []
        index: list[int] = []
        count: list[int] = []
        for r, h in enumerate(hists):
            if h is None:
                continue
            present[r], scale[r], zero[r], pos_inf[r], neg_inf[r] = True, h.scale, h.zero, h.pos_inf, h.neg_inf
            for neg, side in ((False, h.pos), (True, h.neg)):
                for i, c in side.items():
                    if c:
                        row.append(r)
                        negative.append(neg)
                        index.append(i)
                        count.append(c)
        return cls(present, scale, zero, np.array(row, _I64), np.array(negative, bool), np.array(index, _I64),
                   np.array(count, _I64), pos_inf, neg_inf)

    def histograms(self) -> np.ndarray:
        """Each row's :class:`Histogram` (object array; None where there is none)."""
        n = len(self)
        out = np.full(n, None, object)
        made: list[Histogram | None] = [None] * n
        p = self.present
        for r, s, z, pi, ni in zip(np.flatnonzero(p).tolist(), self.scale[p].tolist(), self.zero[p].tolist(),
                                   self.pos_inf[p].tolist(), self.neg_inf[p].tolist(), strict=True):
            made[r] = Histogram(s, z, pos_inf=pi, neg_inf=ni)
        for r, neg, i, c in zip(self.row.tolist(), self.negative.tolist(), self.index.tolist(), self.count.tolist(),
                                strict=True):
            h = made[r]
            assert h is not None
            (h.neg if neg else h.pos)[i] = c
        out[:] = made
        return out

    def _starts(self) -> np.ndarray:
        """Where each row's entries begin (length ``n + 1``)."""
        return np.searchsorted(self.row, np.arange(len(self) + 1))

    def __getitem__(self, index: Any) -> HistBatch:
        """The rows selected by ``index`` (a boolean mask, an index array or a slice), as a new batch."""
        sel = np.arange(len(self))[index]
        starts = self._starts()
        lens = (starts[1:] - starts[:-1])[sel]
        total = int(lens.sum())
        first = np.cumsum(lens) - lens
        take = np.repeat(starts[:-1][sel] - first, lens) + np.arange(total)
        return HistBatch(self.present[sel], self.scale[sel], self.zero[sel], np.repeat(np.arange(len(sel)), lens),
                         self.negative[take], self.index[take], self.count[take], self.pos_inf[sel],
                         self.neg_inf[sel])

    @staticmethod
    def assemble(n: int, pieces: Sequence[tuple[np.ndarray, HistBatch]]) -> HistBatch:
        """A batch of ``n`` rows where ``pieces`` put batch ``b``'s rows at positions ``p`` (``(p, b)`` each,
        ``len(p) == len(b)``); rows no piece covers have no histogram."""
        present, scale, zero = np.zeros(n, bool), np.zeros(n, _I64), np.zeros(n, _I64)
        pos_inf, neg_inf = np.zeros(n, _I64), np.zeros(n, _I64)
        rows, negs, idxs, counts = [], [], [], []
        for pos, b in pieces:
            pos = np.asarray(pos, _I64)
            present[pos], scale[pos], zero[pos] = b.present, b.scale, b.zero
            pos_inf[pos], neg_inf[pos] = b.pos_inf, b.neg_inf
            rows.append(pos[b.row])
            negs.append(b.negative)
            idxs.append(b.index)
            counts.append(b.count)
        if not rows:
            return HistBatch(present, scale, zero, np.zeros(0, _I64), np.zeros(0, bool), np.zeros(0, _I64),
                             np.zeros(0, _I64), pos_inf, neg_inf)
        row = np.concatenate(rows)
        order = np.argsort(row, kind="stable")
        return HistBatch(present, scale, zero, row[order], np.concatenate(negs)[order], np.concatenate(idxs)[order],
                         np.concatenate(counts)[order], pos_inf, neg_inf)

    @staticmethod
    def concat(batches: Sequence[HistBatch]) -> HistBatch:
        """The rows of ``batches`` one after the other."""
        if len(batches) == 1:
            return batches[0]
        offsets = np.cumsum([0, *(len(b) for b in batches)])
        return HistBatch.assemble(int(offsets[-1]), [(np.arange(offsets[k], offsets[k + 1]), b)
                                                     for k, b in enumerate(batches)])

    def merge_groups(self, group: np.ndarray, groups: int, use: np.ndarray) -> HistBatch:
        """One row per group: the merge of the rows ``r`` with ``use[r]`` and a histogram, ``group[r]`` being
        their group (in ``range(groups)``); exactly :func:`shmstat.histogram.merge_histograms` of them."""
        u = use & self.present
        present = np.zeros(groups, bool)
        present[group[u]] = True
        scale = np.full(groups, MAX_SCALE, _I64)
        np.minimum.at(scale, group[u], self.scale[u])
        zero, pos_inf, neg_inf = np.zeros(groups, _I64), np.zeros(groups, _I64), np.zeros(groups, _I64)
        np.add.at(zero, group[u], self.zero[u])
        np.add.at(pos_inf, group[u], self.pos_inf[u])
        np.add.at(neg_inf, group[u], self.neg_inf[u])
        keep = u[self.row]
        g = group[self.row[keep]]
        idx = self.index[keep] >> (self.scale[self.row[keep]] - scale[g])
        neg, cnt = self.negative[keep], self.count[keep]
        need = np.zeros(groups, _I64)
        if len(g):
            lo = np.full((2, groups), np.iinfo(_I64).max, _I64)
            hi = np.full((2, groups), np.iinfo(_I64).min, _I64)
            side = neg.astype(_I64)
            np.minimum.at(lo, (side, g), idx)
            np.maximum.at(hi, (side, g), idx)
            has = lo <= hi
            lo, hi = np.where(has, lo, 0), np.where(has, hi, 0)
            decided = np.zeros(groups, bool)
            for by in range(MAX_SCALE - MIN_SCALE + 1):  # the smallest shift fitting both signs (as _needed_shift)
                fits = (((hi >> by) - (lo >> by)) < MAX_BUCKETS).all(axis=0)
                need[fits & ~decided] = by
                decided |= fits
            idx = idx >> need[g]
        scale -= need
        order = np.lexsort((idx, neg, g))
        g, neg, idx, cnt = g[order], neg[order], idx[order], cnt[order]
        if len(g):
            new = np.concatenate(([True], (g[1:] != g[:-1]) | (neg[1:] != neg[:-1]) | (idx[1:] != idx[:-1])))
            start = np.flatnonzero(new)
            cnt = np.add.reduceat(cnt, start)
            g, neg, idx = g[start], neg[start], idx[start]
        return HistBatch(present, np.where(present, scale, 0), zero, g, neg, idx, cnt, pos_inf, neg_inf)

    def quantiles(self, qs: Sequence[float], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``(n, len(qs))``: each row's :meth:`Histogram.quantiles` of ``qs`` clamped to ``lo``/``hi`` (the
        windows' exact min and max); 0.0 for a row without a histogram or with no sample."""
        n = len(self)
        out = np.zeros((n, len(qs)))
        # every bucket in value order: -inf (class 0), negatives (1, largest index first), the zero bucket (2),
        # positives (3), +inf (4); the three per-row counts as entries of their own
        extra = [(k, np.flatnonzero(self.present & (c > 0)), c)
                 for k, c in ((0, self.neg_inf), (2, self.zero), (4, self.pos_inf))]
        row = np.concatenate((self.row, *(r for _, r, _ in extra)))
        cls = np.concatenate((np.where(self.negative, 1, 3), *(np.full(len(r), k, _I64) for k, r, _ in extra)))
        key = np.concatenate((np.where(self.negative, -self.index, self.index),
                              *(np.zeros(len(r), _I64) for _, r, _ in extra)))
        cnt = np.concatenate((self.count, *(c[r] for _, r, c in extra)))
        if not len(row):
            return out
        order = np.lexsort((key, cls, row))
        row, cls, key, cnt = row[order], cls[order], key[order], cnt[order]
        cum = np.cumsum(cnt)
        starts = np.searchsorted(row, np.arange(n + 1))
        rows = np.flatnonzero(starts[1:] > starts[:-1])
        first, last = starts[rows], starts[rows + 1] - 1
        before = np.where(first > 0, cum[first - 1], 0)
        total = (cum[last] - before).astype(np.float64)
        scale, lo_r, hi_r = self.scale[rows], lo[rows], hi[rows]
        for j, q in enumerate(qs):
            rank = np.maximum(1.0, np.ceil(q * total - 1e-9))
            at = np.minimum(np.searchsorted(cum, before + rank, side="left"), last)
            c, i = cls[at], np.where(cls[at] == 1, -key[at], key[at])
            est = _estimate(scale, i)
            est = np.select((c == 0, c == 1, c == 2, c == 4), (-np.inf, -est, 0.0, np.inf), est)
            est = np.where(est < lo_r, lo_r, est)
            out[rows, j] = np.where(est > hi_r, hi_r, est)
        return out


def _estimate(scale: np.ndarray, index: np.ndarray) -> np.ndarray:
    """:func:`shmstat.histogram.bucket_estimate` of each (scale, index)."""
    up = scale >= 0
    s_up = np.where(up, scale, 0)
    mantissa = _FRACTION_TABLE[scale - MIN_SCALE, np.where(up, index & ((1 << s_up) - 1), 0)]
    exponent = np.where(up, index >> s_up, index << np.where(up, 0, -scale))
    exponent = np.clip(exponent, -1 << 20, 1 << 20)  # beyond any double's range either way; keeps ldexp's int32
    with np.errstate(over="ignore"):
        value = np.ldexp(mantissa, exponent.astype(np.int32)) * _FACTOR_TABLE[scale - MIN_SCALE]
    return np.minimum(value, _DBL_MAX)
