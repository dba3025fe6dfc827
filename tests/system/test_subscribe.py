"""``shmstat subscribe`` as a user runs it, against real collectors and ranks: a subscriber stopped while large
events pass its queue's bound is told exactly what it lost (kept + reported = sent) and the collector counts the
overflow; ``--job J`` exits by itself once J ended, after J's last windows; ``--follow`` stays for J's next run;
node-wide (no endpoint, no ``--job``) it follows every job a node collector serves, and says when none is served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from kit.procs import REPO, load_counts, rank_worker, read_jsonl, spawn, start_collector
from kit.support import run_with_private_dev_shm, wait_for

WINDOW_MS = 50
EVENTS, EVENT_BYTES = 40, 900_000


def _subscribe(tmp_path, name: str, *args: str) -> tuple[subprocess.Popen, str, str]:
    out, err = str(tmp_path / f"{name}.out"), str(tmp_path / f"{name}.err")
    with open(out, "w") as stdout, open(err, "w") as stderr:  # the child keeps its own copies
        proc = subprocess.Popen([sys.executable, "-m", "collector", "subscribe", *args], cwd=REPO,
                                stdout=stdout, stderr=stderr, env=dict(os.environ, PYTHONPATH=REPO))
    return proc, out, err


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _beaten(path: str) -> bool:
    return any(line.get("kind") == "heartbeat" for line in _lines(path))


def _big_events(job: str, n: int, size: int, tally: str) -> None:
    import datetime

    import shmstat
    from shmstat.job import _state

    shmstat.init(job, rank=0)
    for i in range(n):
        shmstat.log_event(shmstat.Event("big", datetime.datetime.now(), {"i": i, "pad": "x" * size}))
    publisher = _state.STATE.publisher
    shmstat.shutdown(flush_timeout_s=30)
    stats = publisher.stats()
    with open(tally, "w") as f:
        json.dump({"logged": n, "sent": stats.sent_items, "dropped": stats.dropped}, f)


@pytest.mark.parametrize("resumed", ["before the end", "as the collector stops"])
def test_a_stopped_subscriber_is_told_exactly_what_it_lost_and_the_collector_counts_it(job, tmp_path, resumed):
    usage = str(tmp_path / "usage.jsonl")
    coll = start_collector(job, "--handler", "*=null", "--handler", f"shmstat=jsonl:{usage}",
                           "--publish-queue", "4", "--status-interval", "0")
    sub, out, err = _subscribe(tmp_path, "sub", "--job", job, "--json", "--topic", "event/")
    try:
        wait_for(lambda: _beaten(out), 20, 0.05, what="the subscriber's first heartbeat")
        os.kill(sub.pid, signal.SIGSTOP)  # it reads nothing from here on, its zmq thread neither
        p = spawn(_big_events, job, EVENTS, EVENT_BYTES, str(tmp_path / "tally.json"))
        p.join(120)
        assert p.exitcode == 0  # the rank exits once the collector acknowledged its last message
        if resumed == "before the end":
            os.kill(sub.pid, signal.SIGCONT)
            wait_for(lambda: _told_everything(out), 30, 0.05, what="a heartbeat counting every event, read")
            # it told the collector what it lost as it learned it: the collector's counter says the same, exactly
            told = _lost_events(out)
            wait_for(lambda: _counter(usage, LOST_COUNTER) == told, 10, 0.05,
                     what=f"{LOST_COUNTER} = {told}, what the subscriber lost")
        # else: its last heartbeat is the collector's final one, which libzmq skips until it has caught up
    finally:
        os.kill(sub.pid, signal.SIGCONT)
        assert coll.stop() == 0
    assert sub.wait(30) == 0  # --job: it ended by itself with the job
    lines = _lines(out)
    kept = sum(len(line["items"]) for line in lines if line.get("kind") == "event")
    gaps = [line for line in lines if line.get("record") == "gap"]
    lost = sum(g["items"] for g in gaps)
    assert kept + lost == EVENTS  # exactly: what it kept and what it was told it lost
    assert kept <= 6, kept  # the bound: 8 MiB = 4 messages queued, one being written, a socket buffer's worth
    assert {(g["rank"], g["stream"], g["job"]) for g in gaps} <= {(0, "event", job), (0, "sender", job)}
    assert sum(g["items"] for g in gaps if g["stream"] == "event") > 0
    print(f"\nstopped subscriber: kept {kept} of {EVENTS} events ({kept * EVENT_BYTES / 2**20:.1f} MiB, queue bound "
          f"8 MiB), told of {lost} lost")
    stderr = _text(err).splitlines()
    assert len([s for s in stderr if "gap:" in s]) == len(gaps)
    assert any(f"job {job} ended" in s for s in stderr) and lines[-1] == {"record": "end", "source": coll.publish,
                                                                          "job": job}
    if resumed == "before the end":  # every message it lost was counted by the collector, none more
        assert _counter(usage, LOST_COUNTER) == sum(g["items"] for g in gaps if g["stream"] == "event")
    else:  # it learned its losses from the final heartbeat, after the collector's last counters: it says them
        assert _counter(usage, LOST_COUNTER) <= lost
    assert _counter(usage, FULL_COUNTER) >= 1  # and the collector found its queue full


LOST_COUNTER = "collector.subscriber_items_lost_event"
FULL_COUNTER = "collector.subscriber_queue_full_event"


def _counter(usage: str, name: str) -> int | None:
    values = [r["value"] for r in read_jsonl(usage) if r["name"] == name]
    return values[-1] if values else None


def _told_everything(out: str) -> bool:
    """The subscriber read a heartbeat that counts all of rank 0's events (and so knows what it lost of them)."""
    return any(item.get("rank") == 0 and item.get("n_event") == EVENTS for line in _lines(out)
               if line.get("kind") == "heartbeat" for item in line["items"])


def _lost_events(out: str) -> int:
    return sum(g["items"] for g in _lines(out) if g.get("record") == "gap" and g["stream"] == "event")


def test_a_job_subscriber_exits_after_the_jobs_last_windows_and_a_follower_stays_for_its_next_run(job, tmp_path):
    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0")
    sub, out, err = _subscribe(tmp_path, "sub", "--job", job, "--json", "--topic", "stat/train/", "--topic", "rank/")
    follower, fout, ferr = _subscribe(tmp_path, "follow", "--job", job, "--follow", "--json", "--topic", "rank/")
    try:
        wait_for(lambda: _beaten(out) and _beaten(fout), 20, 0.05, what="both subscribers' first heartbeat")
        p = spawn(rank_worker, job, 0, 1, 0.5, WINDOW_MS, str(tmp_path / "r0.json"))
        p.join(60)
        assert p.exitcode == 0
    finally:
        assert coll.stop() == 0  # the last windows are emitted as it stops
    assert sub.wait(30) == 0
    added = sum(load_counts(str(tmp_path / "r0.json")).values())
    lines = _lines(out)
    merged = sum(it["count"] for line in lines if line.get("topic") == "stat/train/steps"
                 for it in line["items"] if it["rank"] is None)
    assert merged == added  # every window, the ones emitted at the very end included
    assert any(line.get("topic") == "rank/exited" for line in lines)
    assert not [line for line in lines if line.get("record") == "gap"]
    assert f"job {job} ended" in _text(err)
    try:
        wait_for(lambda: f"job {job} ended" in _text(ferr), 20, 0.05, what="the follower seeing the end")
        assert follower.poll() is None  # --follow: still there
        coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0")
        p = spawn(rank_worker, job, 0, 1, 0.2, WINDOW_MS, str(tmp_path / "r0b.json"))
        p.join(60)
        assert p.exitcode == 0
        assert coll.stop() == 0
        wait_for(lambda: _text(ferr).count(f"job {job} ended") == 2, 20, 0.05, what="the second end")
        exits = [line for line in _lines(fout) if line.get("topic") == "rank/exited"]
        assert len(exits) == 2 and follower.poll() is None
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(20)


_KIT = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/subscribe.py "$WORK"'


def test_node_wide_subscribe_follows_every_job_a_node_collector_serves(tmp_path):
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO)
    done = run_with_private_dev_shm(_KIT, env, REPO, 240)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        result = json.load(f)
    # with no collector on the node it says so, in one sentence, and waits (here: until --timeout)
    assert result["idle_code"] == 0
    assert result["idle_err"].splitlines() == ["shmstat subscribe: no collector serves a job of yours on this node "
                                               "now; waiting for one (start one with: shmstat collect)"]
    lines = [json.loads(line) for line in result["out"].splitlines()]
    err = result["err"]
    assert set(result["exitcodes"]) == {0} and result["code"] in (0, 130) and "gap:" not in err
    for job, world in result["jobs"].items():
        assert f"following job {job}" in err and f"job {job} ended" in err
        mine = [line for line in lines if line.get("job") == job]
        done_events = [it for line in mine if line.get("topic") == "event/done" for it in line["items"]]
        assert sorted(e["data"]["rank"] for e in done_events) == list(range(world))
        merged = sum(it["count"] for line in mine if line.get("topic") == "stat/train/steps"
                     for it in line["items"] if it["rank"] is None)
        assert merged == 500 * world  # every window of the job, to its end
        assert {"record": "end", "source": mine[0]["source"], "job": job} in lines


def _events_and_metrics(job: str, n: int) -> None:
    import datetime

    import shmstat
    from elastic.metrics import put_metric

    shmstat.init(job, rank=0)
    for i in range(n):
        shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {"i": i, "x": float("nan")}))
        put_metric("loss", i / 2, "train")
    shmstat.shutdown(flush_timeout_s=30)


def test_the_python_stream_api_gives_the_records_subscribe_prints_each_naming_its_job(job, tmp_path):
    """The Python stream API (``shmstat.wire.records`` on what a SUB socket receives from a job's own endpoint)
    returns each item as the object ``shmstat subscribe`` prints for it — the same keys and values, timestamps in
    seconds, the job named (issue 44: it gave lists, and None for the job, on a job's own endpoint)."""
    import zmq

    from shmstat.wire.records import records

    n = 5
    coll = start_collector(job, "--handler", "*=null", "--status-interval", "0")
    sub, out, _err = _subscribe(tmp_path, "sub", "--job", job, "--json", "--topic", "event/", "--topic", "metric/")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.connect(coll.publish)
    for topic in (b"event/", b"metric/", b"heartbeat/"):
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    try:
        wait_for(lambda: _beaten_at(sock) and _beaten(out), 20, 0.05, what="both subscribers' first heartbeat")
        p = spawn(_events_and_metrics, job, n)
        p.join(60)
        assert p.exitcode == 0
        got: list[dict] = []
        while len([r for r in got if "name" in r and r["name"] in ("tick", "loss")]) < 2 * n and sock.poll(10_000):
            frames = sock.recv_multipart()
            if not frames[0].startswith(b"heartbeat/"):
                got.extend(records(frames))
    finally:
        sock.close(0)
        ctx.term()
        assert coll.stop() == 0
    assert sub.wait(30) == 0
    printed = [item for line in _lines(out) if line.get("kind") in ("event", "metric") for item in line["items"]]
    assert got == printed and len(got) == 2 * n, (got, printed)
    assert {r["job"] for r in got} == {job}
    ticks = [r for r in got if r.get("name") == "tick"]
    assert [r["data"]["i"] for r in ticks] == list(range(n)) and ticks[0]["data"]["x"] == "NaN"
    assert all(isinstance(r["timestamp"], float) and r["timestamp"] > 1e9 for r in got)


def _beaten_at(sock) -> bool:
    """Whether a heartbeat reached ``sock`` (the collector serves it): the subscription took."""
    while sock.poll(0):
        if sock.recv_multipart()[0].startswith(b"heartbeat/"):
            return True
    return False
