"""torchrun without ``--rdzv-id`` gives every job the run id ``none``: two such jobs at once on one node are two
jobs for shmstat, each with exactly its own samples, and a job keeps its id across torchrun's restarts. Real
torchrun (static rendezvous), real ranks, one node collector, in a private /dev/shm."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import pytest
from kit.procs import REPO, read_jsonl
from kit.support import run_with_private_dev_shm

_KIT = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/torchrun_default_id_node.py "$WORK"'


def test_two_torchrun_jobs_with_the_default_run_id_are_two_jobs_each_with_exactly_its_samples(tmp_path):
    pytest.importorskip("torch", reason="real torchrun needs PyTorch (pip install torch==2.13.0)")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO)
    done = run_with_private_dev_shm(_KIT, env, REPO, 300)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        result = json.load(f)
    logs = {tag: (work / f"{tag}.log").read_text() for tag in ("first", "second")}
    assert result["codes"] == {"first": 0, "second": 0} and result["code"] == 0, logs
    tallies = result["tallies"]
    # the first job ran twice (attempt 0 failed, torchrun restarted it), the second once: 2 ranks each time
    assert sorted((t["tag"], t["attempt"], t["rank"]) for t in tallies) == [
        ("first", 0, 0), ("first", 0, 1), ("first", 1, 0), ("first", 1, 1), ("second", 0, 0), ("second", 0, 1)]
    assert {t["run_id"] for t in tallies} == {"none"}  # what torchrun gave them: the same for both jobs
    job_of = {tag: {t["job"] for t in tallies if t["tag"] == tag} for tag in ("first", "second")}
    assert all(len(jobs) == 1 for jobs in job_of.values()), job_of  # every rank, every attempt: one job
    first, second = job_of["first"].pop(), job_of["second"].pop()
    assert first != second and first.startswith("none-") and second.startswith("none-")
    rows = read_jsonl(str(work / "m.jsonl"))
    own = read_jsonl(str(work / "own.jsonl"))  # the collector's counters: what it counted lost, said on a failure
    assert {r["job"] for r in rows if r["group"] == "train"} == {first, second}
    for tag, job in (("first", first), ("second", second)):
        added: dict[int, float] = defaultdict(float)
        for t in tallies:
            if t["tag"] == tag:
                added[t["rank"]] += t["count"]
        mine = [r for r in rows if r["job"] == job and r["group"] == "train"]
        counted = {r["name"]: r["value"] for r in own if r.get("job") == job and r["value"]}
        for rank, count in added.items():  # exactly its own samples, both attempts, nothing of the other job
            assert sum(r["value"] for r in mine if r["name"] == "step_ms.count" and r["rank"] == rank) == count, \
                (tag, rank, counted)
            assert sum(r["value"] for r in mine if r["name"] == "step_ms.sum" and r["rank"] == rank) == \
                count * (rank + 1.0)
        assert sum(r["value"] for r in mine if r["name"] == "step_ms.count" and r["rank"] is None) == \
            sum(added.values())
        assert any(f"job {job} picked up" in line for line in result["lines"])
    assert not [n for n in result["left"] if n.startswith("shmstat.")], "the jobs leave nothing in /dev/shm"
