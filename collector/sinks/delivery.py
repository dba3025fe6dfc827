"""Events off the collector's loop: every events sink runs in a thread of its own behind a queue bounded in bytes.

The loop only queues (:meth:`EventDelivery.offer_message` for a rank's ``event/`` message, kept as the bytes it
arrived in and decoded in the sink's thread; :meth:`EventDelivery.offer` for a record the collector made); it
never waits for a sink. A sink's queue holds at most ``queue_bytes`` (payload bytes plus a fixed overhead per
entry); what does not fit is dropped, counted (``dropped``, per job) and summed per sender stream into a
:class:`~collector.sinks.events.GapRecord` with ``at="collector"`` that the sink receives with its next batch,
so its output tells the loss apart from silence. The summaries are bounded too (:data:`MAX_SUMMARIES` streams).

A sink takes batches of up to ~1 MiB of payload (:data:`MAX_BATCH_BYTES`, at most :data:`MAX_BATCH_EVENTS`
events): decoded there, so the decoded objects of at most one batch per sink exist at a time. A call that
raises is counted in ``errors`` and its events in ``dropped``.

:meth:`EventDelivery.close` gives every sink ``close_budget_s`` in all to take what is queued, then flushes and
closes the sinks that finished. A sink still stuck is left behind (its thread is a daemon) and what it held — its
queue and the batch in its hands — is counted as dropped, except the events their live ranks still keep and
re-send to the next collector (``left``: their delivered marks stay below them, see :meth:`EventDelivery.resent_by`),
so at every moment ``offered == delivered + dropped + left + queued + in hand``, per sink, and after close nothing
is unaccounted and nothing counted twice.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, NamedTuple

from shmstat import wire
from shmstat.errors import WireError
from shmstat.publish.item_sizes import item_bytes

from ..relay.intake import Received
from .events import EventRecord, EventSink, GapRecord
from .specs import build_event_handler

__all__ = ["DEFAULT_EVENTS_QUEUE_BYTES", "MAX_BATCH_BYTES", "MAX_BATCH_EVENTS", "MAX_SUMMARIES", "EventDelivery"]

_log = logging.getLogger("shmstat.collector")

DEFAULT_EVENTS_QUEUE_BYTES = 64 * 1024 * 1024
"""Bytes queued per events sink at most (``--events-queue-mb``) before new events for it are dropped, counted."""
STOP_GRACE_S = 1.0
"""At a close whose deadline has passed (a stuck sink used the budget), how long each sink still gets to take its
stop: one that took everything answers at once, but on a loaded machine its thread may not have run yet (given up,
its file would not be flushed)."""
MAX_BATCH_BYTES = 1024 * 1024
MAX_BATCH_EVENTS = 8192
MAX_SUMMARIES = 4096
"""Sender streams whose drops a sink sums separately; past it, drops are summed under job ``""``."""
_RETRY_S = 1.0  # a sink that raised gets its gap records again after this long with nothing else to take
_ENTRY_BYTES = 256  # what an entry costs beyond its payload (the entry, the Received or record object)

_STOP, _BARRIER = object(), object()


class _Entry(NamedTuple):
    job: str
    item: Any  # Received (a rank's event message), EventRecord or GapRecord
    nbytes: int
    events: int
    ticket: int  # the delivery's number for this entry (every sink took it or counted it: see completed())


class _Sink:
    """One sink's queue and thread."""

    def __init__(self, handler: EventSink, limit_bytes: int, on_done: Any = None) -> None:
        self.handler = handler
        self.on_done = on_done  # called in this thread after a batch was taken (the delivery's listeners)
        self.limit = limit_bytes
        self.queue: collections.deque[Any] = collections.deque()
        self.bytes = 0
        self.cond = threading.Condition()
        self.delivered = 0
        self.errors = 0
        self.dropped: dict[str, int] = collections.defaultdict(int)
        self.in_hand: dict[str, int] = {}  # events of the batch being emitted, per job
        self.in_hand_entries: list[_Entry] = []  # that batch's entries
        self.left: dict[str, int] = collections.defaultdict(int)
        """Events of a sink given up at close that their ranks still keep and re-send to the next collector."""
        self.abandoned = False
        self.offered = 0  # the ticket of the last entry put here
        self.done = 0  # every entry with a ticket up to this one was taken (or counted as lost)
        self._upto = 0  # what the batch in hand completes
        self._failing = False  # the last batch raised
        self._summaries: dict[tuple[str, int | None, int, int], list[int]] = {}  # -> [from, to, count]
        self._warned_full = False
        self._warned: set[type] = set()
        self.thread = threading.Thread(target=self._run, name=f"shmstat-events-{type(handler).__name__}",
                                       daemon=True)
        self.thread.start()

    # -- the loop's side ---------------------------------------------------------------------------------
    def put(self, entry: _Entry) -> None:
        with self.cond:
            self.offered = entry.ticket
            if self.abandoned:
                self._drop(entry)
            elif self.bytes + entry.nbytes > self.limit and self.queue:
                self._drop(entry)
                if not self._warned_full:
                    self._warned_full = True
                    _log.warning("events sink %r does not keep up: its queue of %d bytes is full; events for it "
                                 "are dropped, counted in collector.events_dropped and written as gap records",
                                 self.handler, self.limit)
            else:
                self.queue.append(entry)
                self.bytes += entry.nbytes
                self.cond.notify()

    def _drop(self, entry: _Entry) -> None:
        """Count ``entry`` as dropped and add it to its stream's summary (the lock is held)."""
        self.dropped[entry.job] += entry.events
        self._summarise(entry)

    def _summarise(self, entry: _Entry) -> None:
        """Add ``entry``, which this sink never took, to its stream's summary: a gap record in the next batch
        (the lock is held)."""
        item = entry.item
        key: tuple[str, int | None, int, int]
        if isinstance(item, Received):
            key, first, last, count = (entry.job, item.rank, item.pid, item.incarnation), item.seq, \
                item.seq + item.n_items - 1, item.n_items
        elif isinstance(item, GapRecord):
            key, first, last, count = (entry.job, item.rank, item.pid, item.incarnation), item.from_seq, \
                item.to_seq, item.count
        else:
            key, first, last, count = (entry.job, item.rank, item.pid, item.incarnation), item.seq, item.seq, 1
        self._add_summary(key, first, last, count)

    def _add_summary(self, key: tuple[str, int | None, int, int], first: int, last: int, count: int) -> None:
        summary = self._summaries.get(key)
        if summary is None:
            if len(self._summaries) >= MAX_SUMMARIES:
                key = ("", None, 0, 0)
                summary = self._summaries.get(key)
            if summary is None:
                self._summaries[key] = [first, last, count]
                return
        summary[0], summary[1], summary[2] = min(summary[0], first), max(summary[1], last), summary[2] + count

    def lost(self, job: str | None = None) -> int:
        """Events this sink lost (of ``job``, or of every job); the dict grows in two threads, so under the lock."""
        with self.cond:
            return sum(self.dropped.values()) if job is None else self.dropped.get(job, 0)

    def control(self, marker: object) -> threading.Event:
        done = threading.Event()
        with self.cond:
            self.queue.append((marker, done))
            self.cond.notify()
        return done

    # -- the sink's thread -------------------------------------------------------------------------------
    def _take(self) -> tuple[list[_Entry], list[GapRecord], Any]:
        """Wait for work; take up to a batch of entries, the drop summaries, or a control marker."""
        with self.cond:
            # gap records alone are retried at most once a second while the sink fails (then with each batch)
            while not self.queue and not (self._summaries and not self._failing):
                if not self.cond.wait(_RETRY_S if self._summaries else None):
                    self._failing = False
            entries: list[_Entry] = []
            in_hand: dict[str, int] = collections.defaultdict(int)
            taken = events = 0
            while self.queue and type(self.queue[0]) is _Entry and taken < MAX_BATCH_BYTES and \
                    events < MAX_BATCH_EVENTS:
                entry = self.queue.popleft()
                entries.append(entry)
                taken += entry.nbytes
                events += entry.events
                in_hand[entry.job] += entry.events
            self.bytes -= taken
            self.in_hand = in_hand
            self.in_hand_entries = entries
            if entries:  # with nothing queued behind them, every entry offered so far is taken or counted
                self._upto = self.offered if not self.queue else entries[-1].ticket
            now = time.time_ns()
            gaps = [GapRecord(job, rank, pid, inc, first, last, count, "collector", now)
                    for (job, rank, pid, inc), (first, last, count) in self._summaries.items()]
            self._summaries.clear()
            marker = self.queue.popleft() if not entries and self.queue else None
            return entries, gaps, marker

    def _run(self) -> None:
        while True:
            entries, gaps, marker = self._take()
            if entries or gaps:
                self._emit(entries, gaps)
            if marker is not None:
                kind, done = marker
                done.set()
                if kind is _STOP:
                    return

    def _emit(self, entries: list[_Entry], gaps: list[GapRecord]) -> None:
        batch: list[EventRecord | GapRecord] = []
        lost: dict[str, int] = collections.defaultdict(int)
        for entry in entries:
            item = entry.item
            if isinstance(item, Received):
                try:
                    batch.extend(_records(entry.job, item))
                except WireError:  # the intake check let through what decode refuses (a bug): count, go on
                    lost[entry.job] += entry.events
                    self._count_error(WireError)
            else:
                batch.append(item)
        batch.extend(gaps)
        ok = True
        if batch:
            try:
                self.handler.emit_events(batch)
            except Exception as exc:  # a user's sink may raise anything; the loop and the other sinks go on
                ok = False
                self._count_error(type(exc), exc)
        with self.cond:
            if self.abandoned:  # close() counted this batch as dropped already
                return
            if not ok:
                # lost once: counted, and a gap record in the next batch the sink takes (the summaries this
                # batch carried are kept for it too)
                lost = self.in_hand
                for entry in entries:
                    self._summarise(entry)
                for gap in gaps:
                    self._add_summary((gap.job, gap.rank, gap.pid, gap.incarnation), gap.from_seq, gap.to_seq,
                                      gap.count)
            self._failing = not ok
            for job, n in lost.items():
                self.dropped[job] += n
            self.delivered += sum(self.in_hand.values()) - sum(lost.values())
            self.in_hand = {}
            self.in_hand_entries = []
            self.done = max(self.done, self._upto)
        if self.on_done is not None:
            self.on_done()

    def _count_error(self, kind: type, exc: BaseException | None = None) -> None:
        self.errors += 1
        if kind not in self._warned:
            self._warned.add(kind)
            _log.error("events sink %r failed: %r (counted in collector.event_handler_errors; further ones not "
                       "logged)", self.handler, exc if exc is not None else "a message decode refused")

    def abandon(self, resent: Any = None) -> int:
        """Give the sink up (stuck past the close budget): what it holds is counted as dropped, except the events
        ``resent(entry)`` says their rank still keeps and re-sends to the next collector (counted in ``left``);
        returns how many were dropped."""
        with self.cond:
            self.abandoned = True
            held = [*self.in_hand_entries, *(entry for entry in self.queue if type(entry) is _Entry)]
            dropped = 0
            for entry in held:
                if resent is not None and resent(entry):
                    self.left[entry.job] += entry.events
                else:
                    self.dropped[entry.job] += entry.events
                    dropped += entry.events
            self.queue.clear()
            self.bytes = 0
            self.in_hand = {}
            self.in_hand_entries = []
            return dropped


def _records(job: str, msg: Received) -> list[EventRecord]:
    """The events of a rank's ``event/`` message (decoded here, in the sink's thread)."""
    decoded = wire.decode(msg.raw_topic, msg.payload)
    return [EventRecord(name, job, msg.rank, ts_ns, data, msg.seq + j, msg.pid, msg.incarnation)
            for j, (name, ts_ns, data) in enumerate(decoded.items)]


class EventDelivery:
    """The events sinks of a collector (or of a node collector's every job), each in a thread of its own."""

    def __init__(self, handlers: list[EventSink], *, queue_bytes: int = DEFAULT_EVENTS_QUEUE_BYTES,
                 close_budget_s: float = 5.0) -> None:
        self.handlers = list(handlers)
        self.queue_bytes = queue_bytes
        self.close_budget_s = close_budget_s
        self._sinks: list[_Sink] | None = None  # threads start with the first record
        self._closed = False
        self._ticket = 0
        self._listeners: list[Any] = []
        self._keeps: dict[str, Any] = {}  # job -> whether a sender re-sends what no sink took (see resent_by)

    @classmethod
    def from_specs(cls, specs: list[str], *, queue_bytes: int = DEFAULT_EVENTS_QUEUE_BYTES) -> EventDelivery:
        """The sinks ``specs`` name (:func:`collector.sinks.specs.build_event_handler`); a bad SPEC is a
        :class:`~shmstat.errors.ConfigError` and the sinks built before it are closed."""
        built: list[EventSink] = []
        try:
            for spec in specs:
                built.append(build_event_handler(spec))
        except BaseException:
            for handler in built:
                _close_quietly(handler)
            raise
        return cls(built, queue_bytes=queue_bytes)

    def _all(self) -> list[_Sink]:
        if self._sinks is None:
            self._sinks = [_Sink(h, self.queue_bytes, self._taken) for h in self.handlers]
        return self._sinks

    def offer_message(self, job: str, msg: Received) -> int:
        """Queue the events of a rank's ``event/`` message for every sink (never blocks, never decodes); returns
        its ticket (see :meth:`completed`), 0 once closed."""
        if self._closed:
            return 0
        self._ticket += 1
        entry = _Entry(job, msg, len(msg.payload) + len(msg.raw_topic) + _ENTRY_BYTES, msg.n_items, self._ticket)
        for sink in self._all():
            sink.put(entry)
        return self._ticket

    def offer(self, job: str, record: EventRecord | GapRecord) -> int:
        """Queue a record the collector made (one of its events, or a gap it found) for every sink; returns its
        ticket (see :meth:`completed`), 0 once closed."""
        if self._closed:
            return 0
        self._ticket += 1
        if isinstance(record, EventRecord):
            entry = _Entry(job, record, item_bytes(record.name, record.data) + _ENTRY_BYTES, 1, self._ticket)
        else:
            entry = _Entry(job, record, _ENTRY_BYTES, 0, self._ticket)
        for sink in self._all():
            sink.put(entry)
        return self._ticket

    def resent_by(self, job: str, keeps: Any) -> None:
        """``keeps(rank, pid, incarnation)`` says whether a sender of ``job`` still keeps what no sink took and
        re-sends it to the next collector (its delivered mark stays below it): such events of a sink given up at
        close are not counted as dropped."""
        self._keeps = {**self._keeps, job: keeps}

    def _resent(self, entry: _Entry) -> bool:
        keeps = self._keeps.get(entry.job)
        item = entry.item
        if keeps is None or isinstance(item, (EventRecord, GapRecord)):  # the collector's own: no one re-sends
            return False
        return bool(keeps(item.rank, item.pid, item.incarnation))

    def listen(self, fn: Any) -> None:
        """Call ``fn()`` from a sink's thread each time that sink has taken a batch (the collector writes the
        delivered marks at once: what a sink took and the mark that says so are apart only for microseconds)."""
        self._listeners = [*self._listeners, fn]

    def unlisten(self, fn: Any) -> None:
        """Stop calling ``fn`` (see :meth:`listen`)."""
        self._listeners = [f for f in self._listeners if f is not fn]

    def _taken(self) -> None:
        for fn in self._listeners:
            try:
                fn()
            except Exception:  # a listener's failure must not stop a sink
                _log.exception("a listener of the events sinks failed")

    @property
    def offered(self) -> int:
        """The ticket of the last entry offered (see :meth:`completed`)."""
        return self._ticket

    def completed(self) -> int:
        """The highest ticket up to which every sink took what was offered (written it, or counted it as lost
        with a gap record to come): what the collector may acknowledge to the ranks as delivered."""
        sinks = self._sinks
        if not sinks:
            return self._ticket
        return min(s.done for s in sinks)

    @property
    def dropped(self) -> int:
        """Events a sink lost (queue full, a call that raised, left at close), summed over sinks."""
        return sum(s.lost() for s in self._sinks or ())

    def dropped_for(self, job: str) -> int:
        """:attr:`dropped` of ``job``'s events."""
        return sum(s.lost(job) for s in self._sinks or ())

    @property
    def delivered(self) -> int:
        """Events sinks took without raising, summed over sinks."""
        return sum(s.delivered for s in self._sinks or ())

    @property
    def errors(self) -> int:
        """Calls of a sink that raised (and messages that did not decode)."""
        return sum(s.errors for s in self._sinks or ())

    def wait(self, timeout_s: float = 10.0) -> bool:
        """Wait until every sink has taken what was queued before this call; False on timeout (a stuck sink)."""
        deadline = time.monotonic() + timeout_s
        events = [s.control(_BARRIER) for s in self._sinks or ()]
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def drained(self) -> bool:
        """Whether every sink has taken everything offered so far (written it, or counted it as lost)."""
        return self.completed() >= self._ticket

    def close(self, deadline: float | None = None) -> None:
        """Let every sink take what is queued within the close budget (or until ``deadline``, a
        :func:`time.monotonic` time, when the caller already let them work on it; each sink has at least
        :data:`STOP_GRACE_S` to take its stop), then flush and close those that finished; a sink still busy is left
        behind, what it held counted as dropped (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if deadline is None:
            deadline = time.monotonic() + self.close_budget_s
        stops = [(s, s.control(_STOP)) for s in self._sinks or ()]
        finished = {id(h) for h in self.handlers} - {id(s.handler) for s in self._sinks or ()}
        for sink, stopped in stops:
            if stopped.wait(max(STOP_GRACE_S, deadline - time.monotonic())):
                finished.add(id(sink.handler))
            else:
                lost = sink.abandon(self._resent)
                _log.warning("events sink %r did not finish within %.1f s of shutdown; leaving it behind, %d "
                             "events it held counted in collector.events_dropped (%d more its ranks re-send to the "
                             "next collector)", sink.handler, self.close_budget_s, lost, sum(sink.left.values()))
        for handler in self.handlers:
            if id(handler) in finished:
                _close_quietly(handler)


def _close_quietly(handler: Any) -> None:
    """``flush()`` then ``close()`` a sink, whichever it has; what they raise is logged, never raised."""
    for name in ("flush", "close"):
        fn = getattr(handler, name, None)
        if callable(fn):
            try:
                fn()
            except Exception as exc:  # a user's sink may raise anything at shutdown too
                _log.error("events sink %r: %s() raised %r", handler, name, exc)
