"""``shmstat top``'s history: sparklines of the last windows per stat and per rank, and the windows with a straggler
marked, from a recorded segment (real ``Stat`` objects of four ranks written with an injected clock, so every
figure is known), and under a real terminal (tmux, 80x24) as windows arrive."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from kit.procs import REPO
from kit.support import MS, FakeClock, wait_for
from test_top import WINDOW_MS, _stat_as, _text

from collector.cli.top import render, snapshot
from collector.cli.top_history import History, marks, sparkline
from shmstat.job.rank import RankAttachment
from shmstat.shm.segment import Segment

VALUES = (10.0, 20.0, 30.0, 40.0, 50.0)
SLOW_WINDOWS = (1, 3)  # rank 3 adds four times the others' value in these (a straggler: score 0.25)


def _line(text: str, first: str) -> str:
    (line,) = [line for line in text.splitlines() if line.split() and line.split()[0] == first]
    return line


@pytest.fixture
def recorded(job):
    """Five windows of train/step_ms on four ranks, a frame's snapshot taken (twice) after each closes; returns
    the segment, the last snapshot and the history."""
    clock = FakeClock()
    seg = Segment.open(job)
    ranks = [RankAttachment.register(seg, rank=r, local_rank=r, world_size=4) for r in range(4)]
    clock.to_window(WINDOW_MS)
    steps = [_stat_as(att, "step_ms", "train", clock) for att in ranks]
    history = History()
    snap = None
    for k, value in enumerate(VALUES):
        for r, s in enumerate(steps):
            s.add(4 * value if r == 3 and k in SLOW_WINDOWS else value)
        clock.advance_ms(WINDOW_MS)
        for _ in range(2):  # two frames show the same window: it is kept once
            snap = snapshot(seg, clock.now)
            history.observe(snap)
    yield seg, snap, history
    seg.close()


def test_the_stats_view_shows_each_stat_over_the_last_windows_and_the_straggler_windows(recorded):
    seg, snap, history = recorded
    (job,) = snap.jobs
    (stat,) = job.stats
    points = history.points(seg.job, stat)
    # merged mean per window: 10, (3*20 + 80)/4 = 35, 30, (3*40 + 160)/4 = 70, 50
    assert [p.merged for p in points] == [10.0, 35.0, 30.0, 70.0, 50.0]
    assert [p.slow for p in points] == [(), (3,), (), (3,), ()]
    text = _text(render(snap, width=80, history=history))
    assert max(len(line) for line in text.splitlines()) <= 80, text
    row = _line(text.split("STRAGGLERS")[1], "train/step_ms")
    # scaled from 10 (lowest block) to 70 (highest): 10 -> 1st, 35 -> 4th, 30 -> 3rd, 70 -> 8th, 50 -> 6th level
    assert row.split()[1:] == ["▁▄▃█▆", "·!·!·", "3"], row
    styled = _text(render(snap, width=80, history=history), styles=True)
    (marked,) = [line for line in styled.splitlines() if "·!·!·" in line]
    assert "\x1b[1;31m" in marked  # the marks of a stat that had a straggler are bold red too


def test_the_ranks_view_shows_each_rank_over_the_last_windows(recorded):
    _seg, snap, history = recorded
    text = _text(render(snap, view="ranks", stat="train/step_ms", width=80, history=history))
    assert max(len(line) for line in text.splitlines()) <= 80, text
    past = text.split("STRAGGLERS")[1]
    assert _line(past, "merged").split()[1:] == ["▁▄▃█▆", "·!·!·"]
    # rank 3: 10, 80, 30, 160, 50 (scaled 10..160); rank 0: 10 to 50 evenly
    assert _line(past, "3").split()[1:] == ["▁▄▂█▃", "·!·!·"]
    for rank in (0, 1, 2):
        assert _line(past, str(rank)).split()[1:] == ["▁▃▅▆█", "·····"]


def test_sparklines_and_marks_keep_the_newest_windows_and_show_gaps():
    assert sparkline([1.0, None, 1.0], 5) == "  ▄ ▄"  # equal values: the middle level; none: a space
    assert sparkline([float(v) for v in range(30)], 8) == "▁▂▃▄▅▆▇█"  # the last 8, rescaled
    assert marks([True, None, False], 4) == " ! ·"
    history = History(windows=3)
    assert history.windows == 3
    with pytest.raises(ValueError):
        History(windows=0)


def test_a_bad_history_length_is_one_sentence(job):
    seg = Segment.open(job)
    try:
        done = subprocess.run([sys.executable, "-m", "collector", "top", "--job", job, "--history", "0"],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=30)
    finally:
        seg.close()
    assert done.returncode == 2 and "--history must be between 1 and" in done.stderr
    assert "Traceback" not in done.stderr


def test_history_grows_under_a_real_terminal_as_windows_arrive(job):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the real-terminal test needs it (apt-get install tmux)")
    seg = Segment.open(job)
    sock = f"shmstat-toph-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", sock]
    top = (f"cd {shlex.quote(REPO)} && PYTHONPATH={shlex.quote(REPO)} {shlex.quote(sys.executable)} "
           f"-m collector top --job {job} --interval 0.2; echo top exited with status $?")
    env = dict(os.environ, LANG="C.UTF-8", LC_ALL="C.UTF-8")  # the sparkline's blocks are UTF-8
    subprocess.run([*tmux, "-u", "-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24",
                    f"bash -c {shlex.quote(top)}"], check=True, timeout=10, env=env)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True, timeout=10,
                              env=env).stdout

    try:
        wait_for(lambda: "no closed window yet" in screen(), timeout_s=15, interval_s=0.05, what="the empty frame")
        att = RankAttachment.register(seg, rank=0, local_rank=0)
        clock = FakeClock(time.time_ns() - 10_000 * MS)
        clock.to_window(WINDOW_MS)
        s = _stat_as(att, "step_ms", "train", clock)
        for k in (1, 2, 3):  # window k: k samples of k; each shown before the next is written
            for _ in range(k):
                s.add(float(k))
            clock.advance_ms(WINDOW_MS)

            def shown(k: int = k) -> bool:
                rows = [line.split() for line in screen().splitlines() if line.startswith("train/step_ms")]
                return bool(rows) and rows[0][1:3] == [str(k), str(k)]

            wait_for(shown, timeout_s=8, interval_s=0.05, what=f"window {k} on the terminal")
        history = wait_for(lambda: next((line for line in screen().splitlines()
                                         if line.startswith("train/step_ms") and "·" in line), None),
                           timeout_s=8, interval_s=0.05, what="the history row")
        assert history.split()[1:] == ["▁▅█", "···"], history  # means 1, 2, 3; no straggler with one rank
        assert all(len(line) <= 80 for line in screen().splitlines())
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
        seg.close()
