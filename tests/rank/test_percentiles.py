"""Percentiles: exponential histograms per window. Accuracy against exact quantiles (numpy) on several
distributions, exact merging across ranks, the C and pure-Python writers writing the same bytes, the seqlock
covering the histogram while a rank writes, capacity errors, and 4 real ranks whose merged and per-rank p50..p999
rows are exactly the quantiles of all their samples' histogram."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.percentiles import busy_writer, histogram_bytes, percentile_rank_main, rank_samples
from kit.procs import spawn, wait_file
from kit.support import FakeClock

import shmstat
from shmstat import Aggregation as A
from shmstat import _backend
from shmstat.histogram import MAX_BUCKETS, MIN_SCALE, Histogram, error_bound, merge_histograms
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.layout_records import StatDescriptor
from shmstat.shm.segment import Segment

QS = (0.5, 0.9, 0.99, 0.999)
_rng = np.random.default_rng(2026)
DISTRIBUTIONS = {
    "uniform": _rng.uniform(1.0, 100.0, 50_000),
    "lognormal-long-tail": _rng.lognormal(0.0, 2.5, 50_000),
    "bimodal": np.concatenate([_rng.normal(10.0, 1.0, 25_000), _rng.normal(1000.0, 50.0, 25_000)]),
    "constant": np.full(5_000, 3.25),
    "span-1e-6-to-1e6": 10.0 ** _rng.uniform(-6.0, 6.0, 50_000),
    "negative-and-zero": np.concatenate([_rng.normal(0.0, 5.0, 20_000), np.zeros(500)]),
    "span-2^8": _rng.uniform(1.0, 256.0, 50_000),
}


def _exact(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q, method="inverted_cdf"))  # the order statistic of rank ceil(q n)


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_every_quantile_is_within_the_bound_of_the_scale(name):
    x = DISTRIBUTIONS[name]
    h = Histogram()
    for v in x.tolist():
        h.add(v)
    assert h.count == len(x) and h.scale >= MIN_SCALE
    for q in QS:
        exact, got = _exact(x, q), h.quantile(q, float(x.min()), float(x.max()))
        if exact == 0.0:
            assert got == 0.0
        else:
            assert abs(got - exact) / abs(exact) <= error_bound(h.scale) + 1e-12, (q, exact, got, h.scale)
    if name == "span-2^8":
        assert error_bound(h.scale) <= 0.02  # values spanning up to 2^8 keep scale 5 or better


def test_the_same_figures_in_process_and_in_a_job(job):
    x = DISTRIBUTIONS["lognormal-long-tail"][:20_000].tolist()
    got = []
    for attached in (False, True):
        if attached:
            shmstat.init(job, rank=0)
        clock = FakeClock()
        clock.to_window(1000, 1)
        stat = shmstat.Stat("lat", [A.COUNT, A.P50, A.P90, A.P99, A.P999], 1.0, clock=clock)
        for v in x:
            stat.add(v)
        clock.advance_ms(1000)
        stat.add(1.0)
        got.append(stat.get())
        shmstat.shutdown()
    assert got[0] == got[1]
    assert got[0][A.COUNT] == len(x)
    for agg, q in ((A.P50, 0.5), (A.P99, 0.99)):
        assert got[0][agg] == pytest.approx(_exact(np.array(x), q), rel=0.09)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.floats(-1e12, 1e12, allow_nan=False), st.just(0.0),
                                   st.floats(1e-300, 1e-280)), max_size=60), min_size=1, max_size=6))
def test_merging_ranks_gives_exactly_the_histogram_of_all_their_samples(parts):
    hists = []
    for samples in parts:
        h = Histogram()
        for v in samples:
            h.add(v)
        hists.append(h)
    alone = Histogram()
    for v in (v for samples in parts for v in samples):
        alone.add(v)
    merged = merge_histograms(hists)
    assert merged is not None
    assert (merged.scale, merged.zero, merged.pos, merged.neg) == (alone.scale, alone.zero, alone.pos, alone.neg)
    for h in (merged,):
        for side in (h.pos, h.neg):
            assert not side or max(side) - min(side) < MAX_BUCKETS


def test_the_c_and_pure_python_writers_write_the_same_histogram_bytes(job):
    if not _backend.c_available():
        pytest.skip("the C extensions are not built")
    rng = np.random.default_rng(5)
    values = [*(10.0 ** rng.uniform(-8, 8, 600)).tolist(), *(-(10.0 ** rng.uniform(-3, 3, 200))).tolist(),
              0.0, -0.0, math.inf, -math.inf, 5e-324, 1.7976931348623157e308]
    rng.shuffle(values)
    c_bytes = histogram_bytes(job + "c", False, values)
    py_bytes = histogram_bytes(job + "p", True, values)
    assert c_bytes == py_bytes
    h = codec.decode_hist(memoryview(c_bytes), 0)
    assert h is not None and h.count == len(values)


def test_a_reader_never_sees_a_torn_histogram(job, tmp_path):
    """A rank adds values spanning 12 decades as fast as it can (scale changes in every window); every
    consistent copy of a bank has a histogram counting exactly the bank's samples."""
    ready = str(tmp_path / "ready")
    p = spawn(busy_writer, job, 1.5, ready)
    try:
        wait_file(ready)
        seg = Segment.open(job, create=False)
        try:
            geo = seg.geometry
            checked = 0
            while p.is_alive() and checked < 3000:
                descs = seg.descriptors(0)
                if not descs:
                    continue
                d = descs[0]
                for b in range(geo.banks):
                    snap = codec.read_bank(seg.buf, geo.slot_offset(0, d.index) + b * L.BANK_SIZE,
                                       hist_offset=geo.hist_offset(0, d.hist) + b * L.HIST_SIZE)
                    if not snap.torn and snap.count:
                        assert snap.hist is not None and snap.hist.count == snap.count
                        checked += 1
        finally:
            seg.close()
    finally:
        p.join(30)
    assert p.exitcode == 0 and checked > 100


def test_percentile_stats_past_the_table_are_dropped_counted_and_write_nothing(job, caplog):
    shmstat.init(job, rank=0, max_ranks=2, max_stats=64, banks=4)
    stats = [shmstat.Stat(f"p{i}", [A.P99], 1.0) for i in range(L.DEFAULT_HIST_SLOTS)]
    extra = shmstat.Stat("one-too-many", [A.P50], 1.0)  # no histogram left: drop mode, nothing raises
    for v in (1.0, 2.0):
        extra.add(v)
    shmstat.Stat("plain", [A.MEAN], 1.0)  # stats without percentiles still fit
    seg = shmstat.job._state.STATE.attachment.segment
    names = [d.name for d in seg.descriptors(0)]
    assert "one-too-many" not in names and "plain" in names and len(stats) == L.DEFAULT_HIST_SLOTS
    assert (seg.rank(0).dropped, seg.rank(0).stats_refused) == (2, 1)
    assert "--max-percentile-stats" in caplog.text and "SHMSTAT_MAX_PERCENTILE_STATS" in caplog.text


def test_a_descriptor_with_a_histogram_out_of_range_is_refused():
    geo = L.Geometry(2, 4, 4, 2)
    desc = StatDescriptor(0, 0, "s", "g", 100, 1, 1 << 10, -1, 1, 0, 7)
    assert "histogram 7" in (codec.descriptor_problem(desc, geo) or "")
    no_hist = StatDescriptor(0, 0, "s", "g", 100, 1, 1 << 12, -1, 1, 0, -1)
    assert "without a histogram" in (codec.descriptor_problem(no_hist, geo) or "")


def test_four_ranks_merged_and_per_rank_percentiles_are_those_of_all_their_samples(shmstat_job_factory, tmp_path):
    import json

    sj = shmstat_job_factory(collector_args=["--banks", "16"])
    n, window_ms = 6000, 100
    sj.run_ranks(percentile_rank_main, 4, args=(sj.job, 4, n, window_ms, str(tmp_path)), timeout=120)
    sj.wait_for_rows("step_ms", "count", total=4 * n, timeout=30)
    rows = [{"name": f"{r.stat}.{r.agg}", "rank": r.rank, "window_start": r.window_start, "value": r.value}
            for r in sj.rows()]
    tallies = {r: json.load(open(tmp_path / f"r{r}.json")) for r in range(4)}  # noqa: SIM115
    windows = {float(w) for t in tallies.values() for w in t}
    checked = 0
    for w in windows:
        parts = {rank: t.get(repr(w), t.get(str(w), [])) for rank, t in tallies.items()}
        everything = [v for vs in parts.values() for v in vs]
        h = Histogram()
        for v in everything:
            h.add(v)
        for agg, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
            (merged,) = [r["value"] for r in rows
                         if r["name"] == f"step_ms.{agg}" and r["rank"] is None and r["window_start"] == w]
            assert merged == h.quantile(q, min(everything), max(everything))  # exactly the merged histogram
            exact = _exact(np.array(everything), q)
            assert abs(merged - exact) / exact <= error_bound(h.scale) + 1e-12
            checked += 1
        for rank, vs in parts.items():
            if not vs:
                continue
            hr = Histogram()
            for v in vs:
                hr.add(v)
            (mine,) = [r["value"] for r in rows
                       if r["name"] == "step_ms.p99" and r["rank"] == rank and r["window_start"] == w]
            assert mine == hr.quantile(0.99, min(vs), max(vs))
    assert checked >= 4 and len(rank_samples(0, 3)) == 3


def test_percentile_keys_in_the_stat_event_and_on_the_stat_stream():
    from collector.read.rows import WindowRow
    from shmstat.shm.layout_records import WindowFigures

    events = []
    handle = shmstat.register_event_handler(events.append)
    try:
        clock = FakeClock()
        clock.to_window(100, 1)
        stat = shmstat.Stat("lat", [A.MEAN, A.P50, A.P90, A.P99, A.P999], 0.1, clock=clock)
        for v in (1.0, 2.0, 3.0, 4.0):
            stat.add(v)
        clock.advance_ms(100)
        stat.add(5.0)
    finally:
        shmstat.unregister_event_handler(handle)
    (event,) = [e for e in events if e.name == "torch.monitor.Stat"]
    assert list(event.data) == ["lat.mean", "lat.p50", "lat.p90", "lat.p99", "lat.p999"]
    bound = error_bound(7) + 1e-12  # values 1..4 keep scale 7; 2.0 and 4.0 sit on bucket edges: the bound itself
    assert event.data["lat.p50"] == pytest.approx(2.0, rel=bound)
    assert event.data["lat.p999"] == pytest.approx(4.0, rel=bound)
    h = Histogram()
    for v in (1.0, 2.0, 3.0, 4.0):
        h.add(v)
    wire = WindowRow("g", "lat", 7, 100, 1 << 10, None, WindowFigures(4, 10.0, 1.0, 4.0, 4.0, 0, hist=h)).to_wire()
    assert wire["p50"] == h.quantile(0.5, 1.0, 4.0) and wire["p999"] == h.quantile(0.999, 1.0, 4.0)
    assert wire["hist"]["scale"] == h.scale and sum(wire["hist"]["pos"][1]) == 4
