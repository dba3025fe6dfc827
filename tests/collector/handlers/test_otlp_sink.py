"""The ``otlp:ENDPOINT`` handler against a real OTLP/HTTP receiver started by the test (no OTel Collector binary
is available here): windows of real rank processes, through a real collector subprocess, reconcile exactly."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import time
from collections import Counter, defaultdict

import pytest
from kit.percentiles import percentile_rank
from kit.procs import assert_rank_workers_reconcile, read_jsonl, spawn, start_collector
from kit.support import wait_for

from collector.handlers.specs import build_handler
from elastic.metrics import MetricData
from shmstat.errors import ConfigError
from shmstat.histogram import Histogram

_HAVE_OTEL = all(importlib.util.find_spec(m) is not None for m in (
    "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.proto"))
needs_otel = pytest.mark.skipif(not _HAVE_OTEL, reason="opentelemetry not installed (pip install -e '.[test]')")

CUMULATIVE, DELTA = 2, 1  # AggregationTemporality in the proto
WINDOW_MS = 100


def _dense(counts: dict[int, int]) -> tuple[int, list[int]]:
    first = min(counts)
    return first, [counts.get(i, 0) for i in range(first, max(counts) + 1)]


def _hist(samples: list[float]) -> Histogram:
    h = Histogram()
    for v in samples:
        h.add(v)
    return h


def test_without_opentelemetry_the_spec_is_one_sentence_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.metric_exporter", None)
    with pytest.raises(ConfigError) as err:
        build_handler("otlp:http://127.0.0.1:4318/v1/metrics")
    assert "pip install 'shmstat[otlp]'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("spec", ["otlp:", "otlp:127.0.0.1:4318", "otlp:ftp://h/v1/metrics", "otlp:http://"])
def test_a_bad_endpoint_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="otlp"):
        build_handler(spec)


@needs_otel
def test_windows_of_real_ranks_reconcile_exactly_at_the_receiver(job, tmp_path):
    from kit.otlp import receiver

    ranks, n = 3, 12000
    with receiver() as rx:
        coll = start_collector(job, "--handler", f"train=otlp:{rx.endpoint}", "--grace-ms", "10", "--banks", "16")
        try:
            procs = [spawn(percentile_rank, job, r, ranks, n, WINDOW_MS, str(tmp_path / f"r{r}.json"))
                     for r in range(ranks)]
            for p in procs:
                p.join(120)
                assert p.exitcode == 0
        finally:
            assert coll.stop() == 0
        points = rx.points()
    # the samples of each rank per window, keyed by window start in ms
    recorded = {r: {round(float(w) * 1000): vs for w, vs in json.load(open(tmp_path / f"r{r}.json")).items()}  # noqa: SIM115
                for r in range(ranks)}
    every_window = {w for per in recorded.values() for w in per}
    assert len(every_window) >= 2  # the running totals cross windows

    def samples(rank: int | None, window_ms: int) -> list[float]:
        if rank is not None:
            return recorded[rank].get(window_ms, [])
        return [v for per in recorded.values() for v in per.get(window_ms, [])]

    assert points
    by_name: dict[str, list] = defaultdict(list)
    for res, metric, point, attrs in points:
        assert res["host.name"] == socket.gethostname() and res["service.name"] == "shmstat"
        assert attrs["job"] == job and attrs["group"] == "train" and attrs["stat"] == "step_ms"
        by_name[metric.name].append((metric, point, attrs.get("rank")))
    assert "step_ms.mean" not in by_name  # not asked for

    # count and sum: cumulative Sums per series; each step is one window's count, the last one the total
    for name in ("step_ms.count", "step_ms.sum"):
        series: dict[int | None, list] = defaultdict(list)
        for metric, point, rank in by_name[name]:
            assert metric.sum.aggregation_temporality == CUMULATIVE and metric.sum.is_monotonic
            series[rank].append(point)
        assert set(series) == {None, *range(ranks)}
        for rank, pts in series.items():
            pts.sort(key=lambda p: p.time_unix_nano)
            assert len({p.start_time_unix_nano for p in pts}) == 1  # the series' first window start
            assert pts[0].start_time_unix_nano == pts[0].time_unix_nano - WINDOW_MS * 1_000_000
            values = [p.as_int if name.endswith("count") else p.as_double for p in pts]
            assert values == sorted(values)
            if name.endswith("count"):
                assert values[-1] == (n if rank is not None else ranks * n)
                steps = {p.time_unix_nano // 1_000_000 - WINDOW_MS: v - prev
                         for p, v, prev in zip(pts, values, [0, *values[:-1]], strict=True) if v != prev}
                windows = every_window if rank is None else recorded[rank]
                assert steps == {w: len(samples(rank, w)) for w in windows if samples(rank, w)}
            else:
                total = sum(sum(samples(rank, w)) for w in every_window)
                assert values[-1] == pytest.approx(total, rel=1e-9)

    # one ExponentialHistogram point (delta) per window and series: the window's histogram, bucket by bucket
    seen = Counter()
    for metric, point, rank in by_name["step_ms.histogram"]:
        assert metric.exponential_histogram.aggregation_temporality == DELTA
        assert point.time_unix_nano - point.start_time_unix_nano == WINDOW_MS * 1_000_000
        window = point.start_time_unix_nano // 1_000_000
        xs = samples(rank, window)
        h = _hist(xs)
        assert (point.scale, point.zero_count, point.count) == (h.scale, h.zero, len(xs))
        assert (point.positive.offset, list(point.positive.bucket_counts)) == _dense(h.pos)
        assert not point.negative.bucket_counts
        assert (point.min, point.max) == (min(xs), max(xs)) and point.sum == pytest.approx(sum(xs), rel=1e-9)
        seen[(rank, window)] += 1
    expected = {(r, w) for r in range(ranks) for w in recorded[r]} | {(None, w) for w in every_window}
    assert seen == Counter(expected)  # every window once, none twice

    # percentiles as Gauges at the window's end: the figures of the merged histogram
    p99 = [(p, r) for _m, p, r in by_name["step_ms.p99"] if r is None]
    assert len(p99) == len(every_window)
    for point, _rank in p99:
        xs = samples(None, point.time_unix_nano // 1_000_000 - WINDOW_MS)
        assert point.as_double == _hist(xs).quantile(0.99, min(xs), max(xs))


@needs_otel
@pytest.mark.parametrize("mode", ["down", "error-500"])
def test_a_failing_receiver_neither_crashes_nor_stalls_the_collector(job, tmp_path, mode):
    from kit.otlp import receiver, two_group_rank

    other, own = str(tmp_path / "other.jsonl"), str(tmp_path / "own.jsonl")
    with receiver() as rx:
        if mode == "down":
            rx.close()  # nothing listens on the port any more
        else:
            rx.status = 500
        coll = start_collector(job, "--handler", f"train=otlp:{rx.endpoint}", "--handler", f"other=jsonl:{other}",
                               "--handler", f"shmstat=jsonl:{own}", "--grace-ms", "10")
        try:
            p = spawn(two_group_rank, job, 0, 1.5, WINDOW_MS, str(tmp_path / "r0.json"))
            p.join(60)
            assert p.exitcode == 0

            def errors() -> float:
                return max((r["value"] for r in read_jsonl(own) if r["name"] == "collector.handler_errors"),
                           default=0)

            wait_for(errors, 20, 0.05, what="collector.handler_errors > 0")  # the failure is counted
        finally:
            t0 = time.monotonic()
            assert coll.stop() == 0
            assert time.monotonic() - t0 < 10  # a handler stuck in an export is left behind at shutdown
        if mode == "error-500":
            assert rx.refused >= 1 and not rx.requests
    assert_rank_workers_reconcile(read_jsonl(other), tmp_path, 1)  # the other group: every window, once


@needs_otel
def test_totals_carry_over_failed_exports_and_a_signed_sum_is_not_monotonic():
    from kit.otlp import receiver

    from collector.handlers.otlp import OtlpExportError, OtlpMetricHandler
    from collector.read.columns import Columns
    from collector.read.rows import WindowRow
    from shmstat import Aggregation as A
    from shmstat.aggregation import to_mask
    from shmstat.shm.layout_records import WindowFigures

    mask = to_mask([A.COUNT, A.SUM, A.MIN, A.P50])

    def row(wid: int, xs: list[float], name: str = "lat", rank: int | None = 0) -> WindowRow:
        s = WindowFigures(len(xs), sum(xs), min(xs), max(xs), xs[-1], wid, hist=_hist(xs))
        return WindowRow("g", name, wid, WINDOW_MS, mask, rank, s)

    now = [100.0]
    with receiver() as rx:
        h = OtlpMetricHandler(rx.endpoint, host="node-a", clock=lambda: now[0], timeout_s=2.0)
        h.emit_columns(Columns.from_rows("j", [row(10, [1.0, 2.0])]))
        h.emit_columns(Columns.from_rows("j", [row(10, [-1.0, 0.0, 4.0], name="delta")]))
        h.emit(MetricData(1.5, "g", "put.loss", 0.25))
        h.flush()
        rx.status = 500
        h.emit_columns(Columns.from_rows("j", [row(11, [3.0])]))
        with pytest.raises(OtlpExportError, match="500"):
            h.flush()
        rx.status = 200
        h.emit_columns(Columns.from_rows("j", [row(12, [5.0, 6.0, 7.0])]))
        with pytest.raises(OtlpExportError, match="dropped"):
            h.flush()  # within the wait after a failure: dropped, not sent
        now[0] += 1.5
        h.emit_columns(Columns.from_rows("j", [row(13, [8.0])]))
        h.flush()
        h.close()
        points = rx.points()
    assert (h.exports, h.failures) == (2, 2) and len(rx.requests) == 2 and rx.refused == 1
    counts = [(p.start_time_unix_nano, p.time_unix_nano, p.as_int)
              for _r, m, p, _a in points if m.name == "lat.count"]
    w = WINDOW_MS * 1_000_000
    assert counts == [(10 * w, 11 * w, 2), (10 * w, 14 * w, 2 + 1 + 3 + 1)]  # the dropped windows counted on
    sums = {m.name: m.sum.is_monotonic for _r, m, _p, _a in points if m.name.endswith(".sum")}
    assert sums == {"lat.sum": True, "delta.sum": False}
    gauges = {(m.name, a.get("rank"), p.time_unix_nano): p.as_double
              for _r, m, p, a in points if m.WhichOneof("data") == "gauge"}
    assert gauges == {("put.loss", None, 1_500_000_000): 0.25,  # a put metric, at its timestamp
                      ("lat.min", 0, 11 * w): 1.0, ("lat.p50", 0, 11 * w): _hist([1.0, 2.0]).quantile(0.5, 1.0, 2.0),
                      ("delta.min", 0, 11 * w): -1.0, ("delta.p50", 0, 11 * w): 0.0,
                      ("lat.min", 0, 14 * w): 8.0, ("lat.p50", 0, 14 * w): 8.0}
    (delta_hist,) = [p for _r, m, p, _a in points if m.name == "delta.histogram"]
    assert (delta_hist.zero_count, sum(delta_hist.negative.bucket_counts), sum(delta_hist.positive.bucket_counts)) \
        == (1, 1, 1)
    assert {res["host.name"] for res, *_ in points} == {"node-a"}
