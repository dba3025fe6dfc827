"""``shmstat run``: a torchelastic-style job under our agent, with a restart, checked in jsonl output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

from kit.procs import REPO, read_jsonl
from kit.support import unique_job

from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "elastic_job.py")


def _run(job, tmp_path, *extra, env_extra=None):
    out = str(tmp_path / "m.jsonl")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, **(env_extra or {}))
    r = subprocess.run(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "3", "--monitor-interval",
         "0.05", "--handler", f"*=jsonl:{out}", "--grace-ms", "10", *extra, SCRIPT],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    left = _left_behind(job)
    Segment.unlink(job)
    return r, read_jsonl(out), left


def _left_behind(job):
    """The job's files still in /dev/shm and the runtime directory."""
    from shmstat.shm.runtime import ingest_endpoint, lock_path, publish_endpoint, segment_name

    paths = ["/dev/shm" + segment_name(job), lock_path(job),
             ingest_endpoint(job).removeprefix("ipc://"), publish_endpoint(job).removeprefix("ipc://")]
    return [p for p in paths if os.path.exists(p)]


def _agent(rows, name):
    return [r["value"] for r in rows if r["group"] == "torchelastic" and r["name"] == f"workers.default.{name}"]


def test_job_with_one_failure_is_restarted_and_succeeds(tmp_path):
    job = unique_job("run")
    r, rows, left = _run(job, tmp_path, "--max-restarts", "2", env_extra={"FAIL_RANK": "1", "STEPS": "60"})
    assert r.returncode == 0, r.stderr
    assert left == [], "a job that succeeded, every window emitted, leaves nothing behind"

    # the job's own metrics, routed from the ranks through the collector
    losses = {(row["rank"], row["value"]) for row in rows if row["group"] == "trainer" and row["name"] == "loss"}
    assert losses == {(0, 0.25), (1, 0.5), (2, 0.75)}  # ranks 0 and 2 may report twice (both attempts)
    success = [row for row in rows if row["name"] == "__main__.train_step.success"]
    assert len(success) >= 3 * 60
    # stat windows: merged counts equal the per-rank rows, and cover every step of the successful attempt
    merged = sum(row["value"] for row in rows if row["name"] == "step_ms.count" and row["rank"] is None)
    per_rank = sum(row["value"] for row in rows if row["name"] == "step_ms.count" and row["rank"] is not None)
    assert merged == per_rank >= 3 * 60
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("done-1")) == ["done-1-1"]
    # the agent's metrics, under torchelastic's names
    assert _agent(rows, "run_success_with_retries") == [1]
    assert _agent(rows, "run_success_no_retries") == [0]
    assert _agent(rows, "run_failed_with_retries") == [0] and _agent(rows, "run_failed_no_retries") == [0]
    assert _agent(rows, "run_total") == [1]
    assert _agent(rows, "flakiness") == [int(100 - 100 * (1 + 1) / (2 + 1))]
    assert 2 in _agent(rows, "remaining_restarts") and 1 in _agent(rows, "remaining_restarts")
    assert _agent(rows, "failed") and _agent(rows, "succeeded") == [1]
    profs = Counter(row["name"] for row in rows if row["name"].endswith(".success") and "Agent" in row["name"])
    assert profs["Agent._restart_workers.success"] == 1


def test_job_that_keeps_failing_exits_with_the_workers_status(tmp_path):
    job = unique_job("runf")
    r, rows, left = _run(job, tmp_path, "--max-restarts", "0", env_extra={"FAIL_RANK": "0", "STEPS": "5"})
    assert r.returncode == 3
    assert left == [] and "kept" not in r.stderr  # every window was emitted: nothing to keep, even on failure
    assert _agent(rows, "run_failed_no_retries") == [1]
    assert _agent(rows, "flakiness") == [100]


def test_bad_arguments_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "collector", "run", "--nproc-per-node", "2", "no_such_script.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_agent_publishes_worker_status_events(tmp_path, monkeypatch):
    import threading

    import msgpack
    import zmq
    from kit.support import wait_for

    from collector import Collector, CollectorConfig
    from collector.launch.agent import Agent

    job = unique_job("ev")
    collector = Collector(CollectorConfig(job=job, handlers={"*": "null"}, usage_interval_s=0.05))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(collector.publish_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"event/torchelastic.worker.status.")
    sub2 = ctx.socket(zmq.SUB)
    sub2.connect(collector.publish_endpoint)
    sub2.setsockopt(zmq.SUBSCRIBE, b"")
    thread = threading.Thread(target=collector.serve, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sub2.poll(50), 10, what="the subscription to take effect")
        env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, STEPS="3", FAIL_RANK="-1")
        agent = Agent(collector, job, [sys.executable, SCRIPT], 2, monitor_interval_s=0.05, env=env)
        result = agent.run()
        assert result.state == "SUCCEEDED" and result.exit_code == 0
        got = []

        def all_four():
            while sub.poll(0):
                _topic, payload, _job = sub.recv_multipart()
                got.extend(msgpack.unpackb(payload)["items"])
            return len(got) >= 4

        wait_for(all_four, 10, what="START and SUCCEEDED for both workers")
        states = sorted((item[2]["global_rank"], item[2]["state"]) for item in got)
        assert states == [(0, "START"), (0, "SUCCEEDED"), (1, "START"), (1, "SUCCEEDED")]
        meta = got[0][2]
        assert {"run_id", "global_rank", "group_rank", "worker_id", "role", "hostname", "state", "total_run_time",
                "raw_error", "agent_restarts", "duration_ms"} <= set(meta)
        assert meta["run_id"] == job
    finally:
        collector.request_stop()
        thread.join(30)
        sub.close(0)
        sub2.close(0)
        ctx.term()
        Segment.unlink(job)


def _window_ms_with_room(room_ms: int) -> int:
    """A window length (30 to 60 s) whose current window has at least ``room_ms`` left: windows are aligned to
    the epoch, so the test picks the length instead of waiting for a window to start."""
    now_ms = time.time_ns() // 1_000_000
    return next(w for w in range(30_000, 60_000) if now_ms % w < w - room_ms)


def test_a_restart_inside_one_window_keeps_the_first_attempts_samples(tmp_path):
    job = unique_job("rw")
    out = str(tmp_path / "m.jsonl")
    k1, k2 = 700, 300
    window_ms = _window_ms_with_room(25_000)
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, K1=str(k1), K2=str(k2), WINDOW_MS=str(window_ms))
    r = subprocess.run(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "3", "--max-restarts", "1",
         "--monitor-interval", "0.05", "--grace-ms", "10", "--status-interval", "0", "--handler", f"*=jsonl:{out}",
         os.path.join(REPO, "tests", "kit", "programs", "restart_in_window.py")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    left = _left_behind(job)
    Segment.unlink(job)
    assert r.returncode == 0, r.stderr
    assert left == []
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("added-")) == [
        f"added-{rank}-{attempt}" for rank in range(3) for attempt in range(2)]
    rows = [row for row in read_jsonl(out) if row["group"] == "restart"]
    assert len({row["window_start"] for row in rows}) == 1, "both attempts were to fall inside one window"
    count = {row["rank"]: row["value"] for row in rows if row["name"] == "samples.count"}
    total = {row["rank"]: row["value"] for row in rows if row["name"] == "samples.sum"}
    # rank 0 failed, rank 1 was stopped cleanly, rank 2 was killed by the SIGTERM: each keeps its first attempt
    assert count == {None: 3 * (k1 + k2), 0: k1 + k2, 1: k1 + k2, 2: k1 + k2}
    assert total == {None: 6 * (k1 + k2), 0: k1 + k2, 1: 2 * (k1 + k2), 2: 3 * (k1 + k2)}
