"""``shmstat top``: the per-rank view of a job's segment says which window its figures are from."""

from __future__ import annotations

import subprocess
import sys
import time

from _procs import REPO, load_counts, rank_worker, spawn


def test_top_shows_each_stats_last_closed_window_and_says_which(job, tmp_path):
    p = spawn(rank_worker, job, 0, 1, 0.3, 50, str(tmp_path / "r0.json"))
    p.join(60)
    assert p.exitcode == 0
    counts = load_counts(str(tmp_path / "r0.json"))
    last_start = max(counts)
    r = subprocess.run([sys.executable, "-m", "collector", "top", "--job", job, "--iterations", "1"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "last closed window" in r.stdout
    (row,) = [line for line in r.stdout.splitlines() if "train/steps" in line]
    label = time.strftime("%H:%M:%S", time.localtime(last_start)) + f".{int(last_start * 1000) % 1000:03d} +50ms"
    assert row.split()[5] == str(counts[last_start]) and row.endswith(label), (row, label)
