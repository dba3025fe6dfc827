"""A job's events on their way to the sinks (:class:`KeptEvents`): what the collector's loop hands the events
sinks of one job (a rank's ``event/`` messages, the collector's own events, gaps), and what is queued for them and
not known to be taken, per sender (read by :class:`collector.daemon.delivered_marks.DeliveredMarks`).
"""

from __future__ import annotations

import collections
import os
import time
from typing import TYPE_CHECKING

from .delivery import EventDelivery
from .events import EventRecord, GapRecord

if TYPE_CHECKING:
    from ..relay.intake import Received

__all__ = ["KeptEvents"]


class KeptEvents:
    """One job's events on their way to the sinks of ``delivery`` (None: no sink, every call is a no-op). The
    collector's loop calls it; nothing here waits for a sink. ``owns``: :meth:`close` closes the sinks (a node
    collector's jobs share its delivery, which it closes itself)."""

    def __init__(self, job: str, delivery: EventDelivery | None, *, owns: bool) -> None:
        self.job = job
        self.delivery = delivery
        self.owns = owns
        self.own_seq = 0
        """The number the collector's next own event of this job gets."""
        self.pending: dict[tuple[int, int, int], collections.deque[tuple[int, int, int]]] = {}
        """Per sender ``(rank, pid, incarnation)``: ``(ticket, first seq, seq after it)`` of what is queued for
        the sinks and not known to be taken (see :meth:`EventDelivery.completed`), oldest first. The loop appends,
        a sink's thread may take from the left (:class:`collections.deque` makes both safe)."""

    def message(self, msg: Received) -> None:
        """A rank's ``event/`` message, relayed."""
        if self.delivery is not None:
            ticket = self.delivery.offer_message(self.job, msg)
            self._queued((msg.rank, msg.pid, msg.incarnation), ticket, msg.seq, msg.seq + msg.n_items)

    def _queued(self, key: tuple[int, int, int], ticket: int, first: int, end: int) -> None:
        if ticket:
            queue = self.pending.get(key)
            if queue is None:
                queue = self.pending[key] = collections.deque()
            queue.append((ticket, first, end))

    def own(self, name: str, ts_ns: int, data: dict[str, str | int | float | bool]) -> None:
        """An event the collector made (and published)."""
        if self.delivery is not None:
            self.delivery.offer(self.job, EventRecord(name, self.job, None, ts_ns, dict(data), self.own_seq,
                                                      os.getpid()))
            self.own_seq += 1

    def gap(self, rank: int, pid: int, incarnation: int, first: int, count: int) -> None:
        """``count`` items of a rank's stream from seq ``first`` on never reached the collector."""
        if self.delivery is not None:
            ticket = self.delivery.offer(self.job, GapRecord(self.job, rank, pid, incarnation, first,
                                                             first + count - 1, count, "rank", time.time_ns()))
            self._queued((rank, pid, incarnation), ticket, first, first + count)

    def counters(self) -> dict[str, int]:
        """``events_dropped`` (this job's events a sink lost) and ``event_handler_errors`` (calls of a sink that
        raised, over every job the sinks serve)."""
        d = self.delivery
        return {"events_dropped": d.dropped_for(self.job) if d is not None else 0,
                "event_handler_errors": d.errors if d is not None else 0}

    def close(self, deadline: float | None = None) -> None:
        """Close the sinks if they are this job's own (idempotent); ``deadline``: see
        :meth:`EventDelivery.close`."""
        if self.owns and self.delivery is not None:
            self.delivery.close(deadline)
