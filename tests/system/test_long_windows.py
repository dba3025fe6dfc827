"""Windows of any length torch.monitor takes (100 hours, years) work in process and attached: torch.monitor's own
``test_fixed_count_stat`` gives torch's events; attached, a window over an hour is emitted by the collector when
its writer closed it (``max_samples`` reached, a later window started, the writer exited or died), each once and
exact; windows past 2**62 ns are refused; the collector's scan of long windows polls, never spins."""

from __future__ import annotations

import datetime as dt
import os
import signal
import struct
import time
from collections import defaultdict

import pytest
from kit.procs import read_jsonl, spawn, start_collector, wait_file
from kit.support import wait_for

import shmstat
from shmstat import Aggregation as A
from shmstat.job.attach import ensure_init
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.segment import Segment

HOURS_100 = dt.timedelta(hours=100)
H100_NS = 100 * 3600 * 10**9


def _fixed_count_sequence(stat_cls, aggs, register, n: int = 10) -> list[tuple[int, dict, list]]:
    """torch.monitor's test_fixed_count_stat, extended to n adds: (count, get(), events so far) after each add."""
    events: list[dict] = []
    handle = register(lambda e: events.append(dict(e.data)))
    s = stat_cls("asdf", (aggs.SUM, aggs.COUNT), HOURS_100, 3)
    assert s.name == "asdf"
    seen = []
    for i in range(1, n + 1):
        s.add(i)
        seen.append((s.count, {str(k.name): v for k, v in s.get().items()}, list(events)))
    del s
    seen.append((None, None, list(events)))
    return seen, handle


def test_fixed_count_stat_in_process_gives_torch_monitors_values():
    seen, _ = _fixed_count_sequence(shmstat.Stat, A, shmstat.register_event_handler)
    full = {"SUM": 6.0, "COUNT": 3.0}
    zero = {"SUM": 0.0, "COUNT": 0.0}
    logged = [{"asdf.count": 3.0, "asdf.sum": 6.0}]
    assert seen[0] == (1, zero, [])
    assert seen[1] == (2, zero, [])
    # the add that reaches max_samples logs the window at once; later adds of the 100 h window are discarded
    assert seen[2:10] == [(0, full, logged)] * 8
    assert seen[10] == (None, None, logged)


@pytest.mark.torch
def test_fixed_count_stat_in_process_equals_real_torch_monitor():
    monitor = pytest.importorskip("torch.monitor")
    ours, h1 = _fixed_count_sequence(shmstat.Stat, A, shmstat.register_event_handler)
    theirs, h2 = _fixed_count_sequence(monitor.Stat, monitor.Aggregation, monitor.register_event_handler)
    monitor.unregister_event_handler(h2)
    shmstat.unregister_event_handler(h1)
    assert ours == theirs
    assert ours[-1][2] == [{"asdf.count": 3.0, "asdf.sum": 6.0}]


def test_fixed_count_stat_attached_gives_torch_monitors_values(job, backend):
    """In a job (the collector aside), the Stat's own view is torch.monitor's too: the add that fills the window
    logs it to the local handlers at once, ``count`` drops to 0, ``get()`` returns it."""
    in_process, handle = _fixed_count_sequence(shmstat.Stat, A, shmstat.register_event_handler)
    shmstat.unregister_event_handler(handle)
    assert shmstat.init(job, rank=0, publish=False) is not None
    attached, _ = _fixed_count_sequence(shmstat.Stat, A, shmstat.register_event_handler)
    assert attached == in_process
    assert attached[2] == (0, {"SUM": 6.0, "COUNT": 3.0}, [{"asdf.count": 3.0, "asdf.sum": 6.0}])


@pytest.mark.torch
def test_fixed_count_stat_attached_equals_real_torch_monitor(job):
    monitor = pytest.importorskip("torch.monitor")
    shmstat.init(job, rank=0, publish=False)
    ours, _ = _fixed_count_sequence(shmstat.Stat, A, shmstat.register_event_handler)
    theirs, h = _fixed_count_sequence(monitor.Stat, monitor.Aggregation, monitor.register_event_handler)
    monitor.unregister_event_handler(h)
    assert ours == theirs


@pytest.mark.parametrize("max_samples", [1, 2, 3, 2**63 - 1])
def test_attached_windows_close_as_in_process_windows_do(job, backend, max_samples):
    """Over several windows of a stepped clock (100 h each, some skipped), attached and in-process Stats give the
    same count, get() and local events after every add, for every max_samples."""
    def run() -> list:
        now = [10**18 // H100_NS * H100_NS]
        events: list[dict] = []
        handle = shmstat.register_event_handler(lambda e: events.append(dict(e.data)))
        s = shmstat.Stat("m", [A.COUNT, A.SUM, A.MAX, A.P50], HOURS_100, max_samples, clock=lambda: now[0])
        seen = []
        for step in (1, 1, 2, 1, 5):
            for v in range(1, 6):
                s.add(float(v))
                seen.append((s.count, dict(s.get()), list(events)))
            now[0] += step * H100_NS
        s.add(9.0)
        seen.append((s.count, dict(s.get()), list(events)))
        shmstat.unregister_event_handler(handle)
        return seen

    in_process = run()
    assert shmstat.init(job, rank=0, publish=False) is not None
    attached = run()
    assert attached == in_process
    assert any(e for _, _, e in in_process)


@pytest.mark.parametrize("window", [HOURS_100, dt.timedelta(days=365 * 100), dt.timedelta(milliseconds=L.MAX_WINDOW_MS),
                                    L.MAX_WINDOW_MS / 1000 - 1, 3.0e9])
def test_windows_up_to_the_longest_are_accepted_in_process(window):
    events: list[dict] = []
    shmstat.register_event_handler(lambda e: events.append(dict(e.data)))
    s = shmstat.Stat("long", [A.COUNT, A.SUM], window)
    for v in (1.0, 2.0, 4.0):
        s.add(v)
    assert s.count == 3
    s.close()
    assert events == [{"long.count": 3.0, "long.sum": 7.0}]


# -- attached, with a real collector process ------------------------------------------------------------------

def _rows(path: str, stat: str) -> dict[tuple[int | None, float], dict[str, list[float]]]:
    """jsonl rows of ``stat``: {(rank or None, window_start): {aggregation: [values, one per emission]}}."""
    out: dict[tuple[int | None, float], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in read_jsonl(path):
        if r["name"].startswith(stat + "."):
            out[(r["rank"], r["window_start"])][r["name"][len(stat) + 1:]].append(r["value"])
    return out


def _emitted_wid(seg: Segment, local_rank: int, name: str) -> int:
    return next(d.emitted_wid for d in seg.descriptors(local_rank) if d.name == name)


def test_attached_100h_window_with_max_samples_emits_each_full_window_once(job, tmp_path):
    """torch.monitor's fixed-count stat in a job: the clock moves 100 h after every window; each window's 4th
    add is discarded (the window is full); the collector emits every full window at once, exactly once."""
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", "*=jsonl:" + out, "--grace-ms", "10")
    try:
        t0 = time.time_ns()
        now = [t0]
        shmstat.init(job, rank=0, endpoint=coll.ingest)
        s = shmstat.Stat("fc", [A.SUM, A.COUNT], HOURS_100, 3, clock=lambda: now[0])
        seg = ensure_init().segment
        wids = []
        for k in range(6):  # more windows than the ring has banks: each must be emitted before its bank is reused
            wid = now[0] // H100_NS
            wids.append(wid)
            for v in (3 * k + 1, 3 * k + 2, 3 * k + 3, 1000.0):
                s.add(float(v))
            wait_for(lambda w=wid: _emitted_wid(seg, 0, "fc") >= w, 20, what=f"window {wid} emitted")
            now[0] += H100_NS
        assert seg.rank(0).discarded == 6
        shmstat.shutdown()
        wait_for(lambda: len(_rows(out, "fc")) == 12, 20, what="rows in the jsonl output")
    finally:
        assert coll.stop() == 0
    rows = _rows(out, "fc")
    expected = {}
    for k, wid in enumerate(wids):
        start = wid * H100_NS / 1e9
        figures = {"count": [3.0], "sum": [float(9 * k + 6)]}
        expected[(0, start)] = figures
        expected[(None, start)] = figures
    assert {key: dict(v) for key, v in rows.items()} == expected


def _long_window_rank(job: str, endpoint: str, n: int, ready: str, mode: str) -> None:
    """Rank 0: adds 1..n to a 100 h Stat without max_samples, says so in ``ready``, then exits or waits to die."""
    shmstat.init(job, rank=0, local_rank=0, world_size=2, endpoint=endpoint)
    s = shmstat.Stat("lw", [A.COUNT, A.SUM, A.MAX], HOURS_100)
    for v in range(1, n + 1):
        s.add(float(v))
    open(ready, "w").close()
    if mode == "kill":
        time.sleep(120)  # SIGKILLed by the test
    s.close()
    shmstat.shutdown()


@pytest.mark.parametrize("mode", ["exit", "kill"])
def test_attached_long_window_is_emitted_when_its_rank_ends(job, tmp_path, mode):
    """A 100 h window without max_samples: the collector emits rank 0's window once rank 0 exits (or is
    SIGKILLed), long before its wall-clock end, while rank 1 (this process) still adds to its own window of the
    same stat; rank 1's window follows when rank 1 leaves. Each exactly once, counts and sums exact."""
    out = str(tmp_path / "m.jsonl")
    ready = str(tmp_path / "ready")
    coll = start_collector(job, "--handler", "*=jsonl:" + out, "--grace-ms", "10")
    try:
        shmstat.init(job, rank=1, local_rank=1, world_size=2, endpoint=coll.ingest)
        mine = shmstat.Stat("lw", [A.COUNT, A.SUM, A.MAX], HOURS_100)
        mine.add(7.0)
        start = _window_start()
        p = spawn(_long_window_rank, job, coll.ingest, 500, ready, mode)
        wait_file(ready, 60)
        if mode == "kill":
            os.kill(p.pid, signal.SIGKILL)
        p.join(60)
        assert p.exitcode == (-signal.SIGKILL if mode == "kill" else 0)
        wait_for(lambda: (0, start) in _rows(out, "lw"), 20, what="rank 0's window")
        mine.add(8.0)  # rank 1's window is still open
        time.sleep(0.5)  # two long-window polls of the collector: rank 1's window must not come out meanwhile
        assert (1, start) not in _rows(out, "lw")
        shmstat.shutdown()
        wait_for(lambda: (1, start) in _rows(out, "lw"), 20, what="rank 1's window")
    finally:
        assert coll.stop() == 0
    rows = {key: dict(v) for key, v in _rows(out, "lw").items()}
    assert rows[(0, start)] == {"count": [500.0], "sum": [125250.0], "max": [500.0]}
    assert rows[(1, start)] == {"count": [2.0], "sum": [15.0], "max": [8.0]}
    # the merged rows of a long window: one per pass that closed ranks of it, together exact
    merged = rows[(None, start)]
    assert sorted(merged["count"]) == [2.0, 500.0] and sum(merged["sum"]) == 125265.0
    assert set(rows) == {(0, start), (1, start), (None, start)}


def _window_start() -> float:
    return time.time_ns() // H100_NS * H100_NS / 1e9


def test_scanner_refuses_absurd_windows_and_polls_long_ones_without_spinning(job):
    """Descriptors with windows of 0, 2**62 ms, one past the longest, and -1 are refused and counted; a valid
    window of the longest length next to a 50 ms one: its full window (in the far future of the wall clock) is
    emitted once, and the next pass for it is due one poll later, never at once."""
    from collector.read.scanner import Scanner

    seg = Segment.open(job, geometry=L.Geometry(max_ranks=2, max_stats=8))
    try:
        buf, geo, now = seg.buf, seg.geometry, time.time_ns()
        struct.pack_into("<QqQqqqqqQQQQ", buf, geo.rank_offset(0), L.RankState.ACTIVE, os.getpid(), 1, 0, 0, 1,
                         now, now, 6, 0, 0, 0)
        for j, window_ms in enumerate([0, 2**62, L.MAX_WINDOW_MS + 1, 2**64 - 1]):
            codec.write_descriptor(buf, geo, 0, j, name=b"absurd", group=b"g", window_ms=window_ms, max_samples=3,
                               agg_mask=0b11000, incarnation=1)
        codec.write_descriptor(buf, geo, 0, 4, name=b"long", group=b"g", window_ms=L.MAX_WINDOW_MS, max_samples=3,
                           agg_mask=0b11000, incarnation=1)
        codec.write_descriptor(buf, geo, 0, 5, name=b"short", group=b"g", window_ms=50, max_samples=3,
                           agg_mask=0b11000, incarnation=1)
        short_wid = now // 50_000_000 - 2
        for stat, wid, count, total in ((4, 0, 3, 6.0), (5, short_wid, 2, 5.0)):
            off = geo.slot_offset(0, stat) + wid % geo.banks * L.BANK_SIZE
            struct.pack_into("<dqddddqQ", buf, off, 2.0 * count, wid, total, 1.0, total - 1.0, 1.0, now, 1)
        scanner = Scanner(seg, 10_000_000)
        got = scanner.scan(now).rows
        scanner.commit()
        assert scanner.reader.bad_descriptors == 4
        per_rank = sorted((r.name, r.wid, r.summary.count, r.summary.sum) for r in got if r.rank is not None)
        assert per_rank == [("long", 0, 3, 6.0), ("short", short_wid, 2, 5.0)]
        poll = L.LONG_POLL_MS * 1_000_000
        assert now < scanner.next_due_ns() <= now + poll  # the 50 ms window's next end, or the long poll
        assert not scanner.due(now) and scanner.due(now + poll)
        assert scanner.scan(now + poll).rows == []  # each window once
        scanner.commit()
        assert codec.read_descriptor(buf, geo, 0, 4).emitted_wid == 0
    finally:
        seg.close()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the lost count once overflowed its word: a cast of garbage
def test_scanner_survives_random_banks_of_long_window_slots(job):
    """Random bytes in the banks and watermarks of valid long-window slots (read the slow way, every poll),
    writer alive and dead, final pass or not: every pass returns, and whatever comes out has counts a writer
    could produce (0: a dead writer's torn bank)."""
    import random

    from collector.read.scanner import Scanner

    seg = Segment.open(job, geometry=L.Geometry(max_ranks=2, max_stats=4))
    try:
        buf, geo, now = seg.buf, seg.geometry, time.time_ns()
        for j, window_ms in enumerate((L.LONG_WINDOW_MS + 1, 100 * 3600 * 1000, L.MAX_WINDOW_MS)):
            codec.write_descriptor(buf, geo, 0, j, name=b"w%d" % j, group=b"g", window_ms=window_ms, max_samples=3,
                               agg_mask=0b1111000, incarnation=1)
        for seed in range(200):
            rng = random.Random(seed)
            pid = os.getpid() if seed % 2 else 2**31 - 2  # alive / past any real pid
            struct.pack_into("<QqQqqqqqQQQQ", buf, geo.rank_offset(0), L.RankState.ACTIVE, pid, 1, 0, 0, 1, now,
                             now, 3, 0, 0, 0)
            start = geo.slot_offset(0, 0)
            end = geo.slot_offset(0, 2) + geo.banks * L.BANK_SIZE
            buf[start:end] = rng.randbytes(end - start)
            for j in range(3):
                codec.write_emitted_wid(buf, geo, 0, j, rng.choice([-1, 0, rng.randrange(-(2**63), 2**63)]))
            scanner = Scanner(seg, 10_000_000)
            for k in range(3):
                rows = scanner.scan(now + k * L.LONG_POLL_MS * 1_000_000, final=k == 2).rows
                scanner.commit()
                assert all(0 <= r.summary.count < 2**61 for r in rows)
    finally:
        seg.close()


def test_idle_long_window_slots_are_not_read_one_by_one(job):
    """500 long-window slots of a live writer, each with an open window: after the first pass, a poll reads none
    of them one by one; when one fills up (max_samples) or its writer exits, only those are read, and emitted."""
    from collector.read.scanner import Scanner

    n = 500
    seg = Segment.open(job, geometry=L.Geometry(max_ranks=2, max_stats=n))
    try:
        buf, geo, now = seg.buf, seg.geometry, time.time_ns()
        wid = now // H100_NS

        def put(stat: int, count: int, total: float) -> None:
            off = geo.slot_offset(0, stat) + wid % geo.banks * L.BANK_SIZE
            struct.pack_into("<dqddddqQ", buf, off, 2.0 * count, wid, total, 1.0, 1.0, 1.0, now, 1)

        struct.pack_into("<QqQqqqqqQQQQ", buf, geo.rank_offset(0), L.RankState.ACTIVE, os.getpid(), 1, 0, 0, 1, now,
                         now, n, 0, 0, 0)
        for j in range(n):
            codec.write_descriptor(buf, geo, 0, j, name=b"s%d" % j, group=b"g", window_ms=H100_NS // 10**6,
                               max_samples=4, agg_mask=0b11000, incarnation=1)
            put(j, 2, 2.0)
        scanner = Scanner(seg, 10_000_000)
        reads = []
        read_slot = scanner.reader.read_slot
        scanner.reader.read_slot = lambda *a, **k: reads.append(a[1].index) or read_slot(*a, **k)
        poll = L.LONG_POLL_MS * 1_000_000
        assert scanner.scan(now).rows == [] and len(reads) == n  # the first pass settles the watermarks
        scanner.commit()
        reads.clear()
        assert scanner.scan(now + poll).rows == [] and reads == []
        scanner.commit()
        put(7, 4, 4.0)  # full
        got = scanner.scan(now + 2 * poll).rows
        scanner.commit()
        assert reads == [7]
        assert [(r.name, r.rank, r.summary.count, r.summary.sum) for r in got] == [("s7", None, 4, 4.0),
                                                                                   ("s7", 0, 4, 4.0)]
        reads.clear()
        seg.set_rank_state(0, L.RankState.EXITED)
        got = scanner.scan(now + 3 * poll).rows
        scanner.commit()
        assert sorted(reads) == [j for j in range(n) if j != 7]
        assert sum(r.summary.count for r in got if r.rank is not None) == 2 * (n - 1)
    finally:
        seg.close()


def test_a_rank_restarted_inside_a_long_window_its_predecessor_closed_is_emitted_too(job, tmp_path):
    """Rank 0 adds 1..40 to a 100 h Stat and exits: its window is emitted. Rank 0 restarts (same entry, next
    incarnation) inside the same window, adds 1..25 and exits: that window is emitted too, as a second row of the
    same window; no sample is lost or counted twice."""
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", "*=jsonl:" + out, "--grace-ms", "10")
    try:
        start = _window_start()
        for run, n in enumerate((40, 25)):
            p = spawn(_long_window_rank, job, coll.ingest, n, str(tmp_path / f"ready{run}"), "exit")
            p.join(60)
            assert p.exitcode == 0
            wait_for(lambda k=run: len(_rows(out, "lw").get((0, start), {}).get("count", [])) == k + 1, 20,
                     what=f"run {run}'s window")
        time.sleep(0.5)  # two more long-window polls: nothing else may come out
    finally:
        assert coll.stop() == 0
    rows = _rows(out, "lw")
    assert sorted(rows[(0, start)]["count"]) == [25.0, 40.0]
    assert sorted(rows[(0, start)]["sum"]) == [325.0, 820.0]
    assert sorted(rows[(None, start)]["count"]) == [25.0, 40.0]
