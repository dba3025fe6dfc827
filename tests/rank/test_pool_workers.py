"""A worker is a writer of its rank whatever the order: a rank that starts a process pool (``multiprocessing.Pool``,
``ProcessPoolExecutor``; fork, spawn, forkserver) before its own first Stat, as a DataLoader does at its first
batch, keeps its own entry, and its workers, attached first, write for it. Real rank processes (function ranks,
their variables set in Python after their start; script ranks, their variables given at exec as torchrun does),
real pools, a real collector: every sample, event and put metric counted exactly, per rank and merged, and no
process says it cannot attach."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from kit import pool_workers
from kit.pool_workers import ending_workers, pool_rank, rank_with_subprocess_worker
from kit.procs import REPO

RANKS = 2


def _check(sj, out_dir: str, outputs: list[str]) -> None:
    tallies = {}
    for rank in range(RANKS):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            tallies[rank] = json.load(f)
    work = sum(t["work"] for t in tallies.values())
    own = sum(t["own"] for t in tallies.values())
    sj.wait_for_rows("pool/work", "count", total=work, timeout=30)
    sj.wait_for_rows("pool/own", "count", total=own, timeout=30)
    assert sj.per_rank("pool/work") == {r: t["work"] for r, t in tallies.items()}
    assert sj.per_rank("pool/work", "sum") == {r: t["work_sum"] for r, t in tallies.items()}
    assert sj.merged("pool/work") == work
    assert sj.per_rank("pool/own") == {r: t["own"] for r, t in tallies.items()}
    assert sj.merged("pool/own") == own
    tasks = sj.wait_for_event("pool.task", count=RANKS * pool_workers.TASKS, timeout=30)
    assert sorted((e.rank, e.data["task"]) for e in tasks) == [
        (r, i) for r in range(RANKS) for i in range(pool_workers.TASKS)]
    assert {e.pid for e in tasks} == {w[0] for t in tallies.values() for w in t["workers"]}
    ranks = sj.wait_for_event("pool.rank", count=RANKS, timeout=30)
    assert sorted((e.rank, e.pid) for e in ranks) == [(r, tallies[r]["pid"]) for r in range(RANKS)]
    metrics = sj.wait_for_metric("pool.metric", count=RANKS * pool_workers.TASKS, group="pool", timeout=30)
    assert sorted((m.rank, m.value) for m in metrics) == [(r, i) for r in range(RANKS)
                                                          for i in range(pool_workers.TASKS)]
    assert sorted(m.rank for m in sj.wait_for_metric("pool.rank_metric", group="pool")) == list(range(RANKS))
    for output in outputs:
        assert "cannot attach" not in output and "LOCAL_RANK" not in output, output
    for rank, t in tallies.items():  # the rank holds its own entry; each worker an entry of its own, for the rank
        assert t["entry"] == [rank, rank]
        assert all(entry not in (rank, -1) and owner == rank for _pid, entry, owner in t["workers"]), t["workers"]


@pytest.mark.parametrize("method,kind", [("fork", "pool"), ("spawn", "executor"), ("forkserver", "pool")])
def test_a_pool_started_before_the_ranks_first_stat_writes_for_the_rank(shmstat_job_factory, tmp_path, method,
                                                                        kind):
    sj = shmstat_job_factory(collector_args=["--banks", "16"])
    results = sj.run_ranks(pool_rank, RANKS, args=(method, kind, str(tmp_path)), timeout=180)
    _check(sj, str(tmp_path), [r.output for r in results])


@pytest.mark.parametrize("method,kind", [("fork", "executor"), ("spawn", "pool"), ("forkserver", "executor")])
def test_a_script_rank_given_its_variables_at_exec_keeps_its_entry_from_its_pool(shmstat_job_factory, tmp_path,
                                                                                method, kind):
    sj = shmstat_job_factory(collector_args=["--banks", "16"])
    results = sj.run_ranks([sys.executable, pool_workers.__file__, method, kind, str(tmp_path)], RANKS, timeout=180)
    _check(sj, str(tmp_path), [r.output for r in results])


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (torchrun)")
@pytest.mark.parametrize("method,kind", [("fork", "pool"), ("spawn", "executor")])
def test_torchrun_ranks_keep_their_entries_from_their_pools(shmstat_job_factory, tmp_path, method, kind):
    # a torchrun rank's parent is the agent, which is no rank: the rank owns its entry, its workers write for it
    sj = shmstat_job_factory(collector_args=["--banks", "16"])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(RANKS), pool_workers.__file__, method, kind, str(tmp_path)], env=sj.env, cwd=REPO,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(sj, str(tmp_path), [r.stdout + r.stderr])


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_of_a_rank_that_never_attaches_deliver_every_event(shmstat_job_factory, method):
    sj = shmstat_job_factory()
    for round_ in range(1, 3):  # the second round's workers find the first round's writer entries exited
        sj.run_ranks(ending_workers, RANKS, args=(method, 4, 200), timeout=120)
        got = sj.wait_for_event("pool.last", count=round_ * RANKS * 4 * 200, timeout=30)
        assert len(got) == round_ * RANKS * 4 * 200
    assert sorted({(e.rank, e.data["task"]) for e in got}) == [(r, w) for r in range(RANKS) for w in range(4)]


def test_a_rank_whose_entry_a_process_it_started_took_first_still_counts_everything(shmstat_job_factory):
    # a plain subprocess inheriting the rank's variables cannot be told from a rank: it takes the rank's entry; the
    # rank then writes from a writer entry and says why, not "give each process its own LOCAL_RANK"
    sj = shmstat_job_factory()
    results = sj.run_ranks(rank_with_subprocess_worker, RANKS, args=(300,), timeout=120)
    sj.wait_for_rows("sub/work", "count", total=RANKS * 300, timeout=30)
    sj.wait_for_rows("sub/own", "count", total=RANKS * 300, timeout=30)
    assert sj.per_rank("sub/work") == sj.per_rank("sub/own") == {r: 300 for r in range(RANKS)}
    for r in results:
        assert "LOCAL_RANK" not in r.output and "cannot attach" not in r.output, r.output
        assert r.output.count("attached before it") == 1, r.output
