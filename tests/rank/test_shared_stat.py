"""Attached Stat: samples land in the rank's slot and a reader in another process rebuilds every window."""

from __future__ import annotations

import multiprocessing as mp
import random

from kit.support import MS, FakeClock

from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init, shutdown
from shmstat.shm import layout as L
from shmstat.shm.reader import SegmentReader
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat

ALL = [A.VALUE, A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN]
FAR_FUTURE = 1 << 62


def expected_windows(samples, window_ms):
    """{wid: (count, sum, min, max, last)} from (t_ns, value) pairs, NaN ignored."""
    out = {}
    for t, v in samples:
        if v != v:
            continue
        wid = t // (window_ms * MS)
        c, s, lo, hi, _ = out.get(wid, (0, 0.0, v, v, v))
        out[wid] = (c + 1, s + v, min(lo, v), max(hi, v), v)
    return out


def read_all(job, now=FAR_FUTURE, after=-1):
    seg = Segment.open(job, create=False)
    try:
        reader = SegmentReader(seg)
        got = {}
        for info in reader.ranks():
            for desc in reader.descriptors(info.local_rank):
                sr = reader.read_slot(info, desc, now, 0, after)
                for w in sr.windows:
                    got.setdefault((info.rank, desc.name), {})[w.wid] = (w.count, w.sum, w.min, w.max, w.last)
        return got
    finally:
        seg.close()


def test_attached_add_writes_the_slot(job):
    att = init(job, rank=0, publish=False, max_ranks=2, max_stats=4, banks=4)
    assert att is not None
    clock = FakeClock()
    clock.to_window(100)
    s = Stat("lat", ALL, 0.1, clock=clock, group="train")
    samples = []
    for i in range(30):
        v = float(i % 7) - 2.5
        samples.append((clock.now, v))
        s.add(v)
        clock.advance_ms(10)  # 3 windows
    assert read_all(job, now=clock.now) == {(0, "lat"): expected_windows(samples, 100)}
    desc = Segment.open(job, create=False).descriptors(0)[0]
    assert (desc.name, desc.group, desc.window_ms) == ("lat", "train", 100)
    assert s.count == 0  # window 3 never got a sample: the open window is empty
    assert s.get()[A.COUNT] == 10.0  # local view of the last rolled-over window


def test_only_closed_windows_are_read(job):
    init(job, rank=0, publish=False, max_ranks=1, max_stats=1, banks=4)
    clock = FakeClock()
    clock.to_window(100)
    s = Stat("x", [A.COUNT], 0.1, clock=clock)
    s.add(1.0)
    assert read_all(job, now=clock.now) == {}
    assert read_all(job, now=clock.now + 100 * MS) == {(0, "x"): {clock.now // (100 * MS): (1, 1.0, 1.0, 1.0, 1.0)}}
    # a grace period holds the window back
    seg = Segment.open(job, create=False)
    r = SegmentReader(seg)
    info = r.ranks()[0]
    assert r.read_slot(info, r.descriptors(0)[0], clock.now + 100 * MS, 5 * MS, -1).windows == []
    seg.close()


def test_max_samples_nan_and_infinities_in_shared_memory(job):
    init(job, rank=0, publish=False, max_ranks=1, max_stats=2, banks=4)
    clock = FakeClock()
    clock.to_window(100)
    s = Stat("x", [A.COUNT, A.MAX, A.MIN], 0.1, max_samples=3, clock=clock)
    for v in (float("nan"), 1.0, float("inf"), float("nan"), -float("inf"), 5.0, 6.0):
        s.add(v)
    got = read_all(job, now=clock.now + 100 * MS)[(0, "x")]
    ((count, _total, lo, hi, _last),) = got.values()
    assert (count, lo, hi) == (3, -float("inf"), float("inf"))
    info = Segment.open(job, create=False).rank(0)
    assert (info.nan_count, info.discarded) == (2, 2)


def test_a_full_stat_table_drops_and_counts_and_leaves_existing_stats_working(job, caplog):
    init(job, rank=0, publish=False, max_ranks=1, max_stats=2, banks=4)
    clock = FakeClock()
    clock.to_window(100)
    a = Stat("a", [A.SUM], 0.1, clock=clock)
    b = Stat("b", [A.SUM], 0.1, clock=clock)
    c = Stat("c", [A.SUM], 0.1, clock=clock)  # no slot left: drop mode, nothing raises
    a.add(1.0)
    b.add(2.0)
    for _ in range(3):
        c.add(5.0)
    got = read_all(job, now=clock.now + 100 * MS)
    assert {k: sum(w[1] for w in v.values()) for k, v in got.items()} == {(0, "a"): 1.0, (0, "b"): 2.0}
    info = Segment.open(job, create=False).rank(0)
    assert (info.dropped, info.stats_refused) == (3, 1)
    assert "SHMSTAT_MAX_STATS=4" in caplog.text


def _rank_main(job: str, rank: int, seed: int, start_ns: int, n: int) -> None:
    init(job, rank=rank, local_rank=rank, world_size=4, publish=False)
    clock = FakeClock(start_ns)
    rng = random.Random(seed)
    s = Stat("step", ALL, 0.05, clock=clock, group="train")
    for _ in range(n):
        s.add(round(rng.uniform(-10, 10), 3))
        clock.advance_ms(rng.choice((0.5, 1, 3)))
    shutdown()


def test_four_rank_processes_reader_rebuilds_every_window_exactly(job, monkeypatch):
    monkeypatch.setenv("SHMSTAT_KEEP_SEGMENT", "1")  # read here once the ranks, its only processes, are gone
    seg = Segment.open(job, geometry=L.Geometry(max_ranks=4, max_stats=4, banks=64))
    start = FakeClock().now
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(job, r, 1000 + r, start, 400)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    wants, end = {}, 0
    for r in range(4):  # the same sequences, replayed here
        clock, rng, samples = FakeClock(start), random.Random(1000 + r), []
        for _ in range(400):
            samples.append((clock.now, round(rng.uniform(-10, 10), 3)))
            clock.advance_ms(rng.choice((0.5, 1, 3)))
        wants[r] = expected_windows(samples, 50)
        end = max(end, clock.now)
    got = read_all(job, now=end + 50 * MS)
    for r, want in wants.items():
        assert got[(r, "step")].keys() == want.keys()
        for wid, (c, s, lo, hi, last) in want.items():
            gc_, gs, glo, ghi, glast = got[(r, "step")][wid]
            assert (gc_, glo, ghi, glast) == (c, lo, hi, last)
            assert gs == s  # same additions in the same order: bit-identical
    assert sum(w[0] for k in got for w in got[k].values()) == 1600
    assert [i.state_name for i in seg.ranks()] == ["exited"] * 4
    seg.close()
