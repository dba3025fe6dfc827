"""An events sink whose disk fills up and is then freed: each event is counted once, as kept (a whole line in the
file) or as lost (``collector.events_dropped``), never both; every loss while the sink raised is a gap record in
the file, written once the sink takes again. A real tmpfs of 256 KiB (mounting needs root: skipped otherwise), a
real collector, a real rank."""

from __future__ import annotations

import json
import os
import time

import pytest
from kit.procs import read_jsonl, spawn, start_collector
from kit.support import small_tmpfs, wait_for


def _paced_rank(job: str, n1: int, n2: int, full_path: str, go_path: str, out: str) -> None:
    """Log ``n1`` events, note it in ``full_path``, wait for ``go_path``, log ``n2`` more, shut down."""
    import datetime

    import shmstat

    shmstat.init(job, rank=0, world_size=1)
    pub = shmstat.job._state.STATE.publisher
    for i in range(n1 + n2):
        if i == n1:
            with open(full_path, "w"):
                pass
            while not os.path.exists(go_path):
                time.sleep(0.01)
        shmstat.log_event(shmstat.Event("disk.e", datetime.datetime.now(), {"i": i, "pad": "p" * 100}))
        time.sleep(0.0005)
    shmstat.shutdown(flush_timeout_s=30)
    with open(out, "w") as f:
        json.dump({"dropped": pub.stats().dropped}, f)


@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "small", "256k") as where:
        yield where


def test_a_sink_on_a_full_disk_counts_each_event_once_and_writes_its_losses_as_gaps(job, tmp_path, small_disk):
    events = str(small_disk / "events.jsonl")
    usage = str(tmp_path / "usage.jsonl")
    filler = small_disk / "filler"
    filler.write_bytes(b"f" * (200 * 1024))  # room for a few hundred events only
    n1, n2 = 2000, 500
    coll = start_collector(job, "--events", f"jsonl:{events}", "--handler", f"shmstat=jsonl:{usage}",
                           "--handler", "*=null", "--status-interval", "0")
    try:
        p = spawn(_paced_rank, job, n1, n2, str(tmp_path / "full"), str(tmp_path / "go"), str(tmp_path / "r.json"))

        def dropped() -> float:
            values = [r["value"] for r in read_jsonl(usage) if r["name"] == "collector.events_dropped"]
            return values[-1] if values else 0

        wait_for(lambda: os.path.exists(tmp_path / "full"), 120, 0.01, what="the rank's first events")
        wait_for(lambda: dropped() > 0, 60, 0.05, what="the sink losing events to the full disk")
        time.sleep(0.5)  # more events reach the sink while the disk is full
        filler.unlink()  # the disk has room again
        with open(tmp_path / "go", "w"):
            pass
        p.join(120)
        assert p.exitcode == 0
    finally:
        assert coll.stop() == 0
    with open(tmp_path / "r.json") as f:
        assert json.load(f)["dropped"] == 0
    lines = read_jsonl(events)
    gaps = [g for g in lines if "gap" in g]
    final = [r["value"] for r in read_jsonl(usage) if r["name"] == "collector.events_dropped"][-1]
    assert final > 0 and sum(g["gap"] for g in gaps) == final  # every loss is a gap record, counted once
    assert all(g["at"] == "collector" for g in gaps)
    # the rank's stream: each event kept (once) or lost, never both; the losses are exactly the gaps' numbers
    kept = [e["seq"] for e in lines if "gap" not in e and e["rank"] == 0]
    lost = [s for g in gaps if g["rank"] == 0 for s in range(g["from_seq"], g["to_seq"] + 1)]
    assert len(set(kept)) == len(kept)
    assert len(kept) + sum(g["gap"] for g in gaps if g["rank"] == 0) == n1 + n2
    assert sorted(lost) == sorted(set(range(n1 + n2)) - set(kept))
