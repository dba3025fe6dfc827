"""Events that die with their rank are counted: what a rank could not deliver when it exits — no collector
listening (one was Ctrl-C'd while the job ran), or its socket full (a collector that stalled) — is recorded in its
entry of the segment, and the collector that finds it (the next one, or the same one) writes a gap record to its
events sinks and counts it in ``seq_gaps``; with no collector at all, the rank's exit says how many, in one line.
Real collectors (subprocesses), real rank processes, real sockets: events received + gaps counted == events logged.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request

import pytest
from kit.procs import REPO, read_jsonl, start_collector
from kit.support import unique_job, wait_for

from shmstat.shm.segment import Segment

# A rank: logs ``n1`` events and flushes them to the collector, says so (``ready``), waits for ``go``, logs ``n2``
# more, and exits through the interpreter's exit (shmstat's shutdown with its default linger of 2 s).
_RANK = """
import datetime, os, sys, time, shmstat
from shmstat.job import _state
n1, n2, ready, go, pad = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
def log(i):
    shmstat.log_event(shmstat.Event("dead", datetime.datetime.now(), {"i": i, "pad": "x" * pad}))
for i in range(n1):
    log(i)
if n1:
    assert _state.STATE.publisher.flush(60)
open(ready, "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
for i in range(n1, n1 + n2):
    log(i)
print(os.getpid(), flush=True)
"""


def _start_rank(job: str, rank: int, world: int, n1: int, n2: int, ready: str, go: str, pad: int = 0,
                **env: str) -> subprocess.Popen[str]:
    environ = dict(os.environ, SHMSTAT_JOB=job, SHMSTAT_RANK=str(rank), SHMSTAT_LOCAL_RANK=str(rank),
                   SHMSTAT_WORLD_SIZE=str(world), PYTHONPATH=REPO, **env)
    return subprocess.Popen([sys.executable, "-c", _RANK, str(n1), str(n2), ready, go, str(pad)], env=environ,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _seq_gaps(url: str, job: str) -> int:
    """``shmstat_collector_seq_gaps_total`` of ``job`` on the collector's ``/metrics``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf'^shmstat_collector_seq_gaps_total{{[^}}]*job="{re.escape(job)}"[^}}]*}} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def _accounted(lines: list[dict], pid: int) -> tuple[list[int], list[int]]:
    """The sequence numbers of one rank's events that reached the sink, and those its gap records cover."""
    got = [e["seq"] for e in lines if "gap" not in e and e.get("pid") == pid]
    gaps = [g for g in lines if "gap" in g and g["pid"] == pid]
    assert all(g["at"] == "rank" and g["gap"] == g["to_seq"] - g["from_seq"] + 1 for g in gaps), gaps
    return got, [s for g in gaps for s in range(g["from_seq"], g["to_seq"] + 1)]


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> str:
    """A runtime directory of the test's own (short: an ipc path has at most 107 bytes), for ranks and
    collectors, so that no other collector of this user is taken for one of ours."""
    path = tempfile.mkdtemp(prefix="sd-")
    monkeypatch.setenv("SHMSTAT_RUNTIME_DIR", path)
    return path


def test_events_ranks_hold_as_they_exit_between_two_node_collectors_are_counted_by_the_next(job, tmp_path,
                                                                                         runtime_dir):
    """(a) Ctrl-C on a node collector while the job runs; the ranks log on and exit before a successor starts:
    the successor counts what they held as a gap, exactly (it got 0 of them, so it counts every one)."""
    ranks, n1, n2 = 2, 40, 40
    other = unique_job("other")
    out1, out2 = str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")
    go = str(tmp_path / "go")
    readies = [str(tmp_path / f"ready{r}") for r in range(ranks)]
    common = ("--job", job, "--job", other, "--handler", "*=null", "--status-interval", "0")
    first = start_collector(None, *common, "--events", f"jsonl:{out1}")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs = [_start_rank(job, r, ranks, n1, n2, readies[r], go) for r in range(ranks)]
        wait_for(lambda: all(os.path.exists(p) for p in readies), 120, what="the ranks' first events flushed")
        assert first.stop(signal.SIGINT) == 0  # Ctrl-C while the job runs: the ranks hold what they log next
        open(go, "w").close()
        said = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0] * ranks, said
        second = start_collector(None, *common, "--events", f"jsonl:{out2}", "--prometheus", "127.0.0.1:0")
        try:
            second.lines_seen(f"job {job} picked up", 60)
            assert second.prometheus is not None
            wait_for(lambda: _seq_gaps(second.prometheus, job), 30, what="the successor's count of the gaps")
            counted = _seq_gaps(second.prometheus, job)
        finally:
            assert second.stop(signal.SIGINT) == 0
    finally:
        first.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        Segment.unlink(other)
    pids = [int(out.split()[0]) for out, _ in said]
    lines1, lines2 = read_jsonl(out1), read_jsonl(out2)
    for pid, (_, err) in zip(pids, said, strict=True):
        got1, gaps1 = _accounted(lines1, pid)
        got2, gaps2 = _accounted(lines2, pid)
        assert sorted(got1) == list(range(n1)) and gaps1 == []  # the hand-over took everything sent before it
        assert got2 == [] and sorted(gaps2) == list(range(n1, n1 + n2))  # the rest: held, lost at exit, counted
        warned = [line for line in err.splitlines() if "no collector took" in line]
        assert len(warned) == 1 and f"pid {pid}" in warned[0], err  # its exit said so, once
    assert counted == ranks * n2  # seq_gaps on /metrics: what the gap records say


def test_a_rank_whose_socket_is_full_as_it_exits_has_its_lost_tail_counted(job, tmp_path, runtime_dir):
    """(b) A rank logs a burst while its collector cannot read (stopped) and exits with the default linger: the
    tail its socket could not take is lost with it, and the collector, once it reads again, counts it as a gap."""
    n = 50_000
    out = str(tmp_path / "events.jsonl")
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    coll = start_collector(job, "--events", f"jsonl:{out}", "--handler", "*=null", "--status-interval", "0",
                           "--prometheus", "127.0.0.1:0")
    stopped = False
    rank = None
    try:
        rank = _start_rank(job, 0, 1, 1, n - 1, ready, go, pad=40)
        wait_for(lambda: os.path.exists(ready), 120, what="the rank's first event flushed")
        os.kill(coll.proc.pid, signal.SIGSTOP)  # the collector stalls: the rank's socket fills
        stopped = True
        open(go, "w").close()
        said = rank.communicate(timeout=120)
        assert rank.returncode == 0, said
        os.kill(coll.proc.pid, signal.SIGCONT)
        stopped = False
        assert coll.prometheus is not None
        wait_for(lambda: _seq_gaps(coll.prometheus, job), 60, what="the collector's count of the lost tail")
        counted = _seq_gaps(coll.prometheus, job)
    finally:
        if stopped:
            os.kill(coll.proc.pid, signal.SIGCONT)
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.wait()
        assert coll.stop() == 0
    pid = int(said[0].split()[0])
    got, gaps = _accounted(read_jsonl(out), pid)
    assert got and gaps, (len(got), len(gaps))  # some arrived (what the kernel held), a tail did not
    assert len(got) + len(gaps) == n and sorted(got + gaps) == list(range(n))  # exactly: each once, seen or counted
    assert len(gaps) == counted  # seq_gaps on /metrics
    assert "no collector took" not in said[1]  # a collector served it: the collector counts, the rank says nothing


def test_a_rank_no_collector_ever_served_says_at_exit_how_many_it_lost_once(job, tmp_path, runtime_dir):
    """With no collector ever, the segment goes with the last rank: its exit says how many it lost, in one line."""
    n = 25
    go = str(tmp_path / "go")
    open(go, "w").close()
    rank = _start_rank(job, 0, 1, 0, n, str(tmp_path / "ready"), go)
    out, err = rank.communicate(timeout=120)
    assert rank.returncode == 0, err
    warned = [line for line in err.splitlines() if "no collector took" in line]
    assert len(warned) == 1, err
    assert f"exits with {n} events and metrics no collector took" in warned[0] and f"job {job}" in warned[0]
    assert f"pid {out.split()[0]}" in warned[0] and len(warned[0]) < 200, warned[0]
