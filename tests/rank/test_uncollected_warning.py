"""A rank whose events no collector takes says so once (Python logging) naming its job and the command that
would collect it; a rank with a collector says nothing. Real rank processes, a real collector, real sockets."""

from __future__ import annotations

import os
import subprocess
import sys

from kit.procs import REPO, start_collector
from kit.support import unique_job

from shmstat.errors import ConfigError
from shmstat.shm.segment import Segment

_RANK = """
import datetime, time, shmstat
from shmstat.job import _state
shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {{"n": 0}}))
end = time.monotonic() + float({seconds})  # from the first event: attaching may take seconds on a loaded machine
n = 1
while time.monotonic() < end:
    shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {{"n": n}}))
    n += 1
    time.sleep(0.01)
pub = _state.STATE.publisher
shmstat.shutdown(flush_timeout_s=float({flush}))
print("sent", pub.stats().sent_items, "logged", n)
"""


def _rank(job: str, seconds: float, warn_after_s: float, flush_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, SHMSTAT_JOB=job, SHMSTAT_RANK="0", PYTHONPATH=REPO,
               SHMSTAT_UNCOLLECTED_WARNING_S=str(warn_after_s))
    return subprocess.run([sys.executable, "-c", _RANK.format(seconds=seconds, flush=flush_s)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_a_rank_nobody_collects_warns_once_naming_its_job_and_the_command():
    job = unique_job("unc")
    try:
        r = _rank(job, seconds=1.0, warn_after_s=0.2, flush_s=0.1)
    finally:
        Segment.unlink(job)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "no collector takes the events" in line]
    assert len(warnings) == 1, r.stderr
    assert f"job {job}" in warnings[0] and warnings[0].endswith("run the node's collector: shmstat collect")


def test_the_ranks_of_a_job_nobody_collects_warn_once_for_the_job_in_one_short_line():
    job = unique_job("unc")
    env = dict(os.environ, SHMSTAT_JOB=job, PYTHONPATH=REPO, SHMSTAT_UNCOLLECTED_WARNING_S="0.2",
               SHMSTAT_KEEP_SEGMENT="1")
    script = _RANK.format(seconds=3.0, flush=0.1)
    try:
        ranks = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, SHMSTAT_RANK=str(r)), cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
        said = [p.communicate(timeout=60) for p in ranks]
    finally:
        Segment.unlink(job)
    assert [p.returncode for p in ranks] == [0] * 4, said
    stderr = "".join(err for _, err in said)
    warnings = [line for line in stderr.splitlines() if "no collector takes the events" in line]
    assert len(warnings) == 1, stderr  # one for the job, not one per rank
    assert len(warnings[0]) < 160 and warnings[0].endswith("run the node's collector: shmstat collect"), warnings[0]


def test_a_rank_with_a_collector_does_not_warn():
    job = unique_job("col")
    coll = start_collector(job, "--handler", "*=null", "--hold-ms", "0", "--status-interval", "0")
    try:
        r = _rank(job, seconds=1.5, warn_after_s=1.0, flush_s=20)
    finally:
        coll.stop()
        Segment.unlink(job)
    assert r.returncode == 0, r.stderr
    assert "no collector has taken" not in r.stderr
    sent, logged = r.stdout.split()[1::2]
    assert sent == logged  # every event was taken by the collector


def test_a_bad_warning_delay_is_one_clear_error(monkeypatch):
    from shmstat.publish.sender import unacked_warning_from_env

    monkeypatch.setenv("SHMSTAT_UNCOLLECTED_WARNING_S", "soon")
    try:
        unacked_warning_from_env()
    except ConfigError as exc:
        assert "SHMSTAT_UNCOLLECTED_WARNING_S='soon'" in str(exc)
    else:
        raise AssertionError("a bad value was accepted")
