"""When a pass's watermark reaches the segment: once every handler has taken the pass (:class:`PendingCommits`).

The scanner moves its watermark in memory as soon as it read a pass (the next pass never returns those windows
again), but the watermark a restarted collector resumes from (each descriptor's ``emitted_wid``) is written only
once every handler took the pass: its ``emit``/``emit_columns`` returned and its ``flush`` ran, or the rows for it
were dropped because its queue was full (counted in ``collector.handler_dropped``). A collector SIGKILLed at
any moment therefore leaves in the segment a watermark no later than what every handler has; the next collector
re-emits the rest. Passes are committed in order (a slot's watermark only moves forward).

A handler stuck inside one call must not hold the watermark back for ever (a restarted collector would then
re-emit, to every handler, all that happened since, and the ring may have overwritten it meanwhile): a pass not
taken ``wait_s`` seconds (:attr:`collector.daemon.config.CollectorConfig.commit_wait_s`) after it was read is
committed anyway and counted (``collector.passes_not_taken``); so are those a handler had not taken when the
collector stopped (a handler still stuck then is left behind). Such a pass reaches that handler at most once: if
the collector dies before the handler takes it, it never does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from shmstat.shm.segment import Segment

    from ..handlers.dispatch import PassTaken
    from ..read.scanner import DurableMarks

__all__ = ["DEFAULT_COMMIT_WAIT_S", "MAX_PENDING", "PendingCommits"]

_log = logging.getLogger("shmstat.collector")

DEFAULT_COMMIT_WAIT_S = 10.0
"""Seconds a pass may wait for a handler to take it before its watermark is committed without it."""
MAX_PENDING = 8
"""Passes held apart at most; past it the newest two are held as one (committed once the later is taken), so
what waits is bounded in bytes by about 8 times the watermarks of every slot (16 bytes each)."""


class _Pending(NamedTuple):
    taken: PassTaken
    marks: DurableMarks
    since: float  # monotonic time the pass was read


class PendingCommits:
    """The passes read but not yet committed to the segment, oldest first (see the module docstring)."""

    def __init__(self, wait_s: float = DEFAULT_COMMIT_WAIT_S) -> None:
        self.wait_s = wait_s
        self.not_taken = 0
        """Passes committed before every handler had taken them (a handler stuck past ``wait_s``, or at stop)."""
        self.lost_committed = 0
        """Windows lost to the ring whose passes this collector committed (the header's count moved by them)."""
        self._queue: deque[_Pending] = deque()
        self._warned = False

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, taken: PassTaken, marks: DurableMarks) -> None:
        """Hold ``marks`` until ``taken`` is done (a pass that moved no watermark is not held)."""
        if not len(marks.words) and not marks.lost and not self._queue:
            return
        if len(self._queue) >= MAX_PENDING:  # a handler taking each pass only after the next one was read
            newest = self._queue.pop()  # (a handler's queue is in order: the later ticket done, the earlier is)
            self._queue.append(_Pending(taken, newest.marks.then(marks), newest.since))
            return
        self._queue.append(_Pending(taken, marks, time.monotonic()))

    def apply(self, segment: Segment) -> int:
        """Write into ``segment``, in order, the watermarks of the passes every handler took, and those of passes
        waiting longer than ``wait_s`` (counted); returns how many passes were committed."""
        done = 0
        now = time.monotonic()
        while self._queue:
            head = self._queue[0]
            if not head.taken.done:
                if now - head.since < self.wait_s:
                    break
                self._count_not_taken(head, f"within {self.wait_s:g} s")
            self._write(self._queue.popleft().marks, segment)
            done += 1
        return done

    def settle(self, segment: Segment, timeout_s: float) -> None:
        """Before the collector's last counters: while a pass waiting holds windows lost to the ring, wait up to
        ``timeout_s`` seconds in all for the handlers to take the passes up to it, committing each one taken, in
        order, so that the last counters count them; those still not taken stay for :meth:`drain`."""
        deadline = time.monotonic() + timeout_s
        while any(p.marks.lost for p in self._queue):
            if not self._queue[0].taken.wait(max(0.0, deadline - time.monotonic())):
                return
            self._write(self._queue.popleft().marks, segment)

    def drain(self, segment: Segment, timeout_s: float) -> None:
        """At stop: wait up to ``timeout_s`` seconds for the handlers to take every pass, then commit them all
        (those still not taken counted)."""
        deadline = time.monotonic() + timeout_s
        while self._queue:
            head = self._queue.popleft()
            if not head.taken.wait(max(0.0, deadline - time.monotonic())):
                self._count_not_taken(head, "before the collector stopped")
            self._write(head.marks, segment)

    def _write(self, marks: DurableMarks, segment: Segment) -> None:
        marks.write(segment)
        self.lost_committed += marks.lost

    def _count_not_taken(self, pending: _Pending, when: str) -> None:
        self.not_taken += 1
        if not self._warned:
            self._warned = True
            stuck = ", ".join(repr(h) for h in pending.taken.waiting())
            _log.warning("handler %s did not take a pass %s: its watermark is committed without it (counted in "
                         "collector.passes_not_taken; further ones not logged)", stuck, when)
