"""Events and event handlers: the ``torch.monitor`` event API (:class:`Event`, :func:`log_event`, ...).

An :class:`Event` is a name, a timestamp and a flat dict of data. :func:`log_event` hands the event to
every handler registered with :func:`register_event_handler`, synchronously and in registration order, then
(when the process is attached to a job) to the rank's publisher, which ships it to the node's collector.

``data_value_t`` mirrors ``torch.monitor.data_value_t``: a data value is one of ``str``, ``float``, ``int`` or
``bool``. Here it is a typing union usable in annotations and in ``isinstance``.

Where we differ from torch (on purpose, each one an improvement):

- a ``bool`` in the data stays a ``bool`` (torch turns it into ``1.0``);
- a handler that raises is logged and counted in ``shmstat.job._state.STATE.handler_errors``, and the other
  handlers still run (torch skips the rest);
- a handler may call :func:`log_event` itself (torch deadlocks);
- unregistering a handle twice is a no-op (torch crashes);
- timezone-aware timestamps keep their zone; naive ones mean local time, as in
  :meth:`datetime.datetime.timestamp`.

The handler registry lives in :data:`shmstat.job._state.STATE` (``handlers`` and the ``handler_tuple`` snapshot).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .._backend import backend
from ..errors import EventTooLargeError
from ..job import _state
from ..job._state import STATE
from ..names import KNOWN as _KNOWN
from ..names import check_event_name
from ..wire import MAX_EVENT_BYTES
from ._eventdata import (
    _NS_PER_S,
    _c_naive_ns,
    _check_data,
    _check_data_slow,
    _check_name,
    _check_timestamp,
    _datetime_from_ns,
    _naive_local_ns,
    data_value_t,
)
from .item_sizes import item_bytes

__all__ = [
    "STAT_EVENT",
    "Event",
    "EventHandlerHandle",
    "data_value_t",
    "log_event",
    "register_event_handler",
    "unregister_event_handler",
]

_log = logging.getLogger("shmstat")

_KNOWN_NAMES = _KNOWN[0]  # names found valid so far (shmstat.names)

STAT_EVENT = "torch.monitor.Stat"
"""The name of the Event a Stat logs when a window closes (the same string torch uses)."""

class _PyEventStorage:
    """The storage and constructor of :class:`Event` in Python (its C twin: ``Backend.EventBase``, shmstat._backend)."""

    __slots__ = ("_data", "_name", "_nbytes", "_ts", "_ts_ns")

    _name: str
    _ts: datetime | None
    _ts_ns: int | None
    _data: dict[str, data_value_t]
    _nbytes: int

    def __init__(self, name: str, timestamp: datetime, data: Mapping[str, data_value_t]) -> None:
        self._name = name if type(name) is str else _check_name(name)
        self._ts = timestamp if type(timestamp) is datetime else _check_timestamp(timestamp)
        self._ts_ns = None
        self._data = _check_data(data)
        self._nbytes = 0  # its estimated size on the wire, computed when it is first published


_BACKEND = backend()  # Event's storage and log_event are fixed here, when shmstat is imported (see _backend)
if TYPE_CHECKING:  # the C twin has the same slots and constructor: type-check against the Python one
    _EventStorage = _PyEventStorage
else:
    _EventStorage: type = _PyEventStorage
    if _BACKEND.EventBase is not None and _BACKEND.set_event_checks is not None:
        _EventStorage = _BACKEND.EventBase  # the same checks, in C
        _BACKEND.set_event_checks(_check_name, _check_timestamp, _check_data_slow)


class Event(_EventStorage):
    """A named, timestamped record with structured data, to be passed to :func:`log_event`.

    ``Event(name, timestamp, data)``: raises :class:`TypeError` if any argument, key or value has a wrong type;
    ``data`` is copied; an int outside the signed 64-bit range raises :class:`~shmstat.errors.ConfigError`
    (a ValueError, as in torch). A naive ``timestamp`` means local time; an aware one keeps its zone.

    All Events of the same type should have the same name so downstream handlers can process them.
    ``name``, ``timestamp`` and ``data`` can be read and assigned; assignments are validated like the
    constructor's arguments. ``data`` returns the event's own dict: change it by assigning a new one.
    """

    __slots__ = ()

    @classmethod
    def _from_ns(cls, name: str, ts_ns: int, data: dict[str, data_value_t]) -> Event:
        """Build an Event from trusted internal values without validation (``data`` is not copied).

        The timestamp is kept as integer Unix nanoseconds; the datetime is built on first read of
        :attr:`timestamp` (and cached), so an event nobody looks at never pays for a datetime.
        """
        event = _EventStorage.__new__(cls)
        event._name = name
        event._ts = None
        event._ts_ns = ts_ns
        event._data = data
        event._nbytes = 0
        return event

    @property
    def name(self) -> str:
        """The name of the Event."""
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = _check_name(value)
        self._nbytes = 0

    @property
    def timestamp(self) -> datetime:
        """The timestamp when the Event happened (for internal events: naive local time, microseconds)."""
        ts = self._ts
        if ts is None:
            ts = self._ts = _datetime_from_ns(self._ts_ns)  # type: ignore[arg-type]  # _ts or _ts_ns is always set
        return ts

    @timestamp.setter
    def timestamp(self, value: datetime) -> None:
        self._ts = _check_timestamp(value)
        self._ts_ns = None

    @property
    def data(self) -> dict[str, data_value_t]:
        """The structured data contained within the Event (the event's own dict; assign to replace it)."""
        return self._data

    @data.setter
    def data(self, value: Mapping[str, data_value_t]) -> None:
        self._data = _check_data(value)
        self._nbytes = 0

    def _timestamp_ns(self) -> int:
        """The timestamp as integer Unix nanoseconds (computed once from the datetime, then cached).

        A naive datetime is interpreted as local time, exactly like :meth:`datetime.datetime.timestamp`.
        """
        ns = self._ts_ns
        if ns is None:
            ts: datetime = self._ts  # type: ignore[assignment]  # _ts_ns is None: _ts is set
            if ts.tzinfo is None:
                ns = _c_naive_ns(ts) if _c_naive_ns is not None else None
                if ns is None:
                    ns = _naive_local_ns(ts)
                self._ts_ns = ns
            else:
                whole = int(ts.replace(microsecond=0).timestamp())  # an exact integer-valued float
                ns = self._ts_ns = whole * _NS_PER_S + ts.microsecond * 1000
        return ns

    def __repr__(self) -> str:
        """``Event(name=..., timestamp=..., data=...)``."""
        return f"Event(name={self._name!r}, timestamp={self.timestamp!r}, data={self._data!r})"


_HANDLE_TOKEN = object()


class EventHandlerHandle:
    """Returned by :func:`register_event_handler`; pass it to :func:`unregister_event_handler`.

    It cannot be constructed directly (:class:`TypeError`), as in torch.
    """

    __slots__ = ("_callback", "_reported")

    _callback: Callable[[Event], None]
    _reported: set[type[BaseException]]

    def __init__(self, _token: object = None, _callback: Callable[[Event], None] | None = None) -> None:
        """Refuse construction outside this module."""
        if _token is not _HANDLE_TOKEN or _callback is None:
            raise TypeError(
                "EventHandlerHandle cannot be directly initialized: call register_event_handler(callback)"
            )
        self._callback = _callback
        self._reported = set()

    def __repr__(self) -> str:
        """``<EventHandlerHandle for <callback>>``."""
        return f"<EventHandlerHandle for {self._callback!r}>"


def register_event_handler(callback: Callable[[Event], None]) -> EventHandlerHandle:
    """Register ``callback`` to be called with every Event passed to :func:`log_event`; return its handle.

    Handlers run synchronously in registration order inside ``log_event``, so they should not block.
    Registering the same callable twice makes it run twice. Raises :class:`TypeError` if it is not callable.
    """
    if not callable(callback):
        raise TypeError(f"event handler must be callable, not {type(callback).__name__}")
    handle = EventHandlerHandle(_HANDLE_TOKEN, callback)
    with STATE.lock:
        STATE.handlers.append(handle)
        STATE.handler_tuple = tuple(h._callback for h in STATE.handlers)
    return handle


def unregister_event_handler(handler: EventHandlerHandle) -> None:
    """Unregister the handler behind ``handler``; events logged after this returns no longer reach it.

    A ``log_event`` already dispatching (on another thread, or further up this thread's stack) may still
    deliver its current event. Unregistering a handle a second time is a no-op. Raises :class:`TypeError` for
    anything that is not an :class:`EventHandlerHandle`.
    """
    if not isinstance(handler, EventHandlerHandle):
        raise TypeError(f"expected an EventHandlerHandle, not {type(handler).__name__}")
    with STATE.lock:
        handlers = STATE.handlers
        for i, registered in enumerate(handlers):
            if registered is handler:
                del handlers[i]
                STATE.handler_tuple = tuple(h._callback for h in handlers)
                return


def _handler_failed(callback: Callable[[Event], None], exc: Exception) -> None:
    """Count a handler's exception; log it the first time this handler raises this exception type."""
    with STATE.lock:
        STATE.handler_errors += 1
        handle = next((h for h in STATE.handlers if h._callback is callback), None)
        kind = type(exc)
        if handle is not None:
            if kind in handle._reported:
                return
            handle._reported.add(kind)
    _log.error(
        "event handler %r raised %s; the other handlers still ran "
        "(further %s from it are counted, not logged)",
        callback,
        kind.__name__,
        kind.__name__,
        exc_info=exc,
    )


def log_event(event: Event) -> None:
    """Pass ``event`` (the same object) to every registered handler, in order, then to the job's collector.

    With no handlers and no job attached this is a no-op; a job configured by the environment is attached on
    the first call, as by a :class:`Stat`. A handler's exception is logged and counted, never raised, and the
    remaining handlers still run; a handler may itself call ``log_event``. Raises :class:`TypeError` if
    ``event`` is not an :class:`Event`, :class:`~shmstat.errors.ConfigError` if its name breaks the name rule of
    :mod:`shmstat.names` (before any handler sees it; an Event itself takes any ``str``, as torch's does) and
    :class:`~shmstat.errors.EventTooLargeError` if it is to be published and is over
    :data:`shmstat.wire.MAX_EVENT_BYTES` (after the local handlers saw it).
    """
    if not isinstance(event, Event):
        raise TypeError(f"log_event expects an Event, not {type(event).__name__}")
    if event._name not in _KNOWN_NAMES:
        check_event_name(event._name)
    for callback in STATE.handler_tuple:
        try:
            callback(event)
        except Exception as exc:
            _handler_failed(callback, exc)
    pub = STATE.publisher
    if pub is None and not STATE.auto_init_done:
        pub = _attach_from_env()
    if pub is not None:
        _publish(event, pub)


def _publish(event: Event, pub: Any) -> None:
    """The publishing half of :func:`log_event` (the C one calls it for what its fast path declines)."""
    outbox = getattr(pub, "outbox", None)  # None: a stand-in publisher with publish_event only
    if outbox is not None:
        size = outbox.log(event, MAX_EVENT_BYTES)  # fields read, checked, encoded and queued in one call
        if size >= 0:
            if not pub.started:
                pub.start()
            if size > MAX_EVENT_BYTES:
                raise _too_large(event._name, size)
            return
    # stand-in publishers, and what the outbox's fast path declined
    ts_ns = event._ts_ns
    if ts_ns is None:
        ts_ns = event._timestamp_ns()
    # the outbox checks, encodes and queues it in one call (size -1: its fast path declined it)
    size = -1 if outbox is None else outbox.event(event._name, ts_ns, event._data, event._nbytes,
                                                  MAX_EVENT_BYTES)
    if size < 0:
        size = event._nbytes or item_bytes(event._name, event._data)
        if size <= MAX_EVENT_BYTES:
            pub.publish_event(event._name, ts_ns, event._data, size)
    elif not pub.started:
        pub.start()
    if size > MAX_EVENT_BYTES:
        raise _too_large(event._name, size)
    event._nbytes = size


def _too_large(name: str, size: int) -> EventTooLargeError:
    return EventTooLargeError(
        f"event {name!r} is about {size} bytes, over the {MAX_EVENT_BYTES}-byte maximum an event may have on the "
        "wire; log smaller events (large artefacts belong in files)"
    )


def _attach_from_env() -> Any:
    """Attach as :class:`Stat` does, the first time anything is logged (a rank configured by the environment)."""
    from ..job.attach import ensure_init  # late: attach imports the publisher

    ensure_init()
    return STATE.publisher


def _dispatch_local(event: Event) -> None:
    """Pass ``event`` to the local handlers only (no publishing); same error handling as :func:`log_event`.

    Used for Stat windows, which reach the collector through shared memory rather than the wire.
    """
    for callback in STATE.handler_tuple:
        try:
            callback(event)
        except Exception as exc:
            _handler_failed(callback, exc)


_py_log_event = log_event
if (_BACKEND.log_event is not None and _BACKEND.set_log_state is not None and _BACKEND.sync_log_state is not None
        and _EventStorage is not _PyEventStorage):
    _BACKEND.set_log_state(Event, _handler_failed, _attach_from_env, _publish, _too_large, MAX_EVENT_BYTES,
                           check_event_name)
    _state.set_sync_hook(_BACKEND.sync_log_state)  # the C log_event reads its copy of STATE's fields
    log_event = _BACKEND.log_event  # type: ignore[assignment]  # the same function, in C (tests/rank/test_event_paths.py)
