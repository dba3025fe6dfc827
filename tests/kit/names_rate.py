"""The job of tests/kit/programs/names_rate_job.py (stats named like markup, a rate whose rank 2 is slow) under a real
``shmstat run``, for the tests of every surface that shows names and stragglers: ``top``, ``report``, Grafana."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from kit.procs import REPO

PROGRAM = os.path.join(REPO, "tests", "kit", "programs", "names_rate_job.py")
RANKS = 3

_spec = importlib.util.spec_from_file_location("names_rate_job", PROGRAM)
assert _spec is not None and _spec.loader is not None
_program = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_program)  # constants only: the job runs under ``if __name__ == "__main__"``

RATE: tuple[str, str] = _program.RATE
RATES: dict[int, float] = _program.RATES
STEP: tuple[str, str] = _program.STEP
HOSTILE: tuple[tuple[str, str], ...] = _program.HOSTILE
SLOW_RANK = 2
"""The straggler of both ``RATE`` (the lowest rate) and ``STEP`` (the longest time)."""


def start_job(job: str, cwd: Path, *collector_args: str, seconds: float = 2.0,
              wait: bool = False) -> subprocess.Popen | subprocess.CompletedProcess:
    """``shmstat run`` of the program with ``RANKS`` ranks and ``collector_args`` (``--handler`` ...): started in
    the background (the caller stops it with :func:`stop_job`), or run to its end with ``wait``."""
    env = dict(os.environ, PYTHONPATH=REPO, SECONDS_TO_RUN=str(seconds), WINDOW_S="0.2")
    cmd = [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", str(RANKS), "--grace-ms", "20",
           "--monitor-interval", "0.05", *collector_args, PROGRAM]
    if wait:
        return subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=180)
    return subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_job(run: subprocess.Popen) -> None:
    """Ctrl-C a job :func:`start_job` started in the background, and wait for it."""
    if run.poll() is None:
        run.send_signal(signal.SIGINT)
    try:
        run.wait(60)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait(10)
