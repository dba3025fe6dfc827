"""``shmstat run --event-latency MS`` gives its ranks the budget (``SHMSTAT_EVENT_LATENCY_MS``); without it a budget
in the environment is theirs, and else the default. Real runs of real rank processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kit.procs import REPO
from kit.support import unique_job

from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "latency_rank.py")


@pytest.mark.parametrize("flag, env, expected", [(["--event-latency", "50"], None, 0.05),
                                                 (["--event-latency", "50"], "7", 0.05),
                                                 ([], "7", 0.007), ([], None, 0.02)],
                         ids=["flag", "flag-over-env", "env", "default"])
def test_the_ranks_run_with_the_budget_given(tmp_path, flag, env, expected) -> None:
    job = unique_job()
    run_env = {k: v for k, v in os.environ.items() if k != "SHMSTAT_EVENT_LATENCY_MS"}
    run_env.update(OUT_DIR=str(tmp_path), PYTHONPATH=REPO, **({"SHMSTAT_EVENT_LATENCY_MS": env} if env else {}))
    try:
        done = subprocess.run([sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2",
                               "--grace-ms", "10", *flag, SCRIPT], env=run_env, cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for rank in range(2):
            with open(tmp_path / f"latency-{rank}") as f:
                got = json.load(f)
            assert got["budget_s"] == pytest.approx(expected), got
    finally:
        Segment.unlink(job)
