"""Stragglers (issue 12): the detector on hand-made windows, and 4 real ranks with one slowed on purpose."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import pytest
from kit.faults import Subscriber
from kit.procs import REPO, read_jsonl, spawn, start_collector
from kit.straggler_reference import columns_of
from kit.support import wait_for

from collector.daemon.straggler import (
    EVENT_TOPICS,
    RECOVERED_EVENT,
    STRAGGLER_EVENT,
    StragglerDetector,
    StragglerEvent,
    StragglerUpdate,
)
from collector.read.rows import WindowRow
from shmstat import Aggregation as A
from shmstat.errors import ConfigError
from shmstat.histogram import Histogram
from shmstat.shm.layout_records import WindowFigures

WMS = 50


def _row(rank: int | None, value: float, wid: int, *, name: str = "step", group: str = "train", count: int = 1,
         higher_is_better: bool = False, hist: bool = False) -> WindowRow:
    h = None
    if hist:
        h = Histogram()
        for _ in range(count):
            h.add(value)
    summary = WindowFigures(count, value * count, value, value, value, wid, hist=h)
    mask = (1 << A.COUNT) | (1 << A.MEAN) | ((1 << A.P50) if hist else 0)  # a stat that asked for a figure
    return WindowRow(group, name, wid, WMS, mask, rank, summary, higher_is_better=higher_is_better)


def _window(wid: int, figures: dict[int, float], **kw: object) -> list[WindowRow]:
    return [_row(rank, value, wid, **kw) for rank, value in figures.items()]  # type: ignore[arg-type]


def _update(det: StragglerDetector, rows: list[WindowRow]) -> StragglerUpdate:
    """One pass of ``rows`` through the detector's production path (as columns)."""
    return det.update_columns(columns_of(rows))


def _feed(det: StragglerDetector, windows: list[dict[int, float]], first_wid: int = 100,
          **kw: object) -> list[list[StragglerEvent]]:
    """One pass per window; the events of each pass."""
    return [_update(det, _window(first_wid + i, f, **kw)).events for i, f in enumerate(windows)]


# ----------------------------------------------------------------------------------------------- unit


def test_a_rank_slow_for_n_windows_is_reported_once_with_its_figures():
    det = StragglerDetector("j", threshold=0.75, windows=3)
    slow = {0: 10.0, 1: 10.0, 2: 20.0, 3: 10.0}
    passes = _feed(det, [slow] * 5)
    assert [len(e) for e in passes] == [0, 0, 1, 0, 0]
    (ev,) = passes[2]
    assert ev.name == STRAGGLER_EVENT
    assert ev.data == {
        "job": "j", "rank": 2, "group": "train", "stat": "step", "score": 0.5, "figure": 20.0, "median": 10.0,
        "windows": 3, "window_start_ns": 102 * WMS * 1_000_000, "window_ms": WMS,
        "since_ns": 100 * WMS * 1_000_000, "threshold": 0.75,
    }
    assert det.tracked == 1


def test_a_stat_that_asked_only_for_count_is_not_scored():
    det = StragglerDetector("j", threshold=0.75, windows=1)
    rows = [dataclasses.replace(row, agg_mask=1 << A.COUNT) for row in _window(100, {0: 10.0, 1: 10.0, 2: 30.0})]
    assert _update(det, rows) == StragglerUpdate()  # no score, no event: its values' mean is no figure it asked for
    assert _update(det, _window(101, {0: 10.0, 1: 10.0, 2: 30.0})).events  # the same figures of a timed stat


def test_exactly_the_threshold_is_not_slow_and_just_under_is():
    det = StragglerDetector(threshold=0.75, windows=1)
    at = _update(det, _window(1, {0: 3.0, 1: 3.0, 2: 4.0}))  # median 3 / 4 == 0.75 exactly
    assert {s.rank: s.score for s in at.scores} == {0: 1.0, 1: 1.0, 2: 0.75}
    assert at.events == [] and det.tracked == 0
    under = _update(det, _window(2, {0: 3.0, 1: 3.0, 2: 4.0001}))
    assert [(e.name, e.data["rank"]) for e in under.events] == [(STRAGGLER_EVENT, 2)]


def test_recovery_is_reported_once_and_a_new_run_starts_from_zero():
    det = StragglerDetector("j", windows=2)
    slow, fine = {0: 1.0, 1: 1.0, 2: 2.0}, {0: 1.0, 1: 1.0, 2: 1.0}
    passes = _feed(det, [slow, slow, slow, fine, fine, slow, fine, slow, slow])
    names = [[(e.name, e.data["rank"], e.data["windows"]) for e in p] for p in passes]
    assert names == [[], [(STRAGGLER_EVENT, 2, 2)], [], [], [(RECOVERED_EVENT, 2, 3)], [], [], [],
                     [(STRAGGLER_EVENT, 2, 2)]]  # recovered after 2 fine windows in a row, as flagged after 2 slow
    recovered = passes[4][0].data
    assert recovered["reason"] == "recovered" and recovered["score"] == 1.0
    assert recovered["window_start_ns"] == 104 * WMS * 1_000_000 and recovered["since_ns"] == 100 * WMS * 1_000_000
    # a slow window that did not reach N leaves nothing behind once the rank is fine again
    assert det.tracked == 1


def test_one_noisy_window_back_over_the_threshold_is_not_a_recovery():
    """A rank ~5% under the threshold (1.4x) crosses it now and then under load: one straggler event for the episode,
    recovered only after as many windows in a row at or above the threshold as flagging needed under it."""
    det = StragglerDetector("j", threshold=0.75, windows=3)
    slow, noisy, fine = {0: 1.0, 1: 1.0, 2: 1.4}, {0: 1.0, 1: 1.0, 2: 1.3}, {0: 1.0, 1: 1.0, 2: 1.0}
    passes = _feed(det, [slow, slow, slow, noisy, slow, noisy, noisy, slow, slow, slow, fine, noisy, slow, fine,
                          noisy, fine])
    events = [(i, e.name, e.data["rank"]) for i, p in enumerate(passes) for e in p]
    assert events == [(2, STRAGGLER_EVENT, 2), (15, RECOVERED_EVENT, 2)], events
    assert det.reported("train", "step", 2) is False and det.tracked == 0


def test_higher_is_better_flags_the_low_rank_not_the_high_one():
    figures = {0: 100.0, 1: 100.0, 2: 40.0, 3: 250.0}  # a rate: rank 2 produces least
    rate = _update(StragglerDetector(windows=1), _window(1, figures, higher_is_better=True))
    assert {s.rank: s.score for s in rate.scores} == {0: 1.0, 1: 1.0, 2: 0.4, 3: 2.5}
    assert [e.data["rank"] for e in rate.events] == [2]
    time_like = _update(StragglerDetector(windows=1), _window(1, figures))
    assert [e.data["rank"] for e in time_like.events] == [3]


def test_two_ranks_are_scored_and_one_rank_is_not():
    det = StragglerDetector(windows=1)
    alone = _update(det, [*_window(1, {0: 1.0}), _row(None, 1.0, 1)])
    assert alone.scores == [] and alone.events == []
    pair = _update(det, _window(2, {0: 1.0, 1: 3.0}))  # median 2
    assert {s.rank: s.score for s in pair.scores} == {0: 2.0, 1: pytest.approx(2 / 3)}
    assert [e.data["rank"] for e in pair.events] == [1]
    # a rank with no sample in the window has no figure: one rank left, nothing scored
    empty = _update(det, [_row(0, 1.0, 3), _row(1, 0.0, 3, count=0)])
    assert empty.scores == []


def test_each_stat_and_window_is_scored_apart_and_in_window_order():
    det = StragglerDetector(windows=2)
    rows = (_window(2, {0: 1.0, 1: 1.0, 2: 5.0}) + _window(1, {0: 1.0, 1: 1.0, 2: 5.0})
            + _window(1, {0: 1.0, 1: 1.0, 2: 1.0}, name="other") + _window(2, {0: 1.0, 1: 9.0, 2: 1.0}, name="other"))
    got = _update(det, rows)
    assert [(e.data["stat"], e.data["rank"], e.data["window_start_ns"]) for e in got.events] == [
        ("step", 2, 2 * WMS * 1_000_000)]
    assert len(got.scores) == 12 and det.tracked == 2  # step/2 reported, other/1 slow once
    # the same window again (never sent twice by the scanner) counts nothing
    assert _update(det, _window(2, {0: 1.0, 1: 1.0, 2: 5.0})).events == []


def test_a_missing_window_neither_adds_nor_resets():
    det = StragglerDetector(windows=3)
    slow = {0: 1.0, 1: 1.0, 2: 2.0}
    assert _update(det, _window(1, slow)).events == []
    assert _update(det, _window(2, slow)).events == []
    assert _update(det, _window(3, {0: 1.0, 1: 1.0})).events == []  # rank 2 added nothing in window 3
    (ev,) = _update(det, _window(4, slow)).events
    assert ev.data["windows"] == 3 and ev.data["since_ns"] == 1 * WMS * 1_000_000
    assert ev.data["window_start_ns"] == 4 * WMS * 1_000_000


def test_a_rank_that_disappears_is_forgotten_with_a_gone_event():
    det = StragglerDetector("j", windows=2, forget_after_ns=10 * WMS * 1_000_000)
    slow = {0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0}
    _feed(det, [slow, slow], first_wid=1)
    assert det.tracked == 1
    rest = {0: 1.0, 1: 1.0, 3: 1.0}
    passes = _feed(det, [rest] * 10, first_wid=3)
    assert all(p == [] for p in passes) and det.tracked == 1  # window 2 ended 10 windows before window 12 ended
    (gone,) = _update(det, _window(13, rest)).events
    assert gone.name == RECOVERED_EVENT and gone.data["reason"] == "gone" and gone.data["rank"] == 2
    assert gone.data["window_start_ns"] == 2 * WMS * 1_000_000 and gone.data["score"] == 0.5
    assert det.tracked == 0
    # a slow rank never reported is forgotten silently; a stat no longer added too (time is any row's)
    _update(det, _window(20, slow))
    assert det.tracked == 1
    assert _update(det, [_row(None, 1.0, 40, name="elsewhere")]).events == [] and det.tracked == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_figures_are_left_out_and_never_crash(bad):
    det = StragglerDetector(windows=1)
    got = _update(det, _window(1, {0: 1.0, 1: 1.0, 2: bad, 3: 3.0}))
    assert {s.rank for s in got.scores} == {0, 1, 3}
    assert [e.data["rank"] for e in got.events] == [3]
    assert _update(det, _window(2, {0: bad, 1: 1.0})).scores == []
    assert _update(det, _window(3, {0: bad, 1: bad, 2: bad})).scores == []


def test_zero_and_negative_figures_never_crash():
    det = StragglerDetector(windows=1)
    zero = _update(det, _window(1, {0: 0.0, 1: 1.0, 2: 1.0}))  # a rank that spent no time scores as well as can be
    assert {s.rank: s.score for s in zero.scores} == {0: math.inf, 1: 1.0, 2: 1.0} and zero.events == []
    all_zero = _update(det, _window(2, {0: 0.0, 1: 0.0, 2: 0.0}))
    assert {s.score for s in all_zero.scores} == {1.0}
    rate = _update(det, _window(3, {0: 0.0, 1: 1.0, 2: 1.0}, higher_is_better=True))
    assert {s.rank: s.score for s in rate.scores}[0] == 0.0 and [e.data["rank"] for e in rate.events] == [0]
    assert _update(det, _window(4, {0: -1.0, 1: 1.0, 2: 1.0})).scores == []  # not a magnitude: not scored


def test_the_figure_is_p50_when_the_stat_keeps_a_histogram():
    det = StragglerDetector(windows=1)
    rows = [_row(r, v, 1, count=5, hist=True) for r, v in {0: 1.0, 1: 1.0, 2: 2.0}.items()]
    got = _update(det, rows)
    assert [e.data["rank"] for e in got.events] == [2]
    assert got.events[0].data["figure"] == pytest.approx(2.0, rel=0.01)


def test_scores_become_metrics_of_the_collectors_group():
    (score, *_) = _update(StragglerDetector(), _window(7, {0: 1.0, 1: 2.0})).scores
    md = score.metric("shmstat", "j")
    assert (md.group_name, md.name, md.rank, md.job) == ("shmstat", "straggler.score.train/step", 0, "j")
    assert md.window_start == 7 * WMS / 1000 and md.window_end == 8 * WMS / 1000 and md.value == 1.5


@pytest.mark.parametrize("kw, says", [
    ({"threshold": 0.0}, "threshold"), ({"threshold": 1.0}, "threshold"), ({"threshold": math.nan}, "threshold"),
    ({"windows": 0}, "windows"), ({"windows": 1001}, "windows"), ({"forget_after_ns": 0}, "forget_after_ns"),
])
def test_bad_settings_are_one_sentence(kw, says):
    with pytest.raises(ConfigError, match=says):
        StragglerDetector(**kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- integration

STEP_S = 0.001
PAUSE_S = 0.009


def _timed_rank(job: str, rank: int, world: int, step_s: float, seconds: float, ready: str, go: str,
                percentiles: bool = False) -> None:
    """Add each real step's measured CPU time (``step_s`` of busy work, then a pause of ``PAUSE_S``) to Stat
    ``step_s`` for ``seconds`` (with P50/P99, so that ranks are scored on their p50, when ``percentiles``).

    CPU time, not wall time: under CPU load the scheduler stretches a step's wall time by 5 to 100 ms, one rank's
    or all ranks' at once, and such a window rightly scores the slowed rank at the median (seen: 0.75 to 1.0)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    aggs = [A.MEAN, A.COUNT, *([A.P50, A.P99] if percentiles else [])]
    stat = shmstat.Stat("step_s", aggs, WMS / 1000, group="train")
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.002)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.thread_time()
        while time.thread_time() - t0 < step_s:
            pass
        stat.add(time.thread_time() - t0)
        time.sleep(PAUSE_S)
    shmstat.shutdown()


@pytest.mark.parametrize("percentiles", [False, True], ids=["mean", "p50"])
def test_four_ranks_one_slowed_the_report_names_it_and_only_it_within_n_plus_1_windows(job, tmp_path, percentiles):
    n = 3
    scores_path = tmp_path / "shmstat.jsonl"
    coll = start_collector(job, "--grace-ms", "10", "--status-interval", "0", "--handler", "*=null",
                           "--handler", f"shmstat=jsonl:{scores_path}", "--straggler-windows", str(n))
    sub = Subscriber(coll.publish, (EVENT_TOPICS[0].encode(), b"stat/shmstat/usage"), keep_items=True)
    procs = []
    try:
        sub.wait_flowing()  # subscribed before any window is scored
        go = str(tmp_path / "go")
        for rank in range(4):
            # 3x: a window only two ranks added to (the others starved under load) has their mean for median,
            # which scores a 2x rank exactly 0.75 (not slow) and a 3x rank 0.67
            step = 3 * STEP_S if rank == 2 else STEP_S
            procs.append(spawn(_timed_rank, job, rank, 4, step, 0.8, str(tmp_path / f"ready{rank}"), go, percentiles))
        wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(4)), 30, what="4 ranks ready")
        open(go, "w").close()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        wait_for(lambda: any(t == "event/" + STRAGGLER_EVENT for t, _ in sub.items), 5, what="a straggler event")
        assert coll.stop() == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        coll.stop(timeout=5)
        sub.close()
    events = [(topic, item[2]) for topic, item in sub.items]
    reported = [data for topic, data in events if topic == "event/" + STRAGGLER_EVENT]
    assert [d["rank"] for d in reported] == [2], events
    assert all(d["rank"] == 2 for _, d in events), events  # nobody else, not even a recovery
    (ev,) = reported
    assert ev["job"] == job and (ev["group"], ev["stat"]) == ("train", "step_s") and ev["windows"] == n
    assert ev["score"] < 0.75 and ev["figure"] > ev["median"] > 0

    rows = [r for r in read_jsonl(str(scores_path)) if r["name"] == "straggler.score.train/step_s"]
    assert {r["rank"] for r in rows} == {0, 1, 2, 3}
    assert all(r["group"] == "shmstat" and r["job"] == job for r in rows)
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append((round(r["window_start"] * 1000 / WMS), r["value"]))
    first_slow = min(w for w, score in by_rank[2] if score < 0.75)
    reported_wid = ev["window_start_ns"] // (WMS * 1_000_000)
    # the N-th window that scored it from its first slow one: a window it added nothing to (a stall under load
    # can leave whole windows empty) neither counts nor resets, so window ids may run past first_slow + n
    first_n = sorted((w, score) for w, score in by_rank[2] if w >= first_slow)[:n]
    assert reported_wid == first_n[-1][0] and all(s < 0.75 for _, s in first_n), (reported_wid, sorted(by_rank[2]))
    for rank in (0, 1, 3):  # from the scores themselves: no other rank was ever slow n windows in a row
        run = longest = 0
        for _, score in sorted(by_rank[rank]):
            run = run + 1 if score < 0.75 else 0
            longest = max(longest, run)
        assert longest < n, (rank, sorted(by_rank[rank]))


def test_a_stat_declared_higher_is_better_reaches_the_rows_from_its_descriptor(job):
    """The direction a Stat declares travels through the segment to the rows the detector scores, and to the rows
    published on the ``stat/`` topics."""
    import shmstat
    from collector.read.scanner import Scanner
    from shmstat import Aggregation as A
    from shmstat.job._state import STATE

    shmstat.init(job, rank=0)
    clock = [1_700_000_000_000_000_000]
    rate = shmstat.Stat("tokens_per_s", [A.MEAN], 0.1, higher_is_better=True, clock=lambda: clock[0])
    step = shmstat.Stat("step_s", [A.MEAN], 0.1, clock=lambda: clock[0])
    rate.add(1000.0)
    step.add(0.5)
    assert STATE.attachment is not None
    rows = Scanner(STATE.attachment.segment, 0).scan(clock[0] + 10**9).rows
    direction = {r.name: r.higher_is_better for r in rows}
    assert direction == {"tokens_per_s": True, "step_s": False}
    # and on to what a subscriber of stat/<group>/<name> receives
    assert {r.name: r.to_wire()["higher_is_better"] for r in rows} == direction


def test_a_collector_s_first_scored_pass_imports_nothing(job, tmp_path):
    """A pass runs on the loop's thread, and a ring of 4 banks keeps a window about two windows long: an import
    the first pass makes (numpy.ma, which np.unique loads on its first call: 0.2 to 0.9 s on a loaded machine) lost
    a 50 ms window now and then."""
    program = os.path.join(REPO, "tests", "kit", "programs", "first_pass.py")
    proc = subprocess.run([sys.executable, program, job, str(tmp_path / "m.jsonl")], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["windows"] >= 2 and result["imported"] == [], result
