"""Windows under the ring's shortest (``min_window_ms(K)``: 50 ms with 4 banks) in a job: torch.monitor takes any
window from 1 ms, so a rank takes them too, never raises, and its samples are exact or counted. The ring cannot
hold a 1 ms window for a collector that reads it after its grace, so the writer never overwrites a window the
collector has not emitted: a sample that finds its bank still holding one is dropped and counted in its rank's
``dropped`` (``collector.samples_dropped``). Real ranks (``tests/kit/programs/short_windows.py``: Stats of 10 ms
and 1 ms) under ``shmstat run`` and under real torchrun with a node collector at its defaults."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from kit.procs import REPO, read_jsonl
from kit.support import run_with_private_dev_shm, step_and_wait, unique_job
from test_faults import Recorder

from collector.daemon.collector import Collector, CollectorConfig
from shmstat.aggregation import Aggregation as A
from shmstat.shm import layout as L

_PROGRAM = os.path.join(REPO, "tests", "kit", "programs", "short_windows.py")
_STATS = ("w10ms", "w1ms")
_NODE = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/torchrun_short_windows_node.py "$WORK"'


def _tallies(work, ranks: int) -> dict[int, dict]:
    tallies = {}
    for rank in range(ranks):
        with open(os.path.join(work, f"short.r{rank}.json")) as f:
            tallies[rank] = json.load(f)
    return tallies


def _assert_exact_or_counted(rows: list[dict], tallies: dict[int, dict]) -> None:
    """Per rank: the samples its rows hold plus the samples it counted as dropped are what it added, and every
    short stat emitted some windows; the merged rows hold the per-rank samples exactly."""
    rows = [r for r in rows if r["group"] == "short"]
    for rank, tally in tallies.items():
        emitted = {s: sum(r["value"] for r in rows if r["name"] == f"{s}.count" and r["rank"] == rank)
                   for s in _STATS}
        assert all(emitted.values()), (rank, emitted, tally)
        assert sum(emitted.values()) + tally["dropped"] == sum(tally["added"].values()), (rank, emitted, tally)
        for s in _STATS:
            assert emitted[s] <= tally["added"][s]
    for s in _STATS:
        merged = sum(r["value"] for r in rows if r["name"] == f"{s}.count" and r["rank"] is None)
        assert merged == sum(r["value"] for r in rows if r["name"] == f"{s}.count" and r["rank"] is not None)


def test_windows_of_10_ms_and_1_ms_under_shmstat_run_never_raise_and_are_exact_or_counted(tmp_path):
    job = unique_job("short")
    out = str(tmp_path / "m.jsonl")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, SECONDS="1.5")
    r = subprocess.run([sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2",
                        "--monitor-interval", "0.05", "--handler", f"*=jsonl:{out}", "--status-interval", "0",
                        _PROGRAM], env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "ConfigError" not in r.stderr
    _assert_exact_or_counted(read_jsonl(out), _tallies(tmp_path, 2))


def test_windows_of_10_ms_and_1_ms_under_torchrun_with_a_node_collector_are_exact_or_counted(tmp_path):
    pytest.importorskip("torch", reason="real torchrun needs PyTorch (pip install torch==2.13.0)")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO, SECONDS="1.5")
    done = run_with_private_dev_shm(_NODE, env, REPO, 300)
    assert done.returncode == 0, (done.stdout, done.stderr)
    with open(work / "result.json") as f:
        result = json.load(f)
    log = (work / "torchrun.log").read_text()
    assert result["code"] == 0 and result["collector"] == 0, log
    assert "ConfigError" not in log
    _assert_exact_or_counted(read_jsonl(str(work / "m.jsonl")), _tallies(work, 2))


def test_a_short_window_never_overwrites_one_the_collector_has_not_emitted_and_counts_what_it_drops(job, backend):
    """Clock injected, 4 banks, a 10 ms window: the rank fills the ring (windows 0-3) before any collector reads;
    window 4's samples find bank 0 still holding window 0, unemitted: they are dropped and counted, window 0 is
    kept. Once the collector emitted windows 0-3, window 4's later samples are written. Every sample is emitted
    or counted, and each window once."""
    import shmstat

    wns = 10 * 1_000_000
    base = (1_700_000_000_000_000_000 // wns) * wns
    now = [base]
    att = shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False, banks=4)
    assert att is not None
    stat = shmstat.Stat("fast", [A.COUNT], wns / 1e9, group="short", clock=lambda: now[0])

    def add(window: int, n: int) -> None:
        now[0] = base + window * wns + wns // 2
        for _ in range(n):
            stat.add(1.0)

    def dropped() -> int:
        return att.segment.rank(0).dropped

    for w in range(4):
        add(w, 2)
    add(4, 3)
    assert dropped() == 3
    bank0 = att.segment.geometry.slot_offset(0, 0) // 8
    assert att.segment.i64[bank0 + L.B_WID] == base // wns  # window 0 is still there, whole
    rec = Recorder()
    coll = Collector(CollectorConfig(job=job, handlers={"*": "null"}, grace_ms=1, status_interval_s=0,
                                     clock=lambda: now[0]), handler_objects={"short": rec}, out=io.StringIO())
    step_and_wait(coll)
    try:
        coll.step()  # in window 4: windows 0-3 emitted, their watermark committed
        add(4, 5)  # bank 0 is free now: the rest of window 4 is kept
        add(5, 1)
        add(7, 4)  # window 6 left empty; window 7 takes bank 3 (window 3, emitted)
        assert dropped() == 3
        now[0] += 20 * wns
        coll.step()
        counts = {w: row["count"] for (rank, w), row in rec.windows("fast", 10).items() if rank == 0}
    finally:
        coll.close()
    first = base // wns
    assert counts == {first: 2, first + 1: 2, first + 2: 2, first + 3: 2, first + 4: 5, first + 5: 1,
                      first + 7: 4}
    assert sum(counts.values()) + dropped() == 4 * 2 + 3 + 5 + 1 + 4
    assert coll.passes.overwritten == 0
