"""Events kept: the records an events sink receives and the built-in sinks (``--events SPEC`` names one).

A sink is an :class:`EventSink`: ``emit_events(batch)``, ``batch`` a list of :class:`EventRecord` (one event) and
:class:`GapRecord` (numbered items that never reached the sink), in the order the collector took them. The
collector calls it from a thread of the sink's own (:mod:`collector.sinks.delivery`), never from its
loop; ``flush()`` and ``close()``, when the sink has them, are called at shutdown. :class:`EventHandler` is the
documented base class, which has both (subclassing it is optional).

SPECs (``shmstat collect --events SPEC``, repeatable): ``jsonl:PATH`` (:class:`JsonlEventHandler`), ``console``
(:class:`ConsoleEventHandler`), ``otlp:ENDPOINT`` (:mod:`collector.sinks.otlp_logs`: OpenTelemetry logs over
OTLP/HTTP) and ``pkg.module:Class[,key=value...]`` (keyword arguments read as for ``--handler``, see
:func:`collector.handlers.specs.parse_spec_kwargs`). :func:`collector.sinks.specs.build_event_handler` builds
the sink a SPEC names; a bad SPEC is a :class:`ConfigError` of one sentence.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Protocol, runtime_checkable

from shmstat.errors import ConfigError

from ..handlers.jsonl import REPAIR_BYTES, read_tail

__all__ = ["ConsoleEventHandler", "EventHandler", "EventRecord", "EventSink", "GapRecord", "JsonlEventHandler"]

EventData = dict[str, str | int | float | bool]


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One event as the collector took it.

    ``rank`` is the rank whose process logged it (``shmstat.log_event``, ``elastic.events.record``); it is None
    for the collector's own events (``rank/joined|exited|died``, ``shmstat.straggler[.recovered]``, the
    launcher's ``torchelastic.worker.status.<STATE>``), whose data names the rank they are about. ``seq`` is the
    item's number in its sender's stream, keyed by (``rank``, ``pid``, ``incarnation``): a rank numbers its
    events and put metrics in one stream, so a rank's events skip the numbers of its metrics; the collector's
    own events are numbered on their own from 0 per job. A loss is always a :class:`GapRecord`, never only a
    skipped number.
    """

    name: str
    job: str
    rank: int | None
    ts_ns: int
    """When the event happened (unix ns, as the rank stamped it)."""
    data: EventData
    seq: int
    pid: int
    incarnation: int = 0

    @property
    def timestamp(self) -> float:
        """:attr:`ts_ns` in unix seconds."""
        return self.ts_ns / 1e9

    def to_json(self) -> dict[str, Any]:
        """The JSON object of a jsonl line: name, job, rank, timestamp (unix seconds), data, seq, pid,
        incarnation; non-finite floats in data as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
        return {"name": self.name, "job": self.job, "rank": self.rank, "timestamp": self.timestamp,
                "data": {k: _json_value(v) for k, v in self.data.items()}, "seq": self.seq, "pid": self.pid,
                "incarnation": self.incarnation}


@dataclass(frozen=True, slots=True)
class GapRecord:
    """``count`` items of one sender's stream (``job``, ``rank``, ``pid``, ``incarnation``) that this sink never
    received, numbered ``from_seq`` to ``to_seq``.

    ``at`` says where they were lost: ``"rank"`` — they never reached the collector (the rank dropped them, its
    backlog full, or they were lost on the way); the numbers are consecutive and ``count`` is
    ``to_seq - from_seq + 1`` items, events or put metrics (one stream numbers both). ``"collector"`` — they
    reached the collector, but this sink's queue was full (or shut down): ``count`` events (and the items of
    ``"rank"`` gaps that did not fit either) between ``from_seq`` and ``to_seq``. ``ts_ns`` is when the collector
    noticed. ``rank`` None is the collector's own stream.
    """

    job: str
    rank: int | None
    pid: int
    incarnation: int
    from_seq: int
    to_seq: int
    count: int
    at: str
    ts_ns: int

    @property
    def timestamp(self) -> float:
        """:attr:`ts_ns` in unix seconds."""
        return self.ts_ns / 1e9

    def to_json(self) -> dict[str, Any]:
        """The JSON object of a jsonl line: gap (the count), job, rank, pid, incarnation, from_seq, to_seq, at,
        timestamp."""
        return {"gap": self.count, "job": self.job, "rank": self.rank, "pid": self.pid,
                "incarnation": self.incarnation, "from_seq": self.from_seq, "to_seq": self.to_seq, "at": self.at,
                "timestamp": self.timestamp}


@runtime_checkable
class EventSink(Protocol):
    """What the collector calls of an events sink (``--events SPEC``): :meth:`emit_events`, on a thread of the
    sink's own. A class is one if it defines it (:class:`EventHandler` does; subclassing it is optional)."""

    def emit_events(self, batch: list[EventRecord | GapRecord]) -> None:
        """Take a batch of records, in the order the collector took them (see :meth:`EventHandler.emit_events`)."""
        ...


class EventHandler:
    """The base class of an events sink (``--events pkg.module:Class``): an :class:`EventSink` with a
    :meth:`flush` and a :meth:`close` that do nothing; subclassing it is optional."""

    def emit_events(self, batch: list[EventRecord | GapRecord]) -> None:
        """Take a batch of records, in the order the collector took them. Called from one thread of this sink's
        own; a call may block (it delays only this sink, whose queue then fills and drops, counted). Raising
        counts the call in ``collector.event_handler_errors`` and its events in ``collector.events_dropped``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Push what is buffered (called at shutdown, before :meth:`close`)."""

    def close(self) -> None:
        """Release what the sink holds (called once, at shutdown, if the sink finished its queue in time)."""


class JsonlEventHandler(EventHandler):
    """Appends one JSON object per record to ``path`` (:meth:`EventRecord.to_json`, :meth:`GapRecord.to_json`),
    opened 0600 in append mode; a batch is written whole or not at all: a write that fails (a full disk) is undone
    (the file cut back to its length before the batch) and raises, so each record of the batch is either in the
    file or counted as lost, never both, and a reader sees whole lines only. Exactly once across collector
    SIGKILLs: on open, a line a kill cut is removed and the ranks' events the file's tail holds are not written
    again when re-sent."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open the events output {path!r}: {exc.strerror}") from None
        read_tail(self._fd, path, REPAIR_BYTES)  # a cut last line repaired at once (a small read, nothing parsed)
        self._held: set[tuple[Any, ...]] | None = None  # read by the first batch, in the sink's thread
        """(job, rank, pid, incarnation, seq) of the ranks' events in the file's tail when opened: a collector
        SIGKILLed after this file took a batch and before its delivered mark moved leaves them to be re-sent once,
        and they are not written twice."""

    def __repr__(self) -> str:
        return f"JsonlEventHandler({self.path!r})"

    def emit_events(self, batch: list[EventRecord | GapRecord]) -> None:
        """Write one line per record, all or none (see the class docstring)."""
        if self._held is None:
            self._held = _resume_events(self._fd, self.path) if self._fd >= 0 else set()
        if self._held:
            batch = [r for r in batch if not (isinstance(r, EventRecord) and r.rank is not None and
                                              (r.job, r.rank, r.pid, r.incarnation, r.seq) in self._held)]
        if not batch or self._fd < 0:
            return
        data = memoryview("".join(json.dumps(r.to_json(), allow_nan=False) + "\n" for r in batch).encode("utf-8"))
        start = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)  # no partial batch, no partial line
            raise

    def close(self) -> None:
        """Close the file (every batch was written as it came: nothing is buffered here)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


RESUME_TAIL_BYTES = 8 << 20
"""Bytes at the end of an events jsonl file read back on open (a batch is at most about 1 MiB of payload)."""


def _resume_events(fd: int, path: str, tail_bytes: int = RESUME_TAIL_BYTES) -> set[tuple[Any, ...]]:
    """The keys of the ranks' events in the file's tail (:func:`~collector.handlers.jsonl.read_tail`, which also
    cuts a last line a kill left unfinished)."""
    held: set[tuple[Any, ...]] = set()
    for line in read_tail(fd, path, tail_bytes)[0]:
        if not line or b'"gap"' in line[:8]:
            continue
        try:
            row = json.loads(line)
            if row.get("rank") is not None:
                held.add((row["job"], row["rank"], row["pid"], row["incarnation"], row["seq"]))
        except (ValueError, KeyError, TypeError, AttributeError):  # not a line of ours
            continue
    return held


class ConsoleEventHandler(EventHandler):
    """Prints one line per record on ``out`` (default: the current stdout), e.g.
    ``[12:00:05.123] job J rank 0: loss_spike {"step": 3}``, ``[12:00:05.200] job J: rank/joined {...}`` for the
    collector's own, and ``[12:00:06.000] job J rank 1 (pid 42, incarnation 0): 5 lost at the rank (seq 10..14)``
    for a gap."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "ConsoleEventHandler()"

    def emit_events(self, batch: list[EventRecord | GapRecord]) -> None:
        """Print the batch, one line per record."""
        lines = [_console_line(r) for r in batch]
        if lines:
            out = self.out if self.out is not None else sys.stdout
            with self._lock:
                out.write("\n".join(lines) + "\n")
                out.flush()


def _console_line(r: EventRecord | GapRecord) -> str:
    ms = r.ts_ns // 1_000_000
    stamp = f"[{time.strftime('%H:%M:%S', time.localtime(ms // 1000))}.{ms % 1000:03d}]"
    who = f"job {r.job}" + ("" if r.rank is None else f" rank {r.rank}")
    if isinstance(r, GapRecord):
        return (f"{stamp} {who} (pid {r.pid}, incarnation {r.incarnation}): {r.count} lost at the {r.at} "
                f"(seq {r.from_seq}..{r.to_seq})")
    data = json.dumps({k: _json_value(v) for k, v in r.data.items()}, allow_nan=False)
    return f"{stamp} {who}: {r.name} {data}"


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value
