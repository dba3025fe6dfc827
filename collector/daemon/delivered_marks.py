"""The delivered watermark of every sender, kept where the next collector finds it and acknowledged to the ranks
(:class:`DeliveredMarks`), as a job's events reach the sinks (:class:`collector.sinks.kept_events.KeptEvents`).

A rank keeps each message it sent until a collector acknowledges it (:mod:`shmstat.publish.sender`). Per sender
``(rank, pid, incarnation)`` the collector's watermark is the first sequence number not yet delivered: below it
every item was handed on (a put metric to the metric handlers, an event taken by every events sink or counted
lost there with its gap record written, a gap's record written). :class:`DeliveredMarks` moves it as the sinks
take what was queued (:meth:`collector.sinks.delivery.EventDelivery.completed`), writes it into the
sender's delivered mark in the segment (:mod:`shmstat.shm.layout`) *before* acknowledging it, and sends the
acknowledgements batched, once per :data:`ACK_INTERVAL_S`. A restarted collector reads the marks at start
(:meth:`collector.relay.relay.Relay.restore`): what a rank re-sends below its mark is dropped, a hole above it is a
gap. A sender whose mark cannot be kept (every mark held by a live sender) is acknowledged all the same and is
followed as before: its loss across a collector crash is then counted from its first message on.

A sender that exits with items no collector acknowledged records, in its rank entry, the sequence number after
the last one it numbered (``events_end``, :mod:`shmstat.shm.layout`): what it held when no collector served, what
its full socket could not take. :meth:`DeliveredMarks.settle` finds such an entry once the process is gone and
counts what this collector did not receive of them (from the relay's expected number, else the sender's mark) as
a gap — a gap record for the events sinks and ``seq_gaps`` — then the mark follows to that number, and once it is
there the entry's ``events_end`` is cleared: a later collector counts nothing twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from shmstat.shm.segment import pid_alive

if TYPE_CHECKING:
    from shmstat.shm.layout_records import RankInfo
    from shmstat.shm.segment import Segment

    from ..relay.relay import Relay
    from ..sinks.kept_events import KeptEvents

__all__ = ["ACK_INTERVAL_S", "DeliveredMarks"]

ACK_INTERVAL_S = 0.02
"""Seconds between two acknowledgements (and segment writes) at most: a rank keeps about this much more."""

Key = tuple[int, int, int]
_UNSEEN: Any = object()


class DeliveredMarks:
    """The delivered marks of one job's senders (see the module docstring). The collector's loop calls
    :meth:`step`; a sink's thread calls :meth:`taken` after each batch, so a mark moves as soon as the sinks took
    what it covers (a collector killed between the two re-delivers at most what that batch held)."""

    def __init__(self, segment: Segment, relay: Relay, events: KeptEvents) -> None:
        self.segment: Segment | None = segment
        self.relay = relay
        self.events = events
        self._lock = threading.Lock()  # the loop and the sinks' threads write marks
        self._index: dict[Key, int] = {}
        self._written: dict[Key, int] = {}
        self._acked: dict[Key, int] = {}
        self._origin: dict[Key, int] = {}
        self._thaw: dict[Key, int] = {}  # a sender's mark stays until the sinks completed this ticket
        self._ending: dict[Key, int | None] = {}  # gone senders left to count: what the relay expected at a look
        self._settled: set[Key] = set()  # gone senders counted, whose mark is on its way to their end
        self._looked = False
        used: set[int] = set()
        restored: dict[Key, tuple[int, int]] = {}
        self._next = 0.0
        for index, pid, rank, incarnation, delivered, origin in segment.delivered_marks():
            used.add(index)
            key = (rank, pid, incarnation)
            self._index[key] = index
            self._written[key] = self._acked[key] = delivered
            self._origin[key] = origin
            if pid_alive(pid):  # a sender that died re-sends nothing
                restored[key] = (delivered, origin)
        self._free = [i for i in range(segment.geometry.max_marks - 1, -1, -1) if i not in used]
        self._next = 0.0
        relay.restore(restored)
        if events.delivery is not None:
            events.delivery.listen(self.taken)
            events.delivery.resent_by(events.job, self.resends)

    def resends(self, rank: int, pid: int, incarnation: int) -> bool:
        """Whether the sender still keeps what no sink took and re-sends it to the next collector: it re-syncs, its
        mark is kept in the segment (below what it sent and the sinks did not take), and it lives."""
        key = (rank, pid, incarnation)
        return key in self.relay.origins and key in self._index and pid_alive(pid)

    def settle(self, ranks: Iterable[RankInfo], *, final: bool = False) -> None:
        """(The loop, at a look at the rank table.) Count what gone senders could not deliver (see the module
        docstring): for every entry whose process is gone and left an ``events_end``, what the relay did not
        receive below it is a gap — once no message of the sender came between two looks (one may still be on its
        way from the kernel's buffers), or at once at this collector's first look (it started after the sender
        went) and when ``final`` (stopping, after the hand-over). Once the sender's mark reached its end, the
        entry's ``events_end`` is cleared."""
        segment = self.segment
        if segment is None:
            return
        first, self._looked = not self._looked, True
        for info in ranks:
            end = info.events_end
            if end <= 0 or pid_alive(info.pid):
                continue
            key = (info.rank, info.pid, info.events_incarnation)
            if self._written.get(key, -1) >= end:  # every item up to its end delivered or counted, and marked
                segment.clear_events_end(info.local_rank, info.pid, end)
                self._ending.pop(key, None)
                self._settled.discard(key)
                continue
            if key in self._settled:
                continue
            heard = self.relay.expected(key)
            if not (first or final) and self._ending.get(key, _UNSEEN) != heard:
                self._ending[key] = heard
                continue
            self._ending.pop(key, None)
            self._settled.add(key)
            self.relay.ended(key, end, self._written.get(key, 0), self._origin.get(key, 0))

    def close(self) -> None:
        """Stop listening to the sinks and writing marks (the segment is about to be closed); idempotent."""
        if self.events.delivery is not None:
            self.events.delivery.unlisten(self.taken)
        with self._lock:
            self.segment = None

    def step_if_due(self, now: float) -> None:
        """:meth:`step` once per :data:`ACK_INTERVAL_S` (``now``: :func:`time.monotonic`)."""
        if now >= self._next:
            self._next = now + ACK_INTERVAL_S
            self.step()

    def handed_on(self, senders: Iterable[Key]) -> None:
        """(The loop.) Messages of ``senders`` (``(rank, pid, incarnation)``) were handed on at once (a put metric
        to the metric handlers; any message when no events sink runs): their marks move past them now, unless
        events of the sender are still on their way to the sinks (then :meth:`taken` moves it)."""
        relay, pending = self.relay, self.events.pending
        origins, written = relay.origins, self._written
        delivery = self.events.delivery
        done: int | None = None
        asked = False
        for key in senders:
            if pending.get(key):
                continue
            origin = origins.get(key)
            expected = relay.expected(key)
            if origin is None or expected is None:
                continue  # a sender that re-sends nothing (its mark is never kept), or one not followed
            if expected <= written.get(key, -1) and self._origin.get(key) == origin:
                continue  # already there (what _move would find, without taking the lock)
            with self._lock:
                if not asked and delivery is not None:
                    done, asked = delivery.completed(), True
                if not self._frozen(key, done):
                    self._move(key, expected)

    def taken(self) -> None:
        """(A sink's thread.) Move the marks of the senders whose queued events every sink has now taken."""
        delivery = self.events.delivery
        if delivery is None:
            return
        with self._lock:
            if self.segment is None:
                return
            done = delivery.completed()
            for key, queue in list(self.events.pending.items()):
                if self._frozen(key, done):
                    continue
                end = None
                while queue and queue[0][0] <= done:
                    end = queue.popleft()[2]
                if queue:
                    self._move(key, queue[0][1])
                elif end is not None:
                    self._move(key, end)

    def step(self) -> None:
        """Move the watermarks to what the sinks took and the relay received, write them into the segment, then
        acknowledge them (the loop: it owns the socket)."""
        relay, pending = self.relay, self.events.pending
        delivery = self.events.delivery
        acks: list[tuple[int, int, int, int]] = []
        with self._lock:
            done = delivery.completed() if delivery is not None else None
            if relay.closed_windows and delivery is not None:
                for key in relay.closed_windows:  # frozen until the sinks took the window's items
                    self._thaw[key] = delivery.offered
            relay.closed_windows = set()
            keys = relay.touched
            relay.touched = set()
            keys.update(pending)
            keys.update(k for k, w in self._written.items() if self._acked.get(k) != w)
            for key in keys:
                if self._frozen(key, done):
                    continue
                queue = pending.get(key)
                while queue and (done is None or queue[0][0] <= done):
                    queue.popleft()
                if queue:
                    self._move(key, queue[0][1])
                else:
                    pending.pop(key, None)
                    expected = relay.expected(key)
                    if expected is not None:
                        self._move(key, expected)
                delivered = self._written.get(key)
                if delivered is not None and self._acked.get(key) != delivered:
                    self._acked[key] = delivered
                    acks.append((key[1], key[0], key[2], delivered))
        if acks:
            relay.acknowledge(acks)

    def _frozen(self, key: Key, done: int | None) -> bool:
        """Whether ``key``'s mark must not move now: not a re-syncing sender (it re-sends nothing), or items
        below its mark are still on their way (a window of re-sent items, see
        :attr:`collector.relay.relay.Relay.windows`, open or not yet taken by the sinks)."""
        relay = self.relay
        if key not in relay.origins or key in relay.windows or key in relay.closed_windows:
            return True
        thaw = self._thaw.get(key)
        if thaw is None:
            return False
        if done is None or done >= thaw:
            del self._thaw[key]
            return False
        return True

    def _move(self, key: Key, delivered: int) -> None:
        """Write ``delivered`` as ``key``'s mark if it is further (the lock is held)."""
        origin = self.relay.origins.get(key, 0)
        fresh = self._origin.get(key, origin) != origin
        if fresh:  # a new process under a dead sender's name (its pid used again): its own mark, from scratch
            self._written.pop(key, None)
            self._acked.pop(key, None)
        if delivered <= self._written.get(key, -1):
            return
        self._written[key] = delivered
        segment = self.segment
        if segment is None:
            return
        index = self._index.get(key)
        if index is None or fresh or key not in self._origin:
            if index is None:
                index = self._take_index()
                if index is None:  # acknowledged all the same (see the module docstring)
                    return
                self._index[key] = index
            self._origin[key] = origin
            segment.set_delivered_mark(index, key[1], key[0], key[2], delivered, origin)
        else:
            segment.move_delivered_mark(index, delivered)

    def _take_index(self) -> int | None:
        """A free mark, or the mark of a sender whose process is gone; None if every mark is a live sender's."""
        if self._free:
            return self._free.pop()
        for key, index in list(self._index.items()):
            if not pid_alive(key[1]):
                del self._index[key]
                self._written.pop(key, None)
                self._acked.pop(key, None)
                self._origin.pop(key, None)
                return index
        return None
