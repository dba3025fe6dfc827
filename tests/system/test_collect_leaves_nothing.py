"""``shmstat collect --job J`` removes J's segment and lock file when it stops (SIGINT or SIGTERM) and no process
of J lives, every window emitted — also for a job id nobody ever used (a typo): nothing it made is left in
/dev/shm or the runtime directory. A job still running keeps its segment, and the collector says why in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from _procs import REPO, assert_rank_workers_reconcile, rank_worker, read_jsonl, spawn
from _support import unique_job, wait_for

from shmstat.shm.runtime import ingest_endpoint, lock_path, publish_endpoint, segment_name
from shmstat.shm.segment import Segment


def left_behind(job: str) -> list[str]:
    """The job's files still in /dev/shm and the runtime directory."""
    paths = ["/dev/shm" + segment_name(job), lock_path(job),
             ingest_endpoint(job).removeprefix("ipc://"), publish_endpoint(job).removeprefix("ipc://")]
    return [p for p in paths if os.path.exists(p)]


def start(job: str, tmp_path, *args: str) -> subprocess.Popen:
    """``shmstat collect --job job`` with stderr in ``tmp_path/err``, once it printed its endpoints."""
    with open(tmp_path / "err", "w") as err:  # the child keeps writing it
        proc = subprocess.Popen([sys.executable, "-m", "collector", "collect", "--job", job, "--grace-ms", "10",
                                 *args], stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=REPO))
    wait_for(lambda: " publish " in (tmp_path / "err").read_text() or proc.poll() is not None, 60,
             what="its endpoints on stderr")
    assert proc.poll() is None, (tmp_path / "err").read_text()
    return proc


def stop(proc: subprocess.Popen, sig: int) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(30)
    finally:
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_job_nobody_ever_ran_leaves_nothing(tmp_path, sig):
    job = unique_job("typo")
    proc = start(job, tmp_path, "--handler", "*=null")
    try:
        assert os.path.exists("/dev/shm" + segment_name(job))  # the collector made it, waiting for ranks
        assert stop(proc, sig) == 0
        assert left_behind(job) == []
        assert "kept" not in (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        Segment.unlink(job)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_finished_job_is_emitted_whole_then_removed(tmp_path, sig):
    job = unique_job("done")
    out = str(tmp_path / "m.jsonl")
    proc = start(job, tmp_path, "--handler", f"*=jsonl:{out}")
    try:
        ranks = [spawn(rank_worker, job, r, 2, 0.5, 100, str(tmp_path / f"r{r}.json")) for r in range(2)]
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        assert stop(proc, sig) == 0
        assert_rank_workers_reconcile(read_jsonl(out), tmp_path, 2)
        assert left_behind(job) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        Segment.unlink(job)


def test_a_job_still_running_keeps_its_segment_and_the_collector_says_why(tmp_path):
    job = unique_job("live")
    proc = start(job, tmp_path, "--handler", "*=null")
    ready = str(tmp_path / "ready")
    rank = spawn(rank_worker, job, 0, 1, 60.0, 100, str(tmp_path / "r0.json"), None, 0, ready)
    try:
        wait_for(lambda: os.path.exists(ready), 60, what="the rank adding")
        assert stop(proc, signal.SIGTERM) == 0
        assert os.path.exists("/dev/shm" + segment_name(job))  # its open windows wait for the next collector
        said = [line for line in (tmp_path / "err").read_text().splitlines() if "kept" in line]
        assert said == [f"shmstat collector: job {job}'s segment kept: the open windows of rank 0, still running "
                        f"(inspect: shmstat top --job {job}; remove: shmstat clean {job})"]
    finally:
        if proc.poll() is None:
            proc.kill()
        rank.kill()
        rank.join(10)
        Segment.unlink(job)
