"""When a pass's watermark reaches the segment (collector/daemon/commits.py), and the jsonl sink's resume
(collector/handlers/jsonl.py): in-process collectors with an injected clock, real segments and files."""

from __future__ import annotations

import json
import os
import threading

from kit.handlers.user import Recording
from kit.support import MS, FakeClock, wait_for

from collector import Collector, CollectorConfig
from collector.daemon.commits import MAX_PENDING
from collector.handlers.jsonl import JsonlMetricHandler
from elastic.metrics import MetricData, StatMetricData
from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat


class Gate(Recording):
    """Records like Recording, but each ``emit`` waits until :attr:`opened` is set (a handler stuck on a peer)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.opened = threading.Event()

    def emit(self, metric_data) -> None:
        self.entered.set()
        self.opened.wait()
        super().emit(metric_data)


def _one_closed_window(job: str, clock: FakeClock, wait_s: float) -> tuple[Collector, Gate, int]:
    """A collector whose group ``g`` goes to a Gate, and one window of ``g`` closed and dispatched (its wid)."""
    gate = Gate()
    c = Collector(CollectorConfig(job=job, grace_ms=0, clock=clock, usage_interval_s=3600, commit_wait_s=wait_s),
                  handler_objects={"*": Recording(), "g": gate})
    init(job, rank=0, publish=False)
    s = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
    for _ in range(3):
        s.add(1.0)
    wid = clock.now // (100 * MS)
    clock.advance_ms(100)
    c.step()
    assert gate.entered.wait(10), "the window did not reach the handler"
    return c, gate, wid


def _durable(job: str) -> int:
    seg = Segment.open(job, create=False)
    try:
        return seg.descriptors(0)[0].emitted_wid
    finally:
        seg.close()


def test_the_watermark_reaches_the_segment_only_once_every_handler_took_the_pass(job):
    clock = FakeClock()
    clock.to_window(100)
    c, gate, wid = _one_closed_window(job, clock, wait_s=3600)
    first = wid
    try:
        s = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
        for _ in range(2 * MAX_PENDING):  # more passes while the handler holds the first: bounded, none committed
            s.add(1.0)
            wid = clock.now // (100 * MS)
            clock.advance_ms(100)
            c.step()
        assert len(c.commits) <= MAX_PENDING
        # (the slot's first watermark, written with it, is the window before its first one)
        assert _durable(job) == first - 1, "committed while a handler still held the pass"
        gate.opened.set()
        wait_for(lambda: c.step() or _durable(job) == wid, 10, what="the watermark committed")
        assert c.counters()["passes_not_taken"] == 0
        counts = [m.value for m in gate.got if m.name == "lat.count"]
        assert counts == [3, 3] + [1, 1] * 2 * MAX_PENDING  # merged and rank 0, each window once
    finally:
        gate.opened.set()
        c.close()


def test_a_stuck_handler_holds_the_watermark_at_most_commit_wait_s_and_is_counted(job):
    clock = FakeClock()
    clock.to_window(100)
    c, gate, wid = _one_closed_window(job, clock, wait_s=0.2)
    try:
        wait_for(lambda: c.step() or _durable(job) == wid, 10, what="the watermark committed without the handler")
        assert c.counters()["passes_not_taken"] == 1
        assert not gate.got  # it is still stuck in its first emit
    finally:
        gate.opened.set()
        c.close()


def _row(job: str, name: str, rank: int | None, start: float, value: float) -> StatMetricData:
    return StatMetricData(start + 0.1, "g", name, value, rank=rank, window_start=start, window_end=start + 0.1, job=job)


def test_jsonl_repairs_a_cut_last_line_and_skips_the_windows_it_holds(tmp_path):
    path = str(tmp_path / "m.jsonl")
    first = JsonlMetricHandler(path)
    for start in (1.0, 1.1):
        for rank in (None, 0, 1):
            first.emit(_row("j", "lat.count", rank, start, 3))
    first.emit(MetricData(1.2, "g", "loss", 0.5))  # a put metric: no window, never skipped
    first.close()
    with open(path, "a") as f:
        f.write('{"timestamp": 1.3, "group": "g", "name": "lat.co')  # a collector killed in the middle of a line
    again = JsonlMetricHandler(path)
    with open(path) as f:
        kept = f.read()
    assert kept.endswith("}\n") and json.loads(kept.splitlines()[-1])["name"] == "loss"  # the cut line is gone
    for start in (1.0, 1.1, 1.2):  # a restarted collector emits 1.0 and 1.1 again, then the new window 1.2
        for rank in (None, 0, 1):
            again.emit(_row("j", "lat.count", rank, start, 3))
    again.emit(_row("other-job", "lat.count", None, 1.0, 7))  # another job's window of the same start: written
    again.emit(_row("j", "lat.count", None, 1.1, 2))  # a second merged row of a window (a late rank's): written
    again.emit(MetricData(1.2, "g", "loss", 0.5))
    again.close()
    assert again.skipped == 6
    with open(path) as f:
        rows = [json.loads(line) for line in f]  # every line strict JSON
    keys = [(r.get("job"), r["name"], r["rank"], r["window_start"], r["value"]) for r in rows
            if r["window_start"] is not None]
    assert len(keys) == len(set(keys)) == 3 * 3 + 2
    assert [r["value"] for r in rows if r["name"] == "loss"] == [0.5, 0.5]


def test_jsonl_reads_its_tail_in_the_handlers_thread_not_at_the_collectors_start(tmp_path):
    """The windows a file holds are read back by the handler's first write (its own thread), so a collector that
    starts with a large file serves at once (in the soak, 16 MiB of tail took 1.4 s, 4-7 s under load, and a ring
    of 6.4 s wrapped meanwhile); a cut last line is repaired at once all the same."""
    path = str(tmp_path / "m.jsonl")
    first = JsonlMetricHandler(path)
    first.emit(_row("j", "lat.count", None, 1.0, 3))
    first.close()
    with open(path, "a") as f:
        f.write('{"timestamp": 1.3, "gro')
    again = JsonlMetricHandler(path)
    assert not again._resumed and not again._written  # nothing parsed yet
    with open(path) as f:
        assert f.read().endswith("}\n")  # but the cut line is gone
    again.emit(_row("j", "lat.count", None, 1.0, 3))  # emitted again: skipped, the tail read first
    again.close()
    assert again._resumed and again.skipped == 1


def test_jsonl_to_a_file_that_is_not_regular_writes_as_it_is(tmp_path):
    read_fd, write_fd = os.pipe()
    try:
        h = JsonlMetricHandler(f"/proc/self/fd/{write_fd}")  # a pipe: nothing to read back or repair
        h.emit(_row("j", "lat.count", None, 1.0, 3))
        h.close()
        assert json.loads(os.read(read_fd, 65536))["value"] == 3
    finally:
        os.close(read_fd)
        os.close(write_fd)
