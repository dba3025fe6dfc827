"""Straggler scoring the slow way, for tests: the per-row reference :func:`update_rows` that
:meth:`collector.daemon.straggler.StragglerDetector.update_columns` must equal, and :func:`columns_of`, which lays
hand-made :class:`collector.read.merge.WindowRow` objects out as the :class:`collector.read.columns.Columns` of one
pass."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from collector.daemon.straggler import Score, StragglerDetector, StragglerUpdate, figure, score_ranks
from collector.read.columns import Columns
from collector.read.hist_batch import HistBatch
from collector.read.merge import Summary, WindowRow


def update_rows(det: StragglerDetector, rows: Iterable[WindowRow]) -> StragglerUpdate:
    """Score the windows of ``rows`` (merged rows only advance time; per-rank rows are scored) in window order
    per stat, one Python object at a time, feeding ``det``'s state exactly as ``update_columns`` does."""
    by_window: dict[tuple[str, str, int], list[WindowRow]] = {}
    for row in rows:
        det._latest_ns = max(det._latest_ns, row.end_ns)
        if row.rank is not None and row.summary.count > 0:
            by_window.setdefault((row.group, row.name, row.wid), []).append(row)
    out = StragglerUpdate()
    for key in sorted(by_window):
        for score in _score_window(by_window[key]):
            out.scores.append(score)
            event = det._observe(score)
            if event is not None:
                out.events.append(event)
    det._forget(out.events)
    return out


def _score_window(rows: list[WindowRow]) -> list[Score]:
    figures: dict[int, float] = {}
    for row in rows:
        value = figure(row.summary)
        if math.isfinite(value):
            assert row.rank is not None
            figures[row.rank] = value
    if len(figures) < 2 or min(figures.values()) < 0:
        return []
    first = rows[0]
    median, scores = score_ranks(figures, first.higher_is_better)
    return [Score(first.group, first.name, rank, first.wid, first.window_ms, scores[rank], figures[rank], median)
            for rank in sorted(scores)]


def columns_of(rows: Iterable[WindowRow], job: str = "job") -> Columns:
    """``rows`` as the scanner lays a pass out: windows by (wid, group, stat), each its merged row first (the
    given one, or an empty one made up) then its per-rank rows by rank."""
    windows: dict[tuple[int, str, str], list[WindowRow]] = {}
    for row in rows:
        windows.setdefault((row.wid, row.group, row.name), []).append(row)
    laid: list[WindowRow] = []
    for key in sorted(windows):
        mine = windows[key]
        merged = [r for r in mine if r.rank is None]
        first = mine[0]
        laid += merged[:1] or [WindowRow(first.group, first.name, first.wid, first.window_ms, first.agg_mask, None,
                                         Summary(0, 0.0, 0.0, 0.0, 0.0, 0), ranks=len(mine),
                                         higher_is_better=first.higher_is_better)]
        laid += sorted((r for r in mine if r.rank is not None), key=lambda r: r.rank)

    def col(get, dtype) -> np.ndarray:  # type: ignore[no-untyped-def]
        return np.array([get(r) for r in laid], dtype=dtype)

    def q(p: float):  # type: ignore[no-untyped-def]
        return col(lambda r: math.nan if r.summary.quantile(p) is None else r.summary.quantile(p), np.float64)

    return Columns(
        job, group=col(lambda r: r.group, object), stat=col(lambda r: r.name, object),
        rank=col(lambda r: -1 if r.rank is None else r.rank, np.int64), ranks=col(lambda r: r.ranks, np.int64),
        wid=col(lambda r: r.wid, np.int64), window_ms=col(lambda r: r.window_ms, np.int64),
        agg_mask=col(lambda r: r.agg_mask, np.int64), count=col(lambda r: r.summary.count, np.int64),
        sum=col(lambda r: r.summary.sum, np.float64), min=col(lambda r: r.summary.min, np.float64),
        max=col(lambda r: r.summary.max, np.float64), value=col(lambda r: r.summary.last, np.float64),
        last_ts=col(lambda r: r.summary.last_ts, np.int64), mean=col(lambda r: r.summary.mean, np.float64),
        p50=q(0.5), p90=q(0.9), p99=q(0.99), p999=q(0.999), torn=col(lambda r: r.summary.torn, bool),
        higher_is_better=col(lambda r: r.higher_is_better, bool),
        hists=HistBatch.from_histograms([r.summary.hist for r in laid]))
