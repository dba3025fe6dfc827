"""``shmstat top --sections``: one row per rank, its time split across its sections (mean ms and share of the
window, wait sections marked, a straggler's cells marked) and what it is doing now, read from its phase word.

First a recorded segment (ranks and a worker registered in this process, section Stats on a fake clock, phase
words written by the rank side's own :class:`PhaseWriter`), whose frame is checked to the digit; then a real
``shmstat run`` job (tests/kit/programs/sections_job.py: three ranks, the last slow, a section named like markup)
through ``top --once --sections`` and a real terminal (tmux), with a rank stuck in ``data`` while the others
wait in ``allreduce``."""

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
from kit.support import MS, FakeClock, unique_job, wait_for
from rich.console import Console

from collector.cli.top import render, snapshot
from shmstat.aggregation import Aggregation as A
from shmstat.errors import ShmstatError
from shmstat.job import _state
from shmstat.job.rank import RankAttachment
from shmstat.shm.phase import PhaseWriter, read_phase
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat

WINDOW_MS = 100
SECTION_AGGS = (A.COUNT, A.SUM, A.MEAN, A.P50, A.P99, A.MAX)  # a section's, as shmstat.section makes it
HOSTILE = "[b]fwd[/b]"
SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "sections_job.py")
FORWARD = "[b]forward[/b]"  # sections_job.py's second section


def _section(att: RankAttachment, name: str, clock: FakeClock, *, wait: bool = False) -> Stat:
    _state.STATE.attachment = att
    _state.STATE.auto_init_done = True
    try:
        return Stat(name, list(SECTION_AGGS), WINDOW_MS / 1000, group="section", wait=wait, clock=clock)
    finally:
        _state.STATE.attachment = None


def _text(renderable, width: int = 80) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def _rows(text: str) -> dict[int, list[str]]:
    return {int(cells[0]): cells for cells in (line.split() for line in text.splitlines())
            if cells and cells[0].isdigit()}


def test_the_sections_frame_is_each_ranks_split_and_phase_to_the_digit(job):
    """Three ranks and a worker of rank 2, sections ``data``, ``[b]fwd[/b]`` and ``allreduce`` (wait), one closed
    window of 100 ms: rank 0 adds data 5 x 4 ms, fwd 5 x 6 ms, allreduce 5 x 2 ms (40%, 30%, 10% of the window,
    in cells ``4 20%``, ``6 30%``, ``2 10%``); rank 1 the same; rank 2 data 5 x 12 ms and fwd 5 x 6 ms (a
    straggler on data: median 4 / 12), allreduce 1 x 0.5 ms. Phase words: rank 0 in allreduce (a wait) at depth 1,
    rank 1 outside every section after 7 steps, rank 2 itself outside but its worker in data (shown as the rank's,
    as the hang detector reads it)."""
    clock = FakeClock(time.time_ns() - 1000 * MS)
    clock.to_window(WINDOW_MS)
    seg = Segment.open(job)
    try:
        ranks = [RankAttachment.register(seg, rank=r, local_rank=r, world_size=3) for r in range(3)]
        worker = RankAttachment.register_writer(seg, owner_local_rank=2)
        stats = [(_section(a, "data", clock), _section(a, HOSTILE, clock), _section(a, "allreduce", clock, wait=True))
                 for a in ranks]
        worker_data = _section(worker, "data", clock)
        for r, (data, fwd, allreduce) in enumerate(stats):
            for _ in range(5):
                data.add(12.0 if r == 2 else 4.0)
                fwd.add(6.0)
            for _ in range(1 if r == 2 else 5):
                allreduce.add(0.5 if r == 2 else 2.0)
        clock.advance_ms(WINDOW_MS)  # the window is closed
        mono = time.monotonic_ns()
        PhaseWriter(seg, 0).enter(3, 1, mono - 1500 * MS)  # ident 3: the entry's third Stat, allreduce
        one = PhaseWriter(seg, 1)
        for _ in range(7):
            one.step()
        PhaseWriter(seg, worker.local_rank).enter(1, 1, mono - 2500 * MS)  # the worker's data
        now = time.time_ns()
        text = _text(render(snapshot(seg, now), view="sections", width=80))
        assert all(len(line) <= 80 for line in text.splitlines()), text
        header = next(line for line in text.splitlines() if line.lstrip().startswith("RANK"))
        assert header.split() == ["RANK", "NOW", "FOR", "STEP", HOSTILE, "data", "allreduce~"], text
        rows = _rows(text)
        assert sorted(rows) == [0, 1, 2], text

        def age(local_rank: int) -> str:
            phase = read_phase(seg, local_rank)
            assert phase is not None
            return f"{(now - phase.since_ns) / 1e9:.1f}s"

        assert rows[0] == ["0", "allreduce~", age(0), "0", "6", "30%", "4", "20%", "2", "10%"], text
        assert rows[1] == ["1", "(outside)", age(1), "7", "6", "30%", "4", "20%", "2", "10%"], text
        assert rows[2] == ["2", "data", age(worker.local_rank), "0", "6", "30%", "!12", "60%", "0.5", "0%"], text
        assert text.splitlines()[2] == "per section: mean ms, % of the window; ~ a wait", text
        # a terminal too narrow for every section keeps the one taking the most time (data: 100 ms of the window
        # across the ranks, fwd 90, allreduce 20.5) and says how many it left out
        narrow = _text(render(snapshot(seg, now), view="sections", width=40), width=40)
        header = next(line for line in narrow.splitlines() if line.lstrip().startswith("RANK"))
        assert header.split() == ["RANK", "NOW", "FOR", "STEP", "data"], narrow
        assert "2 more do not fit" in narrow, narrow
        del worker_data
    finally:
        seg.close()


def test_sections_and_stat_are_two_views():
    done = subprocess.run([sys.executable, "-m", "collector", "top", "--once", "--sections", "--stat", "a/b"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines()[-1].endswith("--sections and --stat are two views: give one of them")


def _top(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", "top", "--once", "--sections", *args],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO, COLUMNS=str(columns)),
                          cwd=REPO, timeout=60)


def test_a_real_job_shows_its_split_its_slow_rank_and_who_holds_it_when_stuck(tmp_path):
    """``shmstat run`` of sections_job.py (three ranks, rank 2 three times slower in ``data`` and the section named
    ``[b]forward[/b]``): ``top --once --sections`` shows every section's column (``allreduce~`` a wait), the names
    as written, rank 2's data and forward cells marked as a straggler's and no other rank's. Then rank 1 is held
    in ``data`` (the program's stuck file): the frame shows rank 1 in data and ranks 0 and 2 in ``allreduce~``,
    each for the time since the hold (at least 1 s); released, every rank moves again. The live view under a
    real 80-column terminal (tmux) shows the same rows and exits 0 on Ctrl-C."""
    job = unique_job("topsec")
    stuck = tmp_path / "stuck"
    env = dict(os.environ, PYTHONPATH=REPO, SECONDS_TO_RUN="90", SHMSTAT_SECTION_WINDOW_S="0.5", SLOW_RANKS="2",
               SLOW_FACTOR="3", STUCK_FILE=str(stuck), STUCK_RANK="1")
    run = subprocess.Popen([sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "3",
                            "--handler", "*=null", SCRIPT], env=env, cwd=str(tmp_path),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def made() -> bool:
            try:
                Segment.open(job, create=False, wait=False).close()
            except (ShmstatError, OSError):
                return False
            return True

        wait_for(made, timeout_s=60, interval_s=0.05, what="the job's segment")
        last: list[str] = [""]

        def split_shown() -> dict[int, list[str]] | None:
            done = _top("--job", job)
            assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
            last[0] = done.stdout
            rows = _rows(done.stdout)
            # every rank with a cell in every section (two cells a section: mean, share)
            return rows if sorted(rows) == [0, 1, 2] and all(len(r) == 10 for r in rows.values()) else None

        rows = wait_for(split_shown, timeout_s=60, interval_s=0.2, what="every rank's split")
        frame = last[0]
        header = next(line for line in frame.splitlines() if line.lstrip().startswith("RANK"))
        assert header.split() == ["RANK", "NOW", "FOR", "STEP", FORWARD, "data", "allreduce~"], frame
        assert all(len(line) <= 80 for line in frame.splitlines()), frame
        marked = {r: [c for c in row[4:] if c.startswith("!")] for r, row in rows.items()}
        assert len(marked[2]) == 2 and not marked[0] and not marked[1], frame  # data and forward, rank 2 only
        assert all(row[1] in (FORWARD, "data", "allreduce~") for row in rows.values()), frame

        stuck.touch()
        held = time.monotonic()

        def hold_shown() -> dict[int, list[str]] | None:
            done = _top("--job", job)
            last[0] = done.stdout
            rows = _rows(done.stdout)
            ok = (sorted(rows) == [0, 1, 2] and [rows[r][1] for r in range(3)] == ["allreduce~", "data", "allreduce~"]
                  and all(float(rows[r][2].rstrip("s")) >= 1.0 for r in range(3)))
            return rows if ok else None

        rows = wait_for(hold_shown, timeout_s=30, interval_s=0.2, what=f"the hold (last frame:\n{last[0]})")
        assert all(float(rows[r][2].rstrip("s")) <= time.monotonic() - held + 0.5 for r in range(3)), last[0]
        steps = {r: int(rows[r][3]) for r in range(3)}
        stuck.unlink()
        def stepping() -> bool:
            rows = _rows(_top("--job", job).stdout)
            return sorted(rows) == [0, 1, 2] and all(int(rows[k][3]) > steps[k] for k in range(3))

        wait_for(stepping, timeout_s=30, interval_s=0.2, what="every rank stepping again")

        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed: the real-terminal part needs it (apt-get install tmux)")
        sock = f"shmstat-top-{uuid.uuid4().hex[:8]}"
        tmux = ["tmux", "-L", sock]
        top = (f"cd {shlex.quote(REPO)} && PYTHONPATH={shlex.quote(REPO)} {shlex.quote(sys.executable)} "
               f"-m collector top --sections --job {job} --interval 0.2; echo top exited with status $?")
        subprocess.run([*tmux, "-u", "-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24",
                        f"bash -c {shlex.quote(top)}"], check=True, timeout=10)
        subprocess.run([*tmux, "set-option", "-g", "remain-on-exit", "on"], check=True, timeout=10)

        def screen(*history: str) -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", *history], capture_output=True, text=True,
                                  timeout=10).stdout

        try:
            def every_rank() -> str | None:
                text = screen()
                return text if sorted(_rows(text)) == [0, 1, 2] and FORWARD in text else None

            shown = wait_for(every_rank, timeout_s=20, interval_s=0.1, what="every rank's row on the terminal")
            assert all(len(line) <= 80 for line in shown.splitlines()), shown
            subprocess.run([*tmux, "send-keys", "C-c"], check=True, timeout=10)
            said = wait_for(lambda: next((line for line in screen("-S", "-100").splitlines()
                                          if "top exited" in line), None),
                            timeout_s=8, interval_s=0.05, what="top to exit on Ctrl-C")
            assert said.endswith("top exited with status 0"), said
            assert "Traceback" not in screen("-S", "-100")
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
    finally:
        run.send_signal(2)
        try:
            run.wait(60)
        finally:
            Segment.unlink(job)


def _ranks_in_order(text: str) -> list[int]:
    return [int(cells[0]) for cells in (line.split() for line in text.splitlines()) if cells and cells[0].isdigit()]


def test_sort_orders_the_sections_rows_and_a_key_that_does_not_apply_is_refused(job):
    """A recorded segment of four ranks, one closed window of sections ``data`` and ``allreduce`` (wait): rank 1
    three times slower in data, rank 3 twice. Through the real command, piped: ``--sort name`` lists ranks 0..3,
    ``--sort spread`` the worst score first (1, 3, then the others by rank); ``count``, ``mean`` and ``p99`` (a
    rank has one of each per section) are refused in one sentence, exit 2."""
    clock = FakeClock(time.time_ns() - 1000 * MS)
    clock.to_window(WINDOW_MS)
    seg = Segment.open(job)
    try:
        ranks = [RankAttachment.register(seg, rank=r, local_rank=r, world_size=4) for r in range(4)]
        stats = [(_section(a, "data", clock), _section(a, "allreduce", clock, wait=True)) for a in ranks]
        slow = {1: 3.0, 3: 2.0}
        for r, (data, allreduce) in enumerate(stats):
            for _ in range(5):
                data.add(4.0 * slow.get(r, 1.0))
                allreduce.add(2.0)
        clock.advance_ms(WINDOW_MS)  # the window is closed

        def order(sort: str) -> list[int]:
            done = _top("--job", job, "--sort", sort)
            assert done.returncode == 0, done.stderr
            return _ranks_in_order(done.stdout)

        assert order("name") == [0, 1, 2, 3]
        assert order("spread") == [1, 3, 0, 2]
        for key in ("count", "mean", "p99"):
            done = _top("--job", job, "--sort", key)
            assert done.returncode == 2, done
            last = done.stderr.strip().splitlines()[-1]
            assert last.endswith(f"--sort {key} does not apply to --sections (a rank has one per section): "
                                 "sort its ranks by name or spread"), done.stderr
        del stats
    finally:
        seg.close()
