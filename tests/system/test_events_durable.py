"""Events survive a collector crash: a rank keeps what it sent until the collector acknowledges that its sinks took
it, and re-sends the rest to the next collector, which drops what the last one delivered (the delivered marks in
the segment). Real collectors SIGKILLed at random moments while real ranks log events at a steady rate; the
``--events jsonl`` file must hold every event exactly once, with no gap record."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter

from kit.procs import read_jsonl, spawn, start_collector
from kit.support import wait_for


def _steady_rank(job: str, rank: int, world: int, period_s: float, stop_path: str, out: str) -> None:
    """Log one event every ``period_s`` until ``stop_path`` exists, then shut down and report how many."""
    import datetime

    import shmstat

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    pub = shmstat.job._state.STATE.publisher
    i = 0
    next_at = time.monotonic()
    while not os.path.exists(stop_path):
        shmstat.log_event(shmstat.Event("durable.e", datetime.datetime.now(), {"rank": rank, "i": i}))
        i += 1
        next_at += period_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    shmstat.shutdown(flush_timeout_s=30)
    stats = pub.stats()
    with open(out + ".tmp", "w") as f:
        json.dump({"logged": i, "dropped": stats.dropped}, f)
    os.replace(out + ".tmp", out)


def _by_rank(lines: list[dict], rank: int) -> list[int]:
    return sorted(e["seq"] for e in lines if "gap" not in e and e["rank"] == rank)


def _stop_ranks_and_wait_for_their_events(procs, stop: str, tmp_path, out: str) -> list[dict]:
    """Stop the ranks, read their reports, and wait (60 s at most: what is missing then is said by the test) until
    the file holds as many events as they logged."""
    with open(stop, "w"):
        pass
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    reports = []
    for r in range(len(procs)):
        with open(tmp_path / f"r{r}.json") as f:
            reports.append(json.load(f))
    total = sum(rep["logged"] for rep in reports)
    deadline = time.monotonic() + 60
    while len([e for e in read_jsonl(out) if "gap" not in e]) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    return reports


def _gaps_said(lines: list[dict]) -> str:
    """Each gap row with what the file holds of its numbers outside it: which of them arrived all the same (a false
    gap: the rank still held them), and the file's row numbers of the gap and of the first such arrival."""
    said = []
    for at, g in enumerate(lines):
        if "gap" not in g:
            continue
        key = (g["rank"], g["pid"], g["incarnation"])
        came = [(n, e["seq"]) for n, e in enumerate(lines) if "gap" not in e
                and (e["rank"], e["pid"], e["incarnation"]) == key and g["from_seq"] <= e["seq"] <= g["to_seq"]]
        said.append(f"{g} at row {at}: {len(came)} of its numbers arrived, first at row "
                    f"{came[0][0] if came else None}, seqs {[s for _, s in came[:3]]}..{[s for _, s in came[-3:]]}")
    return "; ".join(said)


def _assert_each_event_once(lines: list[dict], reports: list[dict], context: str) -> None:
    """Every event each rank logged is in ``lines`` exactly once, and no rank dropped any."""
    for r, rep in enumerate(reports):
        assert rep["dropped"] == 0
        seen = Counter(e["data"]["i"] for e in lines if "gap" not in e and e["rank"] == r)
        missing = sorted(set(range(rep["logged"])) - set(seen))
        assert missing == [], f"{context}rank {r} misses {len(missing)} events: {missing[:5]}..{missing[-5:]}"
        assert [i for i, n in seen.items() if n > 1] == [], f"{context}rank {r} has duplicates"


def _collector(job: str, out: str):
    return start_collector(job, "--events", f"jsonl:{out}", "--handler", "*=null", "--status-interval", "0")


def test_events_survive_repeated_collector_sigkills_exactly_once(job, tmp_path):
    out = str(tmp_path / "events.jsonl")
    stop = str(tmp_path / "stop")
    ranks, kills = 2, 4
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    coll = _collector(job, out)
    procs = [spawn(_steady_rank, job, r, ranks, 0.002, stop, str(tmp_path / f"r{r}.json")) for r in range(ranks)]
    try:
        for _ in range(kills):
            wait_for(lambda: len(read_jsonl(out)) > 0, 60, 0.01, what="events in the file")
            time.sleep(rng.uniform(0.05, 1.0))  # a random moment while events flow
            coll.proc.send_signal(signal.SIGKILL)
            coll.stop()
            time.sleep(rng.uniform(0.0, 0.3))
            coll = _collector(job, out)
        time.sleep(rng.uniform(0.2, 0.6))
        reports = _stop_ranks_and_wait_for_their_events(procs, stop, tmp_path, out)
    finally:
        with open(stop, "w"):
            pass
        for p in procs:
            p.join(30)
        assert coll.stop(signal.SIGTERM) == 0
    lines = read_jsonl(out)
    gaps = [g for g in lines if "gap" in g]
    assert gaps == [], f"seed {seed}: {gaps} {reports} {[len(_by_rank(lines, r)) for r in range(ranks)]}"
    _assert_each_event_once(lines, reports, f"seed {seed}: ")


def test_a_successor_stopped_before_the_ranks_resync_loses_and_gaps_nothing(job, tmp_path):
    """A collector SIGKILLed, then its successor SIGTERMed at once, before the ranks re-sent what they keep: the
    hand-over must not take the ranks' held sequence numbers for a loss (the ranks still keep those events and
    re-send them to the next collector), nor acknowledge them (the ranks would forget them)."""
    out = str(tmp_path / "events.jsonl")
    stop = str(tmp_path / "stop")
    ranks, rounds = 2, 4
    coll = _collector(job, out)
    procs = [spawn(_steady_rank, job, r, ranks, 0.0002, stop, str(tmp_path / f"r{r}.json")) for r in range(ranks)]
    try:
        for _ in range(rounds):
            wait_for(lambda: len(read_jsonl(out)) > 0, 60, 0.01, what="events in the file")
            time.sleep(0.3)
            coll.proc.send_signal(signal.SIGKILL)
            coll.stop()
            time.sleep(1.0)  # the ranks keep sending into the void meanwhile: their pipes fill up
            coll = _collector(job, out)
            assert coll.stop(signal.SIGTERM) == 0  # at once: the ranks may not have re-synced yet
            coll = _collector(job, out)
        reports = _stop_ranks_and_wait_for_their_events(procs, stop, tmp_path, out)
    finally:
        with open(stop, "w"):
            pass
        for p in procs:
            p.join(30)
        assert coll.stop(signal.SIGTERM) == 0
    lines = read_jsonl(out)
    assert [g for g in lines if "gap" in g] == [], f"{_gaps_said(lines)}; the ranks said {reports}"
    _assert_each_event_once(lines, reports, "")
