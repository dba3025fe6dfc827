"""Every sample ``add`` accepts is counted exactly once, whatever the process and thread shape of the rank:
threads sharing a Stat, re-created and closed Stats, bound adds kept after the Stat is gone, forked children,
and spawn/forkserver/fork workers that inherit the rank's environment. Real rank processes, a real collector,
real shared memory; C and pure-Python paths. A worker's samples count in its rank's row."""

from __future__ import annotations

import datetime as dt
import decimal
import fractions
import json
import threading

import numpy as np
import pytest
from _procs import read_jsonl, spawn, start_collector
from _writers_kit import fork_with_bound_add, rank_with_workers, recreated_stats, threads_on_one_stat

import shmstat
from shmstat import Aggregation as A
from shmstat._writer import coerce_value

PATHS = [pytest.param(False, id="c"), pytest.param(True, id="pure-python")]


def _collect(job, tmp_path, target, *args):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
    tally = str(tmp_path / "tally.json")
    try:
        p = spawn(target, job, *args, tally)
        p.join(180)
        assert p.exitcode == 0
    finally:
        assert coll.stop() == 0
    with open(tally) as f:
        return read_jsonl(out), json.load(f)


def _reconcile(rows, stat: str, want: dict) -> None:
    merged_count = sum(r["value"] for r in rows if r["name"] == f"{stat}.count" and r["rank"] is None)
    merged_sum = sum(r["value"] for r in rows if r["name"] == f"{stat}.sum" and r["rank"] is None)
    per_rank = [r for r in rows if r["name"] == f"{stat}.count" and r["rank"] is not None]
    assert merged_count == want["count"]
    assert merged_sum == pytest.approx(want["sum"], rel=1e-12)
    assert {r["rank"] for r in per_rank} == {0}  # workers and children count in their rank's row
    assert sum(r["value"] for r in per_rank) == want["count"]
    keys = [r["window_start"] for r in per_rank]
    assert len(keys) == len(set(keys)), "a (rank, window) emitted twice"


@pytest.mark.parametrize("pure", PATHS)
def test_threads_adding_to_one_stat_reconcile_exactly(job, tmp_path, pure):
    rows, want = _collect(job, tmp_path, threads_on_one_stat, pure, 4, 60_000 if not pure else 20_000)
    _reconcile(rows, "shared", want)


@pytest.mark.parametrize("pure", PATHS)
def test_recreated_closed_and_collected_stats_lose_nothing(job, tmp_path, pure):
    rows, want = _collect(job, tmp_path, recreated_stats, pure, 1000)
    _reconcile(rows, "loss", want)


@pytest.mark.parametrize("pure", PATHS)
def test_a_forked_child_never_writes_its_parents_slot(job, tmp_path, pure):
    rows, want = _collect(job, tmp_path, fork_with_bound_add, pure, 50_000)
    _reconcile(rows, "forked", want)
    assert not [r for r in rows if r["name"] == "forked.sum" and r["rank"] is None and r["value"] % 1000 != 0
                and r["value"] > 1e9]


@pytest.mark.parametrize("pure", PATHS)
def test_spawn_forkserver_and_fork_workers_count_in_their_ranks_rows(job, tmp_path, pure):
    rows, want = _collect(job, tmp_path, rank_with_workers, pure, 2000, 3)
    _reconcile(rows, "loader", want)
    assert not [r for r in rows if r["name"].startswith("rank/")]


def test_threads_on_one_in_process_stat_reconcile_exactly():
    events = []
    handle = shmstat.register_event_handler(events.append)
    try:
        stat = shmstat.Stat("local", [A.COUNT, A.SUM], dt.timedelta(milliseconds=5))
        pool = [threading.Thread(target=lambda i=i: [stat.add(i + 1.0) for _ in range(20_000)]) for i in range(4)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        stat.close()
    finally:
        shmstat.unregister_event_handler(handle)
    assert sum(e.data["local.count"] for e in events) == 80_000
    assert sum(e.data["local.sum"] for e in events) == 20_000 * (1 + 2 + 3 + 4)


class _Floaty:
    def __float__(self) -> float:
        return 2.5


class _Indexy:
    def __index__(self) -> int:
        return 7


SAMPLES = [1, True, 2.5, -0.0, float("inf"), 10**300, 10**400, decimal.Decimal("1.25"), fractions.Fraction(1, 4),
           np.float32(1.5), np.int64(3), np.float64(-2.0), _Floaty(), _Indexy(), 1 + 2j, "1.5", None, b"1", [1.0]]


@pytest.mark.parametrize("mode", ["c", "pure-python", "in-process"])
def test_sample_types_follow_one_rule_on_every_path_and_a_refused_sample_changes_nothing(job, monkeypatch, mode):
    if mode != "in-process":
        monkeypatch.setenv("SHMSTAT_PURE_PYTHON", "1" if mode == "pure-python" else "0")
        shmstat.init(job, rank=0, publish=False)
    stat = shmstat.Stat("typed", [A.COUNT, A.SUM], 3600.0)
    if mode != "in-process":
        assert (stat._core.binding._c is None) == (mode == "pure-python")
    count, total = 0, 0.0
    for v in SAMPLES:
        try:
            expected = coerce_value(v)
        except (TypeError, OverflowError) as exc:
            with pytest.raises(type(exc)):
                stat.add(v)
        else:
            stat.add(v)
            count += 1
            total += expected
        assert stat.count == count, f"after {v!r}"
    stat.add(1.0)  # the window is not broken by the refused ones
    assert stat.count == count + 1
    if mode != "in-process":
        seg = stat._core.binding.att.segment
        bank = [seg.read_bank(0, stat._core.index, b) for b in range(seg.geometry.banks)]
        (open_bank,) = [b for b in bank if b.count]
        assert not open_bank.torn and open_bank.count == count + 1 and open_bank.sum == total + 1.0


def test_coerce_value_refuses_what_c_refuses():
    assert coerce_value(True) == 1.0 and coerce_value(decimal.Decimal("0.5")) == 0.5
    for bad in (1 + 2j, "1.5", None, b"1", [1.0], object()):
        with pytest.raises(TypeError):
            coerce_value(bad)
    with pytest.raises(OverflowError):
        coerce_value(10**400)
