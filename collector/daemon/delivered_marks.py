"""The delivered watermark of every sender, kept where the next collector finds it, and acknowledged to the ranks.

A rank keeps each message it sent until a collector acknowledges it (:mod:`shmstat.publish.xpub`). Per sender
``(rank, pid, incarnation)`` the collector's watermark is the first sequence number not yet delivered: below it
every item was handed on (a put metric to the metric handlers, an event taken by every events sink or counted
lost there with its gap record written, a gap's record written). :class:`DeliveredMarks` moves it as the sinks
take what was queued (:meth:`collector.handlers.event_delivery.EventDelivery.completed`), writes it into the
sender's delivered mark in the segment (:mod:`shmstat.shm.layout`) *before* acknowledging it, and sends the
acknowledgements batched, once per :data:`ACK_INTERVAL_S`. A restarted collector reads the marks at start
(:meth:`collector.wire.relay.Relay.restore`): what a rank re-sends below its mark is dropped, a hole above it is a
gap. A sender whose mark cannot be kept (every mark held by a live sender) is acknowledged all the same and is
followed as before: its loss across a collector crash is then counted from its first message on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shmstat.shm.segment import pid_alive

if TYPE_CHECKING:
    from shmstat.shm.segment import Segment

    from ..wire.relay import Relay
    from .kept_events import KeptEvents

__all__ = ["ACK_INTERVAL_S", "DeliveredMarks"]

ACK_INTERVAL_S = 0.02
"""Seconds between two acknowledgements (and segment writes) at most: a rank keeps about this much more."""

Key = tuple[int, int, int]


class DeliveredMarks:
    """The delivered marks of one job's senders (see the module docstring); the collector's loop calls it."""

    def __init__(self, segment: Segment, relay: Relay, events: KeptEvents) -> None:
        self.segment = segment
        self.relay = relay
        self.events = events
        self._index: dict[Key, int] = {}
        self._written: dict[Key, int] = {}
        used: set[int] = set()
        restored: dict[Key, int] = {}
        for index, pid, rank, incarnation, delivered in segment.delivered_marks():
            used.add(index)
            key = (rank, pid, incarnation)
            self._index[key] = index
            self._written[key] = delivered
            if pid_alive(pid):  # a sender that died re-sends nothing
                restored[key] = delivered
        self._free = [i for i in range(segment.geometry.max_marks - 1, -1, -1) if i not in used]
        self._next = 0.0
        relay.restore(restored)

    def step_if_due(self, now: float) -> None:
        """:meth:`step` once per :data:`ACK_INTERVAL_S` (``now``: :func:`time.monotonic`)."""
        if now >= self._next:
            self._next = now + ACK_INTERVAL_S
            self.step()

    def step(self) -> None:
        """Move the watermarks to what the sinks took, write them into the segment, then acknowledge them."""
        relay, pending = self.relay, self.events.pending
        delivery = self.events.delivery
        done = delivery.completed() if delivery is not None else None
        keys = relay.touched
        relay.touched = set()
        keys.update(pending)
        acks: list[tuple[int, int, int, int]] = []
        for key in keys:
            queue = pending.get(key)
            while queue and (done is None or queue[0][0] <= done):
                queue.popleft()
            if queue:
                delivered: int | None = queue[0][1]
            else:
                pending.pop(key, None)
                delivered = relay.expected(key)
            if delivered is None or self._written.get(key) == delivered:
                continue
            self._write(key, delivered)
            acks.append((key[1], key[0], key[2], delivered))
        if acks:
            relay.acknowledge(acks)

    def _write(self, key: Key, delivered: int) -> None:
        index = self._index.get(key)
        if index is None:
            index = self._take_index()
            if index is None:  # acknowledged all the same (see the module docstring)
                self._written[key] = delivered
                return
            self._index[key] = index
            self.segment.set_delivered_mark(index, key[1], key[0], key[2], delivered)
        else:
            self.segment.move_delivered_mark(index, delivered)
        self._written[key] = delivered

    def _take_index(self) -> int | None:
        """A free mark, or the mark of a sender whose process is gone; None if every mark is a live sender's."""
        if self._free:
            return self._free.pop()
        for key, index in list(self._index.items()):
            if not pid_alive(key[1]):
                del self._index[key]
                self._written.pop(key, None)
                return index
        return None
