"""Base-2 exponential histograms: the percentile figures of a window (P50, P90, P99, P999), exact to merge.

Semantics are OpenTelemetry's ExponentialHistogram (and Prometheus native histograms, whose bucket index is
ours plus one): at scale ``s`` the base is ``2 ** (2 ** -s)`` and a value ``v > 0`` falls in bucket
``i = ceil(log2(v) * 2**s) - 1``, which holds ``(base**i, base**(i+1)]``; negative values use the same index of
``|v|`` in a range of their own; ``0.0`` counts in the zero bucket; ``+inf`` and ``-inf`` count apart
(``pos_inf``, ``neg_inf``: OpenTelemetry's SDKs keep them out of the buckets too, as one infinity in a bucket
would lower the whole window's scale to fit ``2**1024``). A window's histogram starts at
:data:`MAX_SCALE` and keeps at most :data:`MAX_BUCKETS` buckets per sign: when a value would need more, the
scale is lowered by just enough (indices shifted right), for both signs at once.

Exactness across ranks: every index is computed once at :data:`MAX_SCALE` (``ceil(log2(v) * 256) - 1``, the
same libm ``log2`` in C and Python) and shifted right to the current scale, so an index at any scale is the
same whoever computed it. Merging brings both to the lower scale and adds bucket counts, then lowers the scale
while a range is too wide; the result is exactly the histogram a single writer would have built from all the
samples (each writer's scale is the highest that fits its own samples, so the union's is no higher).

Quantiles: the bucket holding the sample of rank ``ceil(q * n)`` (as numpy's ``inverted_cdf``; ``n`` counts the
infinities, ranked first (``-inf``) and last (``+inf``)) is reported as ``2 * lo * hi / (lo + hi)`` of its
bounds, clamped to the window's exact min and max; a rank among the infinities is reported as that infinity.
Its relative error is at most ``(base - 1) / (base + 1)``: 0.54% at scale 6, 1.1% at scale 5, 2.2% at scale 4.
With 272 buckets a window keeps scale 5 or better while its finite values span up to ``2**8`` (``2**8.5``),
scale 0 up to ``2**272``.

The in-segment form (one block per bank, written under the bank's seqlock) is drawn in :mod:`shmstat.shm.layout`.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "FACTORS",
    "FRACTIONS",
    "MAX_BUCKETS",
    "MAX_SCALE",
    "MIN_SCALE",
    "Histogram",
    "bucket_estimate",
    "error_bound",
    "index_at_max_scale",
    "merge_histograms",
]

MAX_SCALE = 8
"""The scale every window starts at (base 2**(1/256): 0.14% error)."""
MIN_SCALE = -4
"""The lowest scale a histogram can need: every finite double fits in 131 buckets at scale -4."""
MAX_BUCKETS = 272
"""Buckets per sign per window (positive and negative ranges each)."""

_DBL_MAX = sys.float_info.max


def index_at_max_scale(magnitude: float) -> int:
    """The bucket index of ``magnitude > 0`` at :data:`MAX_SCALE` (infinity, which :meth:`Histogram.add` counts
    apart, as the largest double)."""
    if magnitude > _DBL_MAX:
        magnitude = _DBL_MAX
    return math.ceil(math.log2(magnitude) * 256.0) - 1


FRACTIONS: dict[int, tuple[float, ...]] = {s: tuple(2.0 ** (k / 2.0 ** s) for k in range(2 ** max(s, 0)))
                                          for s in range(MIN_SCALE, MAX_SCALE + 1)}
"""Per scale ``s``: ``2 ** (k / 2**s)`` for ``k < 2**s`` (just ``(1.0,)`` below scale 1). The lower bound of
bucket ``i`` is ``ldexp(FRACTIONS[s][i % 2**s], i >> s)`` at ``s >= 0``, ``ldexp(1.0, i << -s)`` below: one
rounding, the same in Python and in the collector's NumPy reader of many windows at once."""

FACTORS: dict[int, float] = {s: 2.0 * 2.0 ** (2.0 ** -s) / (1.0 + 2.0 ** (2.0 ** -s))
                             for s in range(MIN_SCALE, MAX_SCALE + 1)}
"""Per scale: ``2 base / (1 + base)``, a bucket's reported value over its lower bound."""


def bucket_estimate(scale: int, index: int) -> float:
    """The value reported for positive bucket ``index`` at ``scale``: ``2 lo hi / (lo + hi)`` of its bounds,
    computed as ``lower bound * FACTORS[scale]`` (at most the largest double)."""
    if scale >= 0:
        mantissa, exponent = FRACTIONS[scale][index & ((1 << scale) - 1)], index >> scale
    else:
        mantissa, exponent = 1.0, index << -scale
    try:
        return min(math.ldexp(mantissa, exponent) * FACTORS[scale], _DBL_MAX)
    except OverflowError:
        return _DBL_MAX


def error_bound(scale: int) -> float:
    """The largest relative error of a quantile read from a histogram at ``scale``."""
    base = 2.0 ** (2.0 ** -scale)
    return (base - 1.0) / (base + 1.0)


def _shift(counts: dict[int, int], by: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for i, c in counts.items():
        j = i >> by
        out[j] = out.get(j, 0) + c
    return out


@dataclass
class Histogram:
    """One window's exponential histogram: ``scale``, ``zero`` count, sparse ``pos``/``neg`` bucket counts
    (index at ``scale`` -> count) and the ``pos_inf``/``neg_inf`` counts of infinite samples. Build with
    :meth:`add`, combine with :meth:`merge`, read with :meth:`quantile`."""

    scale: int = MAX_SCALE
    zero: int = 0
    pos: dict[int, int] = field(default_factory=dict)
    neg: dict[int, int] = field(default_factory=dict)
    pos_inf: int = 0
    """Samples equal to ``+inf`` (in no bucket)."""
    neg_inf: int = 0
    """Samples equal to ``-inf`` (in no bucket)."""
    _bounds: dict[bool, tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)
    """Cached (lowest, highest) index per sign (True: positive), kept by :meth:`add`."""
    _cdf: tuple[list[int], list[tuple[int, int]]] | None = field(default=None, repr=False, compare=False)
    """Cached cumulative counts in value order and their (sign, index) buckets, for :meth:`quantile`."""

    @property
    def count(self) -> int:
        """Samples counted, the infinite ones included."""
        return self.finite_count + self.pos_inf + self.neg_inf

    @property
    def finite_count(self) -> int:
        """Samples counted in the zero bucket and the buckets (every one but the infinities)."""
        return self.zero + sum(self.pos.values()) + sum(self.neg.values())

    def add(self, value: float) -> None:
        """Count one sample (NaN is the caller's to refuse); lowers the scale when the range of the finite
        samples needs it (an infinity is counted apart and never does)."""
        if value == 0.0:
            self.zero += 1
            return
        if not -_DBL_MAX <= value <= _DBL_MAX:
            if value > 0:
                self.pos_inf += 1
            else:
                self.neg_inf += 1
            self._cdf = None
            return
        i8 = index_at_max_scale(abs(value))
        positive = value > 0
        side = self.pos if positive else self.neg
        i = i8 >> (MAX_SCALE - self.scale)
        if side and i not in side:
            lo, hi = _range(side, positive, self)
            if i < lo or i > hi:
                by = _needed_shift(min(lo, i), max(hi, i))
                if by:
                    self._downscale(by)
                    side = self.pos if positive else self.neg
                    i = i8 >> (MAX_SCALE - self.scale)
                    lo, hi = _range(side, positive, self, fresh=True)
                self._bounds[positive] = (min(lo, i), max(hi, i))
        elif not side:
            self._bounds[positive] = (i, i)
        side[i] = side.get(i, 0) + 1
        self._cdf = None

    def _downscale(self, by: int) -> None:
        if by <= 0:
            return
        self.scale -= by
        self.pos = _shift(self.pos, by)
        self.neg = _shift(self.neg, by)
        self._bounds.clear()
        self._cdf = None

    def merge(self, other: Histogram) -> Histogram:
        """A new histogram of both windows' samples (exactly the one a single writer would have built)."""
        merged = merge_histograms((self, other))
        assert merged is not None
        return merged

    def quantile(self, q: float, lo: float | None = None, hi: float | None = None) -> float:
        """The ``q``-quantile (0 < q <= 1) of the counted samples, within :func:`error_bound` of the exact
        order statistic of rank ``ceil(q * n)`` (``-inf`` or ``+inf`` exactly when that rank is one of the
        infinities); clamped to ``[lo, hi]`` (the window's exact min and max) when given. 0.0 for an empty
        histogram."""
        return self.quantiles((q,), lo, hi)[0]

    def quantiles(self, qs: Iterable[float], lo: float | None = None, hi: float | None = None) -> list[float]:
        """:meth:`quantile` of each of ``qs``, in one go (one cumulative count for all of them)."""
        cdf = self._cdf
        if cdf is None:  # built once per histogram: several quantiles cost one sort
            cum: list[int] = []
            buckets: list[tuple[int, int]] = []
            seen = 0
            if self.neg_inf:
                seen += self.neg_inf
                cum.append(seen)
                buckets.append((-2, 0))
            for i in sorted(self.neg, reverse=True):  # most negative first
                seen += self.neg[i]
                cum.append(seen)
                buckets.append((-1, i))
            if self.zero:
                seen += self.zero
                cum.append(seen)
                buckets.append((0, 0))
            for i in sorted(self.pos):
                seen += self.pos[i]
                cum.append(seen)
                buckets.append((1, i))
            if self.pos_inf:
                seen += self.pos_inf
                cum.append(seen)
                buckets.append((2, 0))
            cdf = self._cdf = (cum, buckets)
        cum, buckets = cdf
        if not cum:
            return [0.0 for _ in qs]
        total, last, scale = cum[-1], len(cum) - 1, self.scale
        out = []
        for q in qs:
            rank = max(1, math.ceil(q * total - 1e-9))
            sign, i = buckets[min(bisect_left(cum, rank), last)]
            if sign == 0:
                estimate = 0.0
            elif sign == 1 or sign == -1:
                estimate = sign * bucket_estimate(scale, i)
            else:  # the infinities' counts (sign -2 and 2)
                estimate = sign * math.inf
            if lo is not None and estimate < lo:
                estimate = lo
            if hi is not None and estimate > hi:
                estimate = hi
            out.append(estimate)
        return out

    def to_wire(self) -> dict[str, object]:
        """A compact map for the wire: ``scale``, ``zero``, per sign ``[offset, [counts...]]``, and ``pos_inf`` /
        ``neg_inf`` when not 0 (absent means 0)."""
        def dense(counts: dict[int, int]) -> list[object]:
            if not counts:
                return [0, []]
            first = min(counts)
            return [first, [counts.get(i, 0) for i in range(first, max(counts) + 1)]]

        out: dict[str, object] = {"scale": self.scale, "zero": self.zero, "pos": dense(self.pos),
                                  "neg": dense(self.neg)}
        if self.pos_inf:
            out["pos_inf"] = self.pos_inf
        if self.neg_inf:
            out["neg_inf"] = self.neg_inf
        return out


def merge_histograms(parts: Iterable[Histogram | None]) -> Histogram | None:
    """Merge any number of histograms in one pass (None parts are skipped; None if there are none): bring every
    part to the lowest scale, add the bucket counts (and the zero and infinity counts), then lower the scale
    while a range is too wide. The result
    is exactly the histogram a single writer would have built from all the samples."""
    hs = [p for p in parts if p is not None]
    if not hs:
        return None
    scale = min(h.scale for h in hs)
    out = Histogram(scale, sum(h.zero for h in hs), pos_inf=sum(h.pos_inf for h in hs),
                    neg_inf=sum(h.neg_inf for h in hs))
    for name in ("pos", "neg"):
        acc: dict[int, int] = {}
        for h in hs:
            counts = getattr(h, name)
            by = h.scale - scale
            if not acc and not by:
                acc = dict(counts)
                continue
            get = acc.get
            for i, c in counts.items():
                j = i >> by
                acc[j] = get(j, 0) + c
        setattr(out, name, acc)
    need = max(_needed_shift(min(out.pos), max(out.pos)) if out.pos else 0,
               _needed_shift(min(out.neg), max(out.neg)) if out.neg else 0)
    out._downscale(need)
    return out


def _range(side: dict[int, int], positive: bool, h: Histogram, fresh: bool = False) -> tuple[int, int]:
    got = None if fresh else h._bounds.get(positive)
    if got is None:
        got = h._bounds[positive] = (min(side), max(side))
    return got


def _needed_shift(lo: int, hi: int) -> int:
    """The smallest right shift after which indices ``lo..hi`` fit in :data:`MAX_BUCKETS` buckets."""
    by = 0
    while (hi >> by) - (lo >> by) >= MAX_BUCKETS:
        by += 1
    return by
