"""Issue 25's window through the collector: 2 real rank processes add 4,240 step times with 3 ``+inf`` and 2
``-inf`` among them. Read from the real segment (both writers), the merged window keeps the scale of its finite
samples and its p50/p99 are within the error bound of numpy's exact ones; through a real collector, the jsonl
Prometheus histogram and the OTLP gauges and ExponentialHistogram points (a real receiver) stay valid and
reconcile: every sample counted, the infinities in ``count``, ``min``, ``max`` and the ``+Inf`` bucket, and out of
the OTLP point's population (whose count is its zero count plus its buckets', as OTLP requires)."""

from __future__ import annotations

import importlib.util
import json
import math
import urllib.request
from collections import defaultdict

import pytest
from kit.percentiles import exact_quantile as _exact
from kit.percentiles import fixed_window_rank, issue_window, nonfinite_rank
from kit.percentiles import hist_of as _hist
from kit.procs import spawn, start_collector, wait_file
from kit.support import wait_for

from collector.read.columns import Columns
from collector.read.rows import WindowRow
from collector.read.scanner import Scanner
from shmstat.aggregation import to_mask
from shmstat.histogram import error_bound
from shmstat.shm.layout_records import WindowFigures
from shmstat.shm.segment import Segment

_HAVE_OTEL = all(importlib.util.find_spec(m) is not None for m in (
    "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.proto"))
INF = math.inf




def _within(got: float, exact: float, scale: int) -> bool:
    if math.isinf(exact):
        return got == exact
    return abs(got - exact) / abs(exact) <= error_bound(scale) + 1e-12


def test_the_merged_window_read_from_the_segment_keeps_its_scale(job, backend, tmp_path):
    t_ns = 1_700_000_000_500_000_000  # mid-window of a 1 s stat
    parts = issue_window(2)
    leave = str(tmp_path / "leave")
    procs = [spawn(fixed_window_rank, job, r, 2, t_ns, parts[r], str(tmp_path / f"ready{r}"), leave)
             for r in range(2)]
    try:
        for r in range(2):
            wait_file(str(tmp_path / f"ready{r}"))
        seg = Segment.open(job, create=False)
        try:
            result = Scanner(seg, 0).scan(t_ns + 5_000_000_000)
        finally:
            seg.close()
    finally:
        open(leave, "w").close()
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    cols = result.columns
    assert len(cols) == 3 and cols.hists.present.all()  # the merged row and one per rank
    everything = parts[0] + parts[1]
    finite = [v for v in everything if math.isfinite(v)]
    for i, row in enumerate(result.rows):
        xs = everything if row.rank is None else parts[row.rank]
        h = row.summary.hist
        assert h is not None and h == _hist(xs)  # exactly the histogram of its samples
        assert (int(cols.hists.pos_inf[i]), int(cols.hists.neg_inf[i])) == (xs.count(INF), xs.count(-INF))
        assert h.scale == _hist([v for v in xs if math.isfinite(v)]).scale  # the infinities changed nothing
        assert (row.summary.count, row.summary.min, row.summary.max) == (len(xs), -INF if -INF in xs else min(xs),
                                                                         INF if INF in xs else max(xs))
    merged = result.rows[0]
    assert merged.rank is None and merged.summary.hist is not None
    scale = merged.summary.hist.scale
    assert scale == _hist(finite).scale and error_bound(scale) < 0.006  # scale 6 or more, not -2
    for q, col in ((0.5, cols.p50), (0.99, cols.p99)):
        got, exact = float(col[0]), _exact(everything, q)
        assert got == merged.summary.quantile(q) and _within(got, exact, scale), (q, got, exact)


@pytest.mark.skipif(not _HAVE_OTEL, reason="opentelemetry not installed (pip install -e '.[test]')")
def test_the_issue_window_through_a_collector_reaches_every_sink_valid(job, tmp_path):
    from kit.otlp import receiver
    from prometheus_client.parser import text_string_to_metric_families

    ranks, window_ms = 2, 1000
    total = sum(map(len, issue_window(ranks)))
    with receiver() as rx:
        coll = start_collector(job, "--handler", f"train=otlp:{rx.endpoint}", "--grace-ms", "10", "--banks", "16",
                               "--prometheus", "127.0.0.1:0",
                               "--status-interval", "0")
        try:
            procs = [spawn(nonfinite_rank, job, r, ranks, window_ms, str(tmp_path / f"r{r}.json"))
                     for r in range(ranks)]
            for p in procs:
                p.join(60)
                assert p.exitcode == 0
            url = coll.prometheus

            def counted():
                with urllib.request.urlopen(url, timeout=5) as r:
                    fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
                c = fams.get("shmstat_stat_count")
                return fams if c and [s.value for s in c.samples if "rank" not in s.labels] == [total] else None

            fams = wait_for(counted, 30, what="every sample counted on /metrics")
        finally:
            assert coll.stop() == 0
        points = rx.points()
    recorded = [json.load(open(tmp_path / f"r{r}.json")) for r in range(ranks)]  # noqa: SIM115
    windows: dict[float, list[float]] = defaultdict(list)
    for per in recorded:
        for w, vs in per.items():
            windows[float(w)] += vs

    # Prometheus: the +Inf bucket (and _count) holds every sample; -inf counts in the lowest bucket
    buckets = [s for s in fams["shmstat_stat_hist"].samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == total
    assert buckets[-2].value == total - 3 and buckets[0].value >= 2

    # OTLP gauges of the merged rows, per window: min/max keep the documented rule (the infinities are in them)
    # and p50/p99 are the merged histogram's, within the bound of the exact figures
    merged = {(p.time_unix_nano, m.name): p.as_double for _r, m, p, a in points
              if m.WhichOneof("data") == "gauge" and "rank" not in a}
    counts = sorted((p.time_unix_nano, p.as_int) for _r, m, p, a in points
                    if m.name == "step_ms.count" and "rank" not in a)
    assert counts[-1][1] == total
    for w, xs in windows.items():
        end = round(w * 1e9) + window_ms * 1_000_000
        h = _hist(xs)
        assert h.scale == _hist([v for v in xs if math.isfinite(v)]).scale
        assert merged[(end, "step_ms.min")] == min(xs) and merged[(end, "step_ms.max")] == max(xs)
        for q, agg in ((0.5, "p50"), (0.99, "p99")):
            got = merged[(end, f"step_ms.{agg}")]
            assert got == h.quantile(q, min(xs), max(xs)) and _within(got, _exact(xs, q), h.scale)
    if len(windows) == 1:  # the usual case: the whole issue window in one window (issue: p50 98.8, p99 134.5)
        ((w, xs),) = windows.items()
        end = round(w * 1e9) + window_ms * 1_000_000
        assert 95 < merged[(end, "step_ms.p50")] < 102 and 125 < merged[(end, "step_ms.p99")] < 145

    # OTLP: one ExponentialHistogram point per window and series whose population is the finite samples
    seen = 0
    for _res, metric, point, attrs in points:
        if metric.name != "step_ms.histogram":
            continue
        w = point.start_time_unix_nano / 1e9
        xs = windows[w] if attrs.get("rank") is None else recorded[attrs["rank"]][str(w)]
        finite = [v for v in xs if math.isfinite(v)]
        h = _hist(xs)
        assert point.count == len(finite) == point.zero_count + sum(point.positive.bucket_counts) \
            + sum(point.negative.bucket_counts)
        assert point.scale == h.scale
        assert point.HasField("sum") == (len(finite) == len(xs))
        assert point.HasField("min") == (-INF not in xs) and point.HasField("max") == (INF not in xs)
        if point.HasField("max"):
            assert point.max == max(finite)
        seen += 1
    assert seen >= 3  # merged and per rank


def test_the_otlp_point_of_a_window_of_infinities_only_is_empty_but_valid():
    pytest.importorskip("opentelemetry.sdk")
    from kit.otlp import receiver

    from collector.handlers.otlp import OtlpMetricHandler
    from shmstat import Aggregation as A

    xs = [INF, -INF, INF]
    s = WindowFigures(3, math.nan, -INF, INF, INF, 0, hist=_hist(xs))
    with receiver() as rx:
        h = OtlpMetricHandler(rx.endpoint, host="node-a", timeout_s=2.0)
        row = WindowRow("g", "lat", 10, 100, to_mask([A.COUNT, A.P50, A.P99]), None, s)
        h.emit_columns(Columns.from_rows("j", [row]))
        h.close()
        points = rx.points()
    (point,) = [p for _r, m, p, _a in points if m.name == "lat.histogram"]
    assert (point.count, point.zero_count, list(point.positive.bucket_counts)) == (0, 0, [])
    assert not point.HasField("sum") and not point.HasField("min") and not point.HasField("max")
    gauges = {m.name: p.as_double for _r, m, p, _a in points if m.WhichOneof("data") == "gauge"}
    assert gauges == {"lat.p50": INF, "lat.p99": INF}
    (count,) = [p.as_int for _r, m, p, _a in points if m.name == "lat.count"]
    assert count == 3
