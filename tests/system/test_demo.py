"""The README's first command: ``shmstat demo`` runs a collector and a few ranks and prints merged windows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kit.procs import REPO


def test_the_demo_prints_merged_windows_with_percentiles_and_exits_0():
    r = subprocess.run([sys.executable, "-m", "collector", "demo", "--ranks", "2", "--seconds", "1.5",
                        "--window-ms", "100"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if "demo/step_ms" in line]
    assert steps, r.stdout
    for line in steps:
        count, p50, p99, mx = (float(re.search(rf"{k}=\s*([\d.]+)", line).group(1))
                               for k in ("count", "p50", "p99", "max"))
        assert count > 0 and 0 < p50 <= p99 <= mx
    (done,) = [line for line in r.stdout.splitlines() if line.startswith("done:")]
    assert int(done.split()[1]) >= len(steps)
