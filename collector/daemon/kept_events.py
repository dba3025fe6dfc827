"""What one job's collector hands its events sinks (``--events``), as :class:`KeptEvents`.

Kept: every event a rank publishes on ``event/<name>`` (``shmstat.log_event``, ``elastic.events.record``), the
backlog a rank held before the collector started included (it arrives through the relay once the collector
subscribes); the collector's own events (``rank/joined|exited|died`` as they are published on ``rank/``,
``shmstat.straggler[.recovered]``, the launcher's ``torchelastic.worker.status.<STATE>``), numbered per job;
and every gap the relay finds in a rank's stream (:class:`~collector.handlers.events.GapRecord`, ``at="rank"``).
Not kept: put metrics (``metric/`` topics go to the metric handlers) and stat windows.
"""

from __future__ import annotations

import collections
import os
import time
from typing import TYPE_CHECKING

from ..handlers.event_delivery import EventDelivery
from ..handlers.events import EventRecord, GapRecord

if TYPE_CHECKING:
    from ..wire.intake import Received

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

    def close(self) -> None:
        """Close the sinks if they are this job's own (idempotent)."""
        if self.owns and self.delivery is not None:
            self.delivery.close()
