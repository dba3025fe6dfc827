"""``elastic.events``: torchelastic's event API (``torch.distributed.elastic.events``), shmstat-backed.

Events are recorded through standard Python logging, one logger per destination::

    from elastic import events

    event = events.Event(name="test_event", source=events.EventSource.WORKER, metadata={"step": 3})
    events.record(event, destination="console")   # one JSON line on stderr

Destinations: ``console`` (the event's JSON on stderr), ``null`` and ``dynamic_rendezvous`` (discarded
unless a handler is added; torchrun chooses one with ``--event-log-handler``). The loggers are named
``shmstat.elastic.events.<destination>``, take their level from ``$LOGLEVEL`` (default ``INFO``, read when
a destination is first used) and do not propagate to the root logger, as in torchelastic.

What we add: when the process is attached to a job, every recorded event is also published to the node's
collector on topic ``event/<name>``, with a flat data dict: for an :class:`Event`, its metadata plus
``source``; for an :class:`RdzvEvent`, its fields (except ``name``). Values that are not ``str``, ``int``,
``float`` or ``bool`` (``None`` included) are sent as strings, enums as their value. Outside a job only the
local destination sees the event, exactly like torchelastic.

Differences from torchelastic, all deliberate: an event is serialized only when some handler will see it;
``construct_and_record_rdzv_event`` finds its caller with one frame lookup (not ``inspect.stack()``, which
reads source files) and resolves the host name once per process; the ``console`` handler writes to the
current ``sys.stderr``; an unknown destination's :class:`KeyError` names the known ones.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from enum import Enum
from typing import Any

from shmstat.names import check_event_name

from ..metrics._registry import publisher
from . import api as api  # torchelastic's events.api, an attribute of the package as there
from .event_types import Event, EventMetadataValue, EventSource, NodeState, RdzvEvent
from .handlers import get_logging_handler

__all__ = [
    "Event",
    "EventMetadataValue",
    "EventSource",
    "NodeState",
    "RdzvEvent",
    "construct_and_record_rdzv_event",
    "get_logging_handler",
    "record",
    "record_rdzv_event",
]

_events_loggers: dict[str, logging.Logger] = {}
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _get_or_create_logger(destination: str = "null") -> logging.Logger:
    """The logger of ``destination``: level from ``$LOGLEVEL`` (default INFO), no propagation, its handler."""
    logger = _events_loggers.get(destination)
    if logger is None:
        handler = get_logging_handler(destination)  # KeyError for an unknown destination
        logger = logging.getLogger(f"shmstat.elastic.events.{destination}")
        level = os.environ.get("LOGLEVEL", "INFO")
        try:
            logger.setLevel(level.upper())
        except ValueError:
            logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(handler)
        _events_loggers[destination] = logger
    return logger


def _has_output(logger: logging.Logger) -> bool:
    """Whether an INFO record on ``logger`` would reach anything but null handlers."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    return logger.propagate or any(not isinstance(h, logging.NullHandler) for h in logger.handlers)


def _scalar(value: Any) -> str | int | float | bool:
    """``value`` as a wire scalar: str/int/float/bool kept (subclasses as the base type), enums as their
    value, ints beyond 64 bits and everything else (``None`` included) as ``str(value)``."""
    kind = type(value)
    if kind is str or kind is bool or kind is float:
        return value
    if kind is int:
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    if isinstance(value, Enum):
        return _scalar(value.value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return _scalar(int(value))
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    return str(value)


def _event_data(event: Any) -> tuple[str, int, dict[str, str | int | float | bool]] | None:
    """``(name, ts_ns, flat data)`` to publish for ``event``, or None if it is not an event we can flatten."""
    if isinstance(event, Event):
        ts_ms = event.timestamp
        if isinstance(ts_ms, (int, float)) and not isinstance(ts_ms, bool) and ts_ms > 0:
            ts_ns = int(ts_ms * 1_000_000)
        else:
            ts_ns = time.time_ns()
        metadata = event.metadata if isinstance(event.metadata, Mapping) else {}
        data = {str(key): _scalar(value) for key, value in metadata.items()}
        data["source"] = _scalar(event.source)
        return str(event.name), ts_ns, data
    if dataclasses.is_dataclass(event) and not isinstance(event, type) and hasattr(event, "name"):
        data = {f.name: _scalar(getattr(event, f.name)) for f in dataclasses.fields(event) if f.name != "name"}
        return str(event.name), time.time_ns(), data
    return None


def _check_name(event: Any) -> None:
    """The name rule for ``event.name`` (an object without a ``name`` is never published: nothing to check)."""
    if hasattr(event, "name"):
        check_event_name(event.name)


def _publish(event: Any) -> None:
    """Publish ``event`` to the collector on ``event/<name>`` when this process is attached to a job."""
    pub = publisher()
    if pub is None:
        return
    item = _event_data(event)
    if item is not None:
        pub.publish_event(*item)


def record(event: Event, destination: str = "null") -> None:
    """Log ``event``'s JSON (:meth:`Event.serialize`) to ``destination``; publish it too when attached.

    ``destination`` is ``"console"``, ``"null"`` or ``"dynamic_rendezvous"``; an unknown one raises
    :class:`KeyError` (and nothing is published). An event whose name breaks the name rule
    (:mod:`shmstat.names`) raises :class:`~shmstat.errors.ConfigError` before anything is logged or published.
    """
    _check_name(event)
    logger = _get_or_create_logger(destination)
    if _has_output(logger):
        logger.info(event.serialize())
    _publish(event)


def record_rdzv_event(event: RdzvEvent) -> None:
    """Log ``event``'s JSON to the ``dynamic_rendezvous`` destination; publish it too when attached. A name that
    breaks the name rule (:mod:`shmstat.names`) raises :class:`~shmstat.errors.ConfigError` first, as in
    :func:`record`."""
    _check_name(event)
    logger = _get_or_create_logger("dynamic_rendezvous")
    if _has_output(logger):
        logger.info(event.serialize())
    _publish(event)


@functools.cache
def _fqdn() -> str:
    return socket.getfqdn()


def construct_and_record_rdzv_event(
    run_id: str,
    message: str,
    node_state: NodeState,
    name: str = "",
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
) -> None:
    """Build an :class:`RdzvEvent` about the caller and record it with :func:`record_rdzv_event`.

    The event is named ``<caller's file name>:<name>`` (``name`` defaults to the caller's function name);
    ``hostname`` defaults to the FQDN, ``pid`` to this process; a ``FAILED`` state carries the traceback of
    the exception being handled. Does nothing (and computes nothing) when the ``dynamic_rendezvous``
    destination discards events and the process is not attached to a job.
    """
    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler) and publisher() is None:
        return
    if not hostname:
        hostname = _fqdn()
    if not pid:
        pid = os.getpid()
    try:
        caller = sys._getframe(1).f_code
    except ValueError:  # pragma: no cover - called with no Python caller
        filename = "no_file"
    else:
        filename = os.path.basename(caller.co_filename)
        if not name:
            name = caller.co_name
    error_trace = traceback.format_exc() if node_state == NodeState.FAILED else ""
    record_rdzv_event(
        RdzvEvent(
            name=f"{filename}:{name}",
            run_id=run_id,
            message=message,
            hostname=hostname,
            pid=pid,
            node_state=node_state,
            master_endpoint=master_endpoint,
            rank=rank,
            local_id=local_id,
            error_trace=error_trace,
        )
    )
