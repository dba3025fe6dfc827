"""Bad parameters are refused in the rank before anything is published; the collector survives any segment
content (garbage rank entries, descriptors and banks written by a hostile local process) and keeps emitting
the good ranks' windows exactly."""

from __future__ import annotations

import datetime as dt
import os
import random
import struct

import pytest
from kit.procs import (
    assert_rank_workers_reconcile,
    load_counts,
    rank_worker,
    read_jsonl,
    spawn,
    start_collector,
    window_counts,
)
from kit.support import wait_for

import shmstat
from shmstat import Aggregation as A
from shmstat.errors import ConfigError
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.segment import Segment

WINDOW_MS = 50


TOO_LONG = [dt.timedelta.max, 1e10, dt.timedelta(milliseconds=L.MAX_WINDOW_MS + 1), L.MAX_WINDOW_MS / 1000 + 1,
            dt.timedelta(days=365 * 147)]


@pytest.mark.parametrize("window", [*TOO_LONG, float("inf"), 0.0005, float("nan"), -1.0, 0.0])
def test_window_outside_the_range_is_refused_in_process(window):
    with pytest.raises(ConfigError, match="window") as info:
        shmstat.Stat("t", [A.SUM], window_size=window)
    assert "\n" not in str(info.value) and str(info.value).count(". ") == 0  # one sentence


def test_longest_window_is_accepted():
    """Any window torch.monitor takes up to 2**62 ns (~146 years); the 1 h cap is gone."""
    longest = dt.timedelta(milliseconds=L.MAX_WINDOW_MS)
    assert shmstat.Stat("t", [A.SUM], window_size=longest)._window_ns == L.MAX_WINDOW_MS * 1_000_000
    assert L.MAX_WINDOW_MS * 1_000_000 <= L.MAX_WINDOW_NS == 2**62
    for window in (dt.timedelta(hours=1, milliseconds=1), dt.timedelta(hours=100), dt.timedelta(days=365 * 100)):
        ms = window // dt.timedelta(milliseconds=1)
        assert shmstat.Stat("t", [A.SUM], window_size=window)._window_ns == ms * 10**6


@pytest.mark.parametrize("window", [*TOO_LONG, 0.0009, dt.timedelta(microseconds=999)])
def test_attached_window_outside_the_range_is_refused_before_anything_is_published(job, window):
    att = shmstat.init(job, rank=0, publish=False)
    assert att is not None
    with pytest.raises(ConfigError, match="window") as info:
        shmstat.Stat("t", [A.SUM], window_size=window)
    assert "\n" not in str(info.value)
    assert att.segment.rank(0).nstats == 0
    assert att.segment.descriptors(0) == []
    shortest = shmstat.Stat("ok", [A.SUM], window_size=dt.timedelta(milliseconds=1))  # under the ring's shortest
    shortest.add(1.0)
    longest = shmstat.Stat("long", [A.SUM], window_size=dt.timedelta(milliseconds=L.MAX_WINDOW_MS))
    longest.add(1.0)
    assert [(d.name, d.window_ms) for d in att.segment.descriptors(0)] == [("ok", 1), ("long", L.MAX_WINDOW_MS)]


def test_min_window_follows_the_ring():
    assert L.min_window_ms(4) == 50
    assert L.min_window_ms(16) == 8
    assert L.min_window_ms(64) == 2
    for banks in range(3, 80):
        assert (banks - 2) * L.min_window_ms(banks) >= L.RING_BUDGET_MS


@pytest.mark.parametrize("aggs", [["mean"], [99], [A.SUM, "bogus"], [1.5]])
def test_bad_aggregations_are_refused(aggs):
    with pytest.raises((ConfigError, TypeError)):
        shmstat.Stat("t", aggs, window_size=1.0)


def _scribble(seg: Segment, rng: random.Random) -> None:
    """Garbage a hostile process of the same user can write: rank entries and descriptors that would crash a
    trusting reader (window 0, window of 2^62 ms, unknown masks and states, pids past pid_max), random banks."""
    geo = seg.geometry
    buf = seg.buf
    me = os.getpid()
    # entry 5: a live pid with descriptors of every bad kind
    struct.pack_into("<QqQqqqqqQQQQ", buf, geo.rank_offset(5), L.RankState.ACTIVE, me, 2**64 - 1, 5, 5, 8, 0, 0,
                     7, 0, 0, 0)
    bad = [(0, 1, 0b1000), (2**62, 1, 0b1000), (50, 0, 0b1000), (50, 1, 0b10), (50, 1, 1 << 40),
           (2**64 - 1, -5, 2**64 - 1), (L.MAX_WINDOW_MS + 1, 1, 0b1000)]
    for j, (window_ms, max_samples, mask) in enumerate(bad):
        off = geo.desc_offset(5, j)
        struct.pack_into("<QQqQqQQQ", buf, off, 1, window_ms, max_samples, mask, -1, 4, 200, 1)
        buf[off + L.D_NAME : off + L.D_NAME + 4] = b"evil"
    # entry 6: random bytes everywhere, state forced to active
    off = geo.rank_offset(6)
    buf[off : off + L.RANK_ENTRY_SIZE] = rng.randbytes(L.RANK_ENTRY_SIZE)
    struct.pack_into("<Q", buf, off, L.RankState.ACTIVE)
    for j in range(4):
        doff = geo.desc_offset(6, j)
        buf[doff : doff + L.DESC_SIZE] = rng.randbytes(L.DESC_SIZE)
        struct.pack_into("<Q", buf, doff, 1)
    # entry 7: a plausible entry whose descriptors are fine (a short and the longest window, read the slow way)
    # but whose banks are random
    struct.pack_into("<QqQqqqqqQQQQ", buf, geo.rank_offset(7), L.RankState.ACTIVE, me, 1, 7, 7, 8, 0, 0, 2, 0, 0, 0)
    for j, window_ms in enumerate((WINDOW_MS, L.MAX_WINDOW_MS)):
        codec.write_descriptor(buf, geo, 7, j, name=b"noise", group=b"train", window_ms=window_ms, max_samples=2**62,
                           agg_mask=0b1000, incarnation=1)
        start, end = geo.slot_offset(7, j), geo.slot_offset(7, j) + geo.banks * L.BANK_SIZE
        buf[start:end] = rng.randbytes(end - start)


def test_collector_survives_garbage_in_the_segment_and_good_ranks_reconcile(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    seg = Segment.open(job, geometry=L.Geometry(banks=16))
    _scribble(seg, random.Random(1234))
    own = str(tmp_path / "collector.jsonl")  # the collector's own group, asked for by name
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--handler", f"shmstat=jsonl:{own}", "--grace-ms", "10",
                           "--banks", "16")
    try:
        procs = [spawn(rank_worker, job, r, 2, 0.5, WINDOW_MS, str(tmp_path / f"r{r}.json")) for r in range(2)]
        for rng_seed in range(5):  # keep scribbling while the good ranks write
            _scribble(seg, random.Random(rng_seed))
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        _scribble(seg, random.Random(99))
        # Entries 5 and 7 carry this test's pid: to the collector they are ranks still running, and a collector
        # stopped while ranks run leaves their open windows to the next one (guarantees.md, clean shutdown). The
        # good ranks' last window closes 10 ms (the grace) after its end: a stop before then kept it in the ring.
        counted = {(r, w) for r in range(2) for w in load_counts(str(tmp_path / f"r{r}.json"))}
        wait_for(lambda: not counted - set(window_counts(read_jsonl(out), "steps")[1]), 30,
                 what="every window the good ranks counted, emitted while the garbage entries stay")
        assert coll.proc.poll() is None, "the collector died on garbage in the segment"
    finally:
        assert coll.stop() == 0
        seg.close()
    rows = read_jsonl(out)
    assert_rank_workers_reconcile(rows, tmp_path, 2)
    assert not [r for r in rows if r["name"].startswith("evil")]
    refused = [r["value"] for r in read_jsonl(own) if r["name"] == "collector.descriptors_refused"]
    assert refused and max(refused) >= 7
    assert max(r["value"] for r in read_jsonl(own) if r["name"] == "collector.ranks_refused") >= 1
