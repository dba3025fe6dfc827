"""The publisher's backlog: items taken from the callers' queue into batches per topic, bounded in items and
in estimated bytes, every dropped item numbered at its place (so a receiver's gap of n is n lost items).

These are the publisher thread's methods for that (a mixin of :class:`shmstat.publisher.Publisher`, which owns
the state they use); :func:`item_bytes` is the size estimate both sides of the queue use.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from .runtime import env_number

__all__ = ["DEFAULT_BACKLOG_BYTES", "MAX_BATCH_BYTES", "METRIC_BYTES", "backlog_bytes_from_env", "item_bytes"]

_log = logging.getLogger("shmstat")

DEFAULT_BACKLOG_BYTES = 64 * 1024 * 1024
"""Bytes (estimated, see :func:`item_bytes`) of items a publisher holds at most, waiting and pending each;
``SHMSTAT_BACKLOG_MB`` or ``Publisher(backlog_bytes=...)`` change it."""

MAX_BATCH_BYTES = 256 * 1024
"""A batch of several items is sealed before it passes this many (estimated) bytes."""

METRIC_BYTES = 160
"""The estimated size of one metric item (Python objects and wire bytes)."""

_ITEM_OVERHEAD = 128


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


def backlog_bytes_from_env() -> int:
    """The backlog bound from ``SHMSTAT_BACKLOG_MB`` (MiB), or the default; a bad value is a ConfigError."""
    mb = env_number("SHMSTAT_BACKLOG_MB", 1, 1 << 20, "MiB")
    return DEFAULT_BACKLOG_BYTES if mb is None else int(mb * 1024 * 1024)


_GONE: tuple[bytes, ...] = ()  # the frames of a batch that was split or given up (no item may join it)


class _Backlog:
    """The thread side of the backlog (mixed into the publisher)."""

    _q: collections.deque[tuple[Any, ...]]
    _pending: collections.deque[_Batch]

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

    def _give_up(self, n: int, reason: str) -> None:
        self._held -= n
        self._dropped += n
        if not self._warned_invalid:
            self._warned_invalid = True
            _log.warning("shmstat: dropping items that cannot be sent (%s); further drops are only counted", reason)

    def _resolve_flushes(self) -> None:
        frontier = self._pending[0].taken if self._pending else self._next_seq
        still: list[Any] = []  # publisher._FlushRequest
        for req in self._flush_waiting:
            if req.cancelled:
                continue
            if frontier >= req.target:
                req.done.set()
            else:
                still.append(req)
        self._flush_waiting = still
