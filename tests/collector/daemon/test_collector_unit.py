"""The collector driven step by step in-process with an injected clock (real segment, real sockets)."""

from __future__ import annotations

import subprocess
import sys

from kit.handlers.user import Recording
from kit.procs import REPO
from kit.support import MS, FakeClock, step_and_wait

from collector import PLATFORM_GROUP, Collector, CollectorConfig
from collector.cli.admin import segment_info
from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init, shutdown
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat


def _collector(job, clock, **handlers):
    rec = Recording()
    objs = {"*": rec, **handlers}
    c = Collector(CollectorConfig(job=job, grace_ms=0, clock=clock, usage_interval_s=0.0), handler_objects=objs)
    step_and_wait(c)
    return c, rec


def test_rank_restart_continues_without_mixing_incarnations(job):
    clock = FakeClock()
    clock.to_window(100)
    c, rec = _collector(job, clock)
    try:
        init(job, rank=0, publish=False)
        s = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
        for _ in range(3):
            s.add(1.0)
        clock.advance_ms(100)
        s.close()
        init(job, rank=0, publish=False)  # the same rank registers again: a new incarnation
        s2 = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
        for _ in range(5):
            s2.add(1.0)
        clock.advance_ms(100)
        c.step()
        rows = [(m.rank, m.window_start, m.value) for m in rec.got if m.name == "lat.count" and m.rank is not None]
        w0 = (clock.now - 200 * MS) / 1e9
        w1 = (clock.now - 100 * MS) / 1e9
        assert rows == [(0, w0, 3.0), (0, w1, 5.0)]
        assert Segment.open(job, create=False).descriptors(0)[0].emitted_wid == int(w1 * 10)
        c.step()
        assert len([m for m in rec.got if m.name == "lat.count"]) == 4  # nothing emitted twice
    finally:
        c.close()


def test_a_rank_registered_again_inside_a_window_continues_it(job, backend):
    """A restarted rank (a new incarnation of the same entry) writing into the window its predecessor was in
    continues that window: the predecessor's samples are emitted with its own, none is lost (both writers)."""
    clock = FakeClock()
    clock.to_window(100)
    c, rec = _collector(job, clock)
    aggs = [A.COUNT, A.SUM, A.MIN, A.MAX, A.P50]
    try:
        init(job, rank=0, publish=False)
        s = Stat("lat", aggs, 0.1, clock=clock, group="g")
        full = Stat("full", [A.COUNT], 0.1, 4, clock=clock, group="g")
        for v in (1.0, 2.0, 3.0):
            s.add(v)
        for _ in range(4):
            full.add(1.0)
        shutdown()
        clock.advance_ms(30)
        init(job, rank=0, publish=False)  # the same rank registers again, inside the same window
        s2 = Stat("lat", aggs, 0.1, clock=clock, group="g")
        full2 = Stat("full", [A.COUNT], 0.1, 4, clock=clock, group="g")
        for v in (10.0, 0.5):
            s2.add(v)
        full2.add(1.0)  # the window holds max_samples already: discarded (and counted), as in one process
        clock.advance_ms(70)
        c.step()
        got = {m.name: m.value for m in rec.got if m.group_name == "g" and m.rank == 0}
        assert {k: got[k] for k in ("lat.count", "lat.sum", "lat.min", "lat.max", "full.count")} == {
            "lat.count": 5, "lat.sum": 16.5, "lat.min": 0.5, "lat.max": 10.0, "full.count": 4}
        assert abs(got["lat.p50"] - 2.0) <= 2.0 * 0.022  # the histogram went on too
        assert Segment.open(job, create=False).rank(0).discarded == 1
    finally:
        c.close()


def test_platform_group_has_rank_usage_and_collector_counters(job):
    clock = FakeClock()
    platform = Recording()
    c, _ = _collector(job, clock, **{PLATFORM_GROUP: platform})
    try:
        init(job, rank=0, publish=False)
        c.step()
        names = {m.name for m in platform.got}
        assert {"rank.cpu_percent", "rank.rss_bytes", "collector.windows_emitted", "collector.frames_rejected",
                "collector.handler_errors", "collector.events_relayed"} <= names
        rss = [m for m in platform.got if m.name == "rank.rss_bytes"]
        assert rss[0].rank == 0 and rss[0].value > 1_000_000
    finally:
        c.close()


def _sample_in_an_open_window(job):
    """A collector, and rank 0 (this process) with one sample of 2.0 in a window still open."""
    clock = FakeClock()
    clock.to_window(1000)
    c, rec = _collector(job, clock)
    init(job, rank=0, publish=False)
    s = Stat("lat", [A.SUM], 1.0, clock=clock, group="g")
    s.add(2.0)
    c.step()
    assert [m for m in rec.got if m.name == "lat.sum"] == []  # the window is still open
    return clock, c, rec, s


def test_shutdown_emits_the_open_window_once_the_ranks_are_gone(job):
    _clock, c, rec, _s = _sample_in_an_open_window(job)
    shutdown()  # the rank exits
    c.close()
    assert [m.value for m in rec.got if m.name == "lat.sum"] == [2.0, 2.0]  # merged and rank 0


def test_shutdown_with_live_ranks_leaves_their_open_window_to_the_next_collector(job):
    clock, c, rec, s = _sample_in_an_open_window(job)
    c.close()  # the rank lives on and keeps adding to the same window
    assert [m for m in rec.got if m.name == "lat.sum"] == []
    s.add(3.0)
    c2, rec2 = _collector(job, clock)
    try:
        clock.advance_ms(1000)
        c2.step()
        assert [m.value for m in rec2.got if m.name == "lat.sum"] == [5.0, 5.0]  # the whole window, once
    finally:
        c2.close()


def test_a_rank_restarted_after_a_final_pass_has_every_window_emitted(job):
    """A collector that lets a job go once its ranks are gone emits every window with data, but moves a slot's
    watermark no further than its newest window: the slot's next incarnation (torchrun restarting the rank) adds
    in the windows after it, and the next collector emits them (a watermark moved to the window after ``now``
    left them unread and uncounted: a restarted torchrun rank lost its first windows)."""
    clock = FakeClock()
    clock.to_window(100)
    c, rec = _collector(job, clock)
    init(job, rank=0, publish=False)
    s = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
    for _ in range(3):
        s.add(1.0)
    shutdown()  # the rank exits
    clock.advance_ms(300)
    c.close()  # no rank alive: the last pass emits every window with data
    init(job, rank=0, publish=False)  # the rank restarted: a new incarnation of the entry, the same slot
    s2 = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
    for _ in range(5):
        s2.add(1.0)
    c2, rec2 = _collector(job, clock)
    try:
        clock.advance_ms(200)
        c2.step()
        rows = [(m.value, m.window_start) for m in rec.got + rec2.got if m.name == "lat.count" and m.rank == 0]
        assert rows == [(3.0, clock.now / 1e9 - 0.5), (5.0, clock.now / 1e9 - 0.2)]
        assert c2.counters()["windows_overwritten"] == 0
    finally:
        shutdown()
        c2.close()


def test_ls_and_clean(job):
    c, _ = _collector(job, FakeClock())
    info = segment_info(job)
    assert info.collector_alive and info.live
    r = subprocess.run([sys.executable, "-m", "collector", "clean", job], capture_output=True, text=True,
                       cwd=REPO, timeout=30)
    assert r.returncode == 2 and "live processes" in r.stderr
    ls = subprocess.run([sys.executable, "-m", "collector", "ls"], capture_output=True, text=True, cwd=REPO,
                        timeout=30)
    assert job in ls.stdout
    c.close()
    r = subprocess.run([sys.executable, "-m", "collector", "clean", job], capture_output=True, text=True,
                       cwd=REPO, timeout=30)
    assert r.returncode == 0 and f"removed {job}" in r.stdout
    assert job not in Segment.list_jobs()
