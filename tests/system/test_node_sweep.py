"""A node collector removes this user's segments that no process uses, after emitting what their rings hold:
a job whose ranks were all SIGKILLed before the node collector started, and one whose ranks are SIGKILLed while
it runs. Each runs in a private /dev/shm (a mount namespace), so the node collector sees only its job."""

from __future__ import annotations

import json
import os
import sys

import pytest
from kit.procs import REPO, read_jsonl
from kit.support import run_with_private_dev_shm

_SCRIPT = 'mount -t tmpfs -o size=160m tmpfs /dev/shm && exec "$PY" tests/kit/sweep.py "$WORK" "$MODE"'


def _run(tmp_path, mode: str) -> tuple[dict, list[dict]]:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO, MODE=mode)
    done = run_with_private_dev_shm(_SCRIPT, env, REPO, 300)
    with open(work / "result.json") as f:
        result = json.load(f)
    assert done.returncode == 0, (done.stdout, done.stderr, result["lines"])
    return result, read_jsonl(str(work / "m.jsonl"))


def _reconcile(result: dict, rows: list[dict]) -> None:
    """Exactly the samples each rank added, per rank and merged, each window once; then nothing left."""
    job = result["job"]
    assert result["code"] == 0, result["lines"]
    assert f"shmstat.{job}" in result["left_before"] and f"shmstat.{job}.lock" in result["left_before"]
    mine = [r for r in rows if r.get("job") == job and r["group"] == "train"]
    for key, k in result["samples"].items():
        rank = int(key)
        counts = [r for r in mine if r["name"] == "steps.count" and r["rank"] == rank]
        assert sum(r["value"] for r in counts) == k
        assert sum(r["value"] for r in mine if r["name"] == "steps.sum" and r["rank"] == rank) == k * (rank + 1)
        assert len({r["window_start"] for r in counts}) == len(counts), "a window emitted twice"
    merged = [r for r in mine if r["name"] == "steps.count" and r["rank"] is None]
    assert sum(r["value"] for r in merged) == sum(result["samples"].values())
    assert [n for n in result["left"] if job in n] == [], "the segment and its lock file are removed"
    assert any(f"job {job}'s segment removed" in line for line in result["lines"])


@pytest.fixture(scope="module")
def later(tmp_path_factory) -> tuple[dict, list[dict]]:
    """One run of mode ``later`` (ranks killed, then the node collector started), shared by the tests below."""
    return _run(tmp_path_factory.mktemp("later"), "later")


def test_a_node_collector_started_after_the_ranks_were_sigkilled_emits_their_samples_and_removes_the_segment(
        later):
    result, rows = later
    _reconcile(result, rows)
    assert any(f"job {result['job']} has no live process" in line for line in result["lines"])


def test_a_node_collector_removes_a_segment_no_rank_registered_in_once_a_minute_old_and_keeps_a_fresh_one(
        later):
    result, _ = later
    old, new = result["empty"]
    assert f"shmstat.{old}" in result["left_before"] and f"shmstat.{new}" in result["left_before"]
    assert any(f"job {old}'s segment removed (no rank ever registered" in line for line in result["lines"])
    assert f"shmstat.{old}" not in result["left"] and f"shmstat.{old}.lock" not in result["left"]
    assert f"shmstat.{new}" in result["left"], "a segment a rank may be about to register in is kept"
    assert not any(f"job {new}" in line for line in result["lines"]), "never served: no rank, nothing to emit"


def test_ranks_sigkilled_while_the_node_collector_runs_are_emitted_and_their_segment_removed(tmp_path):
    result, rows = _run(tmp_path, "running")
    _reconcile(result, rows)
