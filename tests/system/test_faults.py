"""Faults the design must survive, with real processes, shared memory and sockets: a rank SIGKILLed in the middle
of an ``add`` (torn bank), a rank SIGSTOPped across several windows, the collector SIGKILLed and restarted, a
subscriber that stops reading, a rank restarted under the same rank number, a segment that cannot be created.

A ``time.sleep`` here is only ever the fault itself (an outage, a stall); everything else polls with a deadline.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict

import pytest
from kit.faults import (
    RssSampler,
    Subscriber,
    counts_from,
    idle_adder,
    late_writer,
    load_worker,
    overwritten_total,
    percentile_adder,
    read_json,
    rows_by_rank_window,
    sigkill_victim,
)
from kit.procs import REPO, collector_env, read_jsonl, spawn, start_collector
from kit.support import step_and_wait, wait_for, wait_growing
from prometheus_client.parser import text_string_to_metric_families

from collector.daemon.collector import Collector, CollectorConfig
from elastic.metrics import MetricHandler
from shmstat.aggregation import Aggregation as A
from shmstat.aggregation import to_mask
from shmstat.errors import LayoutMismatchError, SegmentError
from shmstat.job.rank import RankAttachment
from shmstat.shm import layout as L
from shmstat.shm.runtime import segment_name
from shmstat.shm.segment import Segment

MS = 1_000_000
WINDOW_MS = 50
# The tests that count every window of a live rank exactly keep 32 banks (a 1.6 s ring of 50 ms windows): with the
# default 4 (200 ms) a collector starved that long on a loaded 2-core CI machine lost a window to overwrite (counted
# as overwritten, which is the designed outcome, not what these tests are about).
LONG_RING = ("--banks", "32")


class Recorder(MetricHandler):
    """Keeps every metric the collector hands it."""

    def __init__(self) -> None:
        self.rows: list = []

    def emit(self, metric_data) -> None:
        self.rows.append(metric_data)

    def windows(self, stat: str, window_ms: int) -> dict[tuple[int | None, int], dict]:
        """``{(rank, wid): {"count": .., "sum": .., ..., "torn": bool}}`` from the rows of ``stat``."""
        out: dict[tuple[int | None, int], dict] = defaultdict(dict)
        for md in self.rows:
            if not md.name.startswith(stat + "."):
                continue
            wid = round(md.window_start * 1000 / window_ms)
            row = out[(md.rank, wid)]
            row[md.name[len(stat) + 1 :]] = md.value
            row["torn"] = row.get("torn", False) or md.torn
        return dict(out)


def _in_process_collector(job: str) -> tuple[Collector, Recorder]:
    rec = Recorder()
    coll = Collector(CollectorConfig(job=job, handlers={"*": "null"}, grace_ms=10, status_interval_s=0),
                     handler_objects={"faults": rec}, out=io.StringIO())
    step_and_wait(coll)
    return coll, rec


def _step_until(coll: Collector, predicate, timeout_s: float = 10.0, what: str = ""):
    """Run collector rounds until ``predicate()``; every round must return promptly (a torn bank never hangs)."""
    def one():
        t0 = time.monotonic()
        coll.step(5)
        assert time.monotonic() - t0 < 2.0, "a collector round took over 2 s"
        return predicate()
    return wait_for(one, timeout_s, 0.0, what=what)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _write_bank(seg: Segment, local_rank: int, stat: int, wid: int, *, seq: float, total: float, lo: float,
                hi: float, last: float, inc: int) -> None:
    bank = wid % seg.geometry.banks
    off = seg.geometry.slot_offset(local_rank, stat) + bank * L.BANK_SIZE
    struct.pack_into("<dqddddqQ", seg.buf, off, seq, wid, total, lo, hi, last, wid * WINDOW_MS * MS, inc)


def _torn_setup(job: str, writer_pid: int):
    seg = Segment.open(job, geometry=L.Geometry(4, 4, 8))
    att = RankAttachment.register(seg, rank=3, local_rank=0, pid=writer_pid)
    idx = att.allocate_stat("torn", "faults", WINDOW_MS, 2**63 - 1, to_mask([A.COUNT, A.SUM, A.MIN, A.MAX]))
    now_wid = time.time_ns() // (WINDOW_MS * MS)
    return seg, att, idx, now_wid


# ----------------------------------------------------------------------------------- torn banks (deterministic)


def test_torn_bank_of_a_dead_writer_is_emitted_flagged_and_counted(job):
    seg, att, idx, now_wid = _torn_setup(job, _dead_pid())
    w_clean, w_torn = now_wid - 5, now_wid - 4
    _write_bank(seg, 0, idx, w_clean, seq=8.0, total=4.0, lo=1.0, hi=1.0, last=1.0, inc=att.incarnation)
    # the writer died in its 6th add of w_torn: seq odd (5 complete samples), the sum already holds the 6th
    _write_bank(seg, 0, idx, w_torn, seq=11.0, total=6.0, lo=1.0, hi=1.0, last=1.0, inc=att.incarnation)
    coll, rec = _in_process_collector(job)
    try:
        _step_until(coll, lambda: (3, w_torn) in rec.windows("torn", WINDOW_MS), what="the torn window")
        rows = rec.windows("torn", WINDOW_MS)
        assert rows[(3, w_clean)] == {"count": 4.0, "sum": 4.0, "max": 1.0, "min": 1.0, "torn": False}
        torn = rows[(3, w_torn)]
        assert torn["torn"] and torn["count"] == 5.0 and torn["sum"] in (5.0, 6.0)
        assert torn["min"] == torn["max"] == 1.0
        assert rows[(None, w_torn)]["torn"]  # the merged row says so too
        assert coll.passes.torn == 1
        assert seg.rank(0).state_name == "died"
    finally:
        coll.close()
        seg.close()


def test_torn_bank_caught_in_its_reset_carries_no_stale_numbers(job):
    seg, att, idx, now_wid = _torn_setup(job, _dead_pid())
    w = now_wid - 4
    # a writer that died right after marking the bank for a new window (seq 1.0) and writing wid: the data
    # fields still hold the window that used this bank before (1e9 is nothing this writer ever added)
    _write_bank(seg, 0, idx, w, seq=1.0, total=1e9, lo=-1e9, hi=1e9, last=7.0, inc=att.incarnation)
    other = RankAttachment.register(seg, rank=4, local_rank=1)  # a healthy rank with 5 samples in that window
    j = other.allocate_stat("torn", "faults", WINDOW_MS, 2**63 - 1, to_mask([A.COUNT, A.SUM, A.MIN, A.MAX]))
    _write_bank(seg, 1, j, w, seq=10.0, total=5.0, lo=1.0, hi=1.0, last=1.0, inc=other.incarnation)
    coll, rec = _in_process_collector(job)
    try:
        _step_until(coll, lambda: (None, w) in rec.windows("torn", WINDOW_MS), what="the window")
        rows = rec.windows("torn", WINDOW_MS)
        assert rows[(4, w)] == {"count": 5.0, "sum": 5.0, "max": 1.0, "min": 1.0, "torn": False}
        merged = rows[(None, w)]
        assert merged["torn"] and merged["count"] == 5.0
        assert merged["sum"] in (5.0, 12.0) and merged["min"] == 1.0 and merged["max"] in (1.0, 7.0), merged
    finally:
        coll.close()
        seg.close()


def test_an_empty_torn_window_is_marked_on_metrics_for_the_rules_to_leave_out(job):
    """A writer that died as it reset its bank for a new window leaves that window with no sample (its mean and
    percentiles read 0): the collector does not score it, and ``/metrics`` says so with
    ``shmstat_stat_window_empty`` on the rank's series (which ``shmstat prometheus-rules`` leaves out: rules/torn.yml),
    only while it is the newest window: none on a window with samples."""
    seg, att, idx, now_wid = _torn_setup(job, _dead_pid())
    w = now_wid - 4
    _write_bank(seg, 0, idx, w, seq=1.0, total=1e9, lo=-1e9, hi=1e9, last=7.0, inc=att.incarnation)
    other = RankAttachment.register(seg, rank=4, local_rank=1)
    j = other.allocate_stat("torn", "faults", WINDOW_MS, 2**63 - 1, to_mask([A.COUNT, A.SUM, A.MIN, A.MAX]))
    _write_bank(seg, 1, j, w, seq=10.0, total=5.0, lo=1.0, hi=1.0, last=1.0, inc=other.incarnation)
    rec = Recorder()
    coll = Collector(CollectorConfig(job=job, handlers={"*": "null"}, grace_ms=10, status_interval_s=0,
                                     prometheus="127.0.0.1:0"), handler_objects={"faults": rec}, out=io.StringIO())
    step_and_wait(coll)
    try:
        _step_until(coll, lambda: (None, w) in rec.windows("torn", WINDOW_MS), what="the window")
        assert coll.exporter is not None
        with urllib.request.urlopen(coll.exporter.url, timeout=10) as resp:
            text = resp.read().decode()
        empty = [s.labels.get("rank") for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "shmstat_stat_window_empty" and s.labels["stat"] == "torn"]
        assert empty == ["3"], text
    finally:
        coll.close()
        seg.close()


def test_torn_bank_of_a_stopped_live_writer_is_held_then_flagged_once_it_dies(job):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        seg, att, idx, now_wid = _torn_setup(job, sleeper.pid)
        w_torn = now_wid - 4
        _write_bank(seg, 0, idx, w_torn, seq=7.0, total=3.0, lo=1.0, hi=1.0, last=1.0, inc=att.incarnation)
        _write_bank(seg, 0, idx, w_torn + 1, seq=4.0, total=2.0, lo=1.0, hi=1.0, last=1.0, inc=att.incarnation)
        coll, rec = _in_process_collector(job)
        try:
            # the writer lives (stopped mid-add): its torn window and the later ones of that slot wait; rounds go on
            for _ in range(20):
                _step_until(coll, lambda: True)
            assert rec.windows("torn", WINDOW_MS) == {}
            assert seg.rank(0).state_name == "active"
            sleeper.kill()
            sleeper.wait()
            _step_until(coll, lambda: (3, w_torn + 1) in rec.windows("torn", WINDOW_MS), what="windows after death")
            rows = rec.windows("torn", WINDOW_MS)
            assert rows[(3, w_torn)]["torn"] and rows[(3, w_torn)]["count"] == 3.0
            assert rows[(3, w_torn + 1)] == {"count": 2.0, "sum": 2.0, "max": 1.0, "min": 1.0, "torn": False}
            assert coll.passes.torn == 1
        finally:
            coll.close()
            seg.close()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_stalled_writer_holds_back_the_merged_window_so_it_is_emitted_once_and_whole(job):
    wms = 500  # long windows: the test's rounds stay well inside the K-2 windows a stall is waited for
    aggs = to_mask([A.COUNT, A.SUM, A.MIN, A.MAX])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    seg = Segment.open(job, geometry=L.Geometry(4, 4, 8))
    try:
        stalled = RankAttachment.register(seg, rank=3, local_rank=0, pid=sleeper.pid)
        healthy = RankAttachment.register(seg, rank=4, local_rank=1)
        w = time.time_ns() // (wms * MS) - 1
        for att, seq, total in ((stalled, 7.0, 3.0), (healthy, 10.0, 5.0)):  # stalled mid-add: 3 complete samples
            i = att.allocate_stat("torn", "faults", wms, 2**63 - 1, aggs)
            off = seg.geometry.slot_offset(att.local_rank, i) + (w % seg.geometry.banks) * L.BANK_SIZE
            struct.pack_into("<dqddddqQ", seg.buf, off, seq, w, total, 1.0, 1.0, 1.0, w * wms * MS, att.incarnation)
        coll, rec = _in_process_collector(job)
        try:
            wait_for(lambda: time.time_ns() >= (w + 1) * wms * MS + 20 * MS, 5, what="the window's end")
            for _ in range(3):
                _step_until(coll, lambda: True)
            assert rec.windows("torn", wms) == {}  # the healthy rank's window waits with the stalled one
            sleeper.kill()
            sleeper.wait()
            _step_until(coll, lambda: (None, w) in rec.windows("torn", wms), what="the merged window")
            merged = [md.value for md in rec.rows if md.name == "torn.count" and md.rank is None]
            assert merged == [8.0]  # once, both ranks
            assert rec.windows("torn", wms)[(None, w)]["torn"]
        finally:
            coll.close()
    finally:
        seg.close()
        sleeper.kill()
        sleeper.wait()


# ----------------------------------------------------------------------------------- SIGKILL while adding


def _victim_rows_are_consistent(rows: list[dict], ranks: set[int]) -> int:
    """Every emitted window of the SIGKILLed ranks holds numbers an adder of 1.0 can produce; returns how many
    were flagged torn."""
    by: dict[tuple[int | None, float], dict] = defaultdict(dict)
    for r in rows:
        if r["group"] != "faults" or not r["name"].startswith("steps."):
            continue
        row = by[(r["rank"], r["window_start"])]
        agg = r["name"].split(".", 1)[1]
        assert agg not in row, f"window emitted twice: {r}"
        row[agg] = r["value"]
        row["torn"] = row.get("torn", False) or bool(r.get("torn"))
    torn = 0
    for (rank, _start), row in by.items():
        if rank not in ranks:
            continue
        count, total = row["count"], row["sum"]
        if row["torn"]:
            torn += 1
            assert total in (count, count + 1), row  # at most the one sample being written is uncertain
        else:
            assert total == count, row
        if count:
            assert row["min"] == row["max"] == 1.0, row
    return torn


def _sigkill_rounds(job: str, tmp_path, rounds: int) -> None:
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0",
                         *LONG_RING)
    stop = str(tmp_path / "stop")
    survivor = spawn(idle_adder, job, 0, WINDOW_MS, str(tmp_path / "r0.json"), stop)
    rng = random.Random(os.getpid())
    try:
        for i in range(rounds):
            victims = []
            for rank in (1, 2):
                ready = str(tmp_path / f"ready-{i}-{rank}")
                victims.append((spawn(sigkill_victim, job, rank, WINDOW_MS, ready, rank == 2), ready))
            for _p, ready in victims:
                wait_for(lambda ready=ready: os.path.exists(ready), 30, what="victim adding")
            time.sleep(rng.uniform(0.0, 0.05))  # the fault: the kill lands at a random point of the add loop
            for p, _ in victims:
                os.kill(p.pid, signal.SIGKILL)
            for p, _ in victims:
                p.join(10)
                assert p.exitcode == -signal.SIGKILL
        open(stop, "w").close()
        survivor.join(60)
        assert survivor.exitcode == 0
        assert coll.proc.poll() is None  # the collector never stopped
        seg = Segment.open(job, create=False)  # read before the collector stops: it removes the segment then
        try:
            wait_for(lambda: seg.rank(1).state_name == "died" and seg.rank(2).state_name == "died", 10,
                     what="both victims marked died")
            assert seg.rank(1).incarnation == rounds
        finally:
            seg.close()
    finally:
        open(stop, "w").close()
        assert coll.stop() == 0
    rows = read_jsonl(out)
    torn = _victim_rows_are_consistent(rows, {1, 2})
    _merged, per_rank, repeats = rows_by_rank_window(rows, "steps", WINDOW_MS)
    assert repeats == 0
    for wid, n in counts_from(read_json(str(tmp_path / "r0.json"))).items():
        assert per_rank.get((0, wid)) == n
    assert any(rank in (1, 2) for rank, _ in per_rank)
    assert not os.path.exists("/dev/shm" + segment_name(job)), "no process of the job lives: removed on exit"
    print(f"\nsigkill: {2 * rounds} kills mid-add, {torn} windows flagged torn")


def test_rank_sigkilled_while_adding_never_hangs_or_corrupts(job, tmp_path):
    _sigkill_rounds(job, tmp_path, 2)


@pytest.mark.slow
def test_rank_sigkilled_while_adding_many_times(job, tmp_path):
    _sigkill_rounds(job, tmp_path, 15)


# ----------------------------------------------------------------------------------- SIGSTOP / SIGCONT


def test_rank_sigstopped_across_several_windows_loses_nothing(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0",
                         *LONG_RING)
    stop = str(tmp_path / "stop")
    victim = spawn(idle_adder, job, 0, WINDOW_MS, str(tmp_path / "r0.json"), stop)
    other = spawn(idle_adder, job, 1, WINDOW_MS, str(tmp_path / "r1.json"), stop)
    wns = WINDOW_MS * MS

    def emitted_after(rank: int, t_ns: int) -> int:
        _m, per_rank, _ = rows_by_rank_window(read_jsonl(out), "steps", WINDOW_MS)
        return sum(1 for (r, wid) in per_rank if r == rank and wid * wns >= t_ns)

    try:
        wait_for(lambda: emitted_after(0, 0) >= 2, 30, 0.02, what="victim's first windows")
        for _ in range(3):
            stopped_at = time.time_ns()
            os.kill(victim.pid, signal.SIGSTOP)
            # the stall: the other rank's windows keep being emitted for 5 more windows meanwhile
            wait_for(lambda t=stopped_at: emitted_after(1, t + wns) >= 5, 30, 0.02, what="other rank's windows")
            resumed_at = time.time_ns()
            os.kill(victim.pid, signal.SIGCONT)
            wait_for(lambda t=resumed_at: emitted_after(0, t + wns) >= 1, 30, 0.02, what="windows after SIGCONT")
        open(stop, "w").close()
        for p in (victim, other):
            p.join(60)
            assert p.exitcode == 0
    finally:
        if victim.exitcode is None:
            os.kill(victim.pid, signal.SIGCONT)
        open(stop, "w").close()
        assert coll.stop() == 0
    rows = read_jsonl(out)
    merged, per_rank, _ = rows_by_rank_window(rows, "steps", WINDOW_MS)
    # every rank's row once; a merged row may come twice, and only as documented: a SIGSTOP that landed inside an
    # add, held for more than K-2 windows (the other rank's windows are awaited above), lets the others' merged row
    # out and the stopped rank's part follows in a second one (the sums below hold either way)
    _, _, rank_repeats = rows_by_rank_window([r for r in rows if r["rank"] is not None], "steps", WINDOW_MS)
    assert rank_repeats == 0
    want: dict[int, int] = defaultdict(int)
    for rank in (0, 1):
        counts = counts_from(read_json(str(tmp_path / f"r{rank}.json")))
        for wid, n in counts.items():
            assert per_rank.get((rank, wid)) == n, (rank, wid)
            want[wid] += n
        assert sum(v for (r, _), v in per_rank.items() if r == rank) == sum(counts.values())
    assert merged == dict(want)


def test_rank_stalled_between_clock_and_write_loses_nothing(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0")
    stop, trigger = str(tmp_path / "stop"), str(tmp_path / "trigger")
    p = spawn(late_writer, job, 0, WINDOW_MS, str(tmp_path / "r0.json"), stop, trigger, 5 * WINDOW_MS / 1000)
    try:
        wait_for(lambda: len(read_jsonl(out)) > 0, 30, 0.02, what="first windows")
        open(trigger, "w").close()
        time.sleep(8 * WINDOW_MS / 1000)  # the stall happens in the rank; let it end
        open(stop, "w").close()
        p.join(60)
        assert p.exitcode == 0
    finally:
        open(stop, "w").close()
        assert coll.stop() == 0
    _m, per_rank, _ = rows_by_rank_window(read_jsonl(out), "steps", WINDOW_MS)
    counts = counts_from(read_json(str(tmp_path / "r0.json")))
    assert sum(per_rank.values()) == sum(counts.values())


# ----------------------------------------------------------------------------------- collector SIGKILL / restart


def _metric_values(rows: list[dict]) -> dict[int, list[int]]:
    """``{rank: [n, ...]}`` of the ``faults/seq`` metrics ranks put (one per add, n = 1, 2, ...)."""
    out: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        if r["group"] == "faults" and r["name"] == "seq" and r["window_start"] is None:
            out[r["rank"]].append(int(r["value"]))
    return out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_collector_killed_and_restarted(job, tmp_path, sig):
    """Windows: none lost, none repeated (both collectors write one jsonl file: a window the first wrote but had
    not committed when killed is skipped by the second). Metrics published during the outage reach the restarted
    collector. After SIGTERM nothing at all is lost; after SIGKILL only metrics the dead collector had in hand
    (received, not yet written) are lost, all in one run just before the kill."""
    out = str(tmp_path / "m.jsonl")
    # the largest ring (64 windows, 2.6 s): an outage longer than that (possible on a loaded machine) loses the
    # oldest windows, and those must be counted as overwritten by the restarted collector
    args = ("--grace-ms", "10", "--banks", "64", "--max-ranks", "8", "--max-stats", "8", "--status-interval", "0")
    own = str(tmp_path / "collector.jsonl")  # the collector's own group, asked for by name
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--handler", f"shmstat=jsonl:{own}", *args)
    stop = str(tmp_path / "stop")
    ranks = [spawn(idle_adder, job, r, WINDOW_MS, str(tmp_path / f"r{r}.json"), stop, None, False, True)
             for r in range(2)]

    def second_rows() -> list[dict]:  # what the restarted collector wrote: the file past the first one's lines
        with open(out, "rb") as f:
            f.seek(first_bytes)
            data = f.read()
        return [json.loads(line) for line in data.split(b"\n")[:-1]]

    try:
        wait_for(lambda: all(len(v) > 20 for v in _metric_values(read_jsonl(out)).values())
                 and len(_metric_values(read_jsonl(out))) == 2, 30, 0.02, what="metrics at the first collector")
        coll.stop(sig)
        with open(out, "rb") as f:
            first_bytes = f.read().rfind(b"\n") + 1  # its whole lines (the next collector removes a cut one)
        time.sleep(0.3)  # the outage: ~7 windows with no collector; the ranks keep adding and putting metrics
        own_first = len(read_jsonl(own))
        coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--handler", f"shmstat=jsonl:{own}", *args)
        wait_for(lambda: all(len(v) > 20 for v in _metric_values(second_rows()).values())
                 and len(_metric_values(second_rows())) == 2, 30, 0.02, what="metrics at the restarted collector")
        open(stop, "w").close()
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
    finally:
        open(stop, "w").close()
        assert coll.stop() == 0
    rows2, every = second_rows(), read_jsonl(out)
    rows1 = every[: len(every) - len(rows2)]
    # windows
    merged, per_rank, repeats = rows_by_rank_window(rows1 + rows2, "steps", WINDOW_MS)
    assert repeats == 0
    want: dict[int, int] = defaultdict(int)
    reports = {r: read_json(str(tmp_path / f"r{r}.json")) for r in range(2)}
    missing = []
    for rank, rep in reports.items():
        for wid, n in counts_from(rep).items():
            if (rank, wid) not in per_rank:
                missing.append((rank, wid))
                continue
            assert per_rank[(rank, wid)] == n, (rank, wid)
            want[wid] += n
    overwritten = max([r["value"] for r in read_jsonl(own)[own_first:] if r["name"] == "collector.windows_overwritten"],
                      default=0)
    assert len(missing) <= overwritten, f"windows lost without being counted: {missing}"
    if not missing:
        assert merged == dict(want)
    # metrics
    first, second = _metric_values(rows1), _metric_values(rows2)
    for rank, rep in reports.items():
        assert rep["pub"]["dropped"] == 0 and rep["pub"]["backlog"] == 0
        a, b = first[rank], second[rank]
        assert len(a) == len(set(a)) and len(b) == len(set(b)) and not set(a) & set(b)
        assert sorted(a) == list(range(1, len(a) + 1))  # the first collector got a prefix
        assert sorted(b) == list(range(min(b), rep["adds"] + 1))  # the restarted one everything from some point on
        lost = min(b) - 1 - len(a)
        if sig == signal.SIGTERM:
            assert lost == 0
        else:
            assert 0 <= lost < 1000, lost


KILLS_WINDOW_MS = 200  # 64 banks: a 12.8 s ring, longer than a collector's start-up on a loaded machine
KILLS_STATS = 6


def _ranges(wids: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of window ids, as (first, last)."""
    out: list[tuple[int, int]] = []
    for w in sorted(wids):
        if out and w == out[-1][1] + 1:
            out[-1] = (out[-1][0], w)
        else:
            out.append((w, w))
    return out


def test_collector_sigkilled_at_random_moments_emits_every_window_once(job, tmp_path):
    """Collectors SIGKILLed again and again at random moments (during start-up, mid-pass, during the shutdown that
    follows a SIGTERM), some restarted at once and some after an outage, while two ranks add to Stats keeping
    percentiles: every window of every rank and Stat is in the one jsonl file exactly once with the count the rank
    added, from the job's first window to its last, or is counted (``windows_overwritten``)."""
    out, stop = str(tmp_path / "m.jsonl"), str(tmp_path / "stop")
    args = ["--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--banks", "64", "--max-ranks", "4", "--max-stats",
            "16", "--status-interval", "0"]
    rng = random.Random(os.environ.get("SHMSTAT_TEST_SEED", os.getpid()))
    # The segment exists before the ranks (with this geometry); its first collector dies before any pass.
    first = start_collector(job, *args)
    ranks = [spawn(percentile_adder, job, r, KILLS_WINDOW_MS, KILLS_STATS, str(tmp_path / f"r{r}.json"), stop)
             for r in range(2)]
    first.stop(signal.SIGKILL)
    moments: list[str] = []
    try:
        for _ in range(12):
            moment = rng.choice(("start-up", "mid-pass", "mid-pass", "shutdown"))
            moments.append(moment)
            if moment == "start-up":  # killed before it serves: started without waiting for it
                proc = subprocess.Popen([sys.executable, "-m", "collector", "collect", "--job", job, *args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=collector_env(),
                                        cwd=REPO)
                time.sleep(rng.uniform(0.0, 0.6))  # python's start, the segment's open, the first pass
                proc.kill()
                proc.wait(20)
            else:
                coll = start_collector(job, *args)
                time.sleep(rng.uniform(0.0, 0.4))
                if moment == "shutdown":
                    coll.proc.send_signal(signal.SIGTERM)
                    time.sleep(rng.uniform(0.0, 0.03))
                coll.stop(signal.SIGKILL)
            time.sleep(rng.choice((0.0, 0.0, rng.uniform(0.05, 0.3))))  # an outage: windows close meanwhile
        coll = start_collector(job, *args)
        open(stop, "w").close()
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        assert coll.stop() == 0
    finally:
        open(stop, "w").close()
        for p in ranks:
            if p.is_alive():
                p.kill()
    rows = read_jsonl(out)
    overwritten = overwritten_total(rows)
    seen: dict[tuple[str, int, int], float] = {}
    repeats = []
    for r in rows:
        if r["group"] == "kills" and r["name"].endswith(".count") and r["rank"] is not None:
            key = (r["name"][: -len(".count")], r["rank"], round(r["window_start"] * 1000 / KILLS_WINDOW_MS))
            if key in seen:
                repeats.append(key)
            seen[key] = r["value"]
    assert not repeats, f"windows emitted twice: {repeats[:5]}"
    missing, wrong = [], []
    first_windows = {}
    for rank in range(2):
        first_windows[rank] = min(int(w) for c in read_json(str(tmp_path / f"r{rank}.json"))["counts"].values()
                                  for w in c)
        for name, per_window in read_json(str(tmp_path / f"r{rank}.json"))["counts"].items():
            for wid, n in per_window.items():
                key = (name, rank, int(wid))
                if key not in seen:
                    missing.append(key)
                elif seen[key] != n:
                    wrong.append((key, seen[key], n))
    assert not wrong, f"windows with another count than the rank added (moments {moments}): {wrong[:5]}"
    lost = {f"{name} rank {rank}": _ranges([w for n, r, w in missing if (n, r) == (name, rank)])
            for name, rank in sorted({(n, r) for n, r, _ in missing})}
    assert len(missing) <= overwritten, (
        f"{len(missing)} windows lost, {overwritten:g} counted (moments {moments}; first windows "
        f"{first_windows}): {dict(list(lost.items())[:4])}")


def test_windows_a_ring_overwrote_are_counted_before_any_watermark_and_across_any_outage(job):
    """A rank writes 50 windows before any collector runs (more than the ring's 4 banks hold, and more than 8
    rings), then 70 more while its collector does not look (one window between them stays empty): the windows
    the ring lost are counted as overwritten, all of them, and the others are emitted (a new slot's watermark
    starts before its first window; the count covers the whole gap)."""
    import shmstat

    wns = 50 * MS
    base = (time.time_ns() // wns) * wns
    now = [base]
    shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False, banks=4)
    stat = shmstat.Stat("ring", [A.COUNT], wns / 1e9, group="faults", clock=lambda: now[0])

    def write_windows(first: int, n: int) -> None:
        for w in range(first, first + n):
            now[0] = base + w * wns + wns // 2
            stat.add(1.0)

    write_windows(0, 50)
    rec = Recorder()
    coll = Collector(CollectorConfig(job=job, handlers={"*": "null"}, grace_ms=1, status_interval_s=0,
                                     clock=lambda: now[0] + 2 * wns), handler_objects={"faults": rec},
                     out=io.StringIO())
    step_and_wait(coll)
    try:
        coll.step()
        emitted = {w for (rank, w) in rec.windows("ring", 50) if rank == 0}
        assert len(emitted) + coll.passes.overwritten == 50, (sorted(emitted), coll.passes.overwritten)
        # from the first window its clock left open; it does not look meanwhile (an outage of 70 windows)
        write_windows(51, 70)
        coll.step()
        emitted = {w for (rank, w) in rec.windows("ring", 50) if rank == 0}
        assert len(emitted) + coll.passes.overwritten == 120, (len(emitted), coll.passes.overwritten)
    finally:
        coll.close()


# ----------------------------------------------------------------------------------- a subscriber stops reading


def test_subscriber_that_stops_reading_bounds_collector_memory_and_never_blocks_ranks(job, tmp_path):
    import zmq

    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0")
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)  # subscribes to everything, then never reads
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(coll.publish)
    healthy = Subscriber(coll.publish, (b"event/", b"stat/shmstat/usage"))
    rss = RssSampler(coll.proc.pid)
    try:
        healthy.wait_flowing()
        wait_for(lambda: stuck.poll(0), 10, what="the stuck subscriber's subscription")
        baseline = max(rss.samples[-5:])
        start = str(tmp_path / "start")
        seconds = 2.0
        procs = [spawn(load_worker, job, r, 4, seconds, WINDOW_MS, str(tmp_path / f"r{r}.json"), 2, start)
                 for r in range(4)]
        open(start, "w").close()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        reports = [read_json(str(tmp_path / f"r{r}.json")) for r in range(4)]
        sent = sum(rep["pub"]["sent"] for rep in reports)
        # ranks never blocked: each ran its loop and flushed everything to the collector
        assert all(rep["flushed"] and rep["pub"]["backlog"] == 0 for rep in reports)
        # and no log_event waited on the stuck subscriber (a blocked call would wait for good; a loaded 2-core
        # machine deschedules a call for milliseconds, not seconds)
        assert max(rep["slowest_log_s"] for rep in reports) < 5.0, [rep["slowest_log_s"] for rep in reports]
        # every event reaches the healthy subscriber: it decodes them in Python, far slower than ranks make them (a
        # starved test process took 22 s for 1.7 M); so it may take as long as it needs while its count grows
        wait_growing(lambda: healthy.received("event"), sent, 15, "the healthy subscriber's events",
                     lambda: f"(gaps {sum(v.gaps for k, v in healthy.snapshot_streams().items() if k[0] == 'event')}, "
                             f"queue full {healthy.counter('collector.subscriber_queue_full')})")
        assert healthy.received("event") + sum(rep["pub"]["dropped"] for rep in reports) == \
            sum(rep["events"] for rep in reports)
        growth = rss.peak - baseline
        print(f"\nstuck subscriber: {sent} events relayed, collector RSS {baseline / 2**20:.0f} -> "
              f"{rss.peak / 2**20:.0f} MiB")
        assert growth < 150 * 2**20, f"collector RSS grew by {growth / 2**20:.0f} MiB"
    finally:
        rss.stop()
        healthy.close()
        stuck.close(0)
        ctx.term()
        assert coll.stop() == 0


# ----------------------------------------------------------------------------------- rank restarted, same rank


def test_rank_restarted_under_the_same_rank_number(job, tmp_path):
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0")
    sub = Subscriber(coll.publish, (b"rank/", b"stat/shmstat/usage"))
    try:
        sub.wait_flowing()
        stop1, stop2 = str(tmp_path / "stop1"), str(tmp_path / "stop2")
        first = spawn(idle_adder, job, 0, WINDOW_MS, str(tmp_path / "a.json"), stop1, None, True, True)
        wait_for(lambda: len(read_jsonl(out)) > 5, 30, 0.02, what="first incarnation's windows")
        open(stop1, "w").close()
        wait_for(lambda: os.path.exists(str(tmp_path / "a.json")), 30, what="first incarnation's report")
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        second = spawn(idle_adder, job, 0, WINDOW_MS, str(tmp_path / "b.json"), stop2, None, False, True)
        wait_for(lambda: any(x["state"] == "joined" and x["incarnation"] == 2 for x in sub.lifecycle), 30,
                 what="second incarnation joined")
        time.sleep(0.2)  # let it add across a few windows
        open(stop2, "w").close()
        second.join(60)
        assert second.exitcode == 0
        wait_for(lambda: any(x["state"] == "exited" for x in sub.lifecycle), 30, what="second incarnation exited")
        states = [(x["state"], x["incarnation"], x["pid"]) for x in sub.lifecycle if x["rank"] == 0]
        assert states == [("joined", 1, first.pid), ("died", 1, first.pid), ("joined", 2, second.pid),
                          ("exited", 2, second.pid)]
        usage_gaps = sub.counter("collector.seq_gaps")
    finally:
        sub.close()
        assert coll.stop() == 0
    rows = read_jsonl(out)
    a, b = (read_json(str(tmp_path / n)) for n in ("a.json", "b.json"))
    want: dict[int, int] = defaultdict(int)
    for rep in (a, b):
        for wid, n in counts_from(rep).items():
            want[wid] += n
    _merged, per_rank, repeats = rows_by_rank_window(rows, "steps", WINDOW_MS)
    assert repeats == 0
    assert {wid: n for (r, wid), n in per_rank.items() if r == 0} == dict(want)
    # each incarnation's metrics arrived whole; the new one's seqs starting at 0 are not a gap
    vals = [int(r["value"]) for r in rows if r["name"] == "seq" and r["window_start"] is None]
    assert sorted(vals) == sorted(list(range(1, a["adds"] + 1)) + list(range(1, b["adds"] + 1)))
    assert not usage_gaps


# ----------------------------------------------------------------------------------- segment cannot be created


def _too_big_geometry() -> L.Geometry:
    st = os.statvfs("/dev/shm")
    size = st.f_blocks * st.f_frsize
    geo = L.Geometry(4096, 65536, 64)
    if geo.total_size <= 2 * size:
        pytest.skip("/dev/shm is too large to exceed with the largest geometry")
    return geo


def test_segment_larger_than_dev_shm_is_a_clear_error_and_leaves_nothing(job):
    with pytest.raises(SegmentError, match=r"cannot allocate \d+ bytes .*free space in /dev/shm"):
        Segment.open(job, geometry=_too_big_geometry())
    assert not os.path.exists("/dev/shm" + segment_name(job))
    seg = Segment.open(job, geometry=L.Geometry(2, 2, 4))  # and the name is usable right after
    seg.close()


def test_collector_and_rank_report_an_uncreatable_segment_in_one_line(job):
    import shmstat

    geo = _too_big_geometry()
    r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--max-ranks",
                        str(geo.max_ranks), "--max-stats", str(geo.max_stats), "--banks", str(geo.banks)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "cannot allocate" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(SegmentError, match="cannot allocate"):
        shmstat.init(job, rank=0, max_ranks=geo.max_ranks, max_stats=geo.max_stats, banks=geo.banks)
    assert not os.path.exists("/dev/shm" + segment_name(job))


@pytest.mark.parametrize(("content", "needle"), [
    (os.urandom(4096), "not created by shmstat"),
    (b"SHMSTAT", "too small"),
    (b"", "too small"),
])
def test_name_taken_by_a_foreign_file_is_refused_and_left_untouched(job, content, needle):
    import shmstat

    path = "/dev/shm" + segment_name(job)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(LayoutMismatchError, match=needle):
        Segment.open(job)
    with pytest.raises(LayoutMismatchError, match=needle):
        shmstat.init(job, rank=0)
    r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with open(path, "rb") as f:
        assert f.read() == content


# ----------------------------------------------------------------------------------- subscriber across a restart


def test_subscriber_of_a_restarted_collector_misses_no_event(job, tmp_path):
    """The ranks hold their events while the collector is away; the restarted collector lets them flow only
    once the subscriber has reconnected (``--hold-ms``), so the subscriber sees every seq exactly once."""
    import tempfile

    short = tempfile.mkdtemp(prefix="shmstat-t-")  # ipc paths are limited to ~107 bytes
    pub = f"ipc://{short}/pub"
    args = ("--publish", pub, "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0")
    coll = start_collector(job, *args)
    sub = Subscriber(pub, (b"event/",), reconnect_ivl_ms=10)
    stop = str(tmp_path / "stop")
    ranks = [spawn(load_worker, job, r, 2, 120.0, WINDOW_MS, str(tmp_path / f"r{r}.json"), 4, None, None, stop, 16)
             for r in range(2)]
    try:
        wait_for(lambda: sub.received("event") > 2000, 30, 0.01, what="events before the restart")
        for _ in range(2):
            coll.stop()
            time.sleep(0.2)  # the outage: the ranks go on logging
            before = sub.received("event")
            coll = start_collector(job, *args)
            wait_for(lambda b=before: sub.received("event") > b + 2000, 30, 0.01, what="events after the restart")
        open(stop, "w").close()
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        reports = [read_json(str(tmp_path / f"r{r}.json")) for r in range(2)]
        assert all(rep["pub"]["dropped"] == 0 for rep in reports)
        total = sum(rep["events"] for rep in reports)
        wait_for(lambda: sub.received("event") >= total, 30, 0.02, what=f"{total} events at the subscriber")
        streams = sub.snapshot_streams()
        for rank, rep in enumerate(reports):
            log = streams[("event", rank, rep["pid"], 1)]
            assert (log.received, log.gaps, log.duplicates) == (rep["events"], 0, 0)
    finally:
        open(stop, "w").close()
        sub.close()
        assert coll.stop() == 0
        import shutil

        shutil.rmtree(short, ignore_errors=True)
