"""One collector per job, checked through the segment itself (whatever runtime directory each uses); a
subscription flood from a local client keeps the collector's memory bounded and loses no window."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import zmq
from _procs import REPO, load_counts, rank_worker, read_jsonl, spawn, start_collector, window_counts
from _support import wait_for

WINDOW_MS = 50


def _collect_cmd(job: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "collector", "collect", "--job", job, "--handler", "*=null", *args]


def _reconciles(rows, tmp_path, ranks: int) -> None:
    merged, per_rank = window_counts(rows, "steps")
    counts = {r: load_counts(str(tmp_path / f"r{r}.json")) for r in range(ranks)}
    for rank, c in counts.items():
        for start, n in c.items():
            assert per_rank.get((rank, start)) == n, "a window missing or emitted twice"
    assert sum(merged.values()) == sum(sum(c.values()) for c in counts.values())


def test_a_second_collector_with_another_runtime_dir_is_refused_naming_the_first(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    first = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
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
    _reconciles(read_jsonl(out), tmp_path, 1)


def test_a_killed_collectors_successor_starts_at_once(job):
    first = start_collector(job, "--handler", "*=null")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    second = start_collector(job, "--handler", "*=null")  # the kernel dropped the dead one's lock
    assert second.stop() == 0


def test_a_subscription_flood_keeps_memory_bounded_and_loses_no_window(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
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
    _reconciles(rows, tmp_path, 1)
    assert max(r["value"] for r in rows if r["name"] == "collector.subscription_resets") >= 1
