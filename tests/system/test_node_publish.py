"""A node collector publishes every job it serves on one endpoint (``shmstat collect --publish tcp://...`` with no
``--job``), as a user on another host would use it: ``shmstat subscribe ENDPOINT`` gets every event of both jobs
exactly once, each line naming its job; ``--topic`` filters there as anywhere; each job ending is said without
ending the subscription; the jobs' own endpoints work as before. Run in a private /dev/shm so the node collector
sees only this test's jobs."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
from kit.procs import REPO
from kit.support import run_with_private_dev_shm

_KIT = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/node_publish.py "$WORK"'


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    """One run of the kit, for every test here."""
    work = tmp_path_factory.mktemp("node-publish") / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO)
    done = run_with_private_dev_shm(_KIT, env, REPO, 300)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        return json.load(f)


def _events(lines: list[dict], job: str) -> Counter:
    """(rank, i) of every event item of ``job`` received, with how many times."""
    return Counter((it["data"]["rank"], it["data"]["i"]) for line in lines if line.get("kind") == "event"
                   and line.get("job") == job for it in line["items"])


def test_one_node_endpoint_carries_every_event_of_both_jobs_exactly_with_its_job(result):
    from kit.node_publish import EVENTS, SAMPLES

    jobs: dict[str, int] = result["jobs"]
    assert set(result["exitcodes"]) == {0} and result["coll_code"] == 0
    # the ready file names the node's endpoint, with the port bound for port 0
    ready = result["ready"]
    assert ready["publish"].startswith("tcp://127.0.0.1:") and not ready["publish"].endswith(":0")
    assert ready["prometheus"] is None and ready["jobs"] is None and ready["pid"] > 0
    assert "is a TCP endpoint" in result["coll_err"]  # TCP is readable by every local user: said
    everything = [json.loads(line) for line in result["out"]["all"].splitlines()]
    events_only = [json.loads(line) for line in result["out"]["events"].splitlines()]
    for name in ("all", "events"):
        err = result["err"][name]
        assert "gap:" not in err and "malformed" not in err, err
        assert result["running"][name], "a job ending on a node endpoint ended the subscription"
        assert result["codes"][name] in (0, 130)
        for job in jobs:
            assert f"job {job} ended" in err
    for job, world in jobs.items():
        want = Counter({(r, i): 1 for r in range(world) for i in range(EVENTS)})
        assert _events(everything, job) == want  # K in, K out, once each, under their job
        assert _events(events_only, job) == want
        merged = sum(it["count"] for line in everything if line.get("job") == job
                     and line.get("topic") == "stat/train/steps" for it in line["items"] if it["rank"] is None)
        assert merged == SAMPLES * world  # every window of the job, to its end
        assert {"record": "end", "source": ready["publish"], "job": job} in everything
        assert any(line.get("topic") == "rank/exited" and line["job"] == job for line in everything)
    assert {line["job"] for line in everything if "kind" in line} == set(jobs)
    assert {line["kind"] for line in events_only if "kind" in line} == {"event", "heartbeat"}  # --topic event/
    assert all(line["source"] == ready["publish"] for line in everything if "kind" in line)


def test_a_jobs_own_endpoint_still_serves_it_beside_the_node_endpoint(result):
    from kit.node_publish import EVENTS

    job_a = next(iter(result["jobs"]))
    lines = [json.loads(line) for line in result["out"]["job_a"].splitlines()]
    assert result["codes"]["job_a"] == 0  # --job: it ended by itself with the job
    assert _events(lines, job_a) == Counter({(r, i): 1 for r in range(2) for i in range(EVENTS)})
    assert {line["job"] for line in lines} == {job_a} and "gap:" not in result["err"]["job_a"]
