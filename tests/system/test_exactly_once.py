"""Exactly once across collector crashes: a collector SIGKILLed at any moment of a pass (in the middle of the jsonl
handler's write, right after the handler wrote and before the watermark was committed, or at a random time) and
started again leaves every (stat, window, rank) in the jsonl once, and the counts add up to what the ranks added."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter, defaultdict

from kit.procs import CollectorProc, read_jsonl, spawn, start_collector
from kit.support import wait_for

from shmstat.shm.segment import Segment

WINDOW_MS = 500
BANKS = 64
"""The ring: 32 s of 500 ms windows, longer than two collector start-ups in a row under any load seen (7 to 15 s at
a load of 12 to 20 on 2 cores). A collector killed after its handler wrote a pass and before it committed it
leaves windows that its successor, finding them overwritten, could only count as lost though they were written (it
cannot know what a dead collector's handlers got): with a ring that wraps during no outage, what is missing is
exactly what is counted."""
STATS = 20
RANKS = 2


def many_stats_rank(job: str, rank: int, stop_path: str, out_path: str) -> None:
    """Add 1.0 to each of STATS stats per step until ``stop_path`` exists; write the steps taken and the steps per
    window (every stat's adds of a step read one clock reading, so they fall in one window)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=RANKS, publish=False)
    now = [0]
    stats = [shmstat.Stat(f"s{i:02d}", [A.COUNT], WINDOW_MS / 1000, group="g", clock=lambda: now[0])
             for i in range(STATS)]
    wns = WINDOW_MS * 1_000_000
    per_window: dict[str, int] = defaultdict(int)
    steps = 0
    while not os.path.exists(stop_path):
        now[0] = time.time_ns()
        for s in stats:
            s.add(1.0)
        per_window[repr(now[0] // wns * wns / 1e9)] += 1
        steps += 1
        time.sleep(0.002)
    with open(out_path + ".tmp", "w") as f:
        json.dump({"steps": steps, "windows": per_window}, f)
    os.replace(out_path + ".tmp", out_path)
    shmstat.shutdown()


class _Progress:
    """What the SlowJsonl handlers of every collector so far noted (``tests/kit/handlers/slow_jsonl.py``), read as it
    grows."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0  # bytes of the file consumed so far

    def wait(self, what: str, pid: int, timeout_s: float = 20.0) -> None:
        """Wait until collector ``pid`` notes ``what`` after everything consumed so far."""
        want = f"{pid} {what}".encode()

        def noted() -> bool:
            if not os.path.exists(self.path):
                return False
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            for line in data.split(b"\n")[:-1]:  # whole lines only
                self.offset += len(line) + 1
                if line == want:
                    return True
            return False

        wait_for(noted, timeout_s, 0.002, what=f"collector {pid} to note {what!r}")


class _Written:
    """The (rank, window id) of the s00 rows in the jsonl file, read as it grows (whole lines only)."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.done = path, 0, set[tuple[int, int]]()

    def read(self) -> set[tuple[int, int]]:
        """Everything written so far."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        lines = data.split(b"\n")[:-1]
        self.offset += sum(len(line) + 1 for line in lines)
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:  # a line cut by a kill (the next collector repairs it)
                continue
            if r["name"] == "s00.count" and r["rank"] is not None:
                self.done.add((r["rank"], _wid(r["window_start"])))
        return self.done


def _wid(window_start: float | str) -> int:
    """The window id of a window start in seconds (as a rank reported it, or as jsonl wrote it)."""
    return round(float(window_start) * 1000 / WINDOW_MS)


def _report(tmp_path, rank: int) -> dict:
    with open(tmp_path / f"r{rank}.json") as f:
        return json.load(f)


def _durable_watermark(job: str) -> int:
    """The newest window of stat s00 of rank 0 the segment says was emitted (what a restarted collector resumes
    after)."""
    seg = Segment.open(job, create=False)
    try:
        return next((d.emitted_wid for d in seg.descriptors(0) if d.name == "s00"), -1)
    finally:
        seg.close()


def test_collector_sigkilled_at_any_moment_of_a_pass_leaves_every_window_exactly_once(job, tmp_path):
    out, progress, stop = str(tmp_path / "m.jsonl"), str(tmp_path / "progress"), str(tmp_path / "stop")
    spec = f"*=kit.handlers.slow_jsonl:SlowJsonl,path={out},progress={progress},buffer=2048"
    args = ("--handler", spec, "--grace-ms", "10", "--status-interval", "0")
    owns: list[str] = []

    def own() -> tuple[str, str]:  # each collector's own counters in a file of its own
        owns.append(str(tmp_path / f"own{len(owns)}.jsonl"))
        return "--handler", f"shmstat=jsonl:{owns[-1]}"

    coll = start_collector(job, *args, *own(), "--banks", str(BANKS), "--max-ranks", "4", "--max-stats", "64")
    procs = [spawn(many_stats_rank, job, r, stop, str(tmp_path / f"r{r}.json")) for r in range(RANKS)]
    seen = _Progress(progress)
    cut_lines = ahead_of_watermark = 0
    try:
        wait_for(lambda: any(r["group"] == "g" for r in read_jsonl(out)), 30, 0.02, what="the ranks' first windows")
        # Where each kill lands: mid-write (the file ends in a cut line), right after the handler wrote and
        # flushed a pass (before its watermark is committed), after a write ending at a line's end, and at a
        # time unrelated to the handler.
        for moment in ("w0", "f", "w1", "f", "t", "w0"):
            if moment == "t":
                seen.wait("f", coll.proc.pid)
                time.sleep(0.037)
            else:
                seen.wait(moment, coll.proc.pid)
            coll.proc.send_signal(signal.SIGKILL)
            coll.stop()
            with open(out, "rb") as f:
                data = f.read()
            cut_lines += not data.endswith(b"\n")
            rows = [json.loads(line) for line in data.split(b"\n")[:-1]]
            newest = max((r["window_start"] for r in rows if r["name"] == "s00.count" and r["rank"] == 0), default=0)
            ahead_of_watermark += _wid(newest) > _durable_watermark(job)
            coll = start_collector(job, *args, *own())
        seen.wait("f", coll.proc.pid)
        open(stop, "w").close()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        last = {r: max(map(_wid, _report(tmp_path, r)["windows"])) for r in range(RANKS)}
        # The handler wrote the ranks' last closed windows: little is left for the stop. (Whoever wrote them: a
        # previous collector may have, when the last one started within a window of the kill.)
        written = _Written(out)
        wait_for(lambda: all((r, w - 1) in written.read() for r, w in last.items()), 20, 0.1,
                 what="the handler to catch up")
        assert coll.stop() == 0
    finally:
        open(stop, "w").close()
        if coll.proc.poll() is None:
            coll.stop(signal.SIGKILL)
    assert cut_lines >= 1, "no kill landed in the middle of a line: the repair of a cut line went untested"
    assert ahead_of_watermark >= 1, "no kill landed between a write and its commit: the de-duplication went untested"

    rows = [r for r in read_jsonl(out) if r["group"] == "g"]  # every line is strict JSON: the cut ones were repaired
    keys = Counter((r["name"], r["rank"], r["window_start"]) for r in rows)
    assert [k for k, n in keys.items() if n > 1] == [], "a window was written twice"
    reports = [_report(tmp_path, r) for r in range(RANKS)]
    # Every (stat, rank) window the ranks added to is in the file with what they added, or counted lost (the job's
    # count, the last its collectors reported); nothing else is counted.
    lost = 0
    for rank, rep in enumerate(reports):
        want = {_wid(k): n for k, n in rep["windows"].items()}
        for i in range(STATS):
            got = {_wid(r["window_start"]): r["value"] for r in rows if r["name"] == f"s{i:02d}.count"
                   and r["rank"] == rank}
            assert got == {w: n for w, n in want.items() if w in got}, f"stat s{i:02d} rank {rank}: windows differ"
            assert set(got) <= set(want), f"stat s{i:02d} rank {rank}: a window the rank did not add to"
            lost += _lost_windows(set(want), set(got))
    reported = [v for path in owns for v in _reported(path)]
    assert reported == sorted(reported), f"the job's count fell from one collector to the next: {reported}"
    assert reported[-1] == lost, f"{lost} (stat, rank) windows lost, {reported[-1]} counted"
    added = sum(rep["steps"] for rep in reports)
    for i in range(STATS):
        mine = [r for r in rows if r["name"] == f"s{i:02d}.count"]
        merged = sum(r["value"] for r in mine if r["rank"] is None)
        per_rank = sum(r["value"] for r in mine if r["rank"] is not None)
        assert merged == per_rank == added or (lost and per_rank < added), \
            f"stat s{i:02d}: {merged} merged, {per_rank} per rank, {added} added ({lost} windows lost)"


def rank_with_an_early_worker(job: str, stop_path: str, worker_done: str) -> None:
    """Rank 0: a forked worker adds 1.0 to ``w`` for ~0.4 s and exits; the rank adds to ``w`` until ``stop_path``."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False)
    stat = shmstat.Stat("w", [A.COUNT], 0.05, group="g")
    stat.add(1.0)
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            stat.add(1.0)
            time.sleep(0.001)
        shmstat.shutdown()
        os._exit(0)
    os.waitpid(pid, 0)
    with open(worker_done, "w"):
        pass
    while not os.path.exists(stop_path):
        stat.add(1.0)
        time.sleep(0.001)
    shmstat.shutdown()


def test_a_restart_after_the_ring_wrapped_never_writes_a_window_twice(job, tmp_path):
    """A handler stuck in its first call holds the watermark back (it is committed only once every handler took a
    pass), the collector is SIGKILLed once the ring (4 banks of 50 ms) wrapped past the windows of an exited
    worker, and started again: the rank's windows are overwritten, the worker's still held. The windows the first
    collector wrote are not written again as smaller rows (the worker's part only); the loss is counted."""
    out = str(tmp_path / "w.jsonl")
    stop, worker_done = str(tmp_path / "stop"), str(tmp_path / "worker_done")
    common = ("--banks", "4", "--grace-ms", "20", "--status-interval", "0")
    coll = start_collector(job, "--handler", f"g=jsonl:{out}", "--handler", "shmstat=kit.handlers.user:Stuck",
                           "--commit-wait", "3600", *common)
    proc = spawn(rank_with_an_early_worker, job, stop, worker_done)
    try:
        wait_for(lambda: os.path.exists(worker_done), 60, 0.01, what="the worker's end")
        time.sleep(0.6)  # the ring (0.2 s) wraps past the worker's windows; every pass waits on the stuck handler
        wait_for(lambda: len(read_jsonl(out)) > 10, 30, 0.01, what="rows in the file")
        coll.proc.send_signal(signal.SIGKILL)
        coll.stop()
        own = str(tmp_path / "own.jsonl")
        coll = start_collector(job, "--handler", f"g=jsonl:{out}", "--handler", f"shmstat=jsonl:{own}", *common)
        time.sleep(0.5)
    finally:
        with open(stop, "w"):
            pass
        proc.join(30)
        assert coll.stop(signal.SIGTERM) == 0
    rows = [r for r in read_jsonl(out) if r["name"] == "w.count"]
    seen = Counter((r["rank"], r["window_start"]) for r in rows)
    assert [k for k, n in seen.items() if n > 1] == []
    assert max(r["value"] for r in read_jsonl(own) if r["name"] == "collector.windows_overwritten") > 0


def rank_with_a_clock(job: str, stop_path: str, out_path: str) -> None:
    """Rank 0: adds 1.0 to ``w`` (50 ms windows) every ~1 ms until ``stop_path`` exists; writes the windows it
    added to (from the clock its adds used)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False)
    last = [0]

    def clock() -> int:
        last[0] = time.time_ns()
        return last[0]

    stat = shmstat.Stat("w", [A.COUNT], 0.05, group="g", clock=clock)
    windows: set[int] = set()
    while not os.path.exists(stop_path):
        stat.add(1.0)
        windows.add(last[0] // 50_000_000)
        time.sleep(0.001)
    shmstat.shutdown()
    with open(out_path + ".tmp", "w") as f:
        json.dump(sorted(windows), f)
    os.replace(out_path + ".tmp", out_path)


def _lost_windows(added: set[int], written: set[int]) -> int:
    """The windows a collector finds lost to the ring, from the windows a rank added to and those written: those
    it added to and not written, and the windows it added nothing to (a rank not scheduled for a window) just
    before such a window (a bank overwritten holds no sign of whether the window it held had data)."""
    missing = added - written
    empty_then_missing, waiting = 0, 0
    for w in range(min(added), max(added) + 1):
        if w not in added:
            waiting += 1
        else:
            empty_then_missing += waiting if w in missing else 0
            waiting = 0
    return len(missing) + empty_then_missing


def _reported(path: str, name: str = "collector.windows_overwritten") -> list[int]:
    """The values of the collector's own counter ``name`` in its file, in the order written."""
    return [int(r["value"]) for r in read_jsonl(path) if r["name"] == name]


def test_windows_a_collector_killed_before_its_first_commit_found_lost_are_counted_once(job, tmp_path):
    """Windows lost to the ring (the node without a collector longer than the ring holds) twice: the first time
    found by a collector that commits, the second by one SIGKILLed before it committed that pass (its one handler of
    the group never returns), which leaves them to the next one, which finds them lost again. The job's count
    (``collector.windows_overwritten``, a count of the job like ``samples_dropped``) never falls from one collector
    to the next and ends at exactly the windows missing: each lost window counted once."""
    out, stop, added = str(tmp_path / "w.jsonl"), str(tmp_path / "stop"), str(tmp_path / "added.json")
    owns = [str(tmp_path / f"own{n}.jsonl") for n in range(4)]
    common = ("--banks", "4", "--grace-ms", "20", "--status-interval", "0")

    def collector(n: int, *handlers: str) -> CollectorProc:
        return start_collector(job, *handlers, "--handler", f"shmstat=jsonl:{owns[n]}", *common)

    coll = collector(0, "--handler", f"g=jsonl:{out}")
    proc = spawn(rank_with_a_clock, job, stop, added)
    try:
        wait_for(lambda: len(read_jsonl(out)) > 5, 30, 0.01, what="rows of the first collector")
        assert coll.stop(signal.SIGTERM) == 0  # its watermark committed; the rank runs on, no collector reads
        time.sleep(0.5)  # the ring (4 banks of 50 ms) wraps: windows lost
        coll = collector(1, "--handler", f"g=jsonl:{out}")
        wait_for(lambda: any(_reported(owns[1])), 30, 0.01, what="the second collector to count the windows lost")
        assert coll.stop(signal.SIGTERM) == 0
        time.sleep(0.5)  # lost again
        coll = collector(2, "--handler", "g=kit.handlers.user:Stuck", "--commit-wait", "3600")
        wait_for(lambda: any(r["name"] == "collector.windows_emitted" and r["value"] > 0 for r in read_jsonl(owns[2])),
                 30, 0.01, what="the counters of the third collector's first pass")
        coll.proc.send_signal(signal.SIGKILL)
        coll.stop()
        coll = collector(3, "--handler", f"g=jsonl:{out}")
        wait_for(lambda: any(r["name"] == "collector.windows_emitted" and r["value"] > 0 for r in read_jsonl(owns[3])),
                 30, 0.01, what="the counters of the last collector's first pass")
    finally:
        with open(stop, "w"):
            pass
        proc.join(30)
        assert coll.stop(signal.SIGTERM) == 0
    with open(added) as f:
        windows = set(json.load(f))
    got = Counter(round(r["window_start"] * 20) for r in read_jsonl(out)
                  if r["name"] == "w.count" and r["rank"] == 0)
    assert [w for w, n in got.items() if n > 1] == [], "a window was written twice"
    missing = _lost_windows(windows, set(got))
    reported = [v for path in owns for v in _reported(path)]
    assert _reported(owns[1]) and missing > max(_reported(owns[1])), "windows were not lost twice: the test is void"
    assert reported == sorted(reported), f"the job's count fell from one collector to the next: {reported}"
    empty = sorted(set(range(min(windows), max(windows) + 1)) - windows)
    assert reported[-1] == missing, (f"{missing} windows lost, {reported[-1]} counted (each collector's counts "
                                     f"{[_reported(p) for p in owns]}; lost {sorted(windows - set(got))}; windows "
                                     f"the rank added nothing to {empty})")
