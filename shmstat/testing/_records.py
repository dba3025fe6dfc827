"""What a test sees of a job: plain records of the collector's rows, the put metrics and the events, taken from
the collector's re-published streams by a subscriber of the test's own."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import zmq

from .. import wire
from ..errors import WireError

__all__ = ["EventRecord", "MetricRecord", "Row"]


@dataclass(frozen=True)
class Row:
    """One figure of one closed window as the collector emitted it: ``stat``'s ``agg`` (``count``, ``sum``,
    ``mean``, ``max``, ``min``, ``value``; ``p50``... for stats keeping percentiles) over ``[window_start,
    window_end)`` (Unix seconds), for one ``rank`` or merged across ranks (``rank`` None). Every figure the
    collector computes is there, whichever aggregations the stat asked for; a ``count`` is an int."""

    group: str
    stat: str
    agg: str
    value: float
    rank: int | None
    window_start: float
    window_end: float
    wait: bool = False
    """The stat times a wait for other ranks (a wait section, ``shmstat.section(..., wait=True)``)."""

    @property
    def merged(self) -> bool:
        """Whether the row is merged across ranks."""
        return self.rank is None


@dataclass(frozen=True)
class MetricRecord:
    """One ``put_metric`` value (or one of ``@prof``'s) as the collector re-published it."""

    group: str
    name: str
    value: float
    rank: int | None
    timestamp: float


@dataclass(frozen=True)
class EventRecord:
    """One event a rank logged (or the collector's own, rank -1), as a subscriber received it."""

    name: str
    timestamp_ns: int
    data: dict[str, Any] = field(hash=False)
    rank: int
    pid: int

    @property
    def timestamp(self) -> datetime:
        """The event's time (UTC)."""
        return datetime.fromtimestamp(self.timestamp_ns / 1e9, tz=timezone.utc)


_AGGS = ("count", "sum", "mean", "min", "max", "value", "p50", "p90", "p99", "p999")


def rows_of(item: dict[str, Any]) -> list[Row]:
    """The :class:`Row` records of one ``stat/`` stream item (one stat, window and rank: every figure); none for
    the collector's own usage items, which are not windows."""
    if "start_ns" not in item:
        return []
    start, end = item["start_ns"] / 1e9, item["end_ns"] / 1e9
    wait = item.get("wait") is True
    return [Row(item["group"], item["name"], agg, item[agg], item["rank"], start, end, wait)
            for agg in _AGGS if agg in item]


class StreamTap:
    """A ZeroMQ subscriber of the collector's ``event/``, ``stat/`` and ``metric/`` streams, recording every item
    in a thread of its own (never dropping: a test wants everything). A stream item is taken whole, so the
    figures of one window and rank always arrive together."""

    def __init__(self, endpoint: str) -> None:
        self.events: list[EventRecord] = []
        self.rows: list[Row] = []
        self.metrics: list[MetricRecord] = []
        self.malformed = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # never drop here: a test wants every event
        for topic in (b"event/", b"stat/", b"metric/"):
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="shmstat-testing-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = wire.decode_frames(frames)
                    except WireError:
                        self.malformed += 1
                        continue
                    with self._cond:
                        try:
                            self._take(msg)
                        except (KeyError, TypeError, ValueError):  # an item of a shape this tap does not know
                            self.malformed += 1
                        self._cond.notify_all()
        finally:
            self._sock.close(0)

    def _take(self, msg: wire.WireMessage) -> None:
        if msg.kind == "event":
            self.events.extend(EventRecord(name, ts, dict(data), msg.rank, msg.pid) for name, ts, data in msg.items)
        elif msg.kind == "stat":
            for item in msg.items:
                self.rows.extend(rows_of(item))
        elif msg.kind == "metric":
            self.metrics.extend(MetricRecord(group, name, value, msg.rank, float(ts))
                                for group, name, value, ts in msg.items)

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for another item."""
        with self._cond:
            self._cond.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        if self._thread.ident != threading.get_ident():
            self._thread.join(5)
        self._ctx.term()


def tail(path: str, max_bytes: int = 4000) -> str:
    """The end of a text file (what a process printed last), or ``""``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
