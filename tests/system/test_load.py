"""Load: 8 rank processes add as fast as they can while publishing events; every sample and every event is
accounted for (merged window counts equal the adds; events received plus events counted as dropped equal the
events logged). The default run is short (CI); the ``slow`` variant runs for several seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from kit.faults import RssSampler, Subscriber, counts_from, load_worker, read_json, rows_by_rank_window
from kit.procs import read_jsonl, start_collector
from kit.support import wait_for

RANKS = 8
WINDOW_MS = 100


def _run_load(job: str, tmp_path, seconds: float) -> None:
    out = str(tmp_path / "m.jsonl")
    # Grace: the longest the collector takes (2 cores, 10 busy processes; a writer preempted inside add is seen
    # mid-write and waited for whatever the grace).
    # --publish-queue: the test's subscriber, a thread starved of CPU by 8 busy ranks, must not fall past the
    # collector's queue for it (a slow subscriber losing messages is test_faults.py's stuck subscriber)
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "50", "--banks", "16",
                           "--publish-queue", "50000", "--status-interval", "0")
    rss = RssSampler(coll.proc.pid)
    sub = Subscriber(coll.publish, (b"event/", b"stat/shmstat/usage"))
    try:
        sub.wait_flowing()
        start = str(tmp_path / "start")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=load_worker, args=(job, r, RANKS, seconds, WINDOW_MS, str(tmp_path / f"r{r}.json"),
                                                  8, start))
            for r in range(RANKS)
        ]
        for p in procs:
            p.start()
        open(start, "w").close()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        reports = {r: read_json(str(tmp_path / f"r{r}.json")) for r in range(RANKS)}

        # events: what each rank logged was queued; queued = sent + dropped; the subscriber received every sent one
        sent = dropped = 0
        for rep in reports.values():
            pub = rep["pub"]
            assert rep["flushed"] and pub["backlog"] == 0, rep
            assert pub["queued"] == rep["events"]
            assert pub["queued"] == pub["sent"] + pub["dropped"]
            sent += pub["sent"]
            dropped += pub["dropped"]
        total_events = sum(rep["events"] for rep in reports.values())
        assert total_events > RANKS * 1000
        wait_for(lambda: sub.received("event") >= sent, 60, 0.05, what=f"{sent} events at the subscriber")
        streams = sub.snapshot_streams()
        for r, rep in reports.items():
            log = streams[("event", r, rep["pid"], 1)]
            assert log.duplicates == 0
            assert log.received + rep["pub"]["dropped"] == rep["events"], (r, log.received, rep)
        assert sub.received("event") + dropped == total_events
        wait_for(lambda: (sub.counter("collector.events_relayed") or 0) >= sent, 30, what="relay counters")
        assert sub.counter("collector.events_relayed") == sent
        assert sub.counter("collector.frames_rejected") == 0
        assert (sub.counter("collector.seq_gaps") or 0) <= dropped
    finally:
        sub.close()
        assert coll.stop() == 0
        rss.stop()

    # samples: every (rank, window) emitted once with exactly the rank's count; merged rows add up
    rows = read_jsonl(out)
    merged, per_rank, repeats = rows_by_rank_window(rows, "load", WINDOW_MS)
    assert repeats == 0
    want_merged: dict[int, int] = {}
    adds = 0
    for r, rep in reports.items():
        counts = counts_from(rep)
        adds += rep["adds"]
        assert sum(counts.values()) == rep["adds"]
        for wid, n in counts.items():
            assert per_rank.get((r, wid)) == n, (r, wid, n, per_rank.get((r, wid)))
            want_merged[wid] = want_merged.get(wid, 0) + n
        assert sum(v for (rk, _), v in per_rank.items() if rk == r) == rep["adds"]
    assert merged == want_merged
    assert sum(merged.values()) == adds
    assert not any(r.get("torn") for r in rows)
    sums = {(r["rank"], round(r["window_start"] * 1000 / WINDOW_MS)): r["value"] for r in rows
            if r["name"] == "load.sum"}
    for (rank, wid), n in per_rank.items():
        assert sums[(rank, wid)] == n  # every sample is 1.0
    print(f"\nload: {RANKS} ranks, {adds} adds, {total_events} events ({dropped} dropped, counted), "
          f"collector peak RSS {rss.peak / 2**20:.0f} MiB")


def test_eight_ranks_under_load_every_sample_and_event_accounted(job, tmp_path):
    _run_load(job, tmp_path, 1.5)


@pytest.mark.slow
def test_eight_ranks_under_load_long(job, tmp_path):
    _run_load(job, tmp_path, float(os.environ.get("SHMSTAT_LOAD_SECONDS", "5")))
