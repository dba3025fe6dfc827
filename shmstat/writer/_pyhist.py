"""The pure-Python twins of the C writer's histogram updates (``hist_reset``/``hist_add`` in ``_fastpath.c``): the
same index function, the same scale lowering, the same bytes of a bank's histogram (see :mod:`shmstat.shm.layout`)."""

from __future__ import annotations

import sys
from math import ceil, log2

from ..histogram import MAX_SCALE
from ..shm import layout as L

__all__ = ["hist_add", "hist_reset"]

_M = L.HIST_BUCKETS
_POS_INF, _NEG_INF = L.HI_POS_INF // 8, L.HI_NEG_INF // 8
_DBL_MAX = sys.float_info.max
_COUNTS_U32 = L.HIST_COUNTS // 4  # the counts' first u32, from the histogram's start


def hist_reset(q: memoryview, u: memoryview, off: int) -> None:
    """An empty histogram at byte offset ``off`` (the bank's seq is odd): the pure-Python twin of the C
    ``hist_reset``; zeroes only the counts the previous window used."""
    w = off // 8
    for side in (0, 1):
        lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
        c0 = (off + L.HIST_COUNTS) // 4 + _M * side
        if lo <= hi:
            for i in (range(lo, hi + 1) if hi - lo < _M else range(_M)):
                u[c0 + i % _M] = 0
        q[w + 2 + 2 * side] = (1 << 63) - 1
        q[w + 3 + 2 * side] = -(1 << 63)
    q[w] = MAX_SCALE
    q[w + 1] = 0
    q[w + _POS_INF] = q[w + _NEG_INF] = 0


def _shift_side(q: memoryview, u: memoryview, off: int, side: int, by: int) -> None:
    w = off // 8
    lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
    if lo > hi:
        return
    c0 = (off + L.HIST_COUNTS) // 4 + _M * side
    merged: dict[int, int] = {}
    for i in range(lo, hi + 1):
        merged[i >> by] = merged.get(i >> by, 0) + u[c0 + i % _M]
        u[c0 + i % _M] = 0
    for j, n in merged.items():
        u[c0 + j % _M] = min(n, 0xFFFFFFFF)
    q[w + 2 + 2 * side], q[w + 3 + 2 * side] = lo >> by, hi >> by


def hist_add(q: memoryview, u: memoryview, off: int, v: float) -> None:
    """Count ``v`` (not NaN) in the histogram at byte offset ``off``: the pure-Python twin of the C
    ``hist_add`` (same index function, same scale lowering, the same bytes). An infinity is counted apart and
    never changes the scale."""
    # written out for the common case (it is every add of a stat with percentiles): a finite bucket inside its
    # side's range, where only the count is written; i8 is index_at_max_scale's
    w = off >> 3
    if v > 0.0:
        if v > _DBL_MAX:
            q[w + _POS_INF] += 1
            return
        i8 = ceil(log2(v) * 256.0) - 1
        r = w + 2  # the side's lo, hi words
        c = (off >> 2) + _COUNTS_U32  # the side's first count
    elif v < 0.0:
        if v < -_DBL_MAX:
            q[w + _NEG_INF] += 1
            return
        i8 = ceil(log2(-v) * 256.0) - 1
        r = w + 4
        c = (off >> 2) + _COUNTS_U32 + _M
    else:  # 0.0 or -0.0
        q[w + 1] += 1
        return
    i = i8 >> (MAX_SCALE - q[w])
    if q[r] <= i <= q[r + 1]:
        c += i % _M
        n = u[c]
        if n != 0xFFFFFFFF:
            u[c] = n + 1
        return
    _hist_add_outside(q, u, off, (r - w - 2) >> 1, i8)


def _hist_add_outside(q: memoryview, u: memoryview, off: int, side: int, i8: int) -> None:
    # hist_add of a bucket outside its side's range (or the side's first): the range grows, the scale is lowered
    # just enough when the range would span more than HIST_M buckets
    w = off >> 3
    scale = q[w]
    i = i8 >> (MAX_SCALE - scale)
    lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
    if lo > hi:
        lo = hi = i
    elif i < lo or i > hi:
        nlo, nhi = min(i, lo), max(i, hi)
        by = 0
        while (nhi >> by) - (nlo >> by) >= _M:
            by += 1
        if by:
            _shift_side(q, u, off, 0, by)
            _shift_side(q, u, off, 1, by)
            scale -= by
            q[w] = scale
            i = i8 >> (MAX_SCALE - scale)
            lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
            if lo > hi:
                lo = hi = i
        lo, hi = min(lo, i), max(hi, i)
    q[w + 2 + 2 * side], q[w + 3 + 2 * side] = lo, hi
    c = (off + L.HIST_COUNTS) // 4 + _M * side + i % _M
    if u[c] != 0xFFFFFFFF:
        u[c] += 1
