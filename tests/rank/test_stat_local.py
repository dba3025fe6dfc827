"""In-process Stat: torch.monitor's behaviour, window by window, with an injected clock."""

from __future__ import annotations

import datetime as dt
import gc
import math

import pytest
from kit.support import FakeClock

from shmstat.aggregation import Aggregation as A
from shmstat.errors import ConfigError
from shmstat.publish.events import register_event_handler
from shmstat.writer.stat import Stat

ALL = [A.VALUE, A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN]


@pytest.fixture
def events():
    got = []
    register_event_handler(got.append)
    return got


def make(clock, name="lat", aggs=None, window_ms=100, **kw):
    clock.to_window(window_ms)
    return Stat(name, ALL if aggs is None else aggs, dt.timedelta(milliseconds=window_ms), clock=clock, **kw)


def test_window_closes_lazily_on_next_add_with_torch_keys(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN])
    for v in (1.0, 5.0, 3.0):
        s.add(v)
    clock.advance_ms(150)
    assert events == []  # nothing logs until the next add
    s.add(10.0)
    assert len(events) == 1
    e = events[0]
    assert e.name == "torch.monitor.Stat"
    assert list(e.data) == ["lat.count", "lat.sum", "lat.mean", "lat.max", "lat.min"]
    assert e.data == {"lat.count": 3.0, "lat.sum": 9.0, "lat.mean": 3.0, "lat.max": 5.0, "lat.min": 1.0}
    assert all(type(v) is float for v in e.data.values())
    assert e.timestamp == dt.datetime.fromtimestamp(clock.now / 1e9)  # the moment of logging
    assert s.count == 1


def test_get_is_zero_before_any_window_then_last_closed_window():
    clock = FakeClock()
    s = make(clock, aggs=[A.MEAN, A.COUNT])
    assert s.get() == {A.MEAN: 0.0, A.COUNT: 0.0}
    s.add(2.0)
    s.add(4.0)
    assert s.count == 2
    assert s.get() == {A.MEAN: 0.0, A.COUNT: 0.0}
    clock.advance_ms(100)
    s.add(7.0)
    assert s.get() == {A.MEAN: 3.0, A.COUNT: 2.0}
    assert s.count == 1


def test_max_samples_logs_at_once_then_discards_until_next_window(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.COUNT, A.SUM], max_samples=3)
    s.add(1.0)
    s.add(2.0)
    assert events == []
    s.add(3.0)
    assert len(events) == 1 and events[0].data == {"lat.count": 3.0, "lat.sum": 6.0}
    assert s.count == 0
    s.add(100.0)  # discarded: the window is full
    assert s.count == 0 and len(events) == 1
    assert s.get() == {A.COUNT: 3.0, A.SUM: 6.0}
    clock.advance_ms(100)
    s.add(4.0)  # closes the (already logged, now empty) window: get() goes back to zeros
    assert len(events) == 1
    assert s.get() == {A.COUNT: 0.0, A.SUM: 0.0}
    assert s.count == 1


def test_skipped_windows_come_out_as_one_event_and_empty_windows_log_nothing(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.COUNT])
    s.add(1.0)
    clock.advance_ms(1000)  # ten windows later
    s.add(1.0)
    assert [e.data for e in events] == [{"lat.count": 1.0}]
    clock.advance_ms(100)
    s.add(1.0)
    assert len(events) == 2


def test_value_aggregation_is_the_last_value_added(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.VALUE, A.MAX])
    s.add(3.0)
    s.add(9.0)
    s.add(4.0)
    clock.advance_ms(100)
    s.add(0.0)
    assert events[0].data == {"lat.max": 9.0, "lat.value": 4.0}
    assert s.get()[A.VALUE] == 4.0


def test_close_and_garbage_collection_log_the_remainder(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.SUM])
    s.add(2.5)
    s.close()
    assert [e.data for e in events] == [{"lat.sum": 2.5}]
    s.close()  # idempotent
    s.add(1.0)  # ignored after close
    t = make(clock, name="other", aggs=[A.SUM])
    t.add(1.5)
    del t
    gc.collect()
    assert events[-1].data == {"other.sum": 1.5}


def test_window_size_forms_and_limits():
    assert Stat("a", [A.COUNT], 1.5).name == "a"
    assert Stat("b", [A.COUNT], dt.timedelta(milliseconds=1))._window_ns == 1_000_000
    assert Stat("c", [A.COUNT], 0.0025)._window_ns == 2_000_000  # truncated to ms
    for bad in (0.0005, 0, -1, dt.timedelta(microseconds=999), float("nan")):
        with pytest.raises(ValueError, match=r"1 ms|finite"):
            Stat("d", [A.COUNT], bad)
    with pytest.raises(TypeError):
        Stat("e", [A.COUNT], "60s")
    with pytest.raises(ConfigError):
        Stat("f", [A.COUNT], 1.0, max_samples=0)


def test_duplicate_aggregations_merge_and_empty_list_logs_empty_data(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.SUM, A.SUM, A.COUNT])
    assert s.get() == {A.SUM: 0.0, A.COUNT: 0.0}
    e = make(clock, name="none", aggs=[])
    e.add(1.0)
    e.close()
    assert events[-1].data == {}


def test_nan_is_ignored_and_counted_infinities_are_kept(events):
    clock = FakeClock()
    s = make(clock, aggs=[A.COUNT, A.MAX, A.MIN])
    s.add(float("nan"))
    s.add(1.0)
    s.add(math.inf)
    s.add(-math.inf)
    assert s.count == 3
    assert s._core.nan_count == 1
    clock.advance_ms(100)
    s.add(0.0)
    assert events[0].data == {"lat.count": 3.0, "lat.max": math.inf, "lat.min": -math.inf}


def test_name_and_types_are_checked():
    with pytest.raises(TypeError):
        Stat(3, [A.COUNT], 1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Stat("", [A.COUNT], 1.0)
    s = Stat("x", [A.COUNT], 1.0)
    with pytest.raises(TypeError):
        s.add("1")  # type: ignore[arg-type]


def test_same_event_data_as_torch_monitor_on_close():
    torch_monitor = pytest.importorskip("torch.monitor")
    seen = []
    h = torch_monitor.register_event_handler(lambda e: seen.append(dict(e.data)))
    try:
        aggs = ["MEAN", "COUNT", "SUM", "MAX", "MIN"]
        ts = torch_monitor.Stat("cmp", [getattr(torch_monitor.Aggregation, a) for a in aggs], dt.timedelta(seconds=60))
        for v in (1.0, 2.0, 6.0):
            ts.add(v)
        del ts
    finally:
        torch_monitor.unregister_event_handler(h)
    ours = []
    register_event_handler(lambda e: ours.append(dict(e.data)))
    s = Stat("cmp", [getattr(A, a) for a in aggs], dt.timedelta(seconds=60))
    for v in (1.0, 2.0, 6.0):
        s.add(v)
    s.close()
    assert ours == seen


def test_a_nan_after_the_window_ended_is_counted_and_closes_nothing_on_either_backend(events, backend):
    clock = FakeClock()
    s = make(clock, aggs=[A.COUNT])
    s.add(1.0)
    clock.advance_ms(100)
    s.add(float("nan"))  # counted; the ended window stays open until a sample comes
    assert events == [] and s.count == 1 and s._core.nan_count == 1
    s.add(2.0)
    assert [e.data for e in events] == [{"lat.count": 1.0}] and s.count == 1
