"""The collector with real rank processes, real shared memory and real sockets: windows reconcile exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from kit.procs import (
    REPO,
    load_counts,
    rank_worker,
    read_jsonl,
    spawn,
    start_collector,
    window_counts,
)
from kit.support import wait_for

from shmstat.shm.segment import Segment

WINDOW_MS = 50


def _check_reconciles(rows, counts_by_rank):
    merged, per_rank = window_counts(rows, "steps")
    want_merged: dict[float, int] = {}
    for rank, counts in counts_by_rank.items():
        for start, n in counts.items():
            assert per_rank.get((rank, start)) == n, f"rank {rank} window {start}"
            want_merged[start] = want_merged.get(start, 0) + n
    assert merged == want_merged
    assert sum(merged.values()) == sum(sum(c.values()) for c in counts_by_rank.values())
    # no (rank, window) emitted twice
    keys = [(r["rank"], r["window_start"]) for r in rows if r["name"] == "steps.count"]
    assert len(keys) == len(set(keys))


def test_four_ranks_reconcile_exactly_in_jsonl(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
    procs = [spawn(rank_worker, job, r, 4, 0.4, WINDOW_MS, str(tmp_path / f"r{r}.json")) for r in range(4)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert coll.stop() == 0
    rows = read_jsonl(out)
    counts = {r: load_counts(str(tmp_path / f"r{r}.json")) for r in range(4)}
    assert len({s for c in counts.values() for s in c}) >= 5  # several windows
    _check_reconciles(rows, counts)
    sums = [r for r in rows if r["name"] == "steps.sum" and r["rank"] is not None]
    assert all(r["value"] == (r["rank"] + 1) * dict(
        ((x["rank"], x["window_start"]), x["value"]) for x in rows if x["name"] == "steps.count"
    )[(r["rank"], r["window_start"])] for r in sums)
    assert all(set(r) >= {"timestamp", "group", "name", "value", "rank", "window_start", "window_end"} for r in rows)


def test_subscriber_before_ranks_sees_events_windows_and_lifecycle_with_filtering(job, tmp_path):
    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10")
    ctx = zmq.Context()
    everything = ctx.socket(zmq.SUB)
    only_rank = ctx.socket(zmq.SUB)
    for s in (everything, only_rank):
        s.connect(coll.publish)
    everything.setsockopt(zmq.SUBSCRIBE, b"")
    only_rank.setsockopt(zmq.SUBSCRIBE, b"rank/")
    # a subscription takes effect asynchronously: wait until the stream flows (usage stats every second)
    wait_for(lambda: everything.poll(100), 10, what="first message from the collector")
    p = spawn(rank_worker, job, 0, 1, 0.2, WINDOW_MS, str(tmp_path / "r0.json"), None, 5)
    p.join(60)
    assert p.exitcode == 0
    seen: dict[str, list] = {}

    def drain(sock, into):
        while sock.poll(0):
            topic, payload, _job = sock.recv_multipart()
            into.setdefault(topic.decode(), []).append(msgpack.unpackb(payload))
        return into

    added = sum(load_counts(str(tmp_path / "r0.json")).values())

    def merged_count():
        drain(everything, seen)
        return sum(it["count"] for m in seen.get("stat/train/steps", []) for it in m["items"] if it["rank"] is None)

    wait_for(lambda: merged_count() == added and "rank/exited" in seen, 10, what="exit and every window")
    assert coll.stop() == 0
    events = [it for m in seen.get("event/tick", []) for it in m["items"]]
    assert [e[2]["i"] for e in events] == [0, 1, 2, 3, 4]
    assert "rank/joined" in seen and "rank/exited" in seen
    windows = [it for m in seen["stat/train/steps"] for it in m["items"]]
    assert sum(w["count"] for w in windows if w["rank"] == 0) == added
    filtered: dict[str, list] = {}
    drain(only_rank, filtered)
    assert filtered and all(t.startswith("rank/") for t in filtered)
    everything.close(0)
    only_rank.close(0)
    ctx.term()


def test_rank_killed_with_sigkill_is_reported_died_others_still_aggregated(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(coll.publish)
    sub.setsockopt(zmq.SUBSCRIBE, b"rank/")
    victim = spawn(rank_worker, job, 0, 2, 30.0, WINDOW_MS, str(tmp_path / "r0.json"))
    survivor = spawn(rank_worker, job, 1, 2, 1.0, WINDOW_MS, str(tmp_path / "r1.json"))
    wait_for(lambda: len([r for r in read_jsonl(out) if r["rank"] == 0]) > 0, 20, what="rank 0 windows")
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    died = []

    def got_died():
        while sub.poll(0):
            topic, payload, _job = sub.recv_multipart()
            if topic == b"rank/died":
                died.extend(msgpack.unpackb(payload)["items"])
        return died

    wait_for(got_died, 10, what="rank/died")
    assert died[0]["rank"] == 0 and died[0]["pid"] == victim.pid
    survivor.join(60)
    assert survivor.exitcode == 0
    assert coll.stop() == 0
    rows = read_jsonl(out)
    _merged, per_rank = window_counts(rows, "steps")
    survivor_counts = load_counts(str(tmp_path / "r1.json"))
    assert all(per_rank.get((1, s)) == n for s, n in survivor_counts.items())
    # every window emitted and no process of the job alive: `collect --job` removed the segment and its lock
    assert not os.path.exists(f"/dev/shm/shmstat.{job}") and not os.path.exists(f"/dev/shm/shmstat.{job}.lock")
    sub.close(0)
    ctx.term()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_ranks_ending_while_their_collector_is_away_leave_the_segment_to_the_next(job, tmp_path, how):
    # The ranks end while no collector runs: a SIGKILLed collector left its pid in the header, a stopped one
    # -1 (windows left to emit), so the last rank keeps the segment and the next collector emits every window.
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--banks", "64",
                           "--max-ranks", "4", "--max-stats", "8", "--status-interval", "0")
    procs = [spawn(rank_worker, job, r, 2, 3.0, WINDOW_MS, str(tmp_path / f"r{r}.json")) for r in range(2)]
    wait_for(lambda: len(read_jsonl(out)) > 0, 20, what="first windows")
    assert all(p.is_alive() for p in procs)
    coll.stop(how)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert job in Segment.list_jobs()  # kept by the ranks: their last windows wait for the next collector
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0")
    assert coll.stop() == 0
    _check_reconciles(read_jsonl(out), {r: load_counts(str(tmp_path / f"r{r}.json")) for r in range(2)})
    assert job not in Segment.list_jobs()  # every window emitted, no process left: the collector removed it


def test_collector_killed_and_restarted_loses_no_window_and_repeats_none(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--banks", "32",
                           "--max-ranks", "4", "--max-stats", "8")
    procs = [spawn(rank_worker, job, r, 2, 1.2, WINDOW_MS, str(tmp_path / f"r{r}.json")) for r in range(2)]
    wait_for(lambda: len(read_jsonl(out)) > 0, 20, what="first windows")
    coll.stop(signal.SIGKILL)
    first = len(read_jsonl(out))
    time.sleep(0.2)  # the outage being tested: several windows pass with no collector (the ring holds 32)
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert coll.stop() == 0
    rows = read_jsonl(out)
    assert len(rows) > first
    _check_reconciles(rows, {r: load_counts(str(tmp_path / f"r{r}.json")) for r in range(2)})


def test_collector_started_after_the_ranks_picks_up_their_data(job, tmp_path, monkeypatch):
    monkeypatch.setenv("SHMSTAT_KEEP_SEGMENT", "1")  # the rank ends before any collector: keep what it wrote
    out = str(tmp_path / "m.jsonl")
    seg = Segment.open(job)  # ranks come first and create the segment
    ready = str(tmp_path / "ready")
    p = spawn(rank_worker, job, 0, 1, 0.1, WINDOW_MS, str(tmp_path / "r0.json"), None, 3, ready)
    p.join(60)
    assert p.exitcode == 0
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
    assert coll.stop() == 0
    _check_reconciles(read_jsonl(out), {0: load_counts(str(tmp_path / "r0.json"))})
    seg.close()


def test_second_collector_for_the_same_job_refuses_with_one_line(job):
    coll = start_collector(job, "--handler", "*=null")
    try:
        r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job], capture_output=True,
                           text=True, cwd=REPO, timeout=30)
        assert r.returncode == 2
        assert r.stderr.count("\n") == 1 and "already running" in r.stderr
        assert "Traceback" not in r.stderr
    finally:
        assert coll.stop() == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["collect", "--job", "bad/job"], "job id"),
        (["collect", "--job", "j", "--handler", "nonsense"], "GROUP=SPEC"),
        (["collect", "--job", "j", "--handler", "g=nope:x:y"], "handler"),
        (["clean", "no-such-job-xyz"], "no segment"),
        (["subscribe", "tcp://127.0.0.1:1", "--count", "0"], "--count"),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, needle):
    r = subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=30)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_subscribe_cli_prints_json_lines(job, tmp_path):
    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10")
    sub = subprocess.Popen([sys.executable, "-m", "collector", "subscribe", coll.publish, "--topic", "event/",
                            "--count", "3", "--timeout", "30"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    time.sleep(0.3)  # let the SUB connect; the events are sent repeatedly below until 3 are printed
    import shmstat

    shmstat.init(job, rank=0, endpoint=coll.ingest)
    import datetime

    deadline = time.monotonic() + 20
    while sub.poll() is None and time.monotonic() < deadline:
        shmstat.log_event(shmstat.Event("hello", datetime.datetime.now(), {"x": 1}))
        time.sleep(0.05)
    out, _ = sub.communicate(timeout=10)
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 3 and all(line["topic"] == "event/hello" for line in lines)
    shmstat.shutdown()
    assert coll.stop() == 0
