"""Tests of shmstat.publish.tensorboard.TensorboardEventHandler against a writer that records its calls."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from shmstat.publish.events import STAT_EVENT, Event, log_event, register_event_handler
from shmstat.publish.tensorboard import TensorboardEventHandler

NOW = dt.datetime(2024, 5, 17, 12, 30, 45, 123456)


class RecordingWriter:
    """Records every add_scalar call as (tag, value, global_step, walltime)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, int | None, float | None]] = []

    def add_scalar(
        self, tag: str, scalar_value: Any, global_step: int | None = None, walltime: float | None = None
    ) -> None:
        self.calls.append((tag, scalar_value, global_step, walltime))


def stat_event(data: dict[str, Any], timestamp: dt.datetime = NOW) -> Event:
    return Event(STAT_EVENT, timestamp, data)


def test_stat_event_writes_one_scalar_per_item_with_the_event_walltime() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    handler(stat_event({"lat.mean": 2.5, "lat.count": 4.0}))
    assert writer.calls == [
        ("lat.mean", 2.5, 0, pytest.approx(NOW.timestamp(), abs=1e-6)),
        ("lat.count", 4.0, 0, pytest.approx(NOW.timestamp(), abs=1e-6)),
    ]


def test_other_events_are_ignored() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    handler(Event("loss", NOW, {"value": 1.0}))
    handler(Event("torch.monitor.Stat.extra", NOW, {"value": 1.0}))
    assert writer.calls == []


def test_step_is_a_per_key_window_counter_starting_at_zero() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    handler(stat_event({"a.sum": 1.0}))
    handler(stat_event({"a.sum": 2.0, "b.sum": 5.0}))
    handler(stat_event({"a.sum": 3.0}))
    assert [(tag, step) for tag, _, step, _ in writer.calls] == [
        ("a.sum", 0),
        ("a.sum", 1),
        ("b.sum", 0),
        ("a.sum", 2),
    ]


def test_window_index_in_the_data_is_the_step_and_is_not_written() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    key = TensorboardEventHandler.WINDOW_INDEX_KEY
    handler(stat_event({"a.max": 9.0, key: 28_000_123}))
    assert [(tag, value, step) for tag, value, step, _ in writer.calls] == [("a.max", 9.0, 28_000_123)]


def test_non_int_window_index_is_not_a_step() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    key = TensorboardEventHandler.WINDOW_INDEX_KEY
    handler(stat_event({"a.max": 9.0, key: 3.5}))
    assert [(tag, step) for tag, _, step, _ in writer.calls] == [("a.max", 0), (key, 0)]


def test_str_values_are_skipped_and_bools_are_written_as_floats() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    handler(stat_event({"a.host": "n1", "a.flag": True, "a.count": 3}))
    assert [(tag, value, type(value)) for tag, value, _, _ in writer.calls] == [
        ("a.flag", 1.0, float),
        ("a.count", 3, int),
    ]


def test_internal_events_use_their_exact_nanosecond_time() -> None:
    writer = RecordingWriter()
    handler = TensorboardEventHandler(writer)
    handler(Event._from_ns(STAT_EVENT, 1_700_000_000_250_000_000, {"a.min": 0.0}))
    assert writer.calls == [("a.min", 0.0, 0, 1_700_000_000.25)]


def test_walltime_of_an_internal_event_equals_its_timestamp() -> None:
    writer = RecordingWriter()
    event = Event._from_ns(STAT_EVENT, 1_700_000_000_250_000_000, {"a.min": 0.0})
    TensorboardEventHandler(writer)(event)
    assert writer.calls[0][3] == pytest.approx(event.timestamp.timestamp(), abs=1e-6)


def test_end_to_end_through_log_event() -> None:
    writer = RecordingWriter()
    register_event_handler(TensorboardEventHandler(writer))
    log_event(stat_event({"x.mean": 1.0}))
    log_event(Event("other", NOW, {"x": 1.0}))
    log_event(stat_event({"x.mean": 2.0}))
    written = [(tag, value, step) for tag, value, step, _ in writer.calls]
    assert written == [("x.mean", 1.0, 0), ("x.mean", 2.0, 1)]


def test_handles_torchs_own_events_and_matches_torchs_handler_except_the_step() -> None:
    monitor = pytest.importorskip("torch.monitor")
    event = monitor.Event(monitor.STAT_EVENT, NOW, {"a.mean": 1.5, "a.count": 2.0})
    torch_writer = RecordingWriter()
    monitor.TensorboardEventHandler(torch_writer)(event)
    our_writer = RecordingWriter()
    TensorboardEventHandler(our_writer)(event)
    assert [(t, v, w) for t, v, _, w in our_writer.calls] == [(t, v, w) for t, v, _, w in torch_writer.calls]
    assert [s for _, _, s, _ in torch_writer.calls] == [None, None]  # torch passes no step
    assert [s for _, _, s, _ in our_writer.calls] == [0, 0]


def test_repr_names_the_writer() -> None:
    assert repr(TensorboardEventHandler("w")) == "TensorboardEventHandler('w')"
