"""``shmstat top``: frames rendered from a recorded segment (real ``Stat`` objects of four ranks and a worker of
one of them, written with an injected clock so every figure is known), the CLI's ``--once`` and its options,
and the live view under a real terminal (tmux, 80x24)."""

from __future__ import annotations

import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from kit.merge_reference import merge_all
from kit.procs import REPO
from kit.support import MS, FakeClock, unique_job, wait_for
from rich.console import Console

from collector.cli.top import abbreviate, render, snapshot, window_label
from collector.read.scanner import Scanner
from shmstat.aggregation import Aggregation as A
from shmstat.errors import ShmstatError
from shmstat.job import _state
from shmstat.job.rank import RankAttachment
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat

WINDOW_MS = 100
LONG = "a_very_long_stat_name_that_cannot_possibly_fit_in_the_stat_column_of_eighty"


def _stat_as(att: RankAttachment, name: str, group: str, clock: FakeClock,
             aggregations: tuple[A, ...] = (A.COUNT, A.MEAN, A.MAX)) -> Stat:
    """A real Stat written through ``att`` (each rank of the recording is an attachment of this process)."""
    _state.STATE.attachment = att
    _state.STATE.auto_init_done = True
    try:
        return Stat(name, list(aggregations), WINDOW_MS / 1000, group=group, clock=clock)
    finally:
        _state.STATE.attachment = None


def _record(job: str, clock: FakeClock) -> tuple[Segment, int]:
    """Four ranks and a worker of rank 1; returns the segment and the id of the newest closed window.

    train/step_ms, newest window: ranks 0 and 2 add 10 x 10.0, rank 1 adds 10 x 10.0 and its worker 5 x 10.0
    (rank 1 counts 15), rank 3 adds 10 x 40.0 (a straggler: median 10 / 40 = 0.25). The window before it holds
    other numbers (1 x 99.0 per rank) that must not show. io/read_bytes: rank 0 only, 3 x 2.5e6.
    """
    seg = Segment.open(job)
    ranks = [RankAttachment.register(seg, rank=r, local_rank=r, world_size=4) for r in range(4)]
    worker = RankAttachment.register_writer(seg, owner_local_rank=1)
    clock.to_window(WINDOW_MS)
    steps = [_stat_as(att, "step_ms", "train", clock) for att in ranks]
    worker_steps = _stat_as(worker, "step_ms", "train", clock)
    io = _stat_as(ranks[0], "read_bytes", "io", clock)
    long = _stat_as(ranks[2], LONG, "train", clock)
    for s in steps:
        s.add(99.0)
    clock.advance_ms(WINDOW_MS)
    wid = clock.now // (WINDOW_MS * MS)
    for r, s in enumerate(steps):
        for _ in range(10):
            s.add(40.0 if r == 3 else 10.0)
    for _ in range(5):
        worker_steps.add(10.0)
    for _ in range(3):
        io.add(2.5e6)
    long.add(1.0)
    clock.advance_ms(WINDOW_MS)  # window ``wid`` is now closed
    return seg, wid


def _text(renderable, *, styles: bool = False) -> str:
    console = Console(record=True, width=80, force_terminal=styles, color_system="standard" if styles else None)
    console.print(renderable)
    return console.export_text(styles=styles)


def _row(text: str, needle: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if needle in line]
    return line.split()


@pytest.fixture
def recorded(job):
    clock = FakeClock()
    seg, wid = _record(job, clock)
    yield seg, clock, wid
    seg.close()


def test_stats_frame_shows_merged_window_spread_and_straggler_in_80_columns(recorded):
    seg, clock, wid = recorded
    snap = snapshot(seg, clock.now)
    text = _text(render(snap, width=80))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert f"job {seg.job}" in lines[0] and "ranks 4/4 alive" in lines[0]
    assert f"window {window_label(wid * WINDOW_MS * MS, WINDOW_MS * MS)}" in lines[1]
    assert window_label(wid * WINDOW_MS * MS, WINDOW_MS * MS).endswith(".100 +100ms")
    # merged: 45 samples (rank 1's worker counts in rank 1), mean 750/45, no histogram yet so p50/p99 "-",
    # lowest figure 10 on rank 0, highest 40 on rank 3, which is the straggler
    assert _row(text, "train/step_ms") == ["!", "train/step_ms", "45", "16.7", "-", "-", "40", "10", "r0", "40",
                                           "r3", "3"]
    assert _row(text, "io/read_bytes") == ["io/read_bytes", "3", "2.5M", "-", "-", "2.5M", "2.5M", "r0", "2.5M",
                                           "r0"]
    long_row = _row(text, "train/a_very")
    assert long_row[0].endswith("…") and LONG not in text and long_row[1] == "1"
    assert "99" not in text.split()  # the older window (1 x 99.0 per rank) does not show
    styled = _text(render(snap, width=80), styles=True)
    (step_line,) = [line for line in styled.splitlines() if "train/step_ms" in line]
    assert "\x1b[1;31m" in step_line  # the straggler's row is bold red
    (io_line,) = [line for line in styled.splitlines() if "io/read_bytes" in line]
    assert "\x1b[1;31m" not in io_line


def test_snapshot_figures_are_exact(recorded):
    seg, clock, wid = recorded
    (job,) = snapshot(seg, clock.now).jobs
    step = next(s for s in job.stats if s.key == "train/step_ms")
    assert step.wid == wid and step.window_ns == WINDOW_MS * MS
    assert (step.merged.count, step.merged.sum, step.merged.max) == (45, 750.0, 40.0)
    assert [(r.rank, r.summary.count, r.figure) for r in step.ranks] == [(0, 10, 10.0), (1, 15, 10.0),
                                                                         (2, 10, 10.0), (3, 10, 40.0)]
    assert step.median == 10.0 and step.stragglers == (3,)
    assert step.low.rank == 0 and step.high.rank == 3 and step.spread == 3.0
    assert step.ranks[3].score == 0.25 and step.ranks[0].score == 1.0
    assert step.merged.quantile(0.99) is None  # no histogram in the segment yet


def _figures(s) -> tuple:
    return (s.count, s.sum, s.min, s.max, s.last, s.last_ts, s.torn, s.quantile(0.5), s.quantile(0.99))


@pytest.mark.parametrize("seed", range(6))
def test_merged_count_is_the_samples_added_and_every_figure_the_collectors(job, seed):
    """Random ranks, some with workers, add random samples (some in the same ns) to a plain stat and a percentile
    stat. In the newest closed window top's merged count is exactly the samples added across ranks and each rank's
    count those of its own slot and its workers; every figure, merged and per rank, is bit for bit what a collector
    pass (the Scanner) emits for that window; and the merged figures are the per-object fold of the rank figures
    (tests/kit/merge_reference.py; sums equal up to the order they are added in)."""
    rng = random.Random(seed)
    clock = FakeClock()
    seg = Segment.open(job)
    try:
        n = rng.randint(2, 5)
        writers = [(r, RankAttachment.register(seg, rank=r, local_rank=r, world_size=n)) for r in range(n)]
        writers += [(r, RankAttachment.register_writer(seg, owner_local_rank=r))
                    for r in range(n) for _ in range(rng.choice((0, 1, 2)))]
        clock.to_window(WINDOW_MS)
        aggs = {"plain": (A.COUNT, A.MEAN, A.MAX), "pct": (A.COUNT, A.MEAN, A.P50, A.P99)}
        stats = [(name, r, _stat_as(att, name, "g", clock, aggs[name])) for name in aggs for r, att in writers]
        for _, _, s in stats:
            s.add(1.0)  # the window before: must not count
        clock.advance_ms(WINDOW_MS)
        wid = clock.now // (WINDOW_MS * MS)
        added: dict[tuple[str, int], int] = {}
        for name, r, s in stats:
            k = rng.choice((0, 1, 7, 40))
            for _ in range(k):
                s.add(rng.choice((rng.uniform(-5, 500), rng.expovariate(0.01), 0.0)))
                clock.advance_ms(rng.choice((0, 0, 0.01)))
            added[name, r] = added.get((name, r), 0) + k
        clock.to_window(WINDOW_MS, 1)  # window ``wid`` is now closed
        for _, _, s in stats:
            s.add(1e9)  # the open window: must not count
        (view,) = snapshot(seg, clock.now).jobs
        collector_rows = [row for row in Scanner(seg, grace_ns=0).scan(clock.now).rows if row.wid == wid]
        shown = {s.name: s for s in view.stats}
        for name in aggs:
            per_rank = {r: sum(k for (nm, rr), k in added.items() if nm == name and rr == r) for r in range(n)}
            if not sum(per_rank.values()):
                assert name not in shown or shown[name].wid < wid
                continue
            stat = shown[name]
            assert stat.wid == wid
            assert stat.merged.count == sum(per_rank.values())
            assert {f.rank: f.summary.count for f in stat.ranks} == {r: k for r, k in per_rank.items() if k}
            rows = {row.rank: row.summary for row in collector_rows if row.name == name}
            assert _figures(stat.merged) == _figures(rows[None])
            assert {f.rank: _figures(f.summary) for f in stat.ranks} == {
                r: _figures(s) for r, s in rows.items() if r is not None}
            folded = merge_all(f.summary for f in stat.ranks)
            assert _figures(folded)[2:] == _figures(stat.merged)[2:] and folded.count == stat.merged.count
            assert math.isclose(folded.sum, stat.merged.sum, rel_tol=1e-12)
            assert (stat.merged.quantile(0.5) is None) == (name == "plain")
    finally:
        seg.close()


def test_per_rank_frame_of_one_stat_and_sorts(recorded):
    seg, clock, _ = recorded
    snap = snapshot(seg, clock.now)
    text = _text(render(snap, view="ranks", stat="train/step_ms", sort="spread", width=80))
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "stat train/step_ms" in text and "median 10" in text
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    pid = str(os.getpid())
    assert rows[0] == ["3", "active", pid, "10", "40", "-", "-", "40", "40", "0.25", "SLOW"]  # worst score first
    assert sorted(r[0] for r in rows) == ["0", "1", "2", "3"]
    assert next(r for r in rows if r[0] == "1")[3] == "15"
    by_name = _text(render(snap, sort="name"))
    by_count = _text(render(snap, sort="count"))
    by_mean = _text(render(snap, sort="mean"))

    def order(text: str) -> list[str]:
        return [w for line in text.splitlines() for w in line.split()[:2] if "/" in w]

    assert order(by_name)[0] == "io/read_bytes" and order(by_name)[-1] == "train/step_ms"
    assert order(by_count)[0] == "train/step_ms" and order(by_mean)[0] == "io/read_bytes"
    missing = _text(render(snap, view="ranks", stat="train/nope"))
    assert "no stat train/nope" in missing


def test_abbreviations_fit_six_characters():
    cases = {0: "0", 12.5: "12.5", 0.125: "0.125", 1234: "1.23k", -4.5e6: "-4.5M", 1.2e-5: "1.2e-5", 999.4: "999",
             3e12: "3T", None: "-", float("inf"): "inf"}
    for value, want in cases.items():
        assert abbreviate(value) == want, value
    assert all(len(abbreviate(v)) <= 6 for v in (-999_999.0, 123_456_789.0, -0.000123, 0.00999, 1e20))


def _shmstat(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", "top", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=30)


def test_once_prints_one_plain_frame_through_the_cli(recorded):
    seg, _, _ = recorded
    done = _shmstat("--job", seg.job, "--once")
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout  # stdout is not a terminal: no escape codes
    assert _row(done.stdout, "train/step_ms")[:4] == ["!", "train/step_ms", "45", "16.7"]
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    ranks = _shmstat("--job", seg.job, "--once", "--stat", "train/step_ms", "--sort", "count")
    assert ranks.returncode == 0, ranks.stderr
    assert "SLOW" in ranks.stdout
    every = _shmstat("--once")  # every job of this user: ours is among them
    assert every.returncode == 0, every.stderr
    assert f"job {seg.job}" in every.stdout


def test_live_view_under_a_real_terminal_shows_data_as_it_arrives(job):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the real-terminal test needs it (apt-get install tmux)")
    seg = Segment.open(job)
    sock = f"shmstat-top-{uuid.uuid4().hex[:8]}"  # a tmux server of our own: independent under xdist
    tmux = ["tmux", "-L", sock]
    # bash reports top's exit status (tmux's own #{pane_dead_status} is sometimes never filled in under load)
    top = (f"cd {shlex.quote(REPO)} && PYTHONPATH={shlex.quote(REPO)} {shlex.quote(sys.executable)} "
           f"-m collector top --job {job} --interval 0.2; echo top exited with status $?")
    cmd = f"bash -c {shlex.quote(top)}"
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24", cmd], check=True,
                   timeout=10)
    subprocess.run([*tmux, "set-option", "-g", "remain-on-exit", "on"], check=True, timeout=10)  # keep the screen

    def screen(*history: str) -> str:
        got = subprocess.run([*tmux, "capture-pane", "-p", *history], capture_output=True, text=True, timeout=10)
        return got.stdout

    try:
        wait_for(lambda: "no closed window yet" in screen(), timeout_s=15, interval_s=0.05, what="the empty frame")
        att = RankAttachment.register(seg, rank=0, local_rank=0)
        clock = FakeClock(time.time_ns() - 10_000 * MS)
        clock.to_window(WINDOW_MS)
        s = _stat_as(att, "step_ms", "train", clock)
        for _ in range(7):
            s.add(3.0)
        clock.advance_ms(WINDOW_MS)
        shown = wait_for(lambda: next((line for line in screen().splitlines() if "train/step_ms" in line), None),
                         timeout_s=8, interval_s=0.05, what="the stat's row on the terminal")
        assert shown.split()[:3] == ["train/step_ms", "7", "3"], shown
        text = screen()
        assert f"job {job}" in text and all(len(line) <= 80 for line in text.splitlines())
        subprocess.run([*tmux, "send-keys", "C-c"], check=True, timeout=10)  # Ctrl-C: a clean exit, status 0
        # (tmux may scroll the line into the history when the pane dies: look there too)
        said = wait_for(lambda: next((line for line in screen("-S", "-50").splitlines() if "top exited" in line),
                                     None), timeout_s=8, interval_s=0.05, what="top to exit on Ctrl-C")
        assert said.endswith("top exited with status 0"), said
        assert "Traceback" not in screen("-S", "-50")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
        seg.close()


def _top_frame(*args: str, columns: int = 160) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", "top", "--once", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO, COLUMNS=str(columns)), cwd=REPO, timeout=60)


def test_names_are_text_and_a_rate_straggler_is_its_slow_rank_under_a_real_job(tmp_path):
    """A real ``shmstat run`` job (tests/kit/programs/names_rate_job.py, three ranks) writes stats named like markup
    (``tok[/s]``, ``step time [ms]``, ``[bold red]loss[/bold red]``, group ``[b]io``, ...) and a higher-is-better
    rate whose rank 2 is slow while rank 1 is the fastest. ``top --once`` (with and without ``--job``, and the
    ranks view of the rate) and the live view under a real terminal (tmux) show every name as written and exit 0;
    the rate's straggler is rank 2 alone, with its score the rate over the median (300 / 1000), as the collector
    scores it."""
    from kit.names_rate import HOSTILE, RANKS, RATE, RATES, SLOW_RANK, start_job, stop_job

    job = unique_job("topnames")
    run = start_job(job, tmp_path, "--handler", "*=null", seconds=60)
    keys = [f"{g}/{n}" for g, n in HOSTILE]
    rate = f"{RATE[0]}/{RATE[1]}"
    try:
        def made() -> bool:  # top --job on a segment still being made says "bad magic": not this test's subject
            try:
                Segment.open(job, create=False, wait=False).close()
            except (ShmstatError, OSError):
                return False
            return True

        wait_for(made, timeout_s=60, interval_s=0.05, what="the job's segment")

        def every_row() -> subprocess.CompletedProcess[str] | None:
            done = _top_frame("--job", job)
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            # every row, and the rate's newest window scored across the ranks (a first window may hold one rank)
            return done if all(any(line.lstrip("! ").startswith(k + " ") for line in lines) for k in keys) and any(
                line.startswith(f"! {rate} ") for line in lines) else None

        frame = wait_for(every_row, timeout_s=60, interval_s=0.2, what="every stat's row in top, the rate scored")
        assert "Traceback" not in frame.stderr
        rate_row = next(line for line in frame.stdout.splitlines() if rate in line)
        assert rate_row.startswith(f"! {rate} ") and rate_row.split()[-1] == str(SLOW_RANK), rate_row
        def every_job() -> subprocess.CompletedProcess[str] | None:
            # every job of this user (other tests' too): ours among them, none taken down by a name; a frame may
            # miss a job whose segment it could not open at that instant, so the next one is looked at
            done = _top_frame()
            assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
            last[:] = [done.stdout]
            return done if f"job {job}" in done.stdout and all(k in done.stdout for k in keys) else None

        last: list[str] = []
        try:
            wait_for(every_job, timeout_s=30, interval_s=0.2, what="our job's stats in the frame of every job")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last frame:\n{last[0] if last else ''}") from None
        ranks = _top_frame("--job", job, "--stat", rate)
        assert ranks.returncode == 0, ranks.stderr
        assert f"stat {rate}" in ranks.stdout
        rows = {int(r[0]): r for r in (line.split() for line in ranks.stdout.splitlines())
                if r and r[0].isdigit() and int(r[0]) < RANKS and len(r) >= 10}
        assert sorted(rows) == list(range(RANKS)), ranks.stdout
        assert [r for r, row in rows.items() if row[-1] == "SLOW"] == [SLOW_RANK], ranks.stdout
        median = sorted(RATES.values())[1]
        assert {r: row[9] for r, row in rows.items()} == {r: f"{RATES[r] / median:.2f}" for r in rows}, ranks.stdout

        sock = f"shmstat-top-{uuid.uuid4().hex[:8]}"
        tmux = ["tmux", "-L", sock]
        top = (f"cd {shlex.quote(REPO)} && PYTHONPATH={shlex.quote(REPO)} {shlex.quote(sys.executable)} "
               f"-m collector top --job {job} --interval 0.2; echo top exited with status $?")
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed: the real-terminal part needs it (apt-get install tmux)")
        subprocess.run([*tmux, "-u", "-f", "/dev/null", "new-session", "-d", "-x", "160", "-y", "40",
                        f"bash -c {shlex.quote(top)}"], check=True, timeout=10)
        subprocess.run([*tmux, "set-option", "-g", "remain-on-exit", "on"], check=True, timeout=10)

        def screen(*history: str) -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", *history], capture_output=True, text=True,
                                  timeout=10).stdout

        try:
            wait_for(lambda: all(k in screen() for k in keys), timeout_s=20, interval_s=0.1,
                     what="every name on the terminal as written")
            subprocess.run([*tmux, "send-keys", "C-c"], check=True, timeout=10)
            said = wait_for(lambda: next((line for line in screen("-S", "-100").splitlines()
                                          if "top exited" in line), None),
                            timeout_s=8, interval_s=0.05, what="top to exit on Ctrl-C")
            assert said.endswith("top exited with status 0"), said
            assert "Traceback" not in screen("-S", "-100")
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
    finally:
        stop_job(run)
        Segment.unlink(job)
