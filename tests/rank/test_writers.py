"""Every sample ``add`` accepts is counted exactly once, whatever the process and thread shape of the rank:
threads sharing a Stat, re-created and closed Stats, bound adds kept after the Stat is gone, forked children,
and spawn/forkserver/fork workers that inherit the rank's environment. Real rank processes, a real collector,
real shared memory; C and pure-Python paths. A worker's samples count in its rank's row."""

from __future__ import annotations

import datetime as dt
import decimal
import fractions
import json
import mmap
import sys
import threading

import numpy as np
import pytest
from kit.support import MS, FakeClock, wait_for
from kit.writers import (
    as_rank,
    creators_racing_on_one_stat,
    fork_with_bound_add,
    rank_with_workers,
    recreated_stats,
    threads_on_one_stat,
)

import shmstat
from shmstat import Aggregation as A
from shmstat.writer._pywriter import PySlotWriter, coerce_value


def _collect(make_job, tmp_path, stat: str, target, *args):
    """Run ``target`` as rank 0 of a job of the testing plugin (shmstat.testing); its rows once its tally's
    count is all emitted, and the tally."""
    # a ring of 16 windows: these ranks keep both cores busy, and a starved collector must not lose windows
    sj = make_job(collector_args=["--banks", "16"])
    tally = str(tmp_path / "tally.json")
    sj.run_ranks(as_rank, 1, args=(target, sj.job, *args, tally), timeout=180)
    with open(tally) as f:
        want = json.load(f)
    sj.wait_for_rows(stat, "count", total=want["count"], timeout=30)
    return sj, want


def _reconcile(sj, stat: str, want: dict) -> None:
    assert sj.merged(stat, "count") == want["count"]
    assert sj.merged(stat, "sum") == pytest.approx(want["sum"], rel=1e-12)
    per_rank = [r for r in sj.rows(stat, "count") if r.rank is not None]
    assert {r.rank for r in per_rank} == {0}  # workers and children count in their rank's row
    assert sum(r.value for r in per_rank) == want["count"]
    keys = [(r.group, r.window_start) for r in per_rank]  # a test's rounds may share a window, each its group
    assert len(keys) == len(set(keys)), "a (rank, window) emitted twice"


def test_threads_adding_to_one_stat_reconcile_exactly(shmstat_job_factory, tmp_path, backend):
    pure = backend == "python"
    sj, want = _collect(shmstat_job_factory, tmp_path, "shared", threads_on_one_stat, pure, 4,
                        60_000 if not pure else 20_000)
    _reconcile(sj, "shared", want)


def test_recreated_closed_and_collected_stats_lose_nothing(shmstat_job_factory, tmp_path, backend):
    pure = backend == "python"
    sj, want = _collect(shmstat_job_factory, tmp_path, "loss", recreated_stats, pure, 1000)
    _reconcile(sj, "loss", want)


def test_a_forked_child_never_writes_its_parents_slot(shmstat_job_factory, tmp_path, backend):
    pure = backend == "python"
    sj, want = _collect(shmstat_job_factory, tmp_path, "forked", fork_with_bound_add, pure, 50_000)
    _reconcile(sj, "forked", want)
    assert not [r for r in sj.rows("forked", "sum", rank=None) if r.value % 1000 != 0 and r.value > 1e9]


def test_spawn_forkserver_and_fork_workers_count_in_their_ranks_rows(shmstat_job_factory, tmp_path, backend):
    pure = backend == "python"
    sj, want = _collect(shmstat_job_factory, tmp_path, "loader", rank_with_workers, pure, 2000, 3)
    _reconcile(sj, "loader", want)
    assert not [r for r in sj.rows() if r.stat.startswith("rank/")]


def test_threads_forks_and_workers_creating_one_stat_at_once_reconcile_exactly(shmstat_job_factory, tmp_path,
                                                                               backend):
    pure = backend == "python"
    sj, want = _collect(shmstat_job_factory, tmp_path, "raced", creators_racing_on_one_stat, pure, 6, 2000, 2)
    _reconcile(sj, "raced", want)


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


def _waiting_in(thread: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_an_add_that_finds_another_threads_add_in_progress_waits_its_turn():
    """PySlotWriter: thread b's add, finding thread a's add in progress (held inside an injected clock, where a
    thread switch is certain), waits for its turn and then adds; both samples count, b's after a's."""
    fake, inside, release = FakeClock(), threading.Event(), threading.Event()

    def clock() -> int:
        if threading.current_thread() is a and not inside.is_set():
            inside.set()
            assert release.wait(30)
        return fake()

    w = PySlotWriter(mmap.mmap(-1, 4096), 1024, 3, 100 * MS, 7, 2**63 - 1, True, 8, 16, 24, None, clock)
    a = threading.Thread(target=w.add, args=(1.0,))
    b = threading.Thread(target=w.add, args=(2.0,))
    a.start()
    assert inside.wait(30)
    b.start()
    wait_for(lambda: _waiting_in(b, "_wait_turn"), 30, what="b waiting for its turn")
    assert w.state() == (0.0, 0.0, 0.0, 0.0, 0.0)  # a is still before its write, b is not past the turn
    release.set()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    assert w.state() == (4.0, 3.0, 1.0, 2.0, 2.0)  # (seq, sum, min, max, last): two samples, 2.0 the last


class _Floaty:
    def __float__(self) -> float:
        return 2.5


class _Indexy:
    def __index__(self) -> int:
        return 7


SAMPLES = [1, True, 2.5, -0.0, float("inf"), 10**300, 10**400, decimal.Decimal("1.25"), fractions.Fraction(1, 4),
           np.float32(1.5), np.int64(3), np.float64(-2.0), _Floaty(), _Indexy(), 1 + 2j, "1.5", None, b"1", [1.0]]


@pytest.mark.parametrize("mode", ["attached", "in-process"])
def test_sample_types_follow_one_rule_on_every_path_and_a_refused_sample_changes_nothing(job, backend, mode):
    if mode != "in-process":
        shmstat.init(job, rank=0, publish=False)
    stat = shmstat.Stat("typed", [A.COUNT, A.SUM], 3600.0)
    if mode != "in-process":
        assert isinstance(stat._core.binding._writer, PySlotWriter) == (backend == "python")
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
