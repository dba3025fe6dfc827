"""What a test sees of a job: plain records of the collector's rows, the put metrics and the events."""

from __future__ import annotations

import json
import math
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
    ``mean``, ``max``, ``min``, ``value``, ``p50``...) over ``[window_start, window_end)`` (Unix seconds), for
    one ``rank`` or merged across ranks (``rank`` None)."""

    group: str
    stat: str
    agg: str
    value: float
    rank: int | None
    window_start: float
    window_end: float

    @property
    def merged(self) -> bool:
        """Whether the row is merged across ranks."""
        return self.rank is None


@dataclass(frozen=True)
class MetricRecord:
    """One ``put_metric`` value (or one of ``@prof``'s) as the collector handled it."""

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


def _number(value: Any) -> float:
    if isinstance(value, str):  # the jsonl handler writes non-finite floats as strings
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value, math.nan)
    return value


class JsonlReader:
    """Reads the rows and metrics the collector's jsonl handler appends to ``path``, incrementally (only whole
    lines; a line being written is read on the next call)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._lock = threading.Lock()
        self.rows: list[Row] = []
        self.metrics: list[MetricRecord] = []

    def refresh(self) -> None:
        """Take in the lines appended since the last call."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    chunk = f.read()
            except FileNotFoundError:
                return
            end = chunk.rfind(b"\n") + 1
            self._offset += end
            for line in chunk[:end].splitlines():
                if line.strip():
                    self._take(json.loads(line))

    def _take(self, doc: dict[str, Any]) -> None:
        if doc.get("window_start") is None:
            rank = doc.get("source_rank", doc.get("rank"))
            self.metrics.append(MetricRecord(doc["group"], doc["name"], _number(doc["value"]), rank,
                                             float(doc["timestamp"])))
            return
        stat, _, agg = doc["name"].rpartition(".")
        self.rows.append(Row(doc["group"], stat, agg, _number(doc["value"]), doc["rank"],
                             float(doc["window_start"]), float(doc["window_end"])))


class EventTap:
    """A ZeroMQ subscriber of the collector's ``event/`` stream, recording every event in a thread of its own."""

    def __init__(self, endpoint: str) -> None:
        self.events: list[EventRecord] = []
        self.malformed = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # never drop here: a test wants every event
        self._sock.setsockopt(zmq.SUBSCRIBE, b"event/")
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
                        if len(frames) != 2:
                            raise WireError("not two frames")
                        msg = wire.decode(frames[0], frames[1])
                    except WireError:
                        self.malformed += 1
                        continue
                    got = [EventRecord(name, ts, dict(data), msg.rank, msg.pid) for name, ts, data in msg.items]
                    with self._cond:
                        self.events.extend(got)
                        self._cond.notify_all()
        finally:
            self._sock.close(0)

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for another event."""
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
