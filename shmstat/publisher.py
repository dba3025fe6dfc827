"""The rank's event publisher: ships events and metrics to the node's collector without blocking the caller.

A :class:`Publisher` owns one ZeroMQ ``XPUB`` socket *connected* to the collector's ``XSUB`` (which binds the
job's ``ipc://`` endpoint and sends the subscribe-all frame ``b"\\x01"``). The caller's side of every
``publish*`` method is one tuple and one ``deque.append``: ``("event", name, ts_ns, data_copy, size)``,
``("metric", group, name, value, ts, size)`` or ``(None, topic, kind, item, size)``, ``size`` being the item's
estimated bytes (:func:`item_bytes`) (the topic string of events and metrics
is built by the thread, once per batch: measured here, ~170 ns per ``publish_event`` instead of ~200 ns, and
fewer objects for the GC while a backlog is held). A daemon thread, started on
the first publish, owns the socket and does everything else: it takes entries from the deque, batches the items
of each topic (up to ``batch_max`` per message; an item joins its topic's batch still waiting to be sent, so
topics published interleaved — ``@prof``'s success and duration, a loop's several metrics — still travel in
large messages), numbers them when a batch is sealed, encodes them with :func:`shmstat.wire.encode`, sends
with ``zmq.NOBLOCK``, and reads the subscription frames the ``XPUB`` reports.

What the ``XPUB`` tells us (measured on libzmq 4.3.5 and written into the socket options below):

- An ``XPUB`` silently discards messages no subscriber has asked for. So until the collector's subscribe-all
  frame has arrived (``subscribed`` is False) items are held here, in order, in a bounded backlog.
- With the default ``ZMQ_IMMEDIATE=0`` the socket's pipe to the collector's endpoint outlives the connection:
  when the collector dies the ``XPUB`` reports *nothing* (no unsubscribe frame), keeps the subscription, and
  queues what we send in that pipe (up to ``SNDHWM`` messages; ``ZMQ_XPUB_NODROP`` makes a full pipe answer
  ``EAGAIN`` instead of discarding); when a collector binds the endpoint again, libzmq reconnects and delivers
  that queue to it. (With ``ZMQ_IMMEDIATE=1`` the ``XPUB`` reports ``b"\\x00"`` on disconnect but silently
  discards everything sent to the dead pipe before that frame is read, and the whole pipe content: more loss,
  so it is not used.)
- A collector that shuts down cleanly sends the hand-over request (``wire.HANDOVER_REQUEST``, a user message
  upstream; not an unsubscribe, which libzmq applies inside a later ``send()`` and so silently discards that
  message although it was counted as sent). The thread answers with a hand-over marker on
  ``wire.HELD_TOPIC``, behind everything it sent (the collector stops reading once it has every marker), and
  from then on holds items here until a subscribe-all frame arrives (``XPUB_VERBOSE``: the next collector's
  frame is reported even when the kept pipe still holds the old subscription). An explicit unsubscribe
  (``b"\\x00"``) also makes the thread hold items.

Guarantees:

- ``publish_event`` / ``publish_metric`` / ``publish`` never block, never raise for a full queue, never touch
  the socket, and cost one tuple, one ``dict`` copy (events) and one ``deque.append`` (plus checks for
  ``publish``).
- Items of one topic leave in publish order (per publisher), and so do items of different kinds (an event
  published before a metric leaves before it). Items of one kind but different topics published close
  together are regrouped per topic, so between them the wire order can differ from the publish order (each
  item carries its timestamp). Sequence numbers start at 0 and run on in send order; every item that is
  dropped takes one too, at its place in the publish order: a receiver's gap of ``n`` is ``n`` lost items.
- At most ``backlog_limit`` items and ``backlog_bytes`` estimated bytes wait for the thread, and as many are
  pending in it (waiting for a subscriber or for room in zmq's pipe, which holds at most ``sndhwm`` messages of
  at most :data:`MAX_BATCH_BYTES` or one event); past that, new items are dropped, counted in
  :attr:`PublisherStats.dropped` and numbered. Items that cannot be encoded (bad types, too big) are dropped,
  counted and logged once. Nothing within the bound is lost while the collector is up or before it first
  starts. Items left when the publisher closes are dropped and the closing marker carries the sequence number
  after them, so the collector counts them as a gap.
- ``stats().queued == sent_items + dropped + backlog`` once the thread is idle (see :meth:`Publisher.flush`).
- Not guaranteed: items handed to zmq and still in flight when the collector dies (libzmq's encoder buffer
  and the kernel socket buffers, typically up to a few hundred KiB) are lost *uncounted* here; the restarted
  collector sees them as a sequence gap. Items in zmq's pipe when ``close()``'s linger expires with no
  collector present are likewise lost uncounted.

Processes: sequence numbers are per publisher, so a receiver keys them by (rank, incarnation, pid). A
publisher belongs to the process that created it: in a forked child, :func:`after_fork_in_child` (registered
with :func:`os.register_at_fork`) marks every inherited publisher dead — it never touches the parent's socket,
context or thread again; its ``publish*`` calls are no-ops counted as dropped — and clears
``shmstat._state.STATE.publisher`` if it held one, so the child can create its own publisher with its own pid.
At interpreter exit (and at the exit of a ``multiprocessing`` child) live publishers are flushed and closed
within a bounded time.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import zmq

from . import _state, wire
from .errors import ConfigError, WireError

__all__ = [
    "DEFAULT_BACKLOG_BYTES",
    "DEFAULT_SNDHWM",
    "MAX_BATCH_BYTES",
    "Publisher",
    "PublisherStats",
    "after_fork_in_child",
    "item_bytes",
]

_log = logging.getLogger("shmstat")

DEFAULT_SNDHWM = 64
"""zmq's send high-water mark, in messages (each message batches up to ``batch_max`` items and, except for one
large event, at most :data:`MAX_BATCH_BYTES`): what waits inside zmq stays within ~16 MiB, the rest is in the
publisher's own byte-bounded backlog, where a drop is counted and numbered."""

DEFAULT_BACKLOG_BYTES = 64 * 1024 * 1024
"""Bytes (estimated, see :func:`item_bytes`) of items a publisher holds at most, waiting and pending each;
``SHMSTAT_BACKLOG_MB`` or ``Publisher(backlog_bytes=...)`` change it."""

MAX_BATCH_BYTES = 256 * 1024
"""A batch of several items is sealed before it passes this many (estimated) bytes."""

METRIC_BYTES = 160
"""The estimated size of one metric item (Python objects and wire bytes)."""

_ITEM_OVERHEAD = 128

_MAX_IDLE_SLEEP_S = 0.02
_EXIT_BUDGET_S = 2.0

_LIVE: weakref.WeakSet[Publisher] = weakref.WeakSet()
_FORK_ORPHANS: list[Any] = []  # zmq objects inherited by a forked child: kept alive, never closed, never used


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of a publisher's counters (items unless stated otherwise).

    ``queued``: items accepted by ``publish*`` calls since creation. ``sent_items`` / ``sent_messages``:
    items / messages handed to zmq. ``dropped``: items given up (over the backlog bound, not encodable,
    published after close or in a forked child, left over at close). ``subscribed``: whether the collector's
    subscribe-all frame is in effect. ``backlog``: items held in this process, not yet handed to zmq.
    ``queued == sent_items + dropped + backlog`` whenever the publisher thread is idle.
    """

    queued: int
    sent_items: int
    sent_messages: int
    dropped: int
    subscribed: bool
    backlog: int


class _Batch:
    """Items of one topic, in publish order; ``first_seq`` and ``frames`` once sealed for sending.

    ``taken`` is the take index (position in publish order) of the first item: batches are created, and
    stay in the pending queue, in that order, which is what :meth:`Publisher.flush` measures progress by.
    """

    __slots__ = ("first_seq", "frames", "items", "kind", "nbytes", "skip", "taken", "topic")

    def __init__(self, topic: str, kind: str, taken: int, items: list[Any], first_seq: int = -1) -> None:
        self.topic = topic
        self.kind = kind
        self.taken = taken
        self.first_seq = first_seq
        self.items = items
        self.frames: tuple[bytes, ...] | None = None
        self.nbytes = 0  # estimated bytes of the items (see item_bytes)
        self.skip = 0  # > 0: not a message but a gap of that many dropped items, at its place in the order

    @classmethod
    def start(cls, tag: Any, entry: tuple[Any, ...], taken: int, item: Any) -> _Batch:
        """A new batch holding ``item`` (the queue ``entry`` it came from decides topic and kind)."""
        if tag == "event":
            return cls(f"event/{entry[1]}", "event", taken, [item])
        if tag == "metric":
            return cls(f"metric/{entry[1]}/{entry[2]}", "metric", taken, [item])
        return cls(entry[1], entry[2], taken, [item])


def item_bytes(name: str, data: dict[str, Any]) -> int:
    """The estimated size of an event: what its Python objects and its wire encoding take, within a small
    constant (strings count in UTF-8 bytes once they are long enough to matter)."""
    n = _ITEM_OVERHEAD + len(name) + 16 * len(data) + sum(map(len, data))
    for value in data.values():
        if type(value) is str:
            n += len(value)
    if n > 4096:  # long text: count UTF-8 bytes, not characters
        n = _ITEM_OVERHEAD + len(name.encode("utf-8", "replace")) + sum(
            16 + len(k.encode("utf-8", "replace")) + (len(v.encode("utf-8", "replace")) if type(v) is str else 0)
            for k, v in data.items() if type(k) is str
        )
    return n


def _backlog_bytes_from_env() -> int:
    raw = os.environ.get("SHMSTAT_BACKLOG_MB")
    if not raw:
        return DEFAULT_BACKLOG_BYTES
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 1 <= mb <= 1 << 20:
        raise ConfigError(f"SHMSTAT_BACKLOG_MB={raw!r} is not a number of MiB between 1 and 1048576")
    return int(mb * 1024 * 1024)


_GONE: tuple[bytes, ...] = ()  # the frames of a batch that was split or given up (no item may join it)


class _FlushRequest:
    __slots__ = ("cancelled", "done", "target")

    def __init__(self) -> None:
        self.target = -1
        self.cancelled = False
        self.done = threading.Event()


class Publisher:
    """Publishes events and metrics of one rank to the collector at ``endpoint`` (see the module docstring).

    ``rank`` and ``incarnation`` go into every message, with ``pid`` (default: this process). At most
    ``backlog_limit`` items are held here; a message carries at most ``batch_max`` items; the background
    thread sleeps ``idle_sleep_s`` when idle, backing off to 20 ms after a while. ``context`` is a
    ``zmq.Context`` to use (not terminated by :meth:`close`); by default the publisher makes its own.
    ``sndhwm`` is zmq's send high-water mark in messages. Raises :class:`~shmstat.errors.ConfigError` for
    bad arguments or an endpoint zmq cannot connect to. Creating a publisher starts no thread.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        rank: int,
        incarnation: int = 0,
        pid: int | None = None,
        backlog_limit: int = 100_000,
        batch_max: int = 1024,
        idle_sleep_s: float = 0.002,
        context: zmq.Context[Any] | None = None,
        sndhwm: int = DEFAULT_SNDHWM,
        backlog_bytes: int | None = None,
    ) -> None:
        if pid is None:
            pid = os.getpid()
        for label, value, low in (
            ("rank", rank, wire.COLLECTOR_RANK),
            ("incarnation", incarnation, 0),
            ("pid", pid, 0),
            ("backlog_limit", backlog_limit, 1),
            ("batch_max", batch_max, 1),
            ("sndhwm", sndhwm, 0),
            ("backlog_bytes", _backlog_bytes_from_env() if backlog_bytes is None else backlog_bytes, 1024),
        ):
            if type(value) is not int or value < low:
                raise ConfigError(f"Publisher {label} must be an int >= {low}, got {value!r}")
        if not isinstance(idle_sleep_s, (int, float)) or not 0 < idle_sleep_s <= 1:
            raise ConfigError(f"Publisher idle_sleep_s must be in (0, 1] seconds, got {idle_sleep_s!r}")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(f"Publisher endpoint must be a non-empty str, got {endpoint!r}")

        self.endpoint = endpoint
        self.rank = rank
        self.incarnation = incarnation
        self.pid = pid
        self._owner_pid = os.getpid()
        self._backlog_limit = backlog_limit
        self._backlog_bytes = _backlog_bytes_from_env() if backlog_bytes is None else backlog_bytes
        self._batch_max = batch_max
        self._idle_sleep_s = float(idle_sleep_s)
        self._max_sleep_s = max(self._idle_sleep_s, _MAX_IDLE_SLEEP_S)

        # caller side
        # entries: ("event", name, ts_ns, data) | ("metric", group, name, value, ts) | (None, topic, kind, item)
        self._q: collections.deque[tuple[Any, ...]] = collections.deque()
        self._append = self._q.append
        self._started = False
        self._late_drops = 0  # publishes after close() or in a forked child
        self._overflow = 0  # publishes refused because the caller-side queue was full
        self._in_bytes = 0  # estimated bytes ever queued by callers (callers write it)
        self._out_bytes = 0  # estimated bytes ever taken off the queue (the thread writes it)

        # thread side (written only by the background thread while it runs)
        self._next_seq = 0  # == items taken from self._q (the take index)
        self._wire_seq = 0  # the next sequence number on the wire (assigned when a batch is sealed)
        self._pending: collections.deque[_Batch] = collections.deque()
        # the batch of each topic that items may still join, by how they were queued: event name,
        # {group: {name: batch}} for metrics, topic of publish()
        self._open: tuple[dict[Any, _Batch], dict[Any, dict[Any, _Batch]], dict[Any, _Batch]] = ({}, {}, {})
        self._held = 0
        self._held_bytes = 0
        self._overflow_numbered = 0  # how many of the caller-side refusals took their sequence numbers so far
        self._sent_items = 0
        self._sent_messages = 0
        self._dropped = 0
        self._prefixes: set[bytes] = set()
        self._subscribed = False
        self._handed_over = False  # a collector asked for the hand-over: hold items until the next subscribes
        self._warned_invalid = False
        self._flush_waiting: list[_FlushRequest] = []

        # shared control
        self._flush_requests: collections.deque[_FlushRequest] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._close_linger_ms = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._dead = False

        self._own_context = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        sock = self._ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full pipe says EAGAIN instead of discarding
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscribe frame, also a repeated one (see above)
            sock.setsockopt(zmq.LINGER, 0)  # set for real in close()
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if self._own_context:
                self._ctx.term()
            raise ConfigError(f"cannot connect a publisher to {endpoint!r}: {exc}") from exc
        self._sock: zmq.Socket[Any] | None = sock
        _LIVE.add(self)

    # ------------------------------------------------------------------------------------- caller side

    def publish_event(self, name: str, ts_ns: int, data: dict[str, Any], size: int = 0) -> None:
        """Queue the event ``name`` at ``ts_ns`` (Unix ns) with a copy of ``data``; never blocks.

        ``data`` values must be ``str``/``int``/``float``/``bool`` (not checked here: an item that cannot
        be encoded is dropped, counted and logged once by the background thread). ``size`` is the event's
        :func:`item_bytes` if the caller has it. Past the byte bound the event is dropped and counted.
        """
        if not size:
            size = item_bytes(name, data)
        if self._in_bytes - self._out_bytes + size > self._backlog_bytes:
            self._overflow += 1
            return
        self._in_bytes += size
        self._append(("event", name, ts_ns, dict(data), size))
        if not self._started:
            self._start()

    def publish_metric(self, group: str, name: str, value: int | float, ts: float) -> None:
        """Queue metric ``name`` of ``group`` with ``value`` at ``ts`` (Unix seconds); never blocks."""
        if self._in_bytes - self._out_bytes + METRIC_BYTES > self._backlog_bytes:
            self._overflow += 1
            return
        self._in_bytes += METRIC_BYTES
        self._append(("metric", group, name, value, ts, METRIC_BYTES))
        if not self._started:
            self._start()

    def publish(self, topic: str, kind: str, item: Any) -> None:
        """Queue one ``item`` of ``kind`` under ``topic`` (shapes in :mod:`shmstat.wire`); never blocks.

        Checks that ``kind`` is a wire kind and that ``topic`` starts with ``<kind>/`` and, for events and
        metrics, is the topic the item's name implies; raises :class:`~shmstat.errors.ConfigError` if not.
        """
        if type(kind) is not str or kind not in wire.KINDS:
            raise ConfigError(f"publish kind must be one of {wire.KINDS}, got {kind!r}")
        if type(topic) is not str or not topic.startswith(kind + "/"):
            raise ConfigError(f"publish topic {topic!r} must start with {kind!r} + '/'")
        expected = topic
        try:
            if kind == "event":
                expected = wire.event_topic(item[0])
            elif kind == "metric":
                expected = wire.metric_topic(item[0], item[1])
        except (TypeError, IndexError, KeyError) as exc:
            raise ConfigError(f"publish item {item!r} does not have the shape of a {kind} item") from exc
        if expected != topic:
            raise ConfigError(f"publish topic {topic!r} does not match the item's topic {expected!r}")
        if self._in_bytes - self._out_bytes + METRIC_BYTES > self._backlog_bytes:
            self._overflow += 1
            return
        self._in_bytes += METRIC_BYTES
        self._append((None, topic, kind, item, METRIC_BYTES))
        if not self._started:
            self._start()

    def _append_bounded(self, entry: tuple[Any, ...]) -> None:
        """Stand-in for ``deque.append`` while the thread lags: keep the queue within the bound, count the rest.

        The thread swaps it in when the queue it has not yet taken passes half the backlog bound, and back
        out when it has caught up, so the common case costs no check at all.
        """
        if len(self._q) < self._backlog_limit:
            self._q.append(entry)
        else:
            self._in_bytes -= entry[-1]
            self._overflow += 1

    def _drop_late(self, entry: tuple[Any, ...]) -> None:
        """Stand-in for ``deque.append`` after close() or in a forked child: count, keep nothing."""
        self._late_drops += 1

    def _start(self) -> None:
        with self._lock:
            if self._started or self._closed or self._dead:
                return
            _ensure_exit_hooks()
            thread = threading.Thread(target=self._run, name=f"shmstat-publisher-r{self.rank}", daemon=True)
            thread.start()
            self._thread = thread
            self._started = True

    # ------------------------------------------------------------------------------------- control

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every item published before this call was handed to zmq or dropped.

        Returns True if that happened within ``timeout_s`` seconds, False otherwise (for example while no
        collector has subscribed: held items are neither sent nor dropped). Returns True at once if
        nothing was ever published; in a forked child's inherited publisher, always True (its items were
        all dropped). Must not be called from the publisher's own thread.
        """
        if self._dead:
            return True
        thread = self._thread
        if thread is None or not thread.is_alive():
            return not self._q and self._held == 0
        req = _FlushRequest()
        self._flush_requests.append(req)
        self._wake.set()
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            if req.done.wait(max(0.0, min(remaining, 0.05))):
                return True
            if remaining <= 0 or not thread.is_alive():
                req.cancelled = True
                return req.done.is_set()

    def close(self, linger_ms: int = 1000) -> None:
        """Flush for up to ``linger_ms``, stop the thread, close the socket (and the context if ours).

        Items still held afterwards are counted as dropped; later ``publish*`` calls are no-ops counted as
        dropped. Idempotent; bounded by about ``linger_ms`` plus a few ms. A no-op in a forked child's
        inherited publisher.
        """
        with self._lock:
            if self._closed or self._dead:
                return
            self._closed = True
            self._started = True  # never start a thread from now on
            self._append = self._drop_late
        budget_s = max(0, linger_ms) / 1000.0
        deadline = time.monotonic() + budget_s
        thread = self._thread
        if thread is not None:
            self.flush(budget_s)
            self._close_linger_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            self._stop = True
            self._wake.set()
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
            if thread.is_alive():  # pragma: no cover - the loop never blocks for long
                _log.warning("shmstat: publisher thread did not stop in time; leaving its socket open")
                _LIVE.discard(self)
                return
        elif self._sock is not None:
            self._sock.close(linger=0)  # never used by a thread; nothing was ever queued
        self._sock = None
        # whatever was not handed to zmq is given up
        leftover = len(self._q)
        self._q.clear()
        self._next_seq += leftover
        self._dropped += leftover + self._held
        self._held = 0
        self._held_bytes = 0
        self._pending.clear()
        for opened in self._open:
            opened.clear()
        if self._own_context:
            with contextlib.suppress(zmq.ZMQError):
                self._ctx.term()
        _LIVE.discard(self)

    def stats(self) -> PublisherStats:
        """A snapshot of the counters (see :class:`PublisherStats`); exact once the thread is idle."""
        taken = self._next_seq
        waiting = len(self._q)
        late = self._late_drops + self._overflow
        return PublisherStats(
            queued=taken + waiting + late,
            sent_items=self._sent_items,
            sent_messages=self._sent_messages,
            dropped=self._dropped + late,
            subscribed=self._subscribed,
            backlog=self._held + waiting,
        )

    @property
    def closed(self) -> bool:
        """True after :meth:`close`, and for a forked child's inherited publisher."""
        return self._closed or self._dead

    def _mark_dead_in_child(self) -> None:
        """In a forked child: forget the parent's socket, context, thread and items; drop from now on."""
        self._dead = True
        self._started = True
        self._append = self._drop_late
        _FORK_ORPHANS.append((self._sock, self._ctx))  # never closed, never garbage-collected here
        self._sock = None
        self._thread = None
        self._lock = threading.Lock()
        self._q = collections.deque()
        self._pending = collections.deque()
        self._open = ({}, {}, {})
        self._wire_seq = 0
        self._flush_requests = collections.deque()
        self._flush_waiting = []
        self._next_seq = self._held = self._sent_items = self._sent_messages = self._dropped = 0
        self._late_drops = 0
        self._subscribed = False

    # ------------------------------------------------------------------------------------- thread side

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        sleep_s = self._idle_sleep_s
        failures = 0
        try:
            while True:
                try:
                    progressed = self._step(sock)
                except zmq.ContextTerminated:
                    return
                except Exception:  # the thread must survive anything
                    failures += 1
                    if failures == 1:
                        _log.exception("shmstat: unexpected error in the publisher thread (continuing)")
                    progressed = False
                if self._stop:
                    return
                if progressed:
                    sleep_s = self._idle_sleep_s
                    if self._q:
                        continue  # more work right now
                    wait_s = sleep_s  # items are flowing: let the next ones gather into a batch
                else:
                    wait_s = sleep_s  # idle: back off up to _max_sleep_s
                    sleep_s = min(sleep_s * 2, self._max_sleep_s)
                if self._pending and not self._subscribed:
                    # only a subscription frame can unblock the backlog: wait on the socket
                    sock.poll(max(1, int(wait_s * 1000)), zmq.POLLIN)
                elif self._wake.wait(wait_s):
                    self._wake.clear()
        finally:
            if self._subscribed and not self._pending:
                self._send_held(sock)  # all sent: the collector need not wait for more from us
                self._await_ack(sock, self._close_linger_ms)
            elif self._subscribed:
                # closing with items left: they are dropped, and the marker carries the sequence number after
                # them, so the collector counts them as a gap (sealed batches are numbered already)
                self._send_held(sock, self._wire_seq + len(self._q) + (self._overflow - self._overflow_numbered)
                                + sum(b.skip or len(b.items) for b in self._pending if b.frames is None))
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=self._close_linger_ms)

    def _step(self, sock: zmq.Socket[Any]) -> bool:
        """One round: subscriptions, flush requests, take queued items, send. True if anything moved."""
        waiting = len(self._q)
        bounded = self._append == self._append_bounded
        if (not bounded and waiting > self._backlog_limit // 2) or (bounded and waiting < self._backlog_limit // 4):
            with self._lock:  # close() swaps in _drop_late under the same lock
                if not self._closed and not self._dead:
                    self._append = self._q.append if bounded else self._append_bounded
        if sock.get(zmq.EVENTS) & zmq.POLLIN:
            self._read_subscriptions(sock)
        requests = self._flush_requests
        while requests:
            req = requests.popleft()
            req.target = self._next_seq + len(self._q)
            self._flush_waiting.append(req)
        progressed = self._take()
        if self._subscribed and self._pending and self._send(sock):
            progressed = True
        if self._flush_waiting:
            self._resolve_flushes()
        return progressed

    def _read_subscriptions(self, sock: zmq.Socket[Any]) -> None:
        prefixes = self._prefixes
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame[:1] == b"\x01":
                prefixes.add(frame[1:])
                self._handed_over = False
            elif frame[:1] == b"\x00":
                prefixes.discard(frame[1:])
            elif frame == wire.HANDOVER_REQUEST and not self._handed_over:
                if self._subscribed:
                    self._send_held(sock)
                self._handed_over = True
            self._subscribed = b"" in prefixes and not self._handed_over  # the collector subscribes to all

    def _await_ack(self, sock: zmq.Socket[Any], budget_ms: int) -> None:
        """Wait up to ``budget_ms`` for the collector's acknowledgement of our marker: everything sent before it
        has been received, so closing the socket now loses nothing."""
        ack = wire.ACK_PREFIX + str(self.pid).encode()
        deadline = time.monotonic() + budget_ms / 1000
        with contextlib.suppress(zmq.ZMQError):
            while (left := deadline - time.monotonic()) > 0:
                if sock.poll(max(1, int(left * 1000)), zmq.POLLIN) and sock.recv(zmq.NOBLOCK) == ack:
                    return

    def _send_held(self, sock: zmq.Socket[Any], next_seq: int | None = None) -> None:
        """Tell the collector that everything sent before has been sent: the marker travels behind it in the
        same pipe. Sent when a collector that shuts down unsubscribes (from then on items are held for the
        next one) and when this publisher closes with nothing left."""
        seq = self._wire_seq if next_seq is None else next_seq
        payload = wire.encode("rank", self.rank, self.pid, self.incarnation, seq, [{"state": "held"}])
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([wire.HELD_TOPIC, payload], zmq.NOBLOCK)

    def _take(self) -> bool:
        """Move queued items into pending batches (or drop them past the bound); True if any were taken.

        An item joins the batch of its topic still open (not sealed, not full), else starts one at the end
        of the pending queue. Open batches are forgotten whenever a batch of another kind is started or an
        item is dropped, so topics of one kind published interleaved (``@prof``'s success and duration, a
        loop's several metrics) share large messages, while the order between kinds and the place of every
        gap stay those of publishing.
        """
        popleft = self._q.popleft
        pending = self._pending
        seq = self._next_seq
        held = self._held
        cap = self._backlog_limit
        batch_max = self._batch_max
        open_events, open_metrics, open_other = self._open
        last = pending[-1] if pending else None
        open_kind = last.kind if last is not None and last.frames is None and not last.skip else None
        if open_kind is None:
            open_events.clear()
            open_metrics.clear()
            open_other.clear()
        dropped = 0
        refused = self._overflow - self._overflow_numbered  # refused by publish*: numbered here, at this place
        if refused > 0:
            self._overflow_numbered += refused
            self._skip(refused)
            open_kind = None
        held_bytes, byte_cap, out_bytes = self._held_bytes, self._backlog_bytes, 0
        limit = seq + max(8 * batch_max, 8192)
        while seq < limit:
            try:
                entry = popleft()
            except IndexError:
                break
            seq += 1
            size = entry[-1]
            out_bytes += size
            if held < cap and held_bytes + size <= byte_cap:
                tag = entry[0]
                try:
                    if tag == "event":
                        key = entry[1]
                        item = entry[1:4]
                        opened = open_events
                    elif tag == "metric":
                        key = entry[2]  # the name; the group is checked below (no key tuple per item)
                        item = entry[1:5]
                        opened = open_metrics.get(entry[1])
                        if opened is None:
                            opened = open_metrics[entry[1]] = {}
                    else:
                        key = entry[1]
                        item = entry[3]
                        opened = open_other
                    batch = opened.get(key)
                    if (batch is not None and batch.frames is None and len(batch.items) < batch_max
                            and batch.nbytes + size <= MAX_BATCH_BYTES):
                        batch.items.append(item)
                        batch.nbytes += size
                    else:
                        batch = _Batch.start(tag, entry, seq - 1, item)
                        if batch.kind != open_kind:  # a new kind: nothing before it may be joined again
                            open_events.clear()
                            open_metrics.clear()
                            open_other.clear()
                            open_kind = batch.kind
                        batch.nbytes = size
                        pending.append(batch)
                        opened[key] = batch
                    held += 1
                    held_bytes += size
                    continue
                except Exception:  # a name whose hash, == or format raises: never let it stop the thread
                    pass
            # dropped: it takes a sequence number at its place, so the receiver sees the gap
            dropped += 1
            self._skip(1, seq - 1)
            open_kind = None
        taken = seq - self._next_seq
        self._next_seq = seq
        self._held = held
        self._held_bytes = held_bytes
        self._out_bytes += out_bytes
        self._dropped += dropped
        return taken > 0 or refused > 0

    def _skip(self, n: int, taken: int | None = None) -> None:
        """Put a gap of ``n`` dropped items at the end of the pending queue (their sequence numbers are
        skipped when it is reached); no batch before it may be joined any more."""
        pending = self._pending
        last = pending[-1] if pending else None
        if last is not None and last.skip:
            last.skip += n
        else:
            gap = _Batch("", "", self._next_seq if taken is None else taken, [])
            gap.skip = n
            pending.append(gap)
        for opened in self._open:
            opened.clear()

    def _send(self, sock: zmq.Socket[Any]) -> bool:
        """Send pending batches in order until zmq says EAGAIN; True if at least one message left."""
        pending = self._pending
        sent = False
        while pending:
            batch = pending[0]
            if batch.skip:  # dropped items: their sequence numbers are skipped here
                self._wire_seq += batch.skip
                pending.popleft()
                continue
            if batch.frames is None:
                batch.first_seq = self._wire_seq  # sealed now: numbered in send order
                self._wire_seq += len(batch.items)
                good = self._encode(batch)
                if good is not None:
                    batch.frames = _GONE
                    pending.popleft()
                    pending.extendleft(reversed(good))
                    self._held_bytes -= batch.nbytes - sum(part.nbytes for part in good)
                if not pending:
                    break
                batch = pending[0]
                if batch.frames is None:  # pragma: no cover - _encode always seals what it returns
                    continue
            try:
                sock.send_multipart(batch.frames, zmq.NOBLOCK)
            except zmq.Again:
                break
            pending.popleft()
            n = len(batch.items)
            self._held -= n
            self._held_bytes -= batch.nbytes
            self._sent_items += n
            self._sent_messages += 1
            sent = True
        return sent

    def _encode(self, batch: _Batch) -> list[_Batch] | None:
        """Seal ``batch`` with its frames; None if it encoded as is, else the encodable parts (in order)."""
        try:
            topic_b = batch.topic.encode("utf-8")
        except (UnicodeEncodeError, AttributeError):
            topic_b = b""
        if not topic_b or len(topic_b) > wire.MAX_TOPIC:
            self._give_up(len(batch.items), f"topic {batch.topic!r} is not sendable")
            return []
        try:
            payload = wire.encode(batch.kind, self.rank, self.pid, self.incarnation, batch.first_seq, batch.items)
        except WireError as exc:
            if len(batch.items) == 1:
                self._give_up(1, str(exc))
                return []
            half = len(batch.items) // 2
            out: list[_Batch] = []
            for first_seq, items in (
                (batch.first_seq, batch.items[:half]),
                (batch.first_seq + half, batch.items[half:]),
            ):
                part = _Batch(batch.topic, batch.kind, batch.taken, items, first_seq)
                part.nbytes = batch.nbytes * len(items) // len(batch.items)
                sub = self._encode(part)
                out.extend([part] if sub is None else sub)
            return out
        batch.frames = (topic_b, payload)
        return None

    def _give_up(self, n: int, reason: str) -> None:
        self._held -= n
        self._dropped += n
        if not self._warned_invalid:
            self._warned_invalid = True
            _log.warning("shmstat: dropping items that cannot be sent (%s); further drops are only counted", reason)

    def _resolve_flushes(self) -> None:
        frontier = self._pending[0].taken if self._pending else self._next_seq
        still: list[_FlushRequest] = []
        for req in self._flush_waiting:
            if req.cancelled:
                continue
            if frontier >= req.target:
                req.done.set()
            else:
                still.append(req)
        self._flush_waiting = still


# ----------------------------------------------------------------------------------------- process hooks


def after_fork_in_child() -> None:
    """Make every publisher inherited from the parent process unusable, and clear ``STATE.publisher``.

    Runs automatically in a child made by ``os.fork()`` (registered with :func:`os.register_at_fork`);
    idempotent. Inherited publishers never touch the parent's socket, context or thread again; their
    ``publish*`` calls become no-ops counted as dropped. Publishers created in this process are untouched.
    """
    me = os.getpid()
    for pub in list(_LIVE):
        if pub._owner_pid != me and not pub._dead:
            pub._mark_dead_in_child()
            _LIVE.discard(pub)
    st = _state.STATE
    if st.publisher is not None and st.publisher._owner_pid != me:
        st.publisher = None


_hooks_pid = -1


def _ensure_exit_hooks() -> None:
    """Register the exit flush for this process (once per process; a forked child registers its own)."""
    global _hooks_pid
    if _hooks_pid == os.getpid():
        return
    _hooks_pid = os.getpid()
    # multiprocessing children leave through os._exit (fork) and skip atexit: close from its finalizers too
    multiprocessing.util.Finalize(None, _close_all_at_exit, exitpriority=100)


def _close_all_at_exit() -> None:
    """Flush and close this process's live publishers, within about two seconds in total (best effort)."""
    deadline = time.monotonic() + _EXIT_BUDGET_S
    me = os.getpid()
    for pub in list(_LIVE):
        if pub._owner_pid != me or pub.closed:
            continue
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        with contextlib.suppress(Exception):
            pub.close(linger_ms=remaining_ms)


os.register_at_fork(after_in_child=after_fork_in_child)
atexit.register(_close_all_at_exit)
