"""One collector per node serves every job of the user: jobs nobody named (torchrun's random run ids) are
picked up when their first rank attaches, their rows name their job and reconcile exactly, and each job is let
go once its ranks have exited. Run in a private /dev/shm so the node collector sees only this test's jobs."""

from __future__ import annotations

import json
import os
import sys

import pytest
from kit.procs import REPO, read_jsonl
from kit.support import run_with_private_dev_shm

_SCRIPT = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/node.py "$WORK" $MODE'


def test_a_node_collector_serves_jobs_nobody_named_and_lets_them_go(tmp_path):
    result, rows, work = _run_node_kit(tmp_path, "")
    _reconcile(result, rows, work, events_per_rank=1)
    assert all(r.get("job") in result["jobs"] for r in rows if r["group"] == "train")


def test_plain_torchrun_standalone_is_collected_by_a_node_collector_exactly(tmp_path):
    pytest.importorskip("torch", reason="real torchrun needs PyTorch (pip install torch==2.13.0)")
    result, rows, work = _run_node_kit(tmp_path, "torchrun")
    (run_id,) = result["jobs"]
    assert run_id != "none", (work / "torchrun.log").read_text()
    _reconcile(result, rows, work, events_per_rank=2)  # an event and a put_metric per rank
    losses = sorted((r["rank"], r["value"]) for r in rows if r["group"] == "trainer" and r["name"] == "loss")
    assert losses == [(0, 0.5), (1, 1.5)] and all(r["job"] == run_id for r in rows if r["group"] == "trainer")


def _run_node_kit(tmp_path, mode):
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO, MODE=mode)
    done = run_with_private_dev_shm(_SCRIPT, env, REPO, 240)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        result = json.load(f)
    return result, read_jsonl(str(work / "m.jsonl")), work


def _reconcile(result, rows, work, *, events_per_rank):
    """Every job was picked up and let go; every rank's samples count once, per rank and merged; its events
    were taken by a collector that did not know the job when it started."""
    errors = {p.name: p.read_text() for p in work.glob("*.error")}
    assert result["code"] == 0 and set(result["exitcodes"]) == {0}, errors
    for job, world in result["jobs"].items():
        assert any(f"job {job} picked up" in line for line in result["lines"])
        assert any(f"job {job} done" in line for line in result["lines"])
        assert any(f"job {job}'s segment removed" in line for line in result["lines"])
        assert not [n for n in result["left"] if job in n], "a finished job leaves nothing in /dev/shm"
        mine = [r for r in rows if r.get("job") == job]
        for rank in range(world):
            with open(work / f"{job}.r{rank}.json") as f:
                tally = json.load(f)
            # the event reached a collector that did not know the job when it started (sent, acknowledged)
            assert (tally["events_sent"], tally["events_dropped"]) == (events_per_rank, 0)
            stat = next(r["name"].split(".")[0] for r in mine if r["group"] == "train")
            got = [r for r in mine if r["name"] == f"{stat}.count" and r["rank"] == rank]
            assert sum(r["value"] for r in got) == tally["count"]
            assert sum(r["value"] for r in mine if r["name"] == f"{stat}.sum" and r["rank"] == rank) == tally["sum"]
            assert len({r["window_start"] for r in got}) == len(got), "a window emitted twice"
        merged = sum(r["value"] for r in mine if r["name"].endswith(".count") and r["group"] == "train"
                     and r["rank"] is None)
        assert merged == 3000 * world


@pytest.mark.parametrize("first", ["per-job", "other-dir"])
def test_a_node_collector_takes_a_running_job_over_with_every_window_in_the_ring_once(tmp_path, first):
    """A job's collector (``shmstat collect --job JOB``, or a node collector using another runtime directory) stops
    while the ranks run; the node collector that left the job alone takes it over before the ring wraps: every
    window, the one open at the hand-over too, is in one of the two outputs exactly once, and none counts as
    overwritten."""
    from collections import Counter

    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO, MODE=first)
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/handover.py "$WORK" $MODE'
    done = run_with_private_dev_shm(script, env, REPO, 240)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        result = json.load(f)
    errors = {p.name: p.read_text() for p in work.glob("*.error")}
    assert (result["first_code"], result["node_code"], set(result["exitcodes"])) == (0, 0, {0}), (result, errors)
    job = result["job"]
    rows = [r for name in ("first.jsonl", "node.jsonl") for r in read_jsonl(str(work / name))
            if r.get("job", job) == job]
    counts = [r for r in rows if r["name"] == "steps.count"]
    twice = [k for k, n in Counter((r["rank"], r["window_start"]) for r in counts).items() if n > 1]
    assert twice == [], "a window emitted by both collectors"
    added = 0
    for rank in range(2):
        with open(work / f"r{rank}.json") as f:
            tally = {float(k): n for k, n in json.load(f).items()}
        got = {r["window_start"]: r["value"] for r in counts if r["rank"] == rank}
        missing = {w: n for w, n in tally.items() if got.get(w) != n}
        assert missing == {}, (f"rank {rank}: total {sum(got.values())}, added {sum(tally.values())}; "
                               f"windows not emitted as added: {missing}; hand-over {result['timings']}")
        added += sum(tally.values())
    assert sum(r["value"] for r in counts if r["rank"] is None) == added
    own = [r for name in ("first.own.jsonl", "node.own.jsonl") for r in read_jsonl(str(work / name))]
    overwritten = [r["value"] for r in own if r["name"] == "collector.windows_overwritten" and r["job"] == job]
    assert overwritten and max(overwritten) == 0, "a window counted as overwritten that the ring still held"
