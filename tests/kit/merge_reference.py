"""Merging summaries the slow way, for tests: :func:`merge` (two summaries) and :func:`merge_all`, the per-object
fold over :class:`shmstat.shm.layout_records.WindowFigures` parts that the collector's one merge, the columnar
:func:`collector.read.columns.merge_parts`, must equal, bit for bit when the parts come in the same order."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from shmstat.histogram import Histogram, merge_histograms
from shmstat.shm.layout_records import WindowFigures


def merge(a: WindowFigures, b: WindowFigures) -> WindowFigures:
    """Combine two summaries; empty ones are the identity (an empty torn one only passes its flag on)."""
    if a.count == 0:
        return b if not a.torn or b.torn else replace(b, torn=True)
    if b.count == 0:
        return a if not b.torn or a.torn else replace(a, torn=True)
    later = b if b.last_ts > a.last_ts else a
    if a.hist is None:
        hist = b.hist
    elif b.hist is None:
        hist = a.hist
    else:
        hist = a.hist.merge(b.hist)
    return WindowFigures(
        a.count + b.count, a.sum + b.sum, min(a.min, b.min), max(a.max, b.max), later.last, later.last_ts,
        a.torn or b.torn, hist,
    )


def merge_all(parts: Iterable[WindowFigures]) -> WindowFigures:
    """Merge any number of summaries in order (empty input gives the empty summary): counts and sums added in
    order, min/max over the non-empty parts (folded in order, NaN included), the value of the first part with the
    latest timestamp, torn if any part is, the non-empty parts' histograms merged in one pass."""
    count, total, lo, hi, last, last_ts, torn = 0, 0.0, 0.0, 0.0, 0.0, 0, False
    hists: list[Histogram] = []
    for p in parts:
        torn = torn or p.torn
        if not p.count:
            continue
        if count == 0:
            lo, hi, last, last_ts = p.min, p.max, p.last, p.last_ts
        else:
            lo, hi = min(lo, p.min), max(hi, p.max)
            if p.last_ts > last_ts:
                last, last_ts = p.last, p.last_ts
        count += p.count
        total += p.sum
        if p.hist is not None:
            hists.append(p.hist)
    hist = hists[0] if len(hists) == 1 else merge_histograms(hists)
    return WindowFigures(count, total, lo, hi, last, last_ts, torn, hist)
