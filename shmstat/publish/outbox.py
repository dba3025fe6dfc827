"""The publisher's backlog: items encoded at publish time, batched per topic, bounded, every drop numbered.

An :class:`Outbox` holds, in publish order, *batches* (items of one topic, already msgpack-encoded exactly as
they travel in a message's ``items`` array) and *gaps* (items dropped at that place: over the bound, not
encodable). A publish adds its item to the batch of its topic that is still open — not yet sealed by the
publisher thread, below ``batch_max`` items and ``max_batch_bytes`` encoded bytes — else starts a new batch at
the end. Open batches are forgotten whenever a batch of another kind or a gap is added (or more than
:data:`MAX_OPEN` topics interleave), so topics of one kind published interleaved (``@prof``'s success and
duration) share large messages while the order between kinds and the place of every gap stay those of
publishing. At most ``max_items`` items and ``max_bytes`` estimated bytes
(:func:`shmstat.publish.item_sizes.item_bytes`) are held; past that an item becomes a gap of one.

The publisher thread seals the first batch (:meth:`Outbox.head`: it takes the next sequence numbers and gets its
two frames, the payload being the wire header, the array header and the encoded items) and, once zmq took the
frames, forgets it (:meth:`Outbox.pop`). Sequence numbers are assigned in send order; a gap consumes its numbers
when it reaches the head, so a receiver's gap of ``n`` is ``n`` dropped items.

This module is the pure-Python implementation (the ``"python"`` backend of :mod:`shmstat._backend`) and the
reference for its C twin, ``Backend.Outbox``: both put the same bytes on the wire. Every method of the C one is
atomic under the GIL; here a lock makes them so. :func:`new_outbox` builds the backend's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, NamedTuple

import msgpack

from .._backend import backend
from .item_sizes import item_bytes

__all__ = ["KIND_CODES", "MAX_OPEN", "Outbox", "OutboxCounters", "counters_of", "new_outbox"]

MAX_OPEN = 16
"""Topics of one kind whose batches stay open for joining at once (more interleaved topics start new batches)."""

KIND_CODES = {"event": 0, "metric": 1, "stat": 2, "rank": 3}
"""The ``kind`` argument of :meth:`Outbox.raw` for each wire kind."""

_KIND_NAMES = ("event", "metric", "stat", "rank")
_GAP = -1
_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_INT64_MIN = -(1 << 63)
_UINT64_MAX = (1 << 64) - 1
_SCALARS = (str, float, bool)


class _Chunk:
    __slots__ = ("frames", "items", "key1", "key2", "kind", "n", "nbytes", "size", "taken")

    def __init__(self, kind: int, key1: str | None, key2: str | None, taken: int, n: int) -> None:
        self.kind = kind
        self.key1 = key1
        self.key2 = key2
        self.taken = taken
        self.n = n
        self.nbytes = 0
        self.size = 0  # encoded bytes of the items
        self.items: list[bytes] = []
        self.frames: tuple[bytes, bytes] | None = None


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _fast_scalar(value: Any) -> bool:
    t = type(value)
    return t in _SCALARS or (t is int and _INT64_MIN <= value <= _UINT64_MAX)


class Outbox:
    """Bounded, batched, encoded items of one publisher (see the module docstring); pure Python."""

    def __init__(self, rank: int, pid: int, incarnation: int, batch_max: int, max_items: int, max_bytes: int,
                 max_batch_bytes: int, metric_bytes: int) -> None:
        """Items of sender (``rank``, ``pid``, ``incarnation``); bounds in items and (estimated) bytes."""
        self.rank, self.pid, self.incarnation = rank, pid, incarnation
        self.batch_max, self.max_items, self.max_bytes = batch_max, max_items, max_bytes
        self.max_batch_bytes, self.metric_bytes = max_batch_bytes, metric_bytes
        self._chunks: list[_Chunk] = []
        self._first = 0  # index of the head chunk in _chunks (popped ones are trimmed in bulk)
        self._open: dict[tuple[str | None, str | None], _Chunk] = {}
        self._open_kind = _GAP
        self._index = 0
        self._held = self._held_bytes = 0
        self._wire_seq = 0
        self._sent_items = self._sent_messages = self._dropped = self._invalid = self._late = 0
        self._closed = False
        self._wake_fd = -1
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------- caller side

    def log(self, event: Any, limit: int) -> int:
        """:meth:`event` for an :class:`shmstat.publish.events.Event` whose Unix ns are known (``event._ts_ns``); caches
        the size in it once known. -1 when the caller must take its own path (unknown Unix ns, or :meth:`event`
        declined it)."""
        ts_ns = getattr(event, "_ts_ns", None)
        if ts_ns is None:
            return -1
        size = self.event(event._name, ts_ns, event._data, event._nbytes, limit)
        if size > 0:
            event._nbytes = size
        return size

    def event(self, name: Any, ts_ns: Any, data: Any, size: int = 0, limit: int = 0) -> int:
        """Add event ``[name, ts_ns, data]`` (encoded now: ``data`` may change afterwards); returns its
        estimated size (not added if over ``limit`` > 0), 0 when closed, -1 when the caller must validate and
        encode it itself (:meth:`raw` / :meth:`invalid`): anything but exact built-in types within 64 bits."""
        if self._closed:
            with self._lock:
                self._late += 1
            return 0
        if (type(name) is not str or type(ts_ns) is not int or type(data) is not dict
                or not _INT64_MIN <= ts_ns <= _UINT64_MAX):
            return -1
        for key, value in data.items():
            if type(key) is not str or not _fast_scalar(value):
                return -1
        try:
            encoded = _packb([name, ts_ns, data])
        except (UnicodeEncodeError, ValueError, OverflowError, TypeError):
            return -1
        if size <= 0:
            size = item_bytes(name, data)
        if 0 < limit < size:
            return size
        with self._lock:
            self._add(0, name, None, encoded, size)
        return size

    def metric(self, group: Any, name: Any, value: Any, ts: Any) -> int | None:
        """Add metric ``[group, name, value, ts]``; None, or -1 when the caller must take the slow path."""
        if self._closed:
            with self._lock:
                self._late += 1
            return None
        tv, tt = type(value), type(ts)
        if (type(group) is not str or type(name) is not str or tv is str or not _fast_scalar(value)
                or (tt is not float and not (tt is int and _INT64_MIN <= ts <= _UINT64_MAX))):
            return -1
        try:
            encoded = _packb([group, name, value, ts])
        except (UnicodeEncodeError, ValueError, OverflowError, TypeError):
            return -1
        with self._lock:
            self._add(1, group, name, encoded, self.metric_bytes)
        return None

    def raw(self, kind: int, key1: str | None, key2: str | None, encoded: bytes, size: int) -> None:
        """Add an item the caller validated and encoded; ``kind`` from :data:`KIND_CODES`; keys: the event's
        name, the metric's group and name, or the topic (stat, rank)."""
        with self._lock:
            if self._closed:
                self._late += 1
                return
            self._add(kind, key1, key2, encoded, size)

    def invalid(self, n: int = 1) -> None:
        """``n`` published items cannot be sent: dropped, counted (also in ``invalid``), numbered here."""
        with self._lock:
            if self._closed:
                self._late += n
                return
            self._invalid += n
            self._gap(n)

    def refused(self, n: int = 1) -> None:
        """``n`` published items were refused by the caller: dropped, counted, numbered here."""
        with self._lock:
            if self._closed:
                self._late += n
                return
            self._gap(n)

    def _gap(self, n: int) -> None:
        self._open.clear()
        self._open_kind = _GAP
        self._dropped += n
        self._index += n
        last = self._chunks[-1] if len(self._chunks) > self._first else None
        if last is not None and last.kind == _GAP:
            last.n += n
        else:
            self._chunks.append(_Chunk(_GAP, None, None, self._index - n, n))

    def _add(self, kind: int, key1: str | None, key2: str | None, encoded: bytes, size: int) -> None:
        if self._held >= self.max_items or self._held_bytes + size > self.max_bytes:
            self._gap(1)
            return
        chunk = None
        key = (key1, key2)
        if self._open_kind == kind:
            chunk = self._open.get(key)
            if chunk is not None and (chunk.frames is not None or chunk.n >= self.batch_max
                                      or chunk.size + len(encoded) > self.max_batch_bytes):
                del self._open[key]
                chunk = None
        if chunk is None:
            chunk = _Chunk(kind, key1, key2, self._index, 0)
            self._chunks.append(chunk)
            if self._open_kind != kind or len(self._open) >= MAX_OPEN:
                self._open.clear()
                self._open_kind = kind
            self._open[key] = chunk
        chunk.items.append(encoded)
        chunk.size += len(encoded)
        chunk.n += 1
        chunk.nbytes += size
        self._held += 1
        self._held_bytes += size
        self._index += 1
        if self._wake_fd >= 0 and (self._held == self.batch_max or
                                   self._held_bytes >= self.max_batch_bytes > self._held_bytes - size):
            with contextlib.suppress(OSError):  # full or closed: the sender wakes at the end of its budget anyway
                os.eventfd_write(self._wake_fd, 1)

    def wake_on_full(self, fd: int) -> None:
        """Write to eventfd ``fd`` (-1: none) whenever the items held reach a message's worth (``batch_max``
        items or ``max_batch_bytes`` estimated bytes), so that the sender goes at once rather than at the end of its
        latency budget."""
        self._wake_fd = fd

    # ------------------------------------------------------------------------------- thread side

    def head(self, max_topic: int) -> tuple[bytes, bytes] | None:
        """The frames of the first batch, sealed (numbered) now if it was not; None if nothing is held. Gaps
        at the head consume their sequence numbers; a batch whose topic cannot be sent is given up (counted as
        invalid). The batch stays at the head until :meth:`pop`."""
        with self._lock:
            chunks = self._chunks
            while len(chunks) > self._first:
                c = chunks[self._first]
                if c.kind == _GAP:
                    self._wire_seq += c.n
                    self._pop_head()
                    continue
                if c.frames is not None:
                    return c.frames
                first = self._wire_seq
                self._wire_seq += c.n
                if c.kind == 0:
                    topic = f"event/{c.key1}"
                elif c.kind == 1:
                    topic = f"metric/{c.key1}/{c.key2}"
                else:
                    topic = str(c.key1)
                try:
                    topic_b = topic.encode("utf-8")
                except UnicodeEncodeError:
                    topic_b = b""
                if not topic_b or len(topic_b) > max_topic:
                    self._held -= c.n
                    self._held_bytes -= c.nbytes
                    self._dropped += c.n
                    self._invalid += c.n
                    self._pop_head()
                    continue
                header = _packb({"v": 1, "k": _KIND_NAMES[c.kind], "r": self.rank, "p": self.pid,
                                 "i": self.incarnation, "s": first, "items": []})
                payload = b"".join([header[:-1], _array_header(c.n), *c.items])
                c.items = []
                c.frames = (topic_b, payload)
                return c.frames
            return None

    def _pop_head(self) -> None:
        c = self._chunks[self._first]
        self._first += 1
        if self._open.get((c.key1, c.key2)) is c:
            del self._open[(c.key1, c.key2)]
        if self._first > 64 and self._first * 2 > len(self._chunks):
            del self._chunks[:self._first]
            self._first = 0

    def pop(self) -> None:
        """The head batch (from :meth:`head`) was handed to zmq."""
        with self._lock:
            c = self._chunks[self._first] if len(self._chunks) > self._first else None
            if c is None or c.frames is None:
                raise RuntimeError("pop() without a sealed head batch")
            self._held -= c.n
            self._held_bytes -= c.nbytes
            self._sent_items += c.n
            self._sent_messages += 1
            self._pop_head()

    def drop_all(self) -> int:
        """Give up everything held (closing); returns the sequence number after the dropped items."""
        with self._lock:
            seq = self._wire_seq
            for c in self._chunks[self._first:]:
                if c.kind == _GAP:
                    seq += c.n
                else:
                    if c.frames is None:
                        seq += c.n
                    self._dropped += c.n
            self._chunks = []
            self._first = 0
            self._held = self._held_bytes = 0
            self._open.clear()
            self._open_kind = _GAP
            return seq

    def end_seq(self) -> int:
        """The sequence number after everything held."""
        with self._lock:
            return self._wire_seq + sum(c.n for c in self._chunks[self._first:] if c.frames is None)

    def wire_seq(self) -> int:
        """The next sequence number on the wire."""
        return self._wire_seq

    def close(self) -> None:
        """From now on publishes are counted as late drops and kept nowhere."""
        self._closed = True

    def frontier(self) -> int:
        """The publish index of the first item still held (every earlier one was sent or dropped)."""
        with self._lock:
            for c in self._chunks[self._first:]:
                if c.kind != _GAP:
                    return c.taken
            return self._index

    def counters(self) -> OutboxCounters:
        """The counters, as :class:`OutboxCounters` (the C outbox gives the same figures as a plain tuple)."""
        with self._lock:
            return OutboxCounters(self._index, self._sent_items, self._sent_messages, self._dropped, self._held,
                    self._held_bytes, self._invalid, self._late)


class OutboxCounters(NamedTuple):
    """An outbox's counters, in the order both outboxes' ``counters()`` give them."""

    published: int
    """Items handed to the outbox."""
    sent_items: int
    sent_messages: int
    dropped: int
    """Items dropped for want of room (or at close)."""
    held: int
    """Items waiting to be sent."""
    held_bytes: int
    invalid: int
    """Items refused because they cannot be sent (too long a topic or payload)."""
    late: int
    """Items published after the outbox was closed (counted, never sent)."""


def counters_of(outbox: Any) -> OutboxCounters:
    """``outbox.counters()`` by name, whichever outbox (C or Python) it is."""
    return OutboxCounters._make(outbox.counters())


def new_outbox(**kwargs: int) -> Outbox:
    """An outbox of the backend in use (:func:`shmstat._backend.backend`): the C one, or :class:`Outbox`;
    ``kwargs`` as for :class:`Outbox`."""
    c_outbox = backend().Outbox
    return Outbox(**kwargs) if c_outbox is None else c_outbox(**kwargs)
