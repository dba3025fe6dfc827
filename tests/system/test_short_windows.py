"""Windows under the ring's shortest (``min_window_ms(K)``: 50 ms with 4 banks) in a job: torch.monitor takes any
window from 1 ms, so a rank takes them too, never raises, and its samples are exact or counted. The ring cannot
hold a 1 ms window for a collector that reads it after its grace, so the writer never overwrites a window the
collector has not emitted: a sample that finds its bank still holding one is dropped and counted in its rank's
``dropped`` (``collector.samples_dropped``). Real ranks (``tests/kit/programs/short_windows.py``: Stats of 10 ms
and 1 ms) under ``shmstat run`` and under real torchrun with a node collector at its defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kit.procs import REPO, read_jsonl
from kit.support import run_with_private_dev_shm, unique_job

_PROGRAM = os.path.join(REPO, "tests", "kit", "programs", "short_windows.py")
_STATS = ("w10ms", "w1ms")
_NODE = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/torchrun_short_windows_node.py "$WORK"'


def _tallies(work, ranks: int) -> dict[int, dict]:
    tallies = {}
    for rank in range(ranks):
        with open(os.path.join(work, f"short.r{rank}.json")) as f:
            tallies[rank] = json.load(f)
    return tallies


def _assert_exact_or_counted(rows: list[dict], tallies: dict[int, dict]) -> None:
    """Per rank: the samples its rows hold plus the samples it counted as dropped are what it added, and every
    short stat emitted some windows; the merged rows hold the per-rank samples exactly."""
    rows = [r for r in rows if r["group"] == "short"]
    for rank, tally in tallies.items():
        emitted = {s: sum(r["value"] for r in rows if r["name"] == f"{s}.count" and r["rank"] == rank)
                   for s in _STATS}
        assert all(emitted.values()), (rank, emitted, tally)
        assert sum(emitted.values()) + tally["dropped"] == sum(tally["added"].values()), (rank, emitted, tally)
        for s in _STATS:
            assert emitted[s] <= tally["added"][s]
    for s in _STATS:
        merged = sum(r["value"] for r in rows if r["name"] == f"{s}.count" and r["rank"] is None)
        assert merged == sum(r["value"] for r in rows if r["name"] == f"{s}.count" and r["rank"] is not None)


def test_windows_of_10_ms_and_1_ms_under_shmstat_run_never_raise_and_are_exact_or_counted(tmp_path):
    job = unique_job("short")
    out = str(tmp_path / "m.jsonl")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, SECONDS="1.5")
    r = subprocess.run([sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2",
                        "--monitor-interval", "0.05", "--handler", f"*=jsonl:{out}", "--status-interval", "0",
                        _PROGRAM], env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "ConfigError" not in r.stderr
    _assert_exact_or_counted(read_jsonl(out), _tallies(tmp_path, 2))


def test_windows_of_10_ms_and_1_ms_under_torchrun_with_a_node_collector_are_exact_or_counted(tmp_path):
    pytest.importorskip("torch", reason="real torchrun needs PyTorch (pip install torch==2.13.0)")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO, SECONDS="1.5")
    done = run_with_private_dev_shm(_NODE, env, REPO, 300)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        result = json.load(f)
    log = (work / "torchrun.log").read_text()
    assert result["code"] == 0 and result["collector"] == 0, log
    assert "ConfigError" not in log
    _assert_exact_or_counted(read_jsonl(str(work / "m.jsonl")), _tallies(work, 2))
