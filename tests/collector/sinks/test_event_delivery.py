"""Events sinks behind their threads (collector.sinks.delivery) and the ``--events`` SPECs: a sink that
does not keep up loses what does not fit in its queue (bounded in bytes), every loss counted and written to it as
gap records once it takes again; a sink that raises or is stuck is counted and never holds the others up; a bad
SPEC is one sentence."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from kit.support import wait_for

from collector.sinks.delivery import EventDelivery
from collector.sinks.events import (
    ConsoleEventHandler,
    EventRecord,
    GapRecord,
    JsonlEventHandler,
)
from collector.sinks.specs import build_event_handler
from shmstat.errors import ConfigError


def _record(seq: int, *, rank: int | None = 0, payload: int = 1000, job: str = "j") -> EventRecord:
    return EventRecord("ev", job, rank, 1_700_000_000_000_000_000 + seq, {"seq": seq, "blob": "x" * payload}, seq,
                       4242)


class _Gated:
    """Blocks in its first call until released; keeps every record."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.got: list = []
        self.closed = False

    def emit_events(self, batch) -> None:
        self.entered.set()
        self.release.wait(30)
        self.got.extend(batch)

    def close(self) -> None:
        self.closed = True


class _Keeping:
    def __init__(self) -> None:
        self.got: list = []
        self.closed = False

    def emit_events(self, batch) -> None:
        self.got.extend(batch)

    def close(self) -> None:
        self.closed = True


def test_a_slow_sink_loses_what_does_not_fit_in_bytes_and_then_gets_gap_records_that_add_up():
    slow = _Gated()
    delivery = EventDelivery([slow], queue_bytes=256 * 1024)
    n = 2000  # ~2.5 MB offered against a 256 KiB queue
    delivery.offer("j", _record(0))
    assert slow.entered.wait(10)  # the slow sink holds the first record in its hands
    for seq in range(1, n):
        delivery.offer("j", _record(seq))
    delivery.offer("j", _record(0, rank=None))  # the collector's own stream is summed apart
    dropped = delivery.dropped
    assert 0 < dropped < n, "the queue bound did not bite; the test proves nothing"
    assert delivery.dropped_for("j") == dropped and delivery.dropped_for("other") == 0
    slow.release.set()
    assert delivery.wait(30)
    events = [r for r in slow.got if isinstance(r, EventRecord)]
    gaps = [r for r in slow.got if isinstance(r, GapRecord)]
    assert len(events) + dropped == n + 1 and delivery.delivered == len(events)
    assert {g.at for g in gaps} == {"collector"} and sum(g.count for g in gaps) == dropped
    kept = {(r.rank, r.seq) for r in events}
    lost = {(0, s) for s in range(n)} - kept
    (rank0,) = [g for g in gaps if g.rank == 0]
    assert (rank0.job, rank0.pid, rank0.from_seq, rank0.to_seq) == ("j", 4242, min(s for _, s in lost),
                                                                     max(s for _, s in lost))
    delivery.close()
    assert slow.closed


def test_a_sink_that_raises_is_counted_and_its_events_dropped_while_the_others_get_everything():
    class Raising:
        calls = 0

        def emit_events(self, batch) -> None:
            Raising.calls += 1
            raise OSError("disk full")

    keeping = _Keeping()
    delivery = EventDelivery([Raising(), keeping])
    for seq in range(50):
        delivery.offer("j", _record(seq, payload=10))
    assert delivery.wait(10)
    assert Raising.calls >= 1 and delivery.errors == Raising.calls
    assert delivery.dropped == 50 and delivery.delivered == 50 and len(keeping.got) == 50
    delivery.close()


def test_a_stuck_sink_is_left_behind_at_close_within_the_budget_and_what_it_held_is_counted():
    class Stuck:
        def emit_events(self, batch) -> None:
            threading.Event().wait()

    keeping = _Keeping()
    delivery = EventDelivery([Stuck(), keeping], close_budget_s=0.3)
    for seq in range(300):
        delivery.offer("j", _record(seq, payload=10))
    wait_for(lambda: len(keeping.got) == 300, 10, what="the other sink took every record")
    start = time.monotonic()
    delivery.close()
    assert time.monotonic() - start < 2.0
    assert delivery.dropped == 300 and delivery.delivered == 300 and keeping.closed
    delivery.offer("j", _record(301))  # after close: ignored, never blocks
    assert delivery.dropped == 300


def test_records_and_their_json():
    ev = EventRecord("tick", "job", 3, 1_700_000_000_500_000_000, {"x": float("inf"), "ok": True}, 7, 99, 2)
    assert ev.to_json() == {"name": "tick", "job": "job", "rank": 3, "timestamp": 1_700_000_000.5,
                            "data": {"x": "Infinity", "ok": True}, "seq": 7, "pid": 99, "incarnation": 2}
    gap = GapRecord("job", 3, 99, 2, 10, 14, 5, "rank", 1_700_000_000_000_000_000)
    assert gap.to_json() == {"gap": 5, "job": "job", "rank": 3, "pid": 99, "incarnation": 2, "from_seq": 10,
                             "to_seq": 14, "at": "rank", "timestamp": 1_700_000_000.0}


def test_the_jsonl_sink_writes_whole_lines_owner_only(tmp_path):
    path = str(tmp_path / "e.jsonl")
    sink = build_event_handler(f"jsonl:{path}")
    assert isinstance(sink, JsonlEventHandler)
    sink.emit_events([_record(1, payload=3), GapRecord("j", 0, 1, 0, 2, 3, 2, "rank", 0)])
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert [line.get("gap") for line in lines] == [None, 2] and lines[0]["data"]["blob"] == "xxx"
    sink.close()


def test_the_jsonl_sink_reopened_writes_a_resent_event_once_and_repairs_a_cut_line(tmp_path):
    """A collector SIGKILLed after its sink wrote a batch and before the delivered mark moved: the ranks re-send
    that batch to the next collector, whose sink finds its events in the file's tail and skips them; a line the
    kill cut is removed. The collector's own events (rank None) are never re-sent and are always written."""
    path = str(tmp_path / "e.jsonl")
    first = JsonlEventHandler(path)
    ranks = [EventRecord("e", "j", 0, 1_000, {"i": i}, i, 42, 1) for i in range(5)]
    first.emit_events(ranks[:3])
    first.close()
    with open(path, "a") as f:
        f.write('{"name": "e", "job": "j", "ra')  # a write the kill cut
    again = JsonlEventHandler(path)
    own = EventRecord("rank/joined", "j", None, 2_000, {}, 0, 7, 0)
    again.emit_events([*ranks, own])  # re-sent from seq 0, then new ones
    again.close()
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert [(line["rank"], line["seq"]) for line in lines] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (None, 0)]


def test_the_console_sink_prints_one_line_per_record(capsys):
    sink = build_event_handler("console")
    assert isinstance(sink, ConsoleEventHandler)
    sink.emit_events([_record(1, payload=1), _record(2, rank=None, payload=1),
                      GapRecord("j", 0, 7, 1, 2, 6, 5, "rank", 0)])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3
    assert "job j rank 0: ev " in out[0] and "job j: ev " in out[1]
    assert "job j rank 0 (pid 7, incarnation 1): 5 lost at the rank (seq 2..6)" in out[2]


def test_a_users_sink_takes_keyword_arguments():
    sink = build_event_handler("kit.handlers.event_sinks:Counting,every=3")
    assert sink.every == 3


@pytest.mark.parametrize(("spec", "says"), [
    ("bogus", "unknown events sink kind 'bogus'"),
    ("json:/tmp/x", "unknown events sink kind 'json'"),
    ("jsnl:x", "unknown events sink kind 'jsnl'"),
    ("jsonl:", "needs a path"),
    ("jsonl:/nonexistent-dir/e.jsonl", "cannot open the events output"),
    ("otlp:", "needs an endpoint"),
    ("otlp:ftp://host/v1/logs", "is not an http(s) URL"),
    ("no_such_module_xyz:Sink", "unknown events sink kind 'no_such_module_xyz' in 'no_such_module_xyz:Sink' (no "
                                "module"),
    ("tests_no_such_pkg.mod:Sink", "cannot import module 'tests_no_such_pkg.mod' for an events sink"),
    ("kit.handlers.event_sinks:Missing", "has no class 'Missing'"),
    ("kit.handlers.event_sinks:NotASink", "has no emit_events(batch) method"),
    ("kit.handlers.event_sinks:Counting,bogus=1", "does not take these arguments"),
    ("kit.handlers.event_sinks:Exploding", "failed: RuntimeError: no sink today second line"),
    ("kit.handlers.event_sinks:Counting,every", "is not key=value"),
])
def test_a_bad_spec_is_one_sentence(spec, says):
    with pytest.raises(ConfigError) as err:
        build_event_handler(spec)
    assert says in str(err.value) and "\n" not in str(err.value)
