"""scripts/multinode_bench.py in brief (one round of 1 s at 100 events/s per rank, on a real simulated cluster):
it runs both modes, prints them side by side with every run, and every event the ranks logged reached the ops
subscriber, in both modes. Skipped, with the reason, where the cluster kit cannot make hosts (not root, no
namespaces)."""

from __future__ import annotations

import os
import subprocess
import sys

from kit.cluster import require_namespaces

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "multinode_bench.py")


def _row(report: str, label: str) -> list[str]:
    """The plain TCP and CURVE cells of the side-by-side row starting with ``label``."""
    (line,) = [ln for ln in report.splitlines() if ln.startswith(f"| {label}")]
    return [cell.strip() for cell in line.strip("|").split("|")][1:3]


def test_the_multinode_bench_runs_both_modes_and_loses_no_event():
    require_namespaces()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMSTAT_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = REPO
    done = subprocess.run([sys.executable, SCRIPT, "--seconds", "1", "--rate", "100", "--rounds", "1", "--idle",
                           "0.3"], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "| | plain TCP | CURVE | CURVE / plain |" in out
    sent = 2 * 2 * 100  # hosts x ranks x events
    assert _row(out, "events sent") == [f"{sent}", f"{sent}"]
    assert _row(out, "events received by the ops subscriber") == [f"{sent}", f"{sent}"]
    assert _row(out, "lost (sent - received)") == ["0", "0"]
    assert _row(out, "duplicates received") == ["0", "0"]
    runs = [ln for ln in out.splitlines() if ln.startswith(("| 1 |", "| 2 |"))]
    assert [ln.split("|")[2].strip() for ln in runs] == ["plain TCP", "CURVE"]
    for label in ("latency p50", "latency p99", "node collector CPU s per wall s, 200"):
        assert all(float(v) > 0 for v in _row(out, label)), label
    assert "machine:" in out and "date:" in out
    assert "run 2: CURVE" in done.stderr  # progress on stderr
