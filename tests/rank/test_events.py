"""Tests of shmstat.publish.events: Event, handler registration, log_event dispatch and publishing."""

from __future__ import annotations

import datetime as dt
import enum
import logging
import re
import threading
import time
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest

from shmstat.errors import ConfigError
from shmstat.job._state import STATE
from shmstat.publish.events import (
    STAT_EVENT,
    Event,
    EventHandlerHandle,
    _dispatch_local,
    data_value_t,
    log_event,
    register_event_handler,
    unregister_event_handler,
)

NOW = dt.datetime(2024, 5, 17, 12, 30, 45, 123456)


def make_event(name: str = "e", **data: Any) -> Event:
    return Event(name, NOW, data)


class FakePublisher:
    """Records publish_event calls; has the close() that _state.reset() calls."""

    def __init__(self) -> None:
        self.published: list[tuple[str, int, dict[str, Any]]] = []

    def publish_event(self, name: str, ts_ns: int, data: dict[str, Any], size: int = 0) -> None:
        self.published.append((name, ts_ns, data))

    def close(self, linger_ms: int = 0) -> None:
        pass


@pytest.fixture
def eastern_tz(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time = UTC-5 with no DST (a POSIX TZ string, no tz database needed)."""
    monkeypatch.setenv("TZ", "EST+5")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# -- Event construction and types ----------------------------------------------------------------------------


def test_event_exposes_name_timestamp_and_data() -> None:
    e = Event("loss", NOW, {"epoch": 3, "value": 0.25, "phase": "train", "best": True})
    assert e.name == "loss"
    assert e.timestamp is NOW
    assert e.data == {"epoch": 3, "value": 0.25, "phase": "train", "best": True}


def test_event_data_keeps_each_value_type_including_bool() -> None:
    e = make_event(i=1, f=1.5, s="x", b=True)
    assert [type(v) for v in e.data.values()] == [int, float, str, bool]
    assert e.data["b"] is True


def test_event_accepts_empty_data_and_empty_name() -> None:
    e = Event("", NOW, {})
    assert e.name == ""
    assert e.data == {}


def test_event_copies_the_data_it_is_given() -> None:
    source = {"a": 1}
    e = Event("e", NOW, source)
    source["a"] = 2
    source["b"] = 3
    assert e.data == {"a": 1}


def test_event_accepts_any_mapping_as_data_and_stores_a_dict() -> None:
    e = Event("e", NOW, MappingProxyType({"a": 1}))
    assert type(e.data) is dict
    assert e.data == {"a": 1}


def test_event_converts_subclasses_of_allowed_types_to_the_base_type() -> None:
    class Level(enum.IntEnum):
        HIGH = 2

    class Tag(str):
        pass

    e = Event(Tag("n"), NOW, {Tag("k"): Level.HIGH, "t": Tag("v")})
    assert type(e.name) is str
    assert [type(k) for k in e.data] == [str, str]
    assert type(e.data["k"]) is int and e.data["k"] == 2
    assert type(e.data["t"]) is str


@pytest.mark.parametrize("name", [None, 1, b"e", ["e"]])
def test_event_name_must_be_a_str(name: Any) -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        Event(name, NOW, {})


@pytest.mark.parametrize("timestamp", [None, 1.0, 1_700_000_000, "2024-01-01", dt.date(2024, 1, 1)])
def test_event_timestamp_must_be_a_datetime(timestamp: Any) -> None:
    with pytest.raises(TypeError, match="timestamp must be a datetime"):
        Event("e", timestamp, {})


@pytest.mark.parametrize("data", [None, [("a", 1)], "a=1", 3])
def test_event_data_must_be_a_mapping(data: Any) -> None:
    with pytest.raises(TypeError, match="data must be a dict"):
        Event("e", NOW, data)


@pytest.mark.parametrize("key", [1, None, b"k", 1.5])
def test_event_data_keys_must_be_str_and_the_message_names_the_key(key: Any) -> None:
    with pytest.raises(TypeError, match=re.escape(f"key {key!r} is a {type(key).__name__}")):
        Event("e", NOW, {key: 1})


@pytest.mark.parametrize("value", [None, [1], {"x": 1}, b"bytes", 1j, (1,), dt.timedelta(1)])
def test_event_data_values_of_other_types_raise_type_error_naming_key_and_type(value: Any) -> None:
    with pytest.raises(TypeError, match=re.escape(f"key 'bad' is a {type(value).__name__}")):
        Event("e", NOW, {"ok": 1, "bad": value})


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**100])
def test_event_int_outside_int64_raises_value_error_like_torch(value: int) -> None:
    with pytest.raises(ConfigError, match="64-bit"):
        Event("e", NOW, {"big": value})
    assert issubclass(ConfigError, ValueError)


def test_event_int64_limits_are_accepted() -> None:
    e = make_event(lo=-(2**63), hi=2**63 - 1)
    assert e.data == {"lo": -(2**63), "hi": 2**63 - 1}


def test_event_nan_and_infinities_are_valid_floats() -> None:
    e = make_event(n=float("nan"), p=float("inf"), m=float("-inf"))
    assert e.data["n"] != e.data["n"]
    assert e.data["p"] == float("inf") and e.data["m"] == float("-inf")


def test_event_attributes_are_settable_and_validated() -> None:
    e = make_event(a=1)
    later = NOW + dt.timedelta(seconds=1)
    e.name = "renamed"
    e.timestamp = later
    e.data = {"b": False}
    assert (e.name, e.timestamp, e.data) == ("renamed", later, {"b": False})
    with pytest.raises(TypeError):
        e.name = 3  # type: ignore[assignment]
    with pytest.raises(TypeError):
        e.timestamp = 3.0  # type: ignore[assignment]
    with pytest.raises(TypeError):
        e.data = {"c": object()}  # type: ignore[dict-item]
    assert (e.name, e.timestamp, e.data) == ("renamed", later, {"b": False})


def test_event_has_slots_and_no_instance_dict() -> None:
    e = make_event()
    assert not hasattr(e, "__dict__")
    with pytest.raises(AttributeError):
        e.other = 1  # type: ignore[attr-defined]


def test_event_repr_shows_name_timestamp_and_data() -> None:
    text = repr(make_event("loss", v=1))
    assert text.startswith("Event(name='loss', timestamp=datetime.datetime(2024, 5, 17")
    assert "data={'v': 1}" in text


def test_data_value_t_is_the_union_of_the_four_types() -> None:
    for value in ("s", 1.0, 1, True):
        assert isinstance(value, data_value_t)
    assert not isinstance(None, data_value_t)
    assert not isinstance(b"x", data_value_t)


def test_stat_event_name_is_torchs() -> None:
    assert STAT_EVENT == "torch.monitor.Stat"


# -- timestamps as integer nanoseconds -----------------------------------------------------------------------


def test_naive_timestamp_ns_matches_datetime_timestamp_as_local_time() -> None:
    e = Event("e", NOW, {})
    assert e._timestamp_ns() == round(NOW.timestamp() * 1_000_000) * 1000


def test_naive_timestamp_is_interpreted_in_the_local_zone(eastern_tz: None) -> None:
    e = Event("e", dt.datetime(2024, 1, 1, 0, 0, 0, 7), {})
    assert e._timestamp_ns() == (1_704_085_200 * 1_000_000 + 7) * 1000


def test_aware_timestamp_keeps_its_zone(eastern_tz: None) -> None:
    tz = dt.timezone(dt.timedelta(hours=2))
    e = Event("e", dt.datetime(2024, 1, 1, 2, 0, 0, 999999, tzinfo=tz), {})
    assert e._timestamp_ns() == 1_704_067_200_999_999_000
    assert e.timestamp.tzinfo is tz


def test_timestamp_setter_recomputes_the_ns_value() -> None:
    e = Event("e", NOW, {})
    first = e._timestamp_ns()
    e.timestamp = NOW + dt.timedelta(microseconds=5)
    assert e._timestamp_ns() == first + 5000


def test_from_ns_builds_a_trusted_event_without_copying_data() -> None:
    data: dict[str, data_value_t] = {"x.mean": 1.0}
    e = Event._from_ns("n", 1_700_000_000_123_456_789, data)
    assert type(e) is Event
    assert e.name == "n"
    assert e.data is data
    assert e._timestamp_ns() == 1_700_000_000_123_456_789


def test_from_ns_timestamp_is_built_lazily_as_naive_local_time_and_cached(eastern_tz: None) -> None:
    e = Event._from_ns("n", 1_704_085_200_000_007_999, {})
    assert e._ts is None  # nothing built yet
    ts = e.timestamp
    assert ts == dt.datetime(2024, 1, 1, 0, 0, 0, 7)  # local (UTC-5), truncated to microseconds
    assert ts.tzinfo is None
    assert e.timestamp is ts
    assert e._timestamp_ns() == 1_704_085_200_000_007_999  # the exact ns is kept


def test_from_ns_round_trips_through_the_datetime() -> None:
    ns = time.time_ns() // 1000 * 1000
    e = Event._from_ns("n", ns, {})
    assert Event("n", e.timestamp, {})._timestamp_ns() == ns


# -- handler handles -----------------------------------------------------------------------------------------


def test_event_handler_handle_cannot_be_constructed_directly() -> None:
    with pytest.raises(TypeError, match="EventHandlerHandle cannot be directly initialized"):
        EventHandlerHandle()
    with pytest.raises(TypeError, match="cannot be directly initialized"):
        EventHandlerHandle(object(), print)  # type: ignore[arg-type]


def test_register_returns_a_handle_and_records_it_in_state() -> None:
    def handler(e: Event) -> None:
        pass

    handle = register_event_handler(handler)
    assert isinstance(handle, EventHandlerHandle)
    assert STATE.handlers == [handle]
    assert STATE.handler_tuple == (handler,)


def test_register_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        register_event_handler(42)  # type: ignore[arg-type]
    assert STATE.handlers == []


def test_unregister_rejects_what_is_not_a_handle() -> None:
    with pytest.raises(TypeError, match="EventHandlerHandle"):
        unregister_event_handler(print)  # type: ignore[arg-type]


# -- log_event dispatch --------------------------------------------------------------------------------------


def test_log_event_without_handlers_is_a_no_op() -> None:
    assert log_event(make_event()) is None
    assert STATE.handler_errors == 0


def test_log_event_rejects_what_is_not_an_event() -> None:
    with pytest.raises(TypeError, match="expects an Event"):
        log_event({"name": "e"})  # type: ignore[arg-type]


def test_handler_receives_the_very_same_event_object() -> None:
    events: list[Event] = []
    register_event_handler(events.append)
    e = make_event(a=1)
    log_event(e)
    assert len(events) == 1
    assert events[0] is e


def test_handlers_run_synchronously_in_registration_order() -> None:
    calls: list[str] = []
    for tag in "abc":
        register_event_handler(lambda e, tag=tag: calls.append(tag))
    log_event(make_event())
    assert calls == ["a", "b", "c"]  # done before log_event returned
    log_event(make_event())
    assert calls == ["a", "b", "c"] * 2


def test_registering_the_same_callable_twice_calls_it_twice() -> None:
    events: list[Event] = []
    register_event_handler(events.append)
    register_event_handler(events.append)
    log_event(make_event())
    assert len(events) == 2


def test_unregistered_handler_no_longer_receives_events() -> None:
    first: list[Event] = []
    second: list[Event] = []
    h1 = register_event_handler(first.append)
    register_event_handler(second.append)
    unregister_event_handler(h1)
    log_event(make_event())
    assert first == []
    assert len(second) == 1
    assert STATE.handler_tuple == (second.append,)


def test_unregistering_twice_is_a_no_op() -> None:
    events: list[Event] = []
    handle = register_event_handler(events.append)
    other = register_event_handler(events.append)
    unregister_event_handler(handle)
    unregister_event_handler(handle)
    assert STATE.handlers == [other]
    log_event(make_event())
    assert len(events) == 1


def test_unregister_removes_only_that_handle_when_a_callable_is_registered_twice() -> None:
    events: list[Event] = []
    h1 = register_event_handler(events.append)
    h2 = register_event_handler(events.append)
    unregister_event_handler(h2)
    assert STATE.handlers == [h1]


def test_raising_handler_does_not_stop_the_others_and_is_counted() -> None:
    calls: list[str] = []

    def bad(e: Event) -> None:
        calls.append("bad")
        raise RuntimeError("boom")

    register_event_handler(lambda e: calls.append("before"))
    register_event_handler(bad)
    register_event_handler(lambda e: calls.append("after"))
    log_event(make_event())
    log_event(make_event())
    assert calls == ["before", "bad", "after"] * 2
    assert STATE.handler_errors == 2


def test_raising_handler_is_logged_once_per_exception_type(caplog: pytest.LogCaptureFixture) -> None:
    kinds = [ValueError, ValueError, KeyError, ValueError]

    def bad(e: Event) -> None:
        raise kinds.pop(0)("x")

    register_event_handler(bad)
    with caplog.at_level(logging.ERROR, logger="shmstat"):
        for _ in range(4):
            log_event(make_event())
    assert STATE.handler_errors == 4
    records = [r for r in caplog.records if r.name == "shmstat"]
    assert len(records) == 2
    assert "ValueError" in records[0].getMessage()
    assert "KeyError" in records[1].getMessage()
    assert records[0].exc_info is not None


def test_base_exceptions_from_a_handler_propagate() -> None:
    def interrupted(e: Event) -> None:
        raise KeyboardInterrupt

    register_event_handler(interrupted)
    with pytest.raises(KeyboardInterrupt):
        log_event(make_event())
    assert STATE.handler_errors == 0


def test_handler_may_log_an_event_itself() -> None:
    seen: list[str] = []

    def relay(e: Event) -> None:
        seen.append(e.name)
        if e.name == "outer":
            log_event(make_event("inner"))

    register_event_handler(relay)
    log_event(make_event("outer"))
    assert seen == ["outer", "inner"]


def test_handler_may_register_and_unregister_handlers_during_dispatch() -> None:
    calls: list[str] = []
    handles: dict[str, EventHandlerHandle] = {}

    def first(e: Event) -> None:
        calls.append("first")
        unregister_event_handler(handles["first"])
        handles["late"] = register_event_handler(lambda e: calls.append("late"))

    handles["first"] = register_event_handler(first)
    log_event(make_event())
    assert calls == ["first"]  # the snapshot taken at the start of the dispatch is used
    log_event(make_event())
    assert calls == ["first", "late"]


def test_concurrent_logging_and_registration_from_threads() -> None:
    lock = threading.Lock()
    counted = [0]

    def count(e: Event) -> None:
        with lock:
            counted[0] += 1

    register_event_handler(count)
    event = make_event()
    barrier = threading.Barrier(5)

    def logger() -> None:
        barrier.wait()
        for _ in range(2000):
            log_event(event)

    def churner() -> None:
        barrier.wait()
        for _ in range(500):
            unregister_event_handler(register_event_handler(lambda e: None))

    threads = [threading.Thread(target=logger) for _ in range(4)] + [threading.Thread(target=churner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counted[0] == 8000
    assert STATE.handler_tuple == (count,)
    assert STATE.handler_errors == 0


# -- publishing ----------------------------------------------------------------------------------------------


def test_log_event_publishes_after_local_handlers_when_attached() -> None:
    order: list[str] = []
    publisher = FakePublisher()
    original = publisher.publish_event
    publisher.publish_event = lambda *a: (order.append("publish"), original(*a))  # type: ignore[method-assign]
    STATE.publisher = publisher  # type: ignore[assignment]
    register_event_handler(lambda e: order.append("handler"))
    e = make_event("loss", v=0.5, ok=True)
    log_event(e)
    assert order == ["handler", "publish"]
    assert publisher.published == [("loss", e._timestamp_ns(), {"v": 0.5, "ok": True})]


def test_log_event_publishes_even_when_a_handler_raises() -> None:
    publisher = FakePublisher()
    STATE.publisher = publisher  # type: ignore[assignment]

    def bad(e: Event) -> None:
        raise ValueError("x")

    register_event_handler(bad)
    log_event(make_event())
    assert len(publisher.published) == 1
    assert STATE.handler_errors == 1


def test_dispatch_local_calls_handlers_but_does_not_publish() -> None:
    publisher = FakePublisher()
    STATE.publisher = publisher  # type: ignore[assignment]
    events: list[Event] = []
    register_event_handler(events.append)

    def bad(e: Event) -> None:
        raise ValueError("x")

    register_event_handler(bad)
    e = Event._from_ns(STAT_EVENT, 1_700_000_000_000_000_000, {"s.mean": 1.0})
    _dispatch_local(e)
    assert events == [e]
    assert publisher.published == []
    assert STATE.handler_errors == 1


def test_reset_forgets_handlers_and_counters() -> None:
    from shmstat.job._state import reset

    register_event_handler(lambda e: None)
    STATE.handler_errors = 3
    reset()
    assert STATE.handlers == []
    assert STATE.handler_tuple == ()
    assert STATE.handler_errors == 0


# -- against the real torch.monitor --------------------------------------------------------------------------


def test_event_accepts_and_rejects_the_same_data_as_torch() -> None:
    monitor = pytest.importorskip("torch.monitor")
    # bytes are left out on purpose: torch decodes them to str, we refuse them (see the test below)
    cases: list[Any] = [1, -5, 1.5, "s", True, float("inf"), None, [1], {"a": 1}, 2**70, 2**63 - 1]
    for value in cases:
        try:
            monitor.Event("e", NOW, {"k": value})
            torch_error: type[BaseException] | None = None
        except (TypeError, ValueError) as exc:
            torch_error = TypeError if isinstance(exc, TypeError) else ValueError
        try:
            Event("e", NOW, {"k": value})
            ours: type[BaseException] | None = None
        except (TypeError, ValueError) as exc:
            ours = TypeError if isinstance(exc, TypeError) else ValueError
        assert ours == torch_error, value


def test_stat_event_name_and_handler_order_match_torch() -> None:
    monitor = pytest.importorskip("torch.monitor")
    assert monitor.STAT_EVENT == STAT_EVENT
    torch_calls: list[str] = []
    handles = [monitor.register_event_handler(lambda e, t=t: torch_calls.append(t)) for t in "xyz"]
    try:
        monitor.log_event(monitor.Event("e", NOW, {}))
    finally:
        for h in handles:
            monitor.unregister_event_handler(h)
    our_calls: list[str] = []
    for t in "xyz":
        register_event_handler(lambda e, t=t: our_calls.append(t))
    log_event(make_event())
    assert our_calls == torch_calls


def test_bytes_are_refused_where_torch_decodes_them() -> None:
    """A documented difference: torch turns b"x" into "x"; we ask for str instead of guessing an encoding."""
    monitor = pytest.importorskip("torch.monitor")
    assert monitor.Event("e", NOW, {"k": b"x"}).data == {"k": "x"}
    with pytest.raises(TypeError, match="bytes"):
        Event("e", NOW, {"k": b"x"})
