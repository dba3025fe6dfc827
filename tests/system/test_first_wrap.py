"""A ring that wraps before any collector emitted a pass of its slot: a collector SIGKILLed right after it became
ready, and the rank writes more windows than ``--banks`` holds before the next collector's first pass. The windows
overwritten meanwhile are counted (``collector.windows_overwritten``): every window the rank wrote is emitted with
its exact count or counted as overwritten, none silently lost."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict

import pytest
from kit.faults import overwritten_total
from kit.procs import read_jsonl, spawn, start_collector, wait_file, window_counts
from kit.support import unique_job

WINDOW_MS = 60  # at least min_window_ms(4): the writer does not guard it, the ring simply wraps
BANKS = 4
WINDOWS = 14  # written before any collector's first pass: far more than BANKS


def wrapping_rank(job: str, out_path: str, stop_path: str) -> None:
    """Add 1.0 per step to Stat ``steps`` until WINDOWS windows hold samples; write ``{window_start_s: count}`` to
    ``out_path``, then keep the job attached until ``stop_path`` exists (the next collector reads the segment
    meanwhile)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False)
    last = [0]

    def clock() -> int:
        last[0] = time.time_ns()
        return last[0]

    stat = shmstat.Stat("steps", [A.COUNT], WINDOW_MS / 1000, group="train", clock=clock)
    wns = WINDOW_MS * 1_000_000
    counts: dict[str, int] = defaultdict(int)
    while len(counts) < WINDOWS:  # windows with samples, however slowly a loaded machine runs this process
        stat.add(1.0)
        counts[repr(last[0] // wns * wns / 1e9)] += 1
        time.sleep(0.002)
    with open(out_path + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(out_path + ".tmp", out_path)
    while not os.path.exists(stop_path):
        time.sleep(0.01)
    shmstat.shutdown()


@pytest.mark.parametrize("first_collector", ["killed_at_ready", "none"])
def test_windows_a_ring_overwrote_before_any_collector_emitted_its_slot_are_counted(tmp_path, first_collector):
    job = unique_job("firstwrap")
    out, own = str(tmp_path / "m.jsonl"), str(tmp_path / "own.jsonl")
    counts_path, stop = str(tmp_path / "r0.json"), str(tmp_path / "stop")
    args = ("--banks", str(BANKS), "--handler", f"train=jsonl:{out}", "--handler", f"shmstat=jsonl:{own}",
            "--status-interval", "0")
    if first_collector == "killed_at_ready":  # else the rank creates the segment (4 banks), a collector starts late
        start_collector(job, *args).stop(signal.SIGKILL)  # right after it became ready: it never emitted a pass
    rank = spawn(wrapping_rank, job, counts_path, stop)
    try:
        wait_file(counts_path, 30)
        time.sleep(2 * WINDOW_MS / 1000)  # the rank's last window closes before the next collector starts
        second = start_collector(job, *args)
        time.sleep(0.3)
        assert second.stop(signal.SIGTERM) == 0, second.lines
    finally:
        open(stop, "w").close()
        rank.join(30)
    with open(counts_path) as f:
        added = {float(k): v for k, v in json.load(f).items()}
    rows = read_jsonl(out)
    _, per_rank = window_counts(rows, "steps")
    emitted = {start: n for (r, start), n in per_rank.items() if r == 0}
    assert len(added) > BANKS + 2
    for start, n in emitted.items():
        assert added.get(start) == n, f"window {start}: emitted {n}, added {added.get(start)}"
    lost = overwritten_total(read_jsonl(own))
    missing = set(added) - set(emitted)
    # A window the rank wrote no sample in (held off the CPU for a whole window, as on a loaded machine) is in
    # no bank: where its bank was later taken by a newer window, nothing in the ring says it was empty, and it
    # counts as overwritten too. So the count lies between the windows missing and the ids the ring passed; with
    # no such window it is exactly the windows missing.
    wns = WINDOW_MS * 1_000_000
    ids = [round(start * 1e9 / wns) for start in added]
    spanned = max(ids) - min(ids) + 1
    assert len(missing) <= lost <= spanned - len(emitted), (
        f"{len(added)} windows added over {spanned} ids, {len(emitted)} emitted, {lost} counted as overwritten")
    if spanned == len(added):
        assert lost == len(missing), f"{len(missing)} windows missing, {lost} counted as overwritten"
