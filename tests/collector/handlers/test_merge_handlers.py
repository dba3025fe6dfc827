"""Merge across ranks, handler specs, dispatch and the jsonl output."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from kit.merge_reference import merge, merge_all

from collector.handlers.dispatch import Dispatcher, ThreadedDispatcher
from collector.handlers.jsonl import JsonlMetricHandler
from collector.handlers.protocol import ColumnsAdapter, RowsAdapter
from collector.handlers.specs import build_handler, parse_handler_args
from collector.read.columns import Columns
from collector.read.rows import WindowRow
from elastic.metrics import ConsoleMetricHandler, MetricData, MetricHandler, NullMetricHandler, StatMetricData
from shmstat.aggregation import Aggregation as A
from shmstat.aggregation import to_mask
from shmstat.errors import ConfigError
from shmstat.shm.layout_records import WindowFigures


def _summary(rng: random.Random) -> WindowFigures:
    values = [rng.uniform(-5, 5) for _ in range(rng.randint(1, 6))]
    return WindowFigures(len(values), sum(values), min(values), max(values), values[-1], rng.randint(0, 10**6))


def test_merge_rules():
    a = WindowFigures(2, 3.0, 1.0, 2.0, 2.0, 10)
    b = WindowFigures(3, 12.0, 0.5, 6.0, 4.0, 20)
    m = merge(a, b)
    assert (m.count, m.sum, m.min, m.max, m.last, m.last_ts) == (5, 15.0, 0.5, 6.0, 4.0, 20)
    assert m.mean == 3.0
    assert merge_all([]) .count == 0 and merge_all([]).mean == 0.0
    assert merge(WindowFigures(0, 0.0, 0.0, 0.0, 0.0, 0), a) == a


def test_merge_is_associative_and_commutative_on_counts_and_extremes():
    rng = random.Random(7)
    for _ in range(50):
        parts = [_summary(rng) for _ in range(4)]
        results = [merge_all(p) for p in itertools.permutations(parts)]
        nested = merge(merge(parts[0], parts[1]), merge(parts[2], parts[3]))
        for r in [*results, nested]:
            assert (r.count, r.min, r.max, r.last, r.last_ts) == (
                results[0].count, results[0].min, results[0].max, results[0].last, results[0].last_ts)
            assert math.isclose(r.sum, results[0].sum, rel_tol=1e-12, abs_tol=1e-12)


def test_window_row_values_follow_the_requested_aggregations():
    row = WindowRow("g", "lat", 5, 100, to_mask([A.MEAN, A.MAX, A.VALUE]), None,
                    WindowFigures(2, 6.0, 1.0, 5.0, 1.0, 3))
    assert row.values() == {"lat.mean": 3.0, "lat.max": 5.0, "lat.value": 1.0}
    assert (row.start_ns, row.end_ns) == (500_000_000, 600_000_000)
    wire = row.to_wire()
    assert wire["rank"] is None and wire["count"] == 2 and wire["mean"] == 3.0


def test_handler_specs():
    console, null, user = (build_handler(s) for s in ("console", "null", "kit.handlers.user:Recording"))
    assert isinstance(console, RowsAdapter) and isinstance(console.handler, ConsoleMetricHandler)
    assert isinstance(null, RowsAdapter) and isinstance(null.handler, NullMetricHandler) and null.discards
    assert isinstance(user, RowsAdapter) and type(user.handler).__name__ == "Recording" and not user.discards
    for bad in ("jsonl:", "nope", "os.path:join", "no_such_module_xyz:Thing"):
        with pytest.raises(ConfigError):
            build_handler(bad)
    assert parse_handler_args(["a=console", "*=null"]) == {"a": "console", "*": "null"}
    with pytest.raises(ConfigError, match="GROUP=SPEC"):
        parse_handler_args(["console"])
    assert parse_handler_args(["shmstat=console", "训练组=null"]) == {"shmstat": "console", "训练组": "null"}
    for group in ("a/b", "rank0", "x" * 49):  # a group no rank can have (shmstat.names): said, not ignored
        with pytest.raises(ConfigError, match=r"--handler group .*the name rule"):
            parse_handler_args([f"{group}=console"])


@pytest.mark.parametrize("spec, says", [
    ("kit.handlers.args:NoEmit", "kit.handlers.args:NoEmit does not define emit: a handler defines "
                                  "emit(metric_data), and emit_columns(columns) to take passes as columns"),
    ("kit.handlers.args:NoColumns", "kit.handlers.args:NoColumns does not define emit_columns: a handler "
                                     "defines emit(metric_data), and emit_columns(columns) to take passes as columns"),
])
def test_a_handler_class_missing_the_protocol_is_refused_when_built_in_one_sentence(spec, says):
    with pytest.raises(ConfigError) as err:
        build_handler(spec)
    assert str(err.value) == says and len(says) < 160


def test_a_user_class_with_emit_columns_gets_passes_as_columns_and_its_own_flush_and_close(tmp_path):
    built = build_handler(f"kit.handlers.columns:Recorder,path={tmp_path / 'rec.jsonl'}")
    assert isinstance(built, ColumnsAdapter) and type(built.handler).__name__ == "Recorder"
    built.emit_columns(Columns.from_rows("j", [WindowRow("g", "lat", 5, 100, to_mask([A.COUNT]), None,
                                                         WindowFigures(2, 3.0, 1.0, 2.0, 2.0, 7), ranks=2)]))
    built.flush()  # Recorder has no flush: nothing to call
    built.close()  # its own close
    (line,) = (tmp_path / "rec.jsonl").read_text().splitlines()
    assert json.loads(line)["count"] == [2] and built.handler._out.closed


class _Picky(MetricHandler):
    """Raises on every figure of stat ``b``; keeps the others."""

    def __init__(self):
        self.got = []

    def emit(self, metric_data):
        if metric_data.name.startswith("b."):
            raise KeyError(metric_data.name)
        self.got.append(metric_data.name)


def test_a_rows_handler_raising_on_some_rows_gets_the_others_and_each_failure_is_counted(caplog):
    mask = to_mask([A.COUNT, A.MEAN])
    rows = [WindowRow("g", name, 5, 100, mask, rank, WindowFigures(1, 1.0, 1.0, 1.0, 1.0, 1))
            for name in ("a", "b", "c") for rank in (None, 0)]
    picky = _Picky()
    d = ThreadedDispatcher(Dispatcher({"g": picky}))
    d.emit_columns(Columns.from_rows("j", rows))
    assert d.wait(10)
    d.close()
    assert picky.got == ["a.count", "a.mean"] * 2 + ["c.count", "c.mean"] * 2
    assert d.errors == 4 and d.emitted == 6  # every failed figure counted; the pass's rows as taken rows
    assert sum("KeyError" in r.getMessage() for r in caplog.records) == 1


class _Boom(MetricHandler):
    def emit(self, metric_data):
        raise RuntimeError("boom")


class _Keep(MetricHandler):
    def __init__(self):
        self.got = []

    def emit(self, metric_data):
        self.got.append(metric_data)


def test_a_raising_handler_is_counted_and_the_others_still_run(caplog):
    keep = _Keep()
    d = ThreadedDispatcher(Dispatcher({"bad": _Boom(), "good": keep}, default=keep))
    for i in range(3):
        for group, name in (("bad", "x"), ("good", "y"), ("other", "z")):
            d.emit_points(group, [MetricData(1.0, group, name, i)])
    assert d.wait(10)
    assert d.errors == 3 and d.emitted == 6
    d.close()
    assert [m.name for m in keep.got] == ["y", "z"] * 3
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1  # logged once, counted every time


def test_jsonl_rows_are_strict_json_with_rank_and_window(tmp_path):
    path = tmp_path / "out.jsonl"
    h = JsonlMetricHandler(str(path), node="n1")
    h.emit(StatMetricData(2.0, "g", "lat.max", math.inf, rank=None, window_start=1.0, window_end=2.0))
    h.emit(StatMetricData(2.0, "g", "lat.count", 3.0, rank=1, window_start=1.0, window_end=2.0, torn=True))
    h.emit(MetricData(5.0, "trainer", "loss", 0.5))
    h.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"timestamp": 2.0, "group": "g", "name": "lat.max", "value": "Infinity", "rank": None,
                       "window_start": 1.0, "window_end": 2.0, "node": "n1"}
    assert rows[1]["rank"] == 1 and rows[1]["torn"] is True
    assert rows[2]["rank"] is None and rows[2]["window_start"] is None
    assert (path.stat().st_mode & 0o777) == 0o600
