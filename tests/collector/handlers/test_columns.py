"""The columnar handler interface (``emit_columns``) end to end: real ranks, a real collector process, user
handlers loaded from specs. Columns reconcile exactly with what the ranks added and with what per-row handlers
see; the jsonl and tensorboard sinks write the same through columns as row by row; a stuck or raising columnar
handler costs only its own group."""

from __future__ import annotations

import json
import os
import time

from kit.procs import assert_rank_workers_reconcile, rank_worker, read_jsonl, spawn, start_collector, wait_file

WINDOW_MS = 100
K = 3000


def _twin_rank(job: str, rank: int, world: int, out_path: str) -> None:
    """Adds the same K samples to stat ``lat`` of group ``cols`` and of group ``rows`` (one clock reading per
    sample for both, so both land in the same windows)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    now = [0]
    aggs = [A.COUNT, A.SUM, A.MIN, A.MAX, A.P50, A.P99]
    a = shmstat.Stat("lat", aggs, WINDOW_MS / 1000, group="cols", clock=lambda: now[0])
    b = shmstat.Stat("lat", aggs, WINDOW_MS / 1000, group="rows", clock=lambda: now[0])
    for i in range(K):
        now[0] = time.time_ns()
        v = 1.0 + (i * 7919 % 1000) / 10.0 * (rank + 1)
        a.add(v)
        b.add(v)
        if i % 50 == 0:
            time.sleep(0.002)
    open(out_path, "w").close()
    shmstat.shutdown()


def _passes(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_columns_reconcile_with_the_ranks_and_with_per_row_handlers(job, tmp_path):
    cols_path, rows_path = str(tmp_path / "cols.jsonl"), str(tmp_path / "rows.jsonl")
    coll = start_collector(job, "--handler", f"cols=kit.handlers.columns:Recorder,path={cols_path}",
                           "--handler", f"rows=jsonl:{rows_path}", "--handler", "*=null", "--grace-ms", "10")
    try:
        procs = [spawn(_twin_rank, job, r, 2, str(tmp_path / f"done{r}")) for r in range(2)]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        assert coll.stop() == 0
    merged_total, per_rank, got = 0, {0: 0, 1: 0}, {}
    for p in _passes(cols_path):
        assert p["job"] == job and set(p["group"]) == {"cols"}
        n = len(p["count"])
        assert all(len(p[k]) == n for k in ("stat", "rank", "ranks", "wid", "p50", "p99", "agg_mask"))
        for i in range(n):
            if p["rank"][i] < 0:
                merged_total += p["count"][i]
            else:
                per_rank[p["rank"][i]] += p["count"][i]
                assert p["ranks"][i] == 1
            key = (p["wid"][i], None if p["rank"][i] < 0 else p["rank"][i])
            assert key not in got, "a window delivered twice"
            got[key] = (p["count"][i], p["p50"][i], p["p99"][i])
    assert merged_total == 2 * K
    assert per_rank == {0: K, 1: K}
    rows = [r for r in read_jsonl(rows_path) if r["group"] == "rows"]
    seen = {}
    for r in rows:
        wid = round(r["window_start"] * 1000 / WINDOW_MS)
        seen.setdefault((wid, r["rank"]), {})[r["name"]] = r["value"]
    assert set(seen) == set(got)
    for key, (count, p50, p99) in got.items():
        assert seen[key]["lat.count"] == count
        assert seen[key]["lat.p50"] == p50 and seen[key]["lat.p99"] == p99, key


def test_jsonl_and_tensorboard_write_the_same_through_columns_as_row_by_row(job, tmp_path):
    from test_tensorboard_sink import _read_scalars

    paths = {k: str(tmp_path / k) for k in ("cols_jsonl", "rows_jsonl", "cols_tb", "rows_tb")}
    spec = "kit.handlers.columns:Both," + ",".join(f"{k}={v}" for k, v in paths.items())
    coll = start_collector(job, "--handler", f"*={spec}", "--handler", "shmstat=null", "--grace-ms", "10")
    try:
        procs = [spawn(_twin_rank, job, r, 3, str(tmp_path / f"done{r}")) for r in range(3)]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        assert coll.stop() == 0
    with open(paths["cols_jsonl"], encoding="utf-8") as a, open(paths["rows_jsonl"], encoding="utf-8") as b:
        cols_text, rows_text = a.read(), b.read()
    assert cols_text == rows_text
    lines = [json.loads(line) for line in cols_text.splitlines()]
    assert sum(r["value"] for r in lines if r["name"] == "lat.count" and r["rank"] is None) == 2 * 3 * K
    assert {r["rank"] for r in lines} == {None, 0, 1, 2}
    cols_tb = _read_scalars(os.path.join(paths["cols_tb"], job))
    assert cols_tb and cols_tb == _read_scalars(os.path.join(paths["rows_tb"], job))


def _spawn_train_and_noisy(job: str, tmp_path) -> None:
    from test_handler_isolation import _noisy_rank

    procs = [spawn(rank_worker, job, r, 2, 1.0, 50, str(tmp_path / f"r{r}.json"), None, 0) for r in range(2)]
    noisy = spawn(_noisy_rank, job, 2)
    for p in [*procs, noisy]:
        p.join(60)
        assert p.exitcode == 0
    for r in range(2):
        wait_file(str(tmp_path / f"r{r}.json"))


def test_a_stuck_columnar_handler_delays_only_its_group_and_its_drops_are_counted(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"train=jsonl:{out}",
                           "--handler", "noisy=kit.handlers.columns:StuckColumns",
                           "--handler", f"shmstat=jsonl:{out}", "--grace-ms", "10", "--handler-queue", "1000",
                           "--banks", "16")
    try:
        _spawn_train_and_noisy(job, tmp_path)
    finally:
        started = time.monotonic()
        code = coll.stop(timeout=15)
        took = time.monotonic() - started
    assert code == 0
    assert took < 8, f"the collector took {took:.1f} s to exit with a stuck columnar handler"
    rows = read_jsonl(out)
    assert_rank_workers_reconcile(rows, tmp_path, 2)
    dropped = [r["value"] for r in rows if r["name"] == "collector.handler_dropped.noisy"]
    assert dropped and max(dropped) > 0


def test_a_raising_columnar_handler_is_counted_and_the_others_still_run(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"train=jsonl:{out}",
                           "--handler", "noisy=kit.handlers.columns:RaisingColumns",
                           "--handler", f"shmstat=jsonl:{out}", "--grace-ms", "10", "--banks", "16")
    try:
        _spawn_train_and_noisy(job, tmp_path)
    finally:
        assert coll.stop() == 0
    rows = read_jsonl(out)
    assert_rank_workers_reconcile(rows, tmp_path, 2)
    errors = [r["value"] for r in rows if r["name"] == "collector.handler_errors"]
    assert errors and max(errors) > 0
