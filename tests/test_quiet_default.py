"""Quiet by default: with no ``--handler``, ``shmstat run`` and ``shmstat collect`` print one line per merged stat
window (exact counts) and a periodic one-line status; per-call put metrics and ``@prof`` calls are printed only
when asked (``--handler GROUP=console``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from _procs import REPO
from _support import unique_job

from shmstat.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "scripts", "chatty_rank.py")
STEPS = 3000
WINDOW = re.compile(r"^\[\d\d:\d\d:\d\d(\.\d{3})?\] chatty/step_ms  count=(\d+) mean=\S+ p99=\S+ \((\d+) ranks?\)$")
STATUS = re.compile(r"^\[\d\d:\d\d:\d\d\] shmstat: job (\S+), (\d+) ranks? alive, (\d+) windows emitted, "
                    r"(\d+) events relayed, (\d+) dropped$")


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
