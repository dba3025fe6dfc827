"""The rank's event publisher: ships events and metrics to the node's collector without blocking the caller.

A :class:`Publisher` owns one ZeroMQ ``XPUB`` socket *connected* to the collector's ``XSUB`` (which binds the
job's ``ipc://`` endpoint and sends the subscribe-all frame ``b"\\x01"``). The caller's side of every
``publish*`` method is one call into the publisher's outbox (:mod:`shmstat.publish.outbox`; in C, ``shmstat._pubfast``,
when built): the item is checked and msgpack-encoded at once (so the caller may change its data afterwards) and
added to the open batch of its topic (up to ``batch_max`` items per message; an item joins its topic's batch
still waiting to be sent, so topics published interleaved — ``@prof``'s success and duration, a loop's several
metrics — still travel in large messages). A daemon thread, started on the first publish, owns the socket and
does everything else: it seals batches in order (numbering their items and prefixing the wire header), sends
them with ``zmq.NOBLOCK``, and reads the subscription frames the ``XPUB`` reports. The socket, the thread and
the thread's state belong to the publisher's sender (:mod:`shmstat.publish.sender`); the publisher calls it.

What the ``XPUB`` reports, and how the thread answers it, is in :mod:`shmstat.publish.sender`.

Guarantees:

- ``publish_event`` / ``publish_metric`` / ``publish`` never block, never raise for a full backlog, never
  touch the socket, and cost one call into the outbox (the slow path for odd values: a Python check and
  ``msgpack.packb``; plus checks for ``publish``).
- Items of one topic leave in publish order (per publisher), and so do items of different kinds (an event
  published before a metric leaves before it). Items of one kind but different topics published close
  together are regrouped per topic, so between them the wire order can differ from the publish order (each
  item carries its timestamp). Sequence numbers start at 0 and run on in send order; every item that is
  dropped takes one too, at its place in the publish order: a receiver's gap of ``n`` is ``n`` lost items.
- At most ``backlog_limit`` items and ``backlog_bytes`` estimated bytes are held here (waiting for the thread,
  for a subscriber or for room in zmq's pipe, which holds at most ``sndhwm`` messages of at most
  :data:`MAX_BATCH_BYTES` or one event); past that, new items are dropped, counted in
  :attr:`PublisherStats.dropped` and numbered. Items that cannot be encoded (bad types, too big) are dropped,
  counted and logged once. Nothing within the bound is lost while the collector is up or before it first
  starts. Items left when the publisher closes are dropped and the closing marker carries the sequence number
  after them, so the collector counts them as a gap; and when some item was not acknowledged as delivered, that
  number is also recorded in the process's rank entry (:attr:`Publisher.on_undelivered`), where the collector
  that finds the process gone counts what it did not receive (a full socket, no collector serving); with no
  collector serving, the exit says how many in one warning.
- ``stats().queued == sent_items + dropped + backlog`` at any time.
- A message handed to zmq is kept (up to ``backlog_bytes`` more, oldest given up first) until a collector
  acknowledges that it was delivered; when a collector subscribes, everything not acknowledged is re-sent behind
  a re-sync marker (:mod:`shmstat.wire.delivered`), so what a collector that died held (its queues, libzmq's
  buffers, the kernel's) reaches the next one, which drops what was delivered already.
- With no collector listening on the endpoint, ``close()`` does not wait: what is held is dropped and counted
  at once.

Processes: sequence numbers are per publisher, so a receiver keys them by (rank, incarnation, pid). A
publisher belongs to the process that created it: in a forked child, :func:`after_fork_in_child` (registered
with :func:`os.register_at_fork`) marks every inherited publisher dead — it never touches the parent's socket,
context or thread again; its ``publish*`` calls are no-ops counted as dropped — and clears
``shmstat.job._state.STATE.publisher`` if it held one, so the child can create its own publisher with its own pid.
At interpreter exit (and at the exit of a ``multiprocessing`` child) live publishers are flushed and closed
within a bounded time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from .. import wire
from ..errors import ConfigError
from . import _pubprocess
from ._pubprocess import after_fork_in_child
from .item_encoding import check_topic, encode_item
from .item_sizes import (
    DEFAULT_BACKLOG_BYTES,
    MAX_BATCH_BYTES,
    METRIC_BYTES,
    backlog_bytes_from_env,
    item_bytes,
)
from .outbox import KIND_CODES, Outbox, new_outbox
from .sender import DEFAULT_SNDHWM, _Sender, connect_xpub, unacked_warning_from_env

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


class Publisher:
    """Publishes events and metrics of one rank to the collector at ``endpoint`` (see the module docstring).

    ``rank`` and ``incarnation`` go into every message, with ``pid`` (default: this process). At most
    ``backlog_limit`` items are held here; a message carries at most ``batch_max`` items; the background
    thread sleeps ``idle_sleep_s`` when idle, backing off to 20 ms after a while. ``context`` is a
    ``zmq.Context`` to use (not terminated by :meth:`close`); by default the publisher makes its own.
    ``sndhwm`` is zmq's send high-water mark in messages. If no collector has subscribed within
    ``unacked_warning_s`` (default 10 s, ``SHMSTAT_UNCOLLECTED_WARNING_S``) of the first publish, one warning
    per process names ``job`` and the command that would collect it. Raises :class:`~shmstat.errors.ConfigError` for
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
        batch_max: int = 4096,
        idle_sleep_s: float = 0.002,
        context: zmq.Context[Any] | None = None,
        sndhwm: int = DEFAULT_SNDHWM,
        backlog_bytes: int | None = None,
        job: str | None = None,
        unacked_warning_s: float | None = None,
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
            ("backlog_bytes", backlog_bytes_from_env() if backlog_bytes is None else backlog_bytes, 1024),
        ):
            if type(value) is not int or value < low:
                raise ConfigError(f"Publisher {label} must be an int >= {low}, got {value!r}")
        if not isinstance(idle_sleep_s, (int, float)) or not 0 < idle_sleep_s <= 1:
            raise ConfigError(f"Publisher idle_sleep_s must be in (0, 1] seconds, got {idle_sleep_s!r}")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(f"Publisher endpoint must be a non-empty str, got {endpoint!r}")

        self.endpoint = endpoint
        self.job = job
        self.rank = rank
        if unacked_warning_s is None:
            unacked_warning_s = unacked_warning_from_env()
        self.incarnation = incarnation
        self.pid = pid
        self._owner_pid = os.getpid()
        self._backlog_bytes = backlog_bytes_from_env() if backlog_bytes is None else backlog_bytes

        # the backlog: items encoded at publish time, batched, bounded (C or pure Python, see shmstat.publish.outbox)
        self._outbox_args = {"rank": rank, "pid": pid, "incarnation": incarnation, "batch_max": batch_max,
                             "max_items": backlog_limit, "max_bytes": self._backlog_bytes,
                             "max_batch_bytes": MAX_BATCH_BYTES, "metric_bytes": METRIC_BYTES}
        self._outbox: Outbox = new_outbox(**self._outbox_args)
        self._warned_slow = False  # the slow path's log-once (caller side)

        # life cycle, under the lock (the sender owns the socket, the thread and the thread's state)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._dead = False

        self._own_context = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        sock = self._ctx.socket(zmq.XPUB)
        try:
            connect_xpub(sock, endpoint, sndhwm)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if self._own_context:
                self._ctx.term()
            raise ConfigError(f"cannot connect a publisher to {endpoint!r}: {exc}") from exc
        self._sender = _Sender(sock, self._outbox, job=job, rank=rank, pid=pid, incarnation=incarnation,
                               idle_sleep_s=idle_sleep_s, unacked_warning_s=unacked_warning_s,
                               kept_bytes=self._backlog_bytes, endpoint=endpoint)
        self.on_undelivered: Callable[[int, int], None] | None = None
        """Called by :meth:`close` with (the sequence number after the last item numbered, the incarnation) when
        some of them no collector acknowledged: the job layer records it in this process's rank entry."""
        _pubprocess.register(self)

    # ------------------------------------------------------------------------------------- caller side

    def publish_event(self, name: str, ts_ns: int, data: dict[str, Any], size: int = 0) -> None:
        """Queue the event ``name`` at ``ts_ns`` (Unix ns) with ``data`` (encoded now: the caller may change
        ``data`` afterwards); never blocks.

        ``data`` values must be ``str``/``int``/``float``/``bool`` (an item that cannot be encoded is dropped,
        counted and logged once). ``size`` is the event's :func:`item_bytes` if the caller has it. Past the
        bound the event is dropped and counted.
        """
        if self._outbox.event(name, ts_ns, data, size) < 0:
            self._publish_slow("event", name, None, (name, ts_ns, data), size)
        if not self._started:
            self.start()

    def publish_metric(self, group: str, name: str, value: int | float, ts: float) -> None:
        """Queue metric ``name`` of ``group`` with ``value`` at ``ts`` (Unix seconds); never blocks."""
        if self._outbox.metric(group, name, value, ts) is not None:
            self._publish_slow("metric", group, name, (group, name, value, ts), METRIC_BYTES)
        if not self._started:
            self.start()

    def publish(self, topic: str, kind: str, item: Any) -> None:
        """Queue one ``item`` of ``kind`` under ``topic`` (shapes in :mod:`shmstat.wire`); never blocks.

        Checks that ``kind`` is a wire kind and that ``topic`` starts with ``<kind>/`` and, for events and
        metrics, is the topic the item's name implies; raises :class:`~shmstat.errors.ConfigError` if not.
        """
        check_topic(topic, kind, item)
        if kind == "event":
            self._publish_slow(kind, str(item[0]), None, item, METRIC_BYTES)
        elif kind == "metric":
            self._publish_slow(kind, str(item[0]), str(item[1]), item, METRIC_BYTES)
        else:
            self._publish_slow(kind, topic, None, item, METRIC_BYTES)
        if not self._started:
            self.start()

    def _publish_slow(self, kind: str, key1: str, key2: str | None, item: Any, size: int) -> None:
        """Validate and encode an item the outbox's fast path left to us (subclasses, odd values, ``publish``);
        one that cannot go on the wire is dropped, counted and numbered here, and logged once."""
        encoded = encode_item(kind, key1, key2, item, size)
        if isinstance(encoded, str):
            self._outbox.invalid(1)
            if not self._warned_slow:
                self._warned_slow = True
                _log.warning("shmstat: dropping items that cannot be sent (%s); further drops are only counted",
                             encoded)
            return
        self._outbox.raw(KIND_CODES[kind], key1, key2, *encoded)

    # ------------------------------------------------------------------------------------- the fast path
    # log_event and put_metric queue into the outbox directly (in C too: shmstat/_c/log_event.h), then start.

    @property
    def outbox(self) -> Any:
        """The outbox ``log_event`` and ``put_metric`` queue into directly: one call checks, encodes and queues
        an item (:mod:`shmstat.publish.outbox`, or its C twin); call :meth:`start` after queueing. A forked child's
        publisher gets a new, closed one."""
        return self._outbox

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has run (or never will: the publisher was closed, or is a forked child's)."""
        return self._started

    def start(self) -> None:
        """Start the sending thread, once: it sends what is queued. A no-op once started, closed or dead."""
        with self._lock:
            if self._started or self._closed or self._dead:
                return
            _pubprocess.ensure_exit_hooks()
            self._sender.start(f"shmstat-publisher-r{self.rank}")
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
        return self._sender.flush(timeout_s)

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
            self._outbox.close()  # later publishes are counted as dropped
        if not self._sender.close(max(0, linger_ms) / 1000.0):  # pragma: no cover - the loop never blocks for long
            _log.warning("shmstat: publisher thread did not stop in time; leaving its socket open")
            _pubprocess.forget(self)
            return
        end = self._outbox.drop_all()  # whatever was not handed to zmq is given up (counted as dropped)
        if self._own_context:
            with contextlib.suppress(zmq.ZMQError):
                self._ctx.term()
        _pubprocess.forget(self)
        self._left_undelivered(end)

    def _left_undelivered(self, end: int) -> None:
        """Closed with items numbered below ``end``: those no collector acknowledged are recorded where the next
        collector finds them (:attr:`on_undelivered`), and, with no collector serving, said in one line."""
        undelivered = end - self._sender.acked
        if undelivered <= 0:
            return
        if self.on_undelivered is not None:
            try:
                self.on_undelivered(end, self.incarnation)
            except Exception:  # telemetry never raises into the exit; the warning below still says it
                _log.debug("shmstat: recording the undelivered items failed", exc_info=True)
        if not self._sender.listening:
            _log.warning("shmstat: rank %d (pid %d) of job %s exits with %d events and metrics no collector took; "
                         "they are lost (run 'shmstat collect' on the node to keep them)", self.rank, self.pid,
                         self.job or "?", undelivered)

    def stats(self) -> PublisherStats:
        """A snapshot of the counters (see :class:`PublisherStats`); consistent at any time."""
        published, sent_items, sent_messages, dropped, held, _bytes, _invalid, late = self._outbox.counters()
        return PublisherStats(
            queued=published + late,
            sent_items=sent_items,
            sent_messages=sent_messages,
            dropped=dropped + late,
            subscribed=self._sender.subscribed,
            backlog=held,
        )

    @property
    def closed(self) -> bool:
        """True after :meth:`close`, and for a forked child's inherited publisher."""
        return self._closed or self._dead

    def _mark_dead_in_child(self) -> None:
        """In a forked child: forget the parent's socket, context, thread and items; drop from now on."""
        self._dead = True
        self._started = True
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        parent_outbox = self._outbox
        self._outbox = new_outbox(**self._outbox_args)
        self._outbox.close()
        parent_sock = self._sender.forget_in_child(self._outbox)  # its thread, flush requests, subscription
        _pubprocess.keep_fork_orphans(parent_sock, self._ctx, parent_outbox)
