"""One collector per node serves every job of the user: jobs nobody named (torchrun's random run ids) are
picked up when their first rank attaches, their rows name their job and reconcile exactly, and each job is let
go once its ranks have exited. Run in a private /dev/shm so the node collector sees only this test's jobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _procs import REPO, read_jsonl

_SCRIPT = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/_node_kit.py "$WORK"'


def test_a_node_collector_serves_jobs_nobody_named_and_lets_them_go(tmp_path):
    if not shutil.which("unshare") or os.getuid() != 0:
        pytest.skip("needs root and unshare to give the node collector a private /dev/shm")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO)
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", _SCRIPT], env=env, cwd=REPO,
                   check=True, timeout=240)
    with open(work / "result.json") as f:
        result = json.load(f)
    errors = {p.name: p.read_text() for p in work.glob("*.error")}
    assert result["code"] == 0 and result["exitcodes"] == [0, 0, 0], errors
    rows = read_jsonl(str(work / "m.jsonl"))
    for job, world in result["jobs"].items():
        assert any(f"job {job} picked up" in line for line in result["lines"])
        assert any(f"job {job} done" in line for line in result["lines"])
        mine = [r for r in rows if r.get("job") == job]
        for rank in range(world):
            with open(work / f"{job}.r{rank}.json") as f:
                tally = json.load(f)
            # the event reached a collector that did not know the job when it started (sent, acknowledged)
            assert (tally["events_sent"], tally["events_dropped"]) == (1, 0)
            got = [r for r in mine if r["name"] == "steps.count" and r["rank"] == rank]
            assert sum(r["value"] for r in got) == tally["count"]
            assert sum(r["value"] for r in mine if r["name"] == "steps.sum" and r["rank"] == rank) == tally["sum"]
            assert len({r["window_start"] for r in got}) == len(got), "a window emitted twice"
        merged = sum(r["value"] for r in mine if r["name"] == "steps.count" and r["rank"] is None)
        assert merged == 3000 * world
    assert all(r.get("job") in result["jobs"] for r in rows if r["group"] == "train")
