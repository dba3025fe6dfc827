"""The publisher's socket protocol: the thread that owns the ``XPUB`` socket, sends sealed batches without
blocking, reads the collector's subscription and hand-over frames, and marks the end of what it sent.

A :class:`_Sender` is the socket side of one :class:`shmstat.publish.publisher.Publisher`: it owns the socket, the
thread and all the state the thread changes (subscription, hand-over, warnings, waiting flushes), and the controls
the publisher's callers set for it (flush requests, wake-up, stop). The publisher owns the outbox (its callers
queue into it; the sender takes from it) and its life cycle (started, closed, dead, under its lock), and calls the
sender to start the thread, wait for a flush, close, and forget the parent's socket in a forked child.

What the ``XPUB`` tells us (measured on libzmq 4.3.5; the socket options :func:`connect_xpub` sets follow from
it):

- An ``XPUB`` silently discards messages no subscriber has asked for. So until the collector's subscribe-all
  frame has arrived (``subscribed`` is False) items are held in the publisher's bounded backlog, in order.
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
- Every message sent is kept until the collector's delivered acknowledgement covers it
  (:mod:`shmstat.wire.delivered`: a user message upstream, batched); a subscribe-all frame (a collector that
  starts, or the next one after a crash) makes the thread send a re-sync marker and re-send what is kept,
  before anything new.
- ``close()`` first asks whether anyone accepts connections on the ``ipc://`` socket file: if not, no
  collector serves and nothing will be acknowledged, so it waits for nothing.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
from typing import Any, cast

import zmq

from .. import wire
from ..errors import ConfigError
from ..shm.runtime import env_number, node_collector_running
from ..wire.delivered import DELIVERED_PREFIX, SYNC_STATE, delivered_in
from .outbox import Outbox, counters_of

__all__ = ["DEFAULT_EVENT_LATENCY_MS", "DEFAULT_SNDHWM", "DEFAULT_UNCOLLECTED_WARNING_S", "MAX_EVENT_LATENCY_MS",
           "connect_xpub", "event_latency_ms", "unacked_warning_from_env"]

_log = logging.getLogger("shmstat")

DEFAULT_SNDHWM = 64
"""zmq's send high-water mark, in messages (each message batches up to ``batch_max`` items and, except for one
large event, at most :data:`MAX_BATCH_BYTES`): what waits inside zmq stays within ~16 MiB, the rest is in the
publisher's own byte-bounded backlog, where a drop is counted and numbered."""

DEFAULT_EVENT_LATENCY_MS = 20.0
"""The event path's latency budget: how long the publisher thread may hold an item before sending it, so that at low
rates one message (and one turn of the collector) carries many items. Telemetry needs no millisecond latency: a
Prometheus scrape is 15 s apart. A message's worth held, a flush and the exit go at once."""
MAX_EVENT_LATENCY_MS = 60_000.0
_MIN_EVENT_LATENCY_MS = 0.1

_WARNED_UNCOLLECTED = False  # this process checked for the uncollected-events warning (said once per job)
DEFAULT_UNCOLLECTED_WARNING_S = 10.0


def _job_segment(job: str | None) -> Any:
    """The segment of ``job`` this process is attached to (a :class:`shmstat.shm.segment.Segment`), else None."""
    from ..job import _state

    att = _state.STATE.attachment
    if job is None or att is None or att.segment.job != job or att.segment.inode < 0:
        return None
    return att.segment


def event_latency_ms(value: float | None = None) -> float:
    """The latency budget in ms: ``value`` if given, else ``SHMSTAT_EVENT_LATENCY_MS``, else
    :data:`DEFAULT_EVENT_LATENCY_MS`; one out of 0.1 to 60,000 ms is a ConfigError."""
    if value is None:
        env = env_number("SHMSTAT_EVENT_LATENCY_MS", _MIN_EVENT_LATENCY_MS, MAX_EVENT_LATENCY_MS, "milliseconds")
        return DEFAULT_EVENT_LATENCY_MS if env is None else env
    if type(value) not in (int, float) or not _MIN_EVENT_LATENCY_MS <= value <= MAX_EVENT_LATENCY_MS:
        raise ConfigError(f"event_latency_ms must be a number of milliseconds from {_MIN_EVENT_LATENCY_MS:g} to "
                          f"{MAX_EVENT_LATENCY_MS:,.0f}, got {value!r}")
    return float(value)


class _Wakeup:
    """What the publisher thread sleeps on: an eventfd written by :meth:`set` (a flush, the close) and by the outbox
    when a message's worth is held (:meth:`Outbox.wake_on_full`: from C too, with no Python call)."""

    __slots__ = ("_poll", "fd")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def set(self) -> None:
        """Wake the thread (now, or at its next wait)."""
        with contextlib.suppress(OSError):
            os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        """Forget the wake-ups so far."""
        with contextlib.suppress(OSError):
            os.eventfd_read(self.fd)

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True (and cleared) if woken."""
        if self._poll.poll(max(0, math.ceil(timeout_s * 1000))):
            self.clear()
            return True
        return False

    def close(self) -> None:
        """Close the eventfd (the thread and the outbox no longer use it)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def unacked_warning_from_env() -> float:
    """Seconds after the first publish with no collector before the warning (``SHMSTAT_UNCOLLECTED_WARNING_S``,
    default 10); a bad value is a ConfigError."""
    seconds = env_number("SHMSTAT_UNCOLLECTED_WARNING_S", 0, 86400, "seconds")
    return DEFAULT_UNCOLLECTED_WARNING_S if seconds is None else seconds


def connect_xpub(sock: zmq.Socket[Any], endpoint: str, sndhwm: int) -> None:
    """Set the publisher's ``XPUB`` options (see the module docstring) on ``sock`` and connect it to ``endpoint``;
    raises ``zmq.ZMQError`` if zmq cannot."""
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full pipe says EAGAIN instead of discarding
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscribe frame, also a repeated one (see above)
    sock.setsockopt(zmq.LINGER, 0)  # set for real when the thread closes the socket
    sock.connect(endpoint)


class _FlushRequest:
    """A :meth:`Publisher.flush` waiting for the sent frontier to reach ``target``."""

    __slots__ = ("cancelled", "done", "target")

    def __init__(self, target: int) -> None:
        self.target = target
        self.cancelled = False
        self.done = threading.Event()


class _Sender:
    """The socket side of a publisher (see the module docstring): owns ``sock``, ``thread`` and the thread's state.

    ``outbox`` is the publisher's (the sender sends its sealed batches); ``job``, ``rank``, ``pid`` and
    ``incarnation`` name the publisher in the closing marker, the acknowledgement and the uncollected warning.
    """

    def __init__(self, sock: zmq.Socket[Any], outbox: Outbox, *, job: str | None, rank: int, pid: int,
                 incarnation: int, idle_sleep_s: float, unacked_warning_s: float,
                 kept_bytes: int = 64 * 1024 * 1024, endpoint: str = "",
                 latency_s: float = DEFAULT_EVENT_LATENCY_MS / 1000) -> None:
        self.sock: zmq.Socket[Any] | None = sock  # used only by the thread once it runs
        self.thread: threading.Thread | None = None
        self._outbox = outbox  # or its C twin (the same methods)
        self._job = job
        self._segment = _job_segment(job)
        """The job's segment as this process attached it when the publisher started (None: not yet), where the
        uncollected warning is flagged for the whole job; taken now, since shutdown detaches before the last
        flush."""
        self._rank = rank
        self._pid = pid
        self._incarnation = incarnation
        self._latency_s = float(latency_s)
        self._retry_s = min(float(idle_sleep_s), self._latency_s)  # zmq's pipe took part of what is held
        self._unacked_warning_s = unacked_warning_s
        self._kept_limit = kept_bytes
        self.origin = int.from_bytes(os.urandom(8), "little") >> 1
        """This publisher's random id, in its re-sync markers (see :mod:`shmstat.wire.delivered`)."""
        self._endpoint = endpoint
        self._reset_state()

    def _reset_state(self) -> None:
        """Set (or, in a forked child, reset) everything the thread and the controls change."""
        # thread side: written only by the thread while it runs
        self._prefixes: set[bytes] = set()
        self._subscribed = False
        self._ever_subscribed = False
        self._handed_over = False  # a collector asked for the hand-over: hold items until the next subscribes
        self._warned_invalid = False
        self._flush_waiting: list[_FlushRequest] = []
        # sent and not yet acknowledged as delivered: (the sequence number after it, its frames, its bytes)
        self._kept: collections.deque[tuple[int, tuple[Any, Any], int]] = collections.deque()
        self._kept_held = 0
        self.acked = 0
        """The highest delivered watermark a collector acknowledged (every item numbered below it was delivered)."""
        self.listening = False
        """Whether a collector was serving the endpoint when :meth:`close` looked."""
        self.kept_evicted = 0
        """Messages sent and never acknowledged that were given up to stay within the bound (a collector that
        has to re-sync with this publisher counts their items as a gap)."""
        self._resync_due = False  # a collector subscribed: send the re-sync marker, then re-send what is kept
        self._resend: collections.deque[tuple[Any, Any]] = collections.deque()
        # controls: set by the publisher's callers, read by the thread
        self._first_publish = 0.0  # monotonic time of the first publish (set when the thread starts)
        self._flush_requests: collections.deque[_FlushRequest] = collections.deque()
        self._wake = _Wakeup()
        self._outbox.wake_on_full(self._wake.fd)
        self._stop = False
        self._close_linger_ms = 0

    # ------------------------------------------------------------------------------------- the publisher's calls

    @property
    def subscribed(self) -> bool:
        """Whether the collector's subscribe-all frame is in effect (as the thread last saw it)."""
        return self._subscribed

    def start(self, name: str) -> None:
        """Start the thread ``name`` (once: the publisher calls this under its lock)."""
        self._first_publish = time.monotonic()
        thread = threading.Thread(target=self._run, name=name, daemon=True)
        thread.start()
        self.thread = thread

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every item queued before this call was handed to zmq or dropped
        (:meth:`Publisher.flush`); with no thread running, whether nothing is held."""
        thread = self.thread
        if thread is None or not thread.is_alive():
            return not counters_of(self._outbox).held
        req = _FlushRequest(counters_of(self._outbox).published)
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

    def close(self, budget_s: float) -> bool:
        """Flush for up to ``budget_s``, then stop the thread, which marks the end and closes the socket (or
        close the socket no thread ever used). False if the thread did not stop in time: its socket is left
        open."""
        thread = self.thread
        self.listening = thread is not None and self.collector_listening()
        if thread is not None and budget_s > 0 and not self.listening:
            budget_s = 0.0  # no collector serves: nothing will take what is held, nor acknowledge it
        deadline = time.monotonic() + budget_s
        if thread is not None:
            self.flush(budget_s)
            self._close_linger_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            self._stop = True
            self._wake.set()
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
            if thread.is_alive():  # pragma: no cover - the loop never blocks for long
                return False
        elif self.sock is not None:
            self.sock.close(linger=0)  # never used by a thread; nothing was ever queued
        self.sock = None
        self._outbox.wake_on_full(-1)
        self._wake.close()
        return True

    def forget_in_child(self, outbox: Outbox) -> zmq.Socket[Any] | None:
        """In a forked child: forget the parent's thread, flush requests and subscription, use ``outbox`` from
        now on, and return the parent's socket (for the caller to keep alive, never closed or used)."""
        sock, self.sock = self.sock, None
        self.thread = None
        self._outbox = outbox
        self._reset_state()  # (the parent's eventfd stays open in the child, unused, as its socket does)
        return sock

    # ------------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        sock = self.sock
        assert sock is not None
        failures = 0
        waiting = zmq.Poller()  # no subscriber yet with items held: the socket (a subscription) or a wake-up
        waiting.register(sock, zmq.POLLIN)
        waiting.register(self._wake.fd, zmq.POLLIN)
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
                if not self._ever_subscribed:
                    self._check_uncollected()  # also as it stops: a short-lived rank still says it once
                if self._stop:
                    return
                held = counters_of(self._outbox).held
                # what comes next is held up to the latency budget, unless a message's worth, a flush or the close
                # wakes the thread; zmq's pipe that took only part of what is held is tried again soon
                wait_s = self._retry_s if progressed and held else self._latency_s
                if not self._subscribed and held:
                    # only a subscription frame can unblock the backlog: wait on the socket too
                    if self._wake.fd in dict(waiting.poll(max(1, math.ceil(wait_s * 1000)))):
                        self._wake.clear()
                else:
                    self._wake.wait(wait_s)
        finally:
            deadline = time.monotonic() + self._close_linger_ms / 1000
            if self._kept and self._close_linger_ms > 0:
                self._await_delivered(sock, deadline)
            if self._subscribed and not counters_of(self._outbox).held:
                self._send_held(sock, self._outbox.end_seq())  # all sent: the collector need not wait for more from us
                self._await_ack(sock, int(max(0.0, deadline - time.monotonic()) * 1000))
            elif self._subscribed:
                # closing with items left: they are dropped, and the marker carries the sequence number after
                # them, so the collector counts them as a gap (sealed batches are numbered already)
                self._send_held(sock, self._outbox.end_seq())
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=self._close_linger_ms)

    def _step(self, sock: zmq.Socket[Any]) -> bool:
        """One round: subscriptions, flush requests, send. True if anything was sent."""
        if cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:  # EVENTS is an int option
            self._read_subscriptions(sock)
        requests = self._flush_requests
        while requests:
            self._flush_waiting.append(requests.popleft())
        progressed = self._subscribed and self._send(sock)
        if self._flush_waiting:
            self._resolve_flushes()
        if not self._warned_invalid and counters_of(self._outbox).invalid:
            self._warned_invalid = True
            _log.warning("shmstat: dropping items that cannot be sent (a topic longer than %d bytes or not "
                         "UTF-8); further drops are only counted", wire.MAX_TOPIC)
        return progressed

    def _resolve_flushes(self) -> None:
        frontier = self._outbox.frontier()
        still: list[_FlushRequest] = []
        for req in self._flush_waiting:
            if req.cancelled:
                continue
            if frontier >= req.target:
                req.done.set()
            else:
                still.append(req)
        self._flush_waiting = still

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
                if frame == b"\x01":  # a collector subscribed to everything: it may be a new one
                    self._resync_due = True
            elif frame.startswith(DELIVERED_PREFIX):
                self._acknowledged(frame)
                continue
            elif frame[:1] == b"\x00":
                prefixes.discard(frame[1:])
            elif frame == wire.HANDOVER_REQUEST and not self._handed_over:
                if self._subscribed:
                    self._send_held(sock)
                self._handed_over = True
            self._subscribed = b"" in prefixes and not self._handed_over  # the collector subscribes to all
            if self._subscribed:
                self._ever_subscribed = True

    def _acknowledged(self, frame: bytes) -> None:
        """Forget the kept messages a delivered acknowledgement covers."""
        delivered = delivered_in(frame, self._pid, self._rank, self._incarnation)
        if delivered is None:
            return
        self.acked = max(self.acked, delivered)
        kept = self._kept
        while kept and kept[0][0] <= delivered:
            self._kept_held -= kept.popleft()[2]

    def _keep(self, frames: tuple[Any, Any], end_seq: int) -> None:
        """Keep a sent message until a collector acknowledges it (bounded: the oldest are given up)."""
        size = len(frames[1])
        kept = self._kept
        kept.append((end_seq, frames, size))
        self._kept_held += size
        while self._kept_held > self._kept_limit and len(kept) > 1:
            self._kept_held -= kept.popleft()[2]
            self.kept_evicted += 1

    def _start_resync(self, sock: zmq.Socket[Any]) -> bool:
        """Send the re-sync marker (the first sequence number still held) and queue the kept messages for
        re-sending; False if zmq could not take the marker now."""
        first = self._next_to_send()
        marker = wire.encode("rank", self._rank, self._pid, self._incarnation, first,
                             [{"state": SYNC_STATE, "origin": self.origin}])
        try:
            sock.send_multipart([wire.HELD_TOPIC, marker], zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._resync_due = False
        self._resend = collections.deque(entry[1] for entry in self._kept)
        return True

    def _next_to_send(self) -> int:
        """The sequence number of the first item this thread has not handed to zmq since the collector subscribed:
        with a re-sync due, the oldest kept message's; else the next message to re-send's; else the outbox's head
        batch's (sealed, maybe refused by zmq once already: its numbers are taken, its items not sent); else the
        next number on the wire."""
        if self._resync_due:
            head = self._kept[0][1] if self._kept else None
        else:
            head = self._resend[0] if self._resend else None
        if head is None:
            head = self._outbox.head(wire.MAX_TOPIC)
        return self._outbox.wire_seq() if head is None else wire.decode(bytes(head[0]), bytes(head[1])).seq

    def collector_listening(self) -> bool:
        """Whether a collector may be serving this publisher's ``ipc://`` endpoint (a socket file someone
        accepts connections on, or a node collector running that will pick the job up); True for other
        transports, which cannot be told without waiting."""
        if not self._endpoint.startswith("ipc://"):
            return True
        path = self._endpoint[len("ipc://"):]
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.05)
            probe.connect(path)
        except TimeoutError:  # a full accept queue: someone listens
            return True
        except OSError:  # no such file, or nobody accepts on it (a collector that died): a node collector that
            return node_collector_running()  # has not yet picked the job up would
        finally:
            probe.close()
        return True

    def _check_uncollected(self) -> None:
        """Warn once per job (every rank and worker of it) when no collector has taken this publisher's items in
        time: the flag is in the job's segment (:func:`shmstat.job._degrade.warn_once_in_job`)."""
        global _WARNED_UNCOLLECTED
        if _WARNED_UNCOLLECTED or time.monotonic() - self._first_publish < self._unacked_warning_s:
            return
        _WARNED_UNCOLLECTED = True
        from ..job._degrade import warn_once, warn_once_in_job

        job = self._job or "?"
        message = (f"no collector takes the events of job {job}; they wait in the rank, bounded; run the node's "
                   "collector: shmstat collect")
        segment = self._segment if self._segment is not None else _job_segment(self._job)
        try:
            if segment is not None:
                warn_once_in_job("uncollected", message, segment)
            else:
                warn_once("uncollected", message, job=self._job)
        except Exception:  # the sender thread must survive anything; the warning is a courtesy
            _log.debug("shmstat: the uncollected warning failed", exc_info=True)

    def _await_delivered(self, sock: zmq.Socket[Any], deadline: float) -> None:
        """Before closing, until ``deadline``: keep answering the collector (a new one's subscription gets the
        re-sync and what is kept) until it acknowledged everything kept, so nothing this process sent is lost
        with it when the collector it sent to died."""
        with contextlib.suppress(zmq.ZMQError):
            while self._kept and (left := deadline - time.monotonic()) > 0:
                if sock.poll(max(1, int(min(left, 0.01) * 1000)), zmq.POLLIN):
                    self._read_subscriptions(sock)
                if self._subscribed:
                    self._send(sock)

    def _await_ack(self, sock: zmq.Socket[Any], budget_ms: int) -> None:
        """Wait up to ``budget_ms`` for the collector's acknowledgement of our marker: everything sent before it
        has been received, so closing the socket now loses nothing."""
        ack = wire.ACK_PREFIX + str(self._pid).encode()
        deadline = time.monotonic() + budget_ms / 1000
        with contextlib.suppress(zmq.ZMQError):
            while (left := deadline - time.monotonic()) > 0:
                if sock.poll(max(1, int(left * 1000)), zmq.POLLIN) and sock.recv(zmq.NOBLOCK) == ack:
                    return

    def _send_held(self, sock: zmq.Socket[Any], next_seq: int | None = None) -> None:
        """Tell the collector that everything sent before has been sent: the marker travels behind it in the
        same pipe. Sent when a collector that shuts down unsubscribes (from then on items are held for the
        next one) and when this publisher closes. It carries the first number not sent (:meth:`_next_to_send`:
        what zmq refused and what is still to re-send are held for the next collector, no loss), or ``next_seq``
        (closing with items left: the sequence number after them, so they count as a gap)."""
        seq = self._next_to_send() if next_seq is None else next_seq
        payload = wire.encode("rank", self._rank, self._pid, self._incarnation, seq, [{"state": "held"}])
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([wire.HELD_TOPIC, payload], zmq.NOBLOCK)

    def _send(self, sock: zmq.Socket[Any]) -> bool:
        """Send the outbox's batches in order until zmq says EAGAIN; True if at least one message left."""
        outbox = self._outbox
        head, pop, send = outbox.head, outbox.pop, sock.send_multipart
        max_topic = wire.MAX_TOPIC
        sent = False
        if self._resync_due and not self._start_resync(sock):
            return sent
        resend = self._resend
        while resend:
            try:
                send(resend[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return sent
            resend.popleft()
            sent = True
        keep, wire_seq = self._keep, outbox.wire_seq
        while True:
            frames = head(max_topic)
            if frames is None:
                return sent
            try:
                send(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return sent
            keep(frames, wire_seq())
            pop()
            sent = True
