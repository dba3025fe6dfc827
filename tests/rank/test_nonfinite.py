"""Non-finite samples and percentiles: ``+inf`` and ``-inf`` are counted apart from the buckets (as NaN is counted
apart from the window) and never lower a histogram's scale; quantiles rank them at the ends. Issue 25's window
(3 ``+inf`` and 2 ``-inf`` among 4,240 samples) in one histogram, a quantile landing among the infinities, a
window of infinities only, exact merging with infinities, the C and pure-Python writers' bytes, a reused bank
forgetting its infinities, and the histogram's wire map."""

from __future__ import annotations

import math
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.percentiles import exact_quantile as _exact
from kit.percentiles import hist_of as _hist
from kit.percentiles import histogram_bytes, issue_window
from kit.support import FakeClock

import shmstat
from shmstat import Aggregation as A
from shmstat import _backend, wire
from shmstat.errors import WireError
from shmstat.histogram import MAX_SCALE, Histogram, error_bound, merge_histograms
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec

INF = math.inf




def _close(got: float, exact: float, scale: int) -> bool:
    if math.isinf(exact) or exact == 0.0:
        return got == exact
    if abs(exact) < sys.float_info.min:  # subnormal: a bucket's value there underflows (to 0.0 at coarse scales)
        return abs(got - exact) <= sys.float_info.min
    return abs(got - exact) / abs(exact) <= error_bound(scale) + 1e-12


def test_the_issue_window_keeps_its_scale_and_its_percentiles():
    (x,) = issue_window(1)
    finite = [v for v in x if math.isfinite(v)]
    h, h_finite = _hist(x), _hist(finite)
    assert (h.pos_inf, h.neg_inf, h.count, h.finite_count) == (3, 2, 4245, 4240)
    assert (h.scale, h.zero, h.pos, h.neg) == (h_finite.scale, h_finite.zero, h_finite.pos, h_finite.neg)
    assert h.scale >= 6  # values within a factor of 2: the infinities no longer force scale -2
    for q in (0.5, 0.9, 0.99, 0.999):
        exact, got = _exact(x, q), h.quantile(q, min(x), max(x))
        assert math.isfinite(got) and _close(got, exact, h.scale), (q, got, exact)
    assert 95 < h.quantile(0.5) < 102 and 125 < h.quantile(0.99) < 145  # issue: p50 98.8, p99 134.5 (not 30.1)


def test_a_quantile_among_the_infinities_is_that_infinity():
    x = [-INF, -INF, -3.0, 0.0, 1.0, 2.0, 5.0, INF, INF, INF]
    h = _hist(x)
    assert (h.neg_inf, h.pos_inf, h.scale) == (2, 3, _hist([v for v in x if math.isfinite(v)]).scale)
    qs = [k / 1000 for k in range(1, 1001)]
    got = h.quantiles(qs, min(x), max(x))
    for q, g in zip(qs, got, strict=True):
        assert _close(g, _exact(x, q), h.scale), (q, g, _exact(x, q))
    assert h.quantile(0.2) == -INF and h.quantile(0.21) < 0 and h.quantile(0.7) > 0 and h.quantile(0.71) == INF
    assert h.quantile(1.0) == INF and h.quantile(1e-9) == -INF


@pytest.mark.parametrize("x", [[INF] * 4, [-INF] * 3, [INF, -INF, INF], [-INF, INF]])
def test_a_window_of_infinities_only(x):
    h = _hist(x)
    assert (h.scale, h.zero, h.pos, h.neg, h.finite_count, h.count) == (MAX_SCALE, 0, {}, {}, 0, len(x))
    assert (h.pos_inf, h.neg_inf) == (x.count(INF), x.count(-INF))
    for q in (1e-9, 0.5, 0.99, 1.0):
        assert h.quantile(q, min(x), max(x)) == _exact(x, q)
    # merged with a window of finite samples: the scale is that of the finite ones
    other = _hist([1.0, 300.0, 7.5])
    merged = merge_histograms([h, other])
    assert merged is not None
    assert (merged.scale, merged.pos, merged.pos_inf, merged.neg_inf) == (other.scale, other.pos, h.pos_inf,
                                                                          h.neg_inf)


_SAMPLE = st.one_of(st.floats(allow_nan=False), st.sampled_from([INF, -INF, 0.0]), st.floats(-1e6, 1e6))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_SAMPLE, max_size=40), min_size=1, max_size=6))
def test_merging_ranks_with_infinities_gives_exactly_the_histogram_of_all_their_samples(parts):
    everything = [v for samples in parts for v in samples]
    merged = merge_histograms([_hist(samples) for samples in parts])
    alone = _hist(everything)
    assert merged == alone  # scale, zero, buckets, pos_inf and neg_inf
    assert (alone.pos_inf, alone.neg_inf) == (everything.count(INF), everything.count(-INF))
    assert alone.scale == _hist([v for v in everything if math.isfinite(v)]).scale
    if everything:
        for q in (1e-9, 0.5, 0.99, 1.0):
            assert _close(alone.quantile(q, min(everything), max(everything)), _exact(everything, q), alone.scale)


def test_the_c_and_pure_python_writers_count_infinities_apart_in_the_same_bytes(job):
    if not _backend.c_available():
        pytest.skip("the C extensions are not built")
    rng = np.random.default_rng(11)
    values = [*(10.0 ** rng.uniform(-2, 2, 500)).tolist(), *(-(10.0 ** rng.uniform(-1, 1, 100))).tolist(), 0.0,
              *([INF] * 7), *([-INF] * 4), 1.7976931348623157e308]
    rng.shuffle(values)
    c_bytes = histogram_bytes(job + "c", False, values)
    assert c_bytes == histogram_bytes(job + "p", True, values)
    h = codec.decode_hist(memoryview(c_bytes), 0)
    assert h is not None and h == _hist(values) and (h.pos_inf, h.neg_inf, h.count) == (7, 4, len(values))
    assert int.from_bytes(c_bytes[L.HI_POS_INF:L.HI_POS_INF + 8], "little") == 7
    assert int.from_bytes(c_bytes[L.HI_NEG_INF:L.HI_NEG_INF + 8], "little") == 4


def test_a_reused_bank_forgets_the_infinities_of_its_previous_window(job, backend):
    shmstat.init(job, rank=0, publish=False)
    clock = FakeClock()
    clock.to_window(1000, 1)
    stat = shmstat.Stat("lat", [A.COUNT, A.P99], 1.0, clock=clock)
    seg = shmstat.job._state.STATE.attachment.segment
    geo = seg.geometry
    (d,) = seg.descriptors(0)

    def window_hist() -> Histogram:
        wid = clock() // 1_000_000_000
        bank = wid % geo.banks
        snap = codec.read_bank(seg.buf, geo.slot_offset(0, d.index) + bank * L.BANK_SIZE,
                               hist_offset=geo.hist_offset(0, d.hist) + bank * L.HIST_SIZE)
        assert snap.wid == wid and snap.hist is not None and snap.hist.count == snap.count
        return snap.hist

    for v in (INF, 2.0, -INF, INF):
        stat.add(v)
    assert (window_hist().pos_inf, window_hist().neg_inf, window_hist().count) == (2, 1, 4)
    clock.advance_ms(1000 * geo.banks)  # the same bank, a later window
    for v in (3.0, 4.0):
        stat.add(v)
    assert window_hist() == _hist([3.0, 4.0])


def test_the_wire_map_carries_the_infinities_only_when_there_are_some():
    finite = _hist([1.0, 2.0, -1.0, 0.0])
    assert set(finite.to_wire()) == {"scale", "zero", "pos", "neg"}  # unchanged for finite windows
    h = _hist([1.0, 2.0, INF, -INF, -INF])
    item = {"group": "g", "name": "s", "count": 5, "p99": INF, "hist": h.to_wire()}
    assert (item["hist"]["pos_inf"], item["hist"]["neg_inf"]) == (1, 2)
    msg = wire.decode(wire.stat_topic("g", "s").encode(), wire.encode("stat", -1, 1, 0, 0, [item]))
    assert msg.items == [item]
    for bad in ({**h.to_wire(), "pos_inf": -1}, {**h.to_wire(), "neg_inf": 1.0}, {**h.to_wire(), "pos_inf": True},
                {**h.to_wire(), "nan": 1}):
        with pytest.raises(WireError, match="hist"):
            wire.encode("stat", -1, 1, 0, 0, [{**item, "hist": bad}])
        payload = msgpack.packb({"v": 1, "k": "stat", "r": -1, "p": 1, "i": 0, "s": 0,
                                 "items": [{**item, "hist": bad}]})
        with pytest.raises(WireError, match="hist"):
            wire.decode(b"stat/g/s", payload)
