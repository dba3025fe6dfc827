"""A job's events on their way to the sinks (:class:`KeptEvents`): what the collector's loop hands the events
sinks of one job (``--events``), and what is queued for them and not known to be taken, per sender (read by
:class:`collector.daemon.delivered_marks.DeliveredMarks`); and how a stopping collector lets its sinks finish
(:func:`let_sinks_finish`).

Kept: every event a rank publishes on ``event/<name>`` (``shmstat.log_event``, ``elastic.events.record``), the
backlog a rank held before the collector started included (it arrives through the relay once the collector
subscribes); the collector's own events (``rank/joined|exited|died`` as they are published on ``rank/``,
``shmstat.straggler[.recovered]``, ``shmstat.hang``, the launcher's ``torchelastic.worker.status.<STATE>``), numbered
per job; and every gap the relay finds in a rank's stream (:class:`~collector.sinks.events.GapRecord`,
``at="rank"``). Not kept: put metrics (``metric/`` topics go to the metric handlers) and stat windows.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .delivery import EventDelivery
from .events import EventRecord, GapRecord

if TYPE_CHECKING:
    from ..relay.intake import Received

__all__ = ["FINISH_ROUND_S", "KeptEvents", "let_sinks_finish"]

_log = logging.getLogger("shmstat.collector")


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


FINISH_ROUND_S = 0.02
"""How often a stopping collector emits windows and moves delivered marks while its events sinks finish."""


def let_sinks_finish(delivery: EventDelivery, rounds: Mapping[str, Callable[[], None]], deadline: float) -> None:
    """Stopping, after every job's hand-over (:meth:`collector.daemon.collector.Collector.stop_intake`): until the
    events sinks took what was offered to them, or ``deadline`` (:func:`time.monotonic`), each job's round
    (``rounds``, by job: :meth:`collector.daemon.collector.Collector.finish_round`) is taken every
    :data:`FINISH_ROUND_S`. A successor starts only once this process exited, and the ring keeps a closed window
    only a few windows long (:mod:`shmstat.shm.layout`): windows closing while a slow sink finishes are emitted here
    rather than lost; and what the sinks take is acknowledged while the marks still can be (after the jobs are let
    go it would come again from the ranks)."""
    while not delivery.drained() and time.monotonic() < deadline:
        for job, finish_round in rounds.items():
            try:
                finish_round()
            except Exception as exc:  # one job's trouble stops neither the others nor the stop
                _log.warning("job %s: a round while stopping failed (%r)", job, exc)
        time.sleep(FINISH_ROUND_S)
