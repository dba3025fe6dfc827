"""Events kept (``--events``): every event real ranks log (``shmstat.log_event``, ``elastic.events.record``),
those logged before any collector existed included, reaches the sink exactly once with its fields; what a rank
dropped comes out as gap records that add up; a stuck sink stalls nothing and its losses are counted; ``shmstat
run`` and a collector of several jobs keep them too; a bad SPEC starts nothing. Real collectors (subprocesses),
real rank processes, real sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from kit.procs import REPO, read_jsonl, spawn, start_collector
from kit.support import unique_job, wait_for

from shmstat.shm.segment import Segment


def _write(path: str, obj: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _report(pub, out: str) -> None:
    stats = pub.stats()
    _write(out, {"pid": os.getpid(), "queued": stats.queued, "dropped": stats.dropped, "sent": stats.sent_items})


def _logging_rank(job: str, rank: int, world: int, n_log: int, n_rec: int, n_metrics: int, out: str) -> None:
    """Log ``n_log`` events with log_event and ``n_rec`` with elastic.events.record, put ``n_metrics`` metrics in
    between (they share the rank's sequence numbers), then report the publisher's counts."""
    import datetime

    import shmstat
    from elastic import events, metrics

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    pub = shmstat.job._state.STATE.publisher
    for i in range(max(n_log, n_rec, n_metrics)):
        if i < n_log:
            shmstat.log_event(shmstat.Event("kept.log", datetime.datetime.now(), {"rank": rank, "i": i, "x": 0.5}))
        if i < n_rec:
            events.record(events.Event(name="kept.rec", source=events.EventSource.WORKER,
                                       metadata={"rank": rank, "i": i}))
        if i < n_metrics:
            metrics.put_metric("m", i, "g")
    shmstat.shutdown(flush_timeout_s=20)
    _report(pub, out)


def _rank_events(lines: list[dict], rank: int) -> list[dict]:
    return [e for e in lines if "gap" not in e and e["rank"] == rank]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_k_events_of_n_ranks_reach_jsonl_exactly_once_with_their_fields(job, tmp_path, sig):
    out = str(tmp_path / "events.jsonl")
    ranks, n_log, n_rec, n_metrics = 3, 40, 25, 30
    began = time.time()
    coll = start_collector(job, "--events", f"jsonl:{out}", "--handler", "*=null", "--status-interval", "0")
    try:
        procs = [spawn(_logging_rank, job, r, ranks, n_log, n_rec, n_metrics, str(tmp_path / f"r{r}.json"))
                 for r in range(ranks)]
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
    finally:
        assert coll.stop(sig) == 0  # the shutdown path flushes what the sink holds
    lines = read_jsonl(out)
    assert [e for e in lines if "gap" in e] == []
    for r in range(ranks):
        with open(tmp_path / f"r{r}.json") as f:
            rep = json.load(f)
        mine = _rank_events(lines, r)
        assert len(mine) == n_log + n_rec  # exactly K: none missing, none twice
        assert sorted((e["name"], e["data"]["i"]) for e in mine) == sorted(
            [("kept.log", i) for i in range(n_log)] + [("kept.rec", i) for i in range(n_rec)])
        for e in mine:
            assert set(e) == {"name", "job", "rank", "timestamp", "data", "seq", "pid", "incarnation", "node"}
            assert e["job"] == job and e["pid"] == rep["pid"] and e["data"]["rank"] == r
            assert began <= e["timestamp"] <= time.time()
        assert all(e["data"]["x"] == 0.5 for e in mine if e["name"] == "kept.log")
        assert all(e["data"]["source"] == "WORKER" for e in mine if e["name"] == "kept.rec")
        assert len({e["incarnation"] for e in mine}) == 1
        seqs = [e["seq"] for e in mine]  # per-rank sequence numbers, in order; metrics take the ones between
        assert seqs == sorted(set(seqs)) and seqs[-1] < rep["queued"] == n_log + n_rec + n_metrics
    own = [e for e in lines if e["rank"] is None]
    assert [e["seq"] for e in own] == list(range(len(own)))  # the collector's own stream, gap-free
    assert {e["pid"] for e in own} == {coll.proc.pid}
    assert sorted(e["data"]["rank"] for e in own if e["name"] == "rank/joined") == list(range(ranks))


def _early_rank(job: str, n: int, backlog_mb: float, blob: int, ready: str, go: str, out: str) -> None:
    """Log ``n`` events while no collector exists, say so, wait for ``go``, log one more, exit cleanly."""
    import datetime

    import shmstat

    shmstat.init(job, rank=0, world_size=1, backlog_mb=backlog_mb)
    pub = shmstat.job._state.STATE.publisher
    for i in range(n):
        shmstat.log_event(shmstat.Event("early", datetime.datetime.now(), {"i": i, "blob": "b" * blob}))
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    shmstat.log_event(shmstat.Event("after", datetime.datetime.now(), {"i": n}))
    shmstat.shutdown(flush_timeout_s=20)
    _report(pub, out)


def _run_early(job: str, tmp_path, n: int, backlog_mb: float, blob: int) -> tuple[list[dict], dict]:
    ready, go, rep = (str(tmp_path / name) for name in ("ready", "go", "rank.json"))
    out = str(tmp_path / "events.jsonl")
    p = spawn(_early_rank, job, n, backlog_mb, blob, ready, go, rep)
    coll = None
    try:
        wait_for(lambda: os.path.exists(ready) or not p.is_alive(), 60, what="the rank logged its events")
        assert p.is_alive()
        coll = start_collector(job, "--events", f"jsonl:{out}", "--handler", "*=null", "--status-interval", "0")
        open(go, "w").close()
        p.join(120)
        assert p.exitcode == 0
    finally:
        open(go, "w").close()
        if coll is not None:
            assert coll.stop() == 0
    with open(rep) as f:
        return read_jsonl(out), json.load(f)


def test_events_logged_before_any_collector_existed_are_kept(job, tmp_path):
    lines, rep = _run_early(job, tmp_path, 200, 64.0, 10)
    assert rep["dropped"] == 0
    mine = _rank_events(lines, 0)
    assert [e["data"]["i"] for e in mine if e["name"] == "early"] == list(range(200))
    assert [e["seq"] for e in mine] == list(range(201))
    assert [e["name"] for e in mine][-1] == "after"
    assert [e for e in lines if "gap" in e] == []
    joined = [e for e in lines if e["name"] == "rank/joined" and e["rank"] is None]
    assert [(e["data"]["rank"], e["data"]["pid"]) for e in joined] == [(0, rep["pid"])]


def test_a_rank_that_dropped_events_yields_gap_records_that_with_the_kept_add_up_to_what_it_logged(job, tmp_path):
    n = 300
    lines, rep = _run_early(job, tmp_path, n, 1.0, 16_000)  # 4.8 MB logged against a 1 MiB backlog
    assert rep["dropped"] > 0, "the backlog did not overflow; the test proves nothing"
    mine = _rank_events(lines, 0)
    kept = [e["seq"] for e in mine if e["name"] == "early"]
    gaps = [g for g in lines if "gap" in g]
    assert gaps and all(g["at"] == "rank" and g["rank"] == 0 and g["pid"] == rep["pid"] for g in gaps)
    assert all(g["gap"] == g["to_seq"] - g["from_seq"] + 1 for g in gaps)
    assert len(kept) + sum(g["gap"] for g in gaps) == n  # loss told apart from silence, exactly
    assert sum(g["gap"] for g in gaps) == rep["dropped"]
    lost = {s for g in gaps for s in range(g["from_seq"], g["to_seq"] + 1)}
    assert lost == set(range(n)) - set(kept)
    assert [e["name"] for e in mine][-1] == "after" and mine[-1]["seq"] == n


def _busy_rank(job: str, seconds: float, window_ms: int, n_events: int, blob: int, out: str) -> None:
    """Add to a stat for ``seconds`` (tallying every add) and log ``n_events`` events spread over the time."""
    import datetime

    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0, world_size=1)
    stat = shmstat.Stat("steps", [A.COUNT], window_ms / 1000, group="train")
    adds = logged = 0
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        stat.add(1.0)
        adds += 1
        while logged < n_events and logged < n_events * elapsed / seconds:
            shmstat.log_event(shmstat.Event("busy", datetime.datetime.now(), {"i": logged, "blob": "z" * blob}))
            logged += 1
        if adds % 64 == 0:
            time.sleep(0.001)
    while logged < n_events:
        shmstat.log_event(shmstat.Event("busy", datetime.datetime.now(), {"i": logged, "blob": "z" * blob}))
        logged += 1
    # (time to hand everything to zmq; the rest of it waits for acknowledgements a stuck sink never lets come)
    shmstat.shutdown(flush_timeout_s=5)
    _write(out, {"adds": adds})


def test_a_stuck_events_sink_stalls_nothing_and_every_event_it_lost_is_counted(job, tmp_path):
    events, rows, usage = (str(tmp_path / f"{name}.jsonl") for name in ("events", "rows", "usage"))
    n_events = 1500  # 6 MB of events against a 1 MiB queue for the stuck sink
    coll = start_collector(job, "--events", "kit.handlers.event_sinks:Stuck", "--events", f"jsonl:{events}",
                           "--events-queue-mb", "1", "--handler", f"train=jsonl:{rows}",
                           "--handler", f"shmstat=jsonl:{usage}", "--grace-ms", "10", "--status-interval", "0")
    stopped_in = None
    try:
        p = spawn(_busy_rank, job, 2.5, 100, n_events, 4000, str(tmp_path / "rank.json"))

        def dropped() -> float:
            values = [r["value"] for r in read_jsonl(usage) if r["name"] == "collector.events_dropped"]
            return values[-1] if values else 0

        wait_for(lambda: dropped() > 0, 60, what="collector.events_dropped counting the stuck sink's losses")
        p.join(120)
        assert p.exitcode == 0
    finally:
        start = time.monotonic()
        assert coll.stop(timeout=60) == 0
        stopped_in = time.monotonic() - start
    assert stopped_in < 20, "the stuck sink held the shutdown up"
    with open(tmp_path / "rank.json") as f:
        adds = json.load(f)["adds"]
    # the windows kept coming: every add is in exactly one emitted window
    assert sum(r["value"] for r in read_jsonl(rows) if r["name"] == "steps.count" and r["rank"] is None) == adds
    kept = read_jsonl(events)
    busy = [e for e in kept if e.get("name") == "busy"]
    lost_by_jsonl = sum(g["gap"] for g in kept if "gap" in g)
    assert len(busy) + lost_by_jsonl == n_events
    offered = len([e for e in kept if "gap" not in e]) + lost_by_jsonl  # what each sink was offered
    # the stuck sink lost everything it was offered (taken in hand, queued, or dropped), the jsonl sink its gaps
    final = [r["value"] for r in read_jsonl(usage) if r["name"] == "collector.events_dropped"][-1]
    assert final == offered + lost_by_jsonl
    errors = [r["value"] for r in read_jsonl(usage) if r["name"] == "collector.event_handler_errors"][-1]
    assert errors == 0


def test_shmstat_run_keeps_the_ranks_and_the_agents_events(tmp_path):
    job = unique_job("runev")
    out = str(tmp_path / "events.jsonl")
    script = os.path.join(REPO, "tests", "kit", "programs", "events_job.py")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2", "--monitor-interval",
             "0.05", "--handler", "*=null", "--events", f"jsonl:{out}", "--status-interval", "0", script],
            env=dict(os.environ, PYTHONPATH=REPO, EVENTS="15"), cwd=REPO, capture_output=True, text=True,
            timeout=120)
    finally:
        Segment.unlink(job)
    assert done.returncode == 0, done.stderr
    lines = read_jsonl(out)
    for r in range(2):
        mine = Counter(e["name"] for e in _rank_events(lines, r))
        assert mine == {"train.step": 15, "train.rec": 15}
    own = Counter((e["name"], e["data"].get("global_rank")) for e in lines if e["rank"] is None)
    for r in range(2):
        assert own[("torchelastic.worker.status.START", r)] == 1
        assert own[("torchelastic.worker.status.SUCCEEDED", r)] == 1


def test_a_collector_of_several_jobs_keeps_each_jobs_events_under_its_name(tmp_path):
    jobs = [unique_job("evA"), unique_job("evB")]
    out = str(tmp_path / "events.jsonl")
    coll = start_collector(jobs[0], "--job", jobs[1], "--events", f"jsonl:{out}", "--handler", "*=null",
                           "--status-interval", "0")
    try:
        procs = [spawn(_logging_rank, j, r, 2, 10 + i, 5, 0, str(tmp_path / f"{i}-{r}.json"))
                 for i, j in enumerate(jobs) for r in range(2)]
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        wait_for(lambda: sum(1 for e in read_jsonl(out) if e.get("rank") is not None) == 2 * 15 + 2 * 16, 30,
                 what="every job's events in the file")
    finally:
        assert coll.stop() == 0
        for j in jobs:
            Segment.unlink(j)
    lines = read_jsonl(out)
    for i, j in enumerate(jobs):
        for r in range(2):
            mine = [e for e in lines if e["job"] == j and e["rank"] == r]
            assert Counter(e["name"] for e in mine) == {"kept.log": 10 + i, "kept.rec": 5}


def test_a_bad_events_spec_is_one_sentence_and_starts_nothing(job, tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    for args, says in [
        (["collect", "--job", job, "--events", "bogus"], "unknown events sink kind 'bogus'"),
        (["collect", "--job", job, "--events", "kit.handlers.event_sinks:NotASink"], "no emit_events(batch) method"),
        (["collect", "--job", job, "--job", job + "-2", "--events", "jsonl:"], "needs a path"),
        (["collect", "--job", job, "--events", ""], "--events needs a SPEC"),
        (["collect", "--job", job, "--events-queue-mb", "0"], "--events-queue-mb"),
        (["run", "--job", job, "--nproc-per-node", "1", "--events", "otlp:nowhere", str(script)],
         "not an http(s) URL"),
    ]:
        done = subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=60)
        assert done.returncode == 2, done
        err = done.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shmstat: error: ") and says in err[0], done.stderr
        assert not [n for n in os.listdir("/dev/shm") if job in n], "a bad SPEC left a segment"
        assert not marker.exists(), "shmstat run started the script despite a bad SPEC"


def _rank_that_waits(job: str, n_events: int, stop_path: str) -> None:
    """Log ``n_events`` events, then live until ``stop_path`` exists (its publisher keeps what no collector
    acknowledged), then shut down."""
    import datetime

    import shmstat

    shmstat.init(job, rank=0, local_rank=0, world_size=1)
    for i in range(n_events):
        shmstat.log_event(shmstat.Event("held", datetime.datetime.now(), {"i": i}))
    while not os.path.exists(stop_path):
        time.sleep(0.01)
    shmstat.shutdown(flush_timeout_s=20)


def test_a_sink_given_up_at_stop_counts_as_dropped_only_what_no_rank_resends(job, tmp_path):
    """A stuck sink holds a live rank's events at a SIGTERM: the sink is given up, but the rank still keeps those
    events (nothing acknowledged them) and re-sends them to the next collector, so they are not counted as dropped
    (they were, and then arrived too: counted twice)."""
    first, second, usage = (str(tmp_path / f"{name}.jsonl") for name in ("first", "second", "usage"))
    stop = str(tmp_path / "stop")
    n_events = 200
    coll = start_collector(job, "--events", "kit.handlers.event_sinks:Stuck", "--events", f"jsonl:{first}",
                           "--handler", f"shmstat=jsonl:{usage}", "--status-interval", "0")
    p = spawn(_rank_that_waits, job, n_events, stop)
    try:
        wait_for(lambda: len([e for e in read_jsonl(first) if e.get("name") == "held"]) >= n_events, 60,
                 what="the jsonl sink's events")
        assert coll.stop(signal.SIGTERM, timeout=60) == 0
        final = [r["value"] for r in read_jsonl(usage) if r["name"] == "collector.events_dropped"][-1]
        own = [e for e in read_jsonl(first) if e.get("name") != "held" and "gap" not in e]  # rank/joined: no one
        assert own and final == len(own)  # re-sends the collector's own events: those the stuck sink held are lost
        coll = start_collector(job, "--events", f"jsonl:{second}", "--status-interval", "0")
        wait_for(lambda: len([e for e in read_jsonl(second) if e.get("name") == "held"]) >= n_events, 60,
                 what="the rank's re-sent events")
    finally:
        with open(stop, "w"):
            pass
        p.join(60)
        assert coll.stop(signal.SIGTERM, timeout=60) == 0
    again = [e for e in read_jsonl(second) if e.get("name") == "held"]
    assert sorted(e["data"]["i"] for e in again) == list(range(n_events))
    assert [g for g in read_jsonl(second) if "gap" in g] == []


def _steady_rank(job: str, stop_path: str, out: str) -> None:
    """Every 5 ms add to ``train/steps`` (100 ms windows) and log an event, until ``stop_path`` exists; then shut
    down and write how many of each it made (as many adds as events)."""
    import datetime

    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0, local_rank=0, world_size=1)
    stat = shmstat.Stat("steps", [A.COUNT], 0.1, group="train")
    made = 0
    while not os.path.exists(stop_path):
        stat.add(1.0)
        shmstat.log_event(shmstat.Event("steady", datetime.datetime.now(), {"i": made}))
        made += 1
        time.sleep(0.005)
    shmstat.shutdown(flush_timeout_s=20)
    _write(out, {"made": made})


def _end_steady(stop: str, p, coll, other: tuple[str, ...]) -> None:
    """Stop the steady rank, then its collector; remove the second job's segment if there was one."""
    with open(stop, "w"):
        pass
    p.join(60)
    assert coll.stop(signal.SIGTERM, timeout=60) == 0
    if other:
        Segment.unlink(other[1])


@pytest.mark.parametrize("node", [False, True], ids=["job-collector", "node-collector"])
def test_events_a_slow_sink_still_holds_at_a_sigterm_are_kept_once_across_the_restart(tmp_path, node):
    """A sink that is always behind (0.4 s a batch) still holds events when its collector is SIGTERMed; the
    collector lets it finish them, and the next collector gets from the live rank only what no sink took: every
    event once in the two runs' files. With a node collector the sinks are shared by its jobs and finish after the
    jobs were let go; what they wrote then must still reach the ranks as delivered (it came again: twice)."""
    job = unique_job("slowsink")
    other = ("--job", unique_job("slowsink-other")) if node else ()  # two jobs: a node collector's shared sinks
    first, second, stop, out = (str(tmp_path / name) for name in ("first.jsonl", "second.jsonl", "stop", "rank.json"))
    coll = start_collector(job, *other, "--events", "kit.handlers.event_sinks:Slow,seconds=0.4",
                           "--events", f"jsonl:{first}", "--handler", "*=null", "--status-interval", "0")
    p = spawn(_steady_rank, job, stop, out)
    try:
        wait_for(lambda: sum(e.get("name") == "steady" for e in read_jsonl(first)) >= 300, 60,
                 what="the rank's events in the first collector's file")
        assert coll.stop(signal.SIGTERM, timeout=60) == 0
        coll = start_collector(job, *other, "--events", f"jsonl:{second}", "--handler", "*=null",
                               "--status-interval", "0")
        wait_for(lambda: sum(e.get("name") == "steady" for e in read_jsonl(second)) >= 100, 60,
                 what="the rank's events in the second collector's file")
    finally:
        _end_steady(stop, p, coll, other)
    assert p.exitcode == 0
    with open(out) as f:
        logged = json.load(f)["made"]
    lines = read_jsonl(first) + read_jsonl(second)
    assert [g for g in lines if "gap" in g] == []
    kept = Counter(e["data"]["i"] for e in lines if e.get("name") == "steady")
    assert {i: n for i, n in kept.items() if n > 1} == {}, "events written by the first collector came again"
    assert sorted(kept) == list(range(logged))


@pytest.mark.parametrize("node", [False, True], ids=["job-collector", "node-collector"])
def test_windows_that_close_while_a_slow_sink_finishes_are_emitted_by_the_stopping_collector(tmp_path, node):
    """A SIGTERMed collector lets a slow events sink finish (1.5 s a batch here) before it exits; the windows of a
    live rank that close meanwhile are emitted by it, not left in the ring for a successor that starts only after
    it exited (the ring keeps a closed window only a few windows long). Across the two collectors (a segment of 64
    banks: the successor's start is within what its ring keeps) every window is written once and holds every add."""
    job = unique_job("slowwin")
    other = ("--job", unique_job("slowwin-other")) if node else ()
    rows = [str(tmp_path / f"rows{i}.jsonl") for i in (1, 2)]
    stop, out = str(tmp_path / "stop"), str(tmp_path / "rank.json")

    def merged(path: str) -> list[dict]:
        return [r for r in read_jsonl(path) if r["name"] == "steps.count" and r["rank"] is None
                and r.get("job", job) == job]

    coll = start_collector(job, *other, "--events", "kit.handlers.event_sinks:Slow,seconds=1.5",
                           "--handler", f"train=jsonl:{rows[0]}", "--grace-ms", "10", "--banks", "64",
                           "--status-interval", "0")
    p = spawn(_steady_rank, job, stop, out)
    try:
        wait_for(lambda: len(merged(rows[0])) >= 5, 60, what="the first collector's windows")
        stopped_at = time.time()
        assert coll.stop(signal.SIGTERM, timeout=60) == 0
        exited_at = time.time()
        coll = start_collector(job, *other, "--handler", f"train=jsonl:{rows[1]}", "--grace-ms", "10",
                               "--banks", "64", "--status-interval", "0")
        wait_for(lambda: len(merged(rows[1])) >= 3, 60, what="the second collector's windows")
    finally:
        _end_steady(stop, p, coll, other)
    assert p.exitcode == 0
    assert exited_at - stopped_at >= 1.0, "the slow sink had nothing left to finish: the test proves nothing"
    last_end = max(r["window_end"] for r in merged(rows[0]))
    assert last_end >= stopped_at + 0.8, (
        f"the stopping collector's last window ended {last_end - stopped_at:.2f} s after the SIGTERM, though it "
        f"ran {exited_at - stopped_at:.2f} s more")
    with open(out) as f:
        adds = json.load(f)["made"]
    both = merged(rows[0]) + merged(rows[1])
    starts = Counter(r["window_start"] for r in both)
    assert {s: n for s, n in starts.items() if n > 1} == {}
    assert sum(r["value"] for r in both) == adds
