"""Handlers run off the scanning loop: a handler stuck in ``emit`` delays only its own group (bounded queue,
drops counted), every other group still gets every row, and SIGTERM still ends the collector within seconds.
A real collector process, real ranks, a user handler loaded from a spec."""

from __future__ import annotations

import signal
import time

from kit.procs import assert_rank_workers_reconcile, rank_worker, read_jsonl, spawn, start_collector

WINDOW_MS = 50


def test_a_stuck_handler_delays_only_its_group_and_sigterm_still_exits(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"train=jsonl:{out}", "--handler", "*=kit.handlers.user:Stuck",
                           "--handler", f"shmstat=jsonl:{out}", "--grace-ms", "10", "--handler-queue", "1000",
                           "--banks", "16")  # a ring of 16 windows: the test shares 2 cores with 4 busy processes
    try:
        procs = [spawn(rank_worker, job, r, 2, 1.0, WINDOW_MS, str(tmp_path / f"r{r}.json"), None, 0)
                 for r in range(2)]
        from kit.procs import wait_file

        # a second stat in a group whose handler is stuck: it floods that handler's queue
        noisy = spawn(_noisy_rank, job, 2)
        for p in [*procs, noisy]:
            p.join(60)
            assert p.exitcode == 0
        for r in range(2):
            wait_file(str(tmp_path / f"r{r}.json"))
    finally:
        started = time.monotonic()
        coll.proc.send_signal(signal.SIGTERM)
        code = coll.proc.wait(15)
        took = time.monotonic() - started
    assert code == 0
    assert took < 8, f"the collector took {took:.1f} s to exit with a stuck handler"
    rows = read_jsonl(out)
    assert_rank_workers_reconcile(rows, tmp_path, 2)
    dropped = [r["value"] for r in rows if r["name"] == "collector.handler_dropped"]
    assert dropped and max(dropped) > 0
    assert any(r["name"] == "collector.handler_dropped.noisy" for r in rows)


def _noisy_rank(job: str, rank: int) -> None:
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=3)
    stats = [shmstat.Stat(f"n{i}", [A.COUNT, A.SUM, A.MAX, A.MIN, A.MEAN], WINDOW_MS / 1000, group="noisy")
             for i in range(200)]
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # 200 stats with data in every window: ~2,000 rows a window for the stuck one
        for s in stats:
            s.add(1.0)
        time.sleep(0.005)
    shmstat.shutdown()
