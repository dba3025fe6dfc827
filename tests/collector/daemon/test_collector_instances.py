"""One collector per job, checked through the segment itself (whatever runtime directory each uses); a
subscription flood from a local client keeps the collector's memory bounded and loses no window."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import zmq
from kit.procs import REPO, assert_rank_workers_reconcile, rank_worker, read_jsonl, spawn, start_collector
from kit.support import wait_for

WINDOW_MS = 50


def _collect_cmd(job: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "collector", "collect", "--job", job, "--handler", "*=null", *args]


def test_a_second_collector_with_another_runtime_dir_is_refused_naming_the_first(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    # a ring of 16 windows: the second collector's start-up shares a loaded 2-core machine with the first
    first = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--banks", "16")
    other_runtime = tmp_path / "xdg"
    other_runtime.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=str(other_runtime))
    try:
        p = spawn(rank_worker, job, 0, 1, 0.4, WINDOW_MS, str(tmp_path / "r0.json"))
        second = subprocess.run(_collect_cmd(job, "--handler", f"*=jsonl:{out}"), capture_output=True, text=True,
                                env=env, cwd=REPO, timeout=60)
        assert second.returncode == 2
        assert f"pid {first.proc.pid}" in second.stderr and "Traceback" not in second.stderr
        p.join(60)
        assert p.exitcode == 0
    finally:
        assert first.stop() == 0
    assert_rank_workers_reconcile(read_jsonl(out), tmp_path, 1)


def test_a_refused_collector_leaves_the_outputs_of_the_one_serving_alone(job, tmp_path):
    """The same command started twice: the second is refused before it opens any output. A jsonl output whose last
    line is cut (its writer is mid-line: a full buffer flushed, or a write read half done) is the serving collector's
    to finish; a refused one that opened it would take the cut line for a killed writer's and remove it."""
    out = tmp_path / "m.jsonl"
    args = ("--handler", "*=null", "--handler", f"quiet=jsonl:{out}")  # a group nobody writes: the file is ours
    first = start_collector(job, *args)
    try:
        with open(out, "ab") as f:
            f.write(b'{"whole": 1}\n{"cut": ')  # the serving writer is mid-line
        second = subprocess.run(_collect_cmd(job, *args), capture_output=True, text=True, cwd=REPO, timeout=60,
                                env=dict(os.environ, PYTHONPATH=REPO))
        assert second.returncode == 2 and f"pid {first.proc.pid}" in second.stderr, second.stderr
        assert out.read_bytes() == b'{"whole": 1}\n{"cut": ', second.stderr
    finally:
        assert first.stop() == 0


def test_a_killed_collectors_successor_starts_at_once(job):
    first = start_collector(job, "--handler", "*=null")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    second = start_collector(job, "--handler", "*=null")  # the kernel dropped the dead one's lock
    assert second.stop() == 0


def test_a_subscription_flood_keeps_memory_bounded_and_loses_no_window(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    # a ring of 16 windows: on a loaded 2-core machine the flood and the test share the CPU with the collector
    own = str(tmp_path / "collector.jsonl")  # the collector's own group, asked for by name
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--handler", f"shmstat=jsonl:{own}", "--grace-ms", "10",
                           "--banks", "16")
    proc = psutil.Process(coll.proc.pid)
    ctx = zmq.Context()
    flooders = []
    try:
        wait_for(lambda: os.path.exists(coll.publish[len("ipc://"):]), 10, what="publish socket")
        rss_before = proc.memory_info().rss
        p = spawn(rank_worker, job, 0, 1, 2.0, WINDOW_MS, str(tmp_path / "r0.json"))
        peak = rss_before
        for n in range(4):  # 100k subscriptions of ~400 bytes, from several connections
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.connect(coll.publish)
            flooders.append(sock)
            for i in range(25_000):
                sock.setsockopt(zmq.SUBSCRIBE, b"stat/" + f"{n}-{i}-".encode() + b"x" * 380)
                if i % 5000 == 0:
                    peak = max(peak, proc.memory_info().rss)
        too_long = ctx.socket(zmq.SUB)  # a topic over the bound: that subscriber is dropped, nothing else
        too_long.connect(coll.publish)
        too_long.setsockopt(zmq.SUBSCRIBE, b"y" * 100_000)
        flooders.append(too_long)
        p.join(60)
        assert p.exitcode == 0
        peak = max(peak, proc.memory_info().rss)
        assert coll.proc.poll() is None
        assert peak - rss_before < 200 * 1024 * 1024, f"collector grew by {(peak - rss_before) / 2**20:.0f} MiB"
    finally:
        for sock in flooders:
            sock.close(0)
        ctx.term()
        assert coll.stop() == 0
    rows = read_jsonl(out)
    assert_rank_workers_reconcile(rows, tmp_path, 1)
    assert max(r["value"] for r in read_jsonl(own) if r["name"] == "collector.subscription_resets") >= 1


def test_a_job_is_served_by_whichever_collector_came_first_node_wide_or_per_job(tmp_path):
    """A per-job collector serves A; a node collector for A and B leaves A alone (said once) and serves B; a
    per-job collector for B is then refused naming the node collector; once A's collector stops, the node
    collector takes A over. Every window of both jobs is emitted exactly once across the two outputs."""
    from kit.support import unique_job

    from shmstat.shm.segment import Segment

    job_a, job_b = unique_job("first"), unique_job("node")
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    dir_a.mkdir()
    dir_b.mkdir()
    out1, out2 = str(tmp_path / "per_job.jsonl"), str(tmp_path / "node.jsonl")
    env = dict(os.environ, PYTHONPATH=REPO)
    per_job = start_collector(job_a, "--handler", f"*=jsonl:{out1}", "--grace-ms", "10")
    node = start_collector(None, "--job", job_a, "--job", job_b, "--handler", f"*=jsonl:{out2}", "--grace-ms", "10",
                           "--status-interval", "0")
    try:
        ranks = [spawn(rank_worker, job_a, 0, 1, 0.6, WINDOW_MS, str(dir_a / "r0.json")),
                 spawn(rank_worker, job_b, 0, 1, 0.6, WINDOW_MS, str(dir_b / "r0.json"))]
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        third = subprocess.run(_collect_cmd(job_b), capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
        assert third.returncode == 2 and f"pid {node.proc.pid}" in third.stderr, third.stderr
        assert per_job.stop() == 0  # A's first collector goes: the node collector takes A over (within a second)
        node.lines_seen(f"job {job_a} picked up", 30)
    finally:
        per_job.stop()
        code = node.stop(signal.SIGTERM, 30)
        err = "\n".join(node.lines)
        Segment.unlink(job_a)
        Segment.unlink(job_b)
    assert code == 0, err
    assert err.count(f"leaving job {job_a} alone") == 1, err
    assert not any(f"job {job_b}" in line and "alone" in line for line in err.splitlines())
    rows = read_jsonl(out1) + read_jsonl(out2)
    assert_rank_workers_reconcile([r for r in rows if r.get("job", job_a) == job_a], dir_a, 1)
    assert_rank_workers_reconcile([r for r in read_jsonl(out2) if r.get("job") == job_b], dir_b, 1)
