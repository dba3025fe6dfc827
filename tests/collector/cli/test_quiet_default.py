"""Quiet by default: with no ``--handler``, ``shmstat run`` and ``shmstat collect`` print one line per merged stat
window (exact counts) and a periodic one-line status; per-call put metrics and ``@prof`` calls are printed only
when asked (``--handler GROUP=console``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from kit.procs import REPO, load_counts, rank_worker, spawn, start_collector
from kit.support import unique_job

from shmstat.shm.runtime import lock_path, segment_name
from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "chatty_rank.py")
STEPS = 3000
WINDOW = re.compile(r"^\[\d\d:\d\d:\d\d(\.\d{3})?\] chatty/step_ms  count=(\d+) mean=\S+ p99=\S+ \((\d+) ranks?\)$")
STATUS = re.compile(r"^\[\d\d:\d\d:\d\d\] shmstat: (?:stopped: )?job (\S+)(?: served)?, (\d+) ranks? "
                    r"(?:alive|still running), (\d+) windows emitted, (\d+) events relayed, (\d+) dropped$")


def _run(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess[str], str]:
    job = unique_job("quiet")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, STEPS=str(STEPS))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2", "--monitor-interval",
             "0.05", "--grace-ms", "10", "--status-interval", "0.2", *extra, SCRIPT],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        Segment.unlink(job)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["steps-0", "steps-1"]
    return done, job


def _windows(stdout: str) -> list[re.Match[str]]:
    return [m for m in map(WINDOW.match, stdout.splitlines()) if m]


def test_run_prints_one_line_per_merged_window_with_exact_counts_and_no_put_metric(tmp_path):
    done, job = _run(tmp_path)
    lines = done.stdout.splitlines()
    windows = _windows(done.stdout)
    assert len(windows) == len(lines), [line for line in lines if not WINDOW.match(line)]  # nothing else on stdout
    assert sum(int(m.group(2)) for m in windows) == 2 * STEPS  # every sample of both ranks, counted once
    assert len(lines) < STEPS / 10, "O(windows) lines, not O(calls)"  # 4 * STEPS put/@prof calls were made
    statuses = [m for m in map(STATUS.match, done.stderr.splitlines()) if m]
    assert statuses and all(m.group(1) == job for m in statuses), done.stderr
    final = statuses[-1]
    assert int(final.group(3)) == len(windows) and final.group(5) == "0"  # the status counts what was printed


def test_put_metrics_of_a_group_are_printed_when_asked(tmp_path):
    done, _job = _run(tmp_path, "--handler", "torchelastic=console")
    agent = [line for line in done.stdout.splitlines() if "][torchelastic]: " in line]
    assert any(line.endswith("]: workers.default.run_total=1") for line in agent), done.stdout
    assert any("]: Agent._start_workers.success=1" in line for line in agent)  # the agent's @prof calls
    assert "[chatty]" not in done.stdout  # the ranks' group still gets the compact default
    assert sum(int(m.group(2)) for m in _windows(done.stdout)) == 2 * STEPS


@pytest.mark.parametrize("spec", ["chatty=console", "*=console"])
def test_console_still_prints_every_call_of_the_ranks(tmp_path, spec):
    done, _job = _run(tmp_path, "--handler", spec)
    losses = [line for line in done.stdout.splitlines() if "][chatty]: loss=" in line]
    profs = [line for line in done.stdout.splitlines() if "][chatty]: __main__.train_step.success=1" in line]
    assert len(losses) == len(profs) == 2 * STEPS


NODE_STATUS = re.compile(r"^\[\d\d:\d\d:\d\d\] shmstat: (stopped: )?(\d+) jobs?(?: served)?, (\d+) ranks? "
                         r"(alive|still running), (\d+) windows emitted, (\d+) events relayed, (\d+) dropped$")


def test_the_node_collector_names_each_windows_job_and_prints_one_status_line_for_all(tmp_path):
    jobs = [unique_job("na"), unique_job("nb")]
    coll = start_collector(None, "--job", jobs[0], "--job", jobs[1], "--grace-ms", "10", "--status-interval", "0.2")
    try:
        # its start line, then each job picked up (shown as its short id): on stderr
        shown = {job: re.search(r"\(shown as (\S+)\)", coll.lines_seen(f"job {job} picked up", 60)).group(1)
                 for job in jobs}
        assert all(len(short) < len(job) for job, short in shown.items()), shown
        ranks = [spawn(rank_worker, job, 0, 1, 0.6, 100, str(tmp_path / f"r{i}.json")) for i, job in enumerate(jobs)]
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        code, out = coll.finish(signal.SIGTERM, 30)
        assert code == 0
        line = re.compile(r"^\[\d\d:\d\d:\d\d(\.\d{3})?\] (\S+) train/steps  count=(\d+) sum=\S+ max=\S+ \(1 rank\)$")
        windows = [m for m in map(line.match, out.splitlines()) if m]
        assert len(windows) == len(out.splitlines()), out  # stdout: the windows and nothing else
        for i, job in enumerate(jobs):
            printed = sum(int(m.group(3)) for m in windows if m.group(2) == shown[job])
            assert printed == sum(load_counts(str(tmp_path / f"r{i}.json")).values())  # exact, per job
        statuses = [m for m in map(NODE_STATUS.match, coll.lines) if m]
        assert len(statuses) >= 2 and statuses[-1].group(2) == "2"  # periodic, then the final one over both jobs
        assert statuses[-1].group(1) and not any(m.group(1) for m in statuses[:-1])  # only the last says stopped
        assert int(statuses[-1].group(5)) == len(windows) and statuses[-1].group(7) == "0"
        assert statuses[-1].group(3) == "0" and not any("stopping while" in line for line in coll.lines)
        for job in jobs:  # both jobs done, every window emitted: nothing left
            assert not os.path.exists("/dev/shm" + segment_name(job)) and not os.path.exists(lock_path(job))
    finally:
        if coll.proc.poll() is None:
            coll.stop(signal.SIGKILL)
        for job in jobs:
            Segment.unlink(job)


def test_the_status_line_counts_what_the_ranks_dropped_for_want_of_room() -> None:
    from collector.handlers.console import status_line

    base = {"windows_emitted": 7, "events_relayed": 3, "handler_dropped": 1, "seq_gaps": 2, "windows_overwritten": 0,
            "handler_errors": 0, "frames_rejected": 0, "samples_dropped": 0}
    quiet = status_line(base, ranks_alive=2, job="j", now=0)
    assert "7 windows emitted" in quiet and "3 dropped" in quiet and "samples dropped" not in quiet
    loud = status_line({**base, "samples_dropped": 41}, ranks_alive=2, job="j", now=0)
    assert "41 samples dropped by ranks" in loud and "shmstat ls" in loud


def test_a_node_collector_stopped_while_ranks_run_says_so_and_its_status_lines_agree(tmp_path):
    """Ctrl-C on a node collector while jobs run (issue 44): one line names the ranks still running, of which
    jobs, and within how long a successor must start; the periodic lines count the jobs served now and the ranks
    alive, the last line (``stopped:``) the jobs served in all and the ranks still running: none contradicts
    another (before: the last said ``2 jobs, 0 ranks alive`` with 3 ranks running, and nothing more)."""
    jobs = [unique_job("stopa"), unique_job("stopb")]
    coll = start_collector(None, "--job", jobs[0], "--job", jobs[1], "--grace-ms", "10", "--status-interval", "0.2")
    ranks = [spawn(rank_worker, job, r, world, 60.0, 500, str(tmp_path / f"{job}-{r}.json"))
             for job, world in zip(jobs, (2, 1), strict=True) for r in range(world)]
    try:
        for job in jobs:
            coll.lines_seen(f"job {job} picked up", 60)
        coll.lines_seen("2 jobs, 3 ranks alive", 60)
        assert coll.stop(signal.SIGINT, 30) == 0
        statuses = [m for m in map(NODE_STATUS.match, coll.lines) if m]
        final = statuses[-1]
        assert final.group(1) == "stopped: " and final.group(2) == "2" and final.group(3) == "3", coll.lines
        assert final.group(4) == "still running"
        assert all(m.group(1) is None and m.group(4) == "alive" for m in statuses[:-1]), coll.lines
        (said,) = [line for line in coll.lines if "stopping while" in line]
        # windows of 500 ms, 4 banks: the ring holds what they add for 2 windows
        assert (f"stopping while 3 ranks still run ({jobs[0]}: 2, {jobs[1]}: 1); start a collector within 1 s (2 of "
                "the ring's 4 windows)") in said, said
    finally:
        for p in ranks:
            p.terminate()
            p.join(30)
        if coll.proc.poll() is None:
            coll.stop(signal.SIGKILL)
        for job in jobs:
            Segment.unlink(job)
