"""Straggler scoring the slow way, for tests: the per-row reference :func:`update_rows` that
:meth:`collector.daemon.straggler.StragglerDetector.update_columns` must equal, and :func:`columns_of`, which lays
hand-made :class:`collector.read.rows.WindowRow` objects out as the :class:`collector.read.columns.Columns` of one
pass."""

from __future__ import annotations

import math
from collections.abc import Iterable

from collector.daemon.scoring import figure, score_ranks
from collector.daemon.straggler import Score, StragglerDetector, StragglerUpdate
from collector.read.columns import Columns
from collector.read.rows import WindowRow
from shmstat.shm.layout_records import WindowFigures


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
                                         WindowFigures(0, 0.0, 0.0, 0.0, 0.0, 0), ranks=len(mine),
                                         higher_is_better=first.higher_is_better)]
        laid += sorted((r for r in mine if r.rank is not None), key=lambda r: r.rank)

    return Columns.from_rows(job, laid)
