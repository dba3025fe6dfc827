"""Columns helpers, and the straggler detector on columns against the same detector on rows (random passes)."""

from __future__ import annotations

import pickle
import random

import numpy as np
from kit.merge_reference import merge_all
from kit.straggler_reference import update_rows

from collector import Columns, ColumnsHandler, RowsAdapter
from collector.daemon.straggler import StragglerDetector
from collector.handlers.protocol import ColumnsAdapter, as_columns_handler
from collector.read.columns import Parts, StatTable, merge_parts
from collector.read.hist_batch import HistBatch
from elastic.metrics import MetricHandler, StatMetricData
from shmstat.aggregation import Aggregation as A
from shmstat.aggregation import to_mask
from shmstat.histogram import Histogram
from shmstat.shm.layout_records import WindowFigures

MASKS = (to_mask([A.COUNT, A.SUM, A.MEAN]), to_mask([A.MEAN, A.P50, A.P99]))


def _random_pass(rng: random.Random, wid: int) -> Columns:
    """A pass of 3 stats x up to 6 ranks (some with two writers), figures drawn at random."""
    stats = StatTable(np.array(["g", "g", "h"], object), np.array(["a", "b", "a"], object),
                      np.array([100, 100, 100]), np.array([MASKS[0], MASKS[1], MASKS[0]]),
                      np.array([False, False, True]), np.array([False, True, False]), np.array([0, 1, 2]))
    rows = []
    for key in range(3):
        for rank in range(rng.randint(1, 6)):
            for _writer in range(rng.choice((1, 1, 2))):
                n = rng.choice((0, 1, 5, 20))
                vals = [rng.choice((0.0, 1.0, rng.uniform(0.5, 3.0), -1.0 if rng.random() < 0.02 else 2.0))
                        for _ in range(n)]
                hist = None
                if key == 1 and n:
                    hist = Histogram(3, 0)
                    for v in vals:
                        hist.add(v)
                rows.append((key, rank, len(rows), wid, n, sum(vals), min(vals, default=0.0),
                             max(vals, default=0.0), vals[-1] if vals else 0.0, rng.randint(1, 10**6),
                             rng.random() < 0.05 and n == 0, hist))
    cols = list(zip(*rows, strict=True))
    parts = Parts(*(np.array(c) for c in cols[:11]), HistBatch.from_histograms(list(cols[11])))
    return merge_parts("job", parts, stats)


def test_straggler_scores_on_columns_equal_scores_on_rows():
    rng = random.Random(7)
    on_rows, on_cols, lean = (StragglerDetector("job", windows=2) for _ in range(3))
    for wid in range(1, 60):
        cols = _random_pass(rng, wid)
        want = update_rows(on_rows, cols.to_rows())
        got = on_cols.update_columns(cols)
        assert got.scores == want.scores
        assert got.events == want.events
        assert lean.update_columns(cols, scores=False).events == want.events


def test_columns_helpers():
    cols = _random_pass(random.Random(3), 5)
    assert len(cols.merged()) + len(cols.per_rank()) == len(cols)
    assert (cols.merged().rank == -1).all() and (cols.per_rank().rank >= 0).all()
    rows = cols.to_rows()
    assert rows == list(cols) and [cols.row(i) for i in range(len(cols))] == rows
    assert (cols.start_ns == cols.wid * 100 * 10**6).all() and (cols.end_ns - cols.start_ns == 10**8).all()
    for i, row in enumerate(rows):  # merged rows merge every part of the window; per-rank rows those of one rank
        if row.rank is None:
            parts = [r.summary for r in rows[i + 1:i + 1 + row.ranks]]
            assert row.summary.count == merge_all(parts).count
    assert cols.of_groups({"h"}).groups() == ["h"]
    assert cols.aggregations(0) == (A.COUNT, A.SUM, A.MEAN)
    assert np.isnan(cols.of_groups({"h"}).p50).all()
    metrics = cols.to_metrics()
    flat = list(cols.flat())
    assert len(metrics) == len(flat)
    assert all(m.name == f[2] and m.value == f[3] for m, f in zip(metrics, flat, strict=True))
    built = [StatMetricData(end, group, name, value, rank=rank, window_start=start, window_end=end, torn=torn,
                            job="job") for end, group, name, value, rank, start, torn in flat]
    assert metrics == built and [vars(m) for m in metrics] == [vars(b) for b in built]
    assert [pickle.loads(pickle.dumps(m)) for m in metrics[:5]] == metrics[:5]
    assert len(Columns.empty("j")) == 0 and Columns.empty("j").to_metrics() == []
    assert WindowFigures(1, 1.0, 1.0, 1.0, 1.0, 1).count == 1


def test_a_handler_is_wrapped_once_by_what_its_class_defines():
    class Rows(MetricHandler):
        def emit(self, metric_data) -> None:
            pass

    class Cols(Rows):
        def emit_columns(self, columns) -> None:
            pass

    class Own(ColumnsHandler):
        def emit(self, metric_data) -> None:
            pass

        def emit_columns(self, columns) -> None:
            pass

    rows, cols, own = Rows(), Cols(), Own()
    assert type(as_columns_handler(rows)) is RowsAdapter and as_columns_handler(rows).handler is rows
    assert type(as_columns_handler(cols)) is ColumnsAdapter and as_columns_handler(own) is own


def test_the_prometheus_exporter_folds_columns_as_the_rows_say():
    from collector.prometheus.exporter import BUCKET_BOUNDS, PrometheusExporter, _classic

    rng = random.Random(11)
    ex = PrometheusExporter("127.0.0.1:0")
    want: dict[tuple, list] = {}  # (job, group, stat, rank) -> [count, total, mean, lo, hi, percentiles, buckets]
    for wid in range(1, 30):
        cols = _random_pass(rng, wid)
        ex.observe_columns(cols)
        for row in cols.to_rows():  # the reference: each row folded on its own
            s = row.summary
            cur = want.setdefault(("job", row.group, row.name, row.rank), [0, 0.0, 0.0, 0.0, 0.0, None, None])
            cur[0] += s.count
            cur[1] += s.sum
            cur[2:6] = s.mean, s.min, s.max, (tuple(s.quantile(q) or 0.0 for q in (0.5, 0.9, 0.99, 0.999))
                                             if s.hist is not None else None)
            if s.hist is not None and row.rank is None:
                cur[6] = cur[6] or [0] * (len(BUCKET_BOUNDS) + 1)
                for i, c in _classic(s.hist):
                    cur[6][i] += c
    assert ex._series.keys() == want.keys() and want
    for key, (count, total, mean, lo, hi, pct, buckets) in want.items():
        got = ex._series[key]
        assert (got.count, got.total, got.mean, got.lo, got.hi, got.buckets) == (count, total, mean, lo, hi,
                                                                                 buckets), key
        assert got.percentiles == pct, key


def test_a_wait_section_is_never_scored_and_the_rank_that_waits_longest_is_not_flagged():
    """In a synchronous job the healthy ranks wait longest in the collective: a stat that carries the wait flag
    (``shmstat.section(..., wait=True)``) is never scored, while the same figures on a timed stat are."""
    from collector.read.rows import WindowRow

    mask = to_mask([A.COUNT, A.SUM, A.MEAN])
    detector = StragglerDetector("job", windows=1)

    def rows(wid: int, wait: bool) -> list[WindowRow]:
        name = "allreduce" if wait else "forward"
        waits = {0: 20.0, 1: 20.0, 2: 20.0, 3: 2.0}  # rank 3 computes slowly: it waits least, the others long
        merged = WindowRow("section", name, wid, 100, mask, None, WindowFigures(4, 62.0, 2.0, 20.0, 2.0, 0, False,
                                                                              None), ranks=4, wait=wait)
        return [merged] + [WindowRow("section", name, wid, 100, mask, rank,
                                     WindowFigures(1, ms, ms, ms, ms, 0, False, None), wait=wait)
                           for rank, ms in waits.items()]

    cols = Columns.from_rows("job", rows(1, True) + rows(1, False))
    assert cols.wait.tolist() == [True] * 5 + [False] * 5
    assert cols.scored_stats().tolist() == [False] * 5 + [True] * 5
    update = detector.update_columns(cols)
    assert {s.stat for s in update.scores} == {"forward"}  # the same figures, timed: scored (ranks 0-2 flagged)
    assert {e.stat for e in update.events} <= {"forward"}
    assert cols.take(np.arange(5)).wait.tolist() == [True] * 5 and cols.row(0).wait
