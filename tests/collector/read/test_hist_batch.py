"""HistBatch (the collector's histograms of many windows as arrays) against shmstat.histogram's objects on
random input: the same histograms after a round trip, row selection and assembly, the same merge as
merge_histograms, the same floats as Histogram.quantiles; and merge_parts' percentile columns against the
per-object path."""

from __future__ import annotations

import math
import random
import sys

import numpy as np
import pytest

from collector.read.columns import Parts, StatTable, merge_parts
from collector.read.hist_batch import HistBatch
from shmstat.aggregation import PERCENTILES, to_mask
from shmstat.aggregation import Aggregation as A
from shmstat.histogram import MAX_BUCKETS, Histogram, bucket_estimate, merge_histograms

QS = (1e-9, 0.25, 0.5, 0.55, 0.9, 0.99, 0.999, 1.0)  # 0.55 * 100 = 55.00000000000001: rank 55


def _value(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.05:
        return 0.0
    if kind < 0.08:
        return rng.choice((sys.float_info.max, math.inf, -math.inf, 5e-324, -5e-324, -sys.float_info.max, 1e-300))
    sign = -1.0 if rng.random() < 0.2 else 1.0
    return sign * 2.0 ** rng.uniform(-40, 40) if rng.random() < 0.3 else sign * rng.uniform(0.5, 8.0)


def _hist(rng: random.Random) -> Histogram | None:
    if rng.random() < 0.15:
        return None
    h = Histogram()
    for _ in range(rng.choice((0, 1, 3, 20, 100, 200))):
        h.add(_value(rng))
    return h


def _hists(rng: random.Random, n: int) -> list[Histogram | None]:
    return [_hist(rng) for _ in range(n)]


def test_round_trip_and_selection():
    rng = random.Random(1)
    for _ in range(30):
        hs = _hists(rng, rng.randint(0, 12))
        b = HistBatch.from_histograms(hs)
        assert list(b.histograms()) == hs
        assert b.present.tolist() == [h is not None for h in hs]
        if not hs:
            continue
        idx = np.array([rng.randrange(len(hs)) for _ in range(rng.randint(0, 2 * len(hs)))], np.int64)
        assert list(b[idx].histograms()) == [hs[i] for i in idx]
        mask = np.array([rng.random() < 0.5 for _ in hs])
        assert list(b[mask].histograms()) == [h for h, m in zip(hs, mask, strict=True) if m]
        assert list(b[1:].histograms()) == hs[1:]
        other = _hists(rng, 3)
        both = HistBatch.concat([b, HistBatch.from_histograms(other)])
        assert list(both.histograms()) == hs + other
        pos = np.array(rng.sample(range(len(hs) + 4), len(hs)))
        placed = HistBatch.assemble(len(hs) + 4, [(pos, b)]).histograms()
        want: list[Histogram | None] = [None] * (len(hs) + 4)
        for p, h in zip(pos.tolist(), hs, strict=True):
            want[p] = h
        assert list(placed) == want
    assert len(HistBatch.empty(3)) == 3 and list(HistBatch.empty(3).histograms()) == [None] * 3
    assert len(HistBatch.assemble(0, [])) == 0


def test_merge_groups_is_merge_histograms():
    rng = random.Random(2)
    for _ in range(60):
        n = rng.randint(1, 16)
        hs = _hists(rng, n)
        groups = rng.randint(1, 5)
        group = np.array([rng.randrange(groups) for _ in range(n)], np.int64)
        use = np.array([rng.random() < 0.8 for _ in range(n)])
        got = list(HistBatch.from_histograms(hs).merge_groups(group, groups, use).histograms())
        want = [merge_histograms(h for h, g, u in zip(hs, group, use, strict=True) if g == k and u)
                for k in range(groups)]
        assert got == want


def test_merge_lowers_the_scale_when_the_union_spans_too_wide():
    lo, hi = Histogram(), Histogram()
    lo.add(1.0)
    hi.add(2.0 ** 100)  # each alone keeps a high scale; together they need a much lower one
    b = HistBatch.from_histograms([lo, hi]).merge_groups(np.zeros(2, np.int64), 1, np.ones(2, bool))
    want = merge_histograms([lo, hi])
    assert want is not None and want.scale < lo.scale
    assert list(b.histograms()) == [want]
    assert max(want.pos) - min(want.pos) < MAX_BUCKETS


@pytest.mark.parametrize("seed", range(4))
def test_quantiles_are_histogram_quantiles(seed):
    rng = random.Random(seed)
    hs = _hists(rng, 40)
    for _ in range(10):  # narrow ranges keep fine buckets: neighbouring ranks fall in different ones
        h = Histogram()
        for _ in range(100):
            h.add(rng.uniform(0.5, 8.0))
        hs.append(h)
    lo = np.array([rng.choice((-math.inf, -1.0, 0.5, 1.0, math.nan)) for _ in hs])
    hi = np.array([rng.choice((math.inf, 4.0, 1e300, math.nan)) for _ in hs])
    got = HistBatch.from_histograms(hs).quantiles(QS, lo, hi)
    for r, h in enumerate(hs):
        want = [0.0] * len(QS) if h is None else h.quantiles(QS, float(lo[r]), float(hi[r]))
        assert got[r].tolist() == want, (r, h)


def test_bucket_estimates_at_every_scale_and_past_the_double_range():
    scales, index = [], []
    for s in range(-4, 9):
        for i in (*range(-600, 600, 7), 2**20, -(2**20), 300 << max(s, 0), -(1100 << max(s, 0))):
            scales.append(s)
            index.append(i)
    from collector.read.hist_batch import _estimate

    got = _estimate(np.array(scales, np.int64), np.array(index, np.int64)).tolist()
    assert got == [bucket_estimate(s, i) for s, i in zip(scales, index, strict=True)]


def test_merge_parts_percentiles_are_the_object_paths():
    """A pass of 2 stats x ranks with up to 2 writers each: every row's histogram is merge_histograms of its
    non-empty parts, and its percentiles are that histogram's quantiles clamped to the row's min and max."""
    rng = random.Random(5)
    mask = to_mask([A.COUNT, A.MEAN, A.P50, A.P90, A.P99, A.P999])
    stats = StatTable(np.array(["g", "g"], object), np.array(["a", "b"], object), np.array([100, 100]),
                      np.array([mask, mask]), np.array([False, False]), np.array([True, True]), np.array([0, 1]))
    for wid in range(1, 15):
        parts = []
        for key in range(2):
            for rank in range(rng.randint(1, 5)):
                for _ in range(rng.choice((1, 2))):
                    vals = [_value(rng) for _ in range(rng.choice((0, 1, 4, 50)))]
                    h = Histogram()
                    for v in vals:
                        h.add(v)
                    h_or_none = None if rng.random() < 0.1 else h
                    parts.append((key, rank, len(parts), wid, len(vals), float(sum(vals)) if vals else 0.0,
                                  min(vals, default=0.0), max(vals, default=0.0), vals[-1] if vals else 0.0,
                                  rng.randint(1, 10**6), False, h_or_none))
        cols_in = list(zip(*parts, strict=True))
        with np.errstate(invalid="ignore", over="ignore"):
            cols = merge_parts("job", Parts(*(np.array(c) for c in cols_in[:11]),
                                            HistBatch.from_histograms(list(cols_in[11]))), stats)
        for i in range(len(cols)):
            key = 0 if cols.stat[i] == "a" else 1
            mine = [p for p in parts if p[0] == key and (cols.rank[i] < 0 or p[1] == cols.rank[i])]
            single = cols.rank[i] >= 0 and len(mine) == 1
            want = mine[0][11] if single else merge_histograms(p[11] for p in mine if p[4] > 0)
            assert cols.hist[i] == want
            n, lo, hi = int(cols.count[i]), float(cols.min[i]), float(cols.max[i])
            expect = want.quantiles(tuple(PERCENTILES.values()), lo, hi) if (want is not None and n) else [0.0] * 4
            assert [cols.p50[i], cols.p90[i], cols.p99[i], cols.p999[i]] == expect


def test_the_vectorised_reader_decodes_what_read_bank_decodes(job):
    """Stats written by the real writer in a job (several windows per stat, so banks are reused; values that
    wrap the bucket ring and lower the scale; negatives and zeros): read_histograms of every bank equals
    layout_codec.read_bank's decode of it, and a bank whose (seq, wid) no longer matches is left to the caller."""
    import shmstat
    from collector.read.bank_reads import read_histograms
    from shmstat import Aggregation
    from shmstat.shm import layout as L
    from shmstat.shm import layout_codec as codec

    shmstat.init(job, rank=0, publish=False)
    t = [1_700_000_000_000_000_000]
    rng = random.Random(9)
    stats = [shmstat.Stat(f"h{k}", [Aggregation.P50], 0.05, clock=lambda: t[0]) for k in range(6)]
    for _ in range(7):  # windows of 50 ms: more windows than banks
        for s in stats:
            for _ in range(rng.choice((0, 1, 30, 300))):
                s.add(_value(rng))
        t[0] += 50_000_000
    seg = shmstat.job._state.STATE.attachment.segment
    geo = seg.geometry
    hist_off, bank_off, seq_bits, wids, want = [], [], [], [], []
    for d in seg.descriptors(0):
        for b in range(geo.banks):
            off = geo.slot_offset(0, d.index) + b * L.BANK_SIZE
            hoff = geo.hist_offset(0, d.hist) + b * L.HIST_SIZE
            snap = codec.read_bank(seg.buf, off, hist_offset=hoff)
            if not snap.count:
                continue
            seq, wid = np.frombuffer(bytes(seg.buf[off:off + 16]), np.int64).tolist()
            hist_off.append(hoff)
            bank_off.append(off)
            seq_bits.append(seq)
            wids.append(wid)
            want.append(snap.hist)
    assert len(want) > 12 and all(h is not None for h in want)
    wids[0] += 1  # as if the bank had moved on to another window since it was copied
    args = [np.array(a, np.int64) for a in (hist_off, bank_off, seq_bits, wids)]
    got = read_histograms(seg.buf, geo, *args)
    assert got.present.tolist() == [False] + [True] * (len(want) - 1)
    assert list(got.histograms())[1:] == want[1:]
    # headers no writer produces (scale out of range; a span past 2**63 that wraps; a span of M + 1; a zero or
    # infinity count past 2**63) are refused, by both decoders; the other rows still read
    bad = bytearray(seg.buf)
    heads = [(99, 0, 0, 1, 1, 0, 0, 0), (3, 0, -(2**63), 2**62, 1, 0, 0, 0), (3, 0, 5, 5 + MAX_BUCKETS, 1, 0, 0, 0),
             (3, -1, 0, 1, 1, 0, 0, 0), (3, 0, 0, 1, 1, 0, -1, 0), (3, 0, 0, 1, 1, 0, 0, -(2**62) * 2)]
    for k, head in enumerate(heads, start=1):
        bad[hist_off[k]:hist_off[k] + 64] = np.array(head, np.int64).tobytes()
        assert codec.decode_hist(memoryview(bad), hist_off[k]) is None
    got = read_histograms(memoryview(bad), geo, *args)
    nbad = len(heads) + 1
    assert got.present.tolist() == [False] * nbad + [True] * (len(want) - nbad)
    assert list(got.histograms())[nbad:] == want[nbad:]
    assert sum(h.pos_inf + h.neg_inf for h in want) > 0  # the infinities were read too, by both


def test_windows_the_vectorised_read_cannot_confirm_are_read_again_one_by_one(job, monkeypatch):
    """The scanner re-reads, bank by bank, every histogram read_histograms left out (a bank that moved on in the
    meantime): the pass is the same as when all were confirmed at once."""
    import shmstat
    from collector.read import scanner as scanner_module
    from collector.read.scanner import Scanner
    from shmstat import Aggregation

    shmstat.init(job, rank=0, publish=False)
    t = [1_700_000_000_000_000_000]
    rng = random.Random(4)
    for k in range(5):
        s = shmstat.Stat(f"h{k}", [Aggregation.COUNT, Aggregation.P50, Aggregation.P99], 0.05, clock=lambda: t[0])
        for _ in range(40):
            s.add(rng.uniform(0.5, 8.0))
    seg = shmstat.job._state.STATE.attachment.segment
    now = t[0] + 10**9
    want = Scanner(seg, 0).scan(now).columns
    real = scanner_module.read_histograms

    def unconfirmed(*args):
        b = real(*args)
        drop = np.zeros(len(b), bool)
        drop[::2] = True  # every other row as if its bank had changed since it was copied
        return HistBatch.assemble(len(b), [(np.flatnonzero(~drop), b[~drop])])

    monkeypatch.setattr(scanner_module, "read_histograms", unconfirmed)
    got = Scanner(seg, 0).scan(now).columns
    assert len(got) == len(want) == 10 and got.hists.present.all()  # 5 stats: merged and per-rank rows
    assert list(got.hist) == list(want.hist)
    assert got.p50.tolist() == want.p50.tolist() and got.p99.tolist() == want.p99.tolist()
