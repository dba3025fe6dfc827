"""The one serving loop of every collector process: :class:`Loop` turns over the jobs a :class:`Served` holds.

A per-job collector (``shmstat collect --job J``, ``shmstat run``'s) is this loop serving one job
(:class:`collector.daemon.collector.OneJob`); the node collector (:class:`collector.daemon.node.NodeCollector`) is
it serving every job it picked up. One turn (:meth:`Loop.step`): the host's own chores (a node's look for jobs,
its status line), a wait for messages on every job's ingest socket until something is due, then every job's turn
(:meth:`collector.daemon.collector.Collector.turn`: relay, scan, watch ranks). Arbiter-style: signal handlers
only set a flag (:meth:`Loop.request_stop`); the loop ends its turn, and the host closes.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import zmq

from shmstat.shm.layout import MAX_GRACE_MS, RING_BUDGET_MS

from ..sinks.kept_events import let_sinks_finish

if TYPE_CHECKING:  # pragma: no cover
    from ..sinks.delivery import EventDelivery

__all__ = ["CHORE_SLACK_S", "COMMIT_POLL_S", "MAX_POLL_MS", "RELAY_TURN_S", "STAT_LOOK_S", "Loop", "Served",
           "ServedJob", "gather_pause", "relay_turn_s", "stat_look_s", "stop_signals", "wait_quietly"]

MAX_POLL_MS = 100
"""The longest a serving loop waits with nothing due (what other threads submit waits at most this long)."""
RELAY_TURN_S = 0.003
"""While messages flow, a serving loop turns at most this often (:func:`gather_pause`): it adds at most this
much to an event's way to subscribers."""
STAT_LOOK_S = (RING_BUDGET_MS - MAX_GRACE_MS) / 2000
"""Between rank looks, how often a serving loop reads the rank table for stats made since (25 ms): a new stat's
windows must be read before its ring wraps, which the layout allows as soon as RING_BUDGET_MS - MAX_GRACE_MS
after a window's end (shmstat/shm/layout.py)."""
CHORE_SLACK_S = 0.05
"""The periodic looks of a serving loop (rank table, usage figures, status line, heartbeat; a node collector's look
for jobs) are taken up to this much early or late, so that they share the loop's turns: an idle collector turns a
few times a second instead of once per look."""
COMMIT_POLL_S = 0.02
"""While a pass waits for its handlers (:class:`~collector.daemon.commits.PendingCommits`), the loop looks this
often whether it was taken."""
HOLD_LOOK_S = 0.01
"""While a job holds the ranks' events for its first subscriber (``hold_ms``), the loop looks this often for one."""


def stat_look_s(grace_ms: int) -> float:
    """How often a collector of grace ``grace_ms`` looks for new stats between rank looks: half of what the layout
    leaves it to read a new stat's first window, RING_BUDGET_MS less its own grace (which the layout bounds by
    MAX_GRACE_MS: :data:`STAT_LOOK_S`, 25 ms, at the longest grace; 40 ms at the default 20 ms)."""
    return (RING_BUDGET_MS - min(max(grace_ms, 0), MAX_GRACE_MS)) / 2000


def stop_signals() -> list[signal.Signals]:
    """The signals that stop a collector as SIGTERM does: SIGINT, SIGTERM, and SIGHUP (the terminal closed) unless
    it was ignored when the process started (``nohup``)."""
    return [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN
                                              else [])


def relay_turn_s(event_latency_ms: float) -> float:
    """How often a serving loop turns while messages flow, for a latency budget of ``event_latency_ms``: half
    of it, never more often than :data:`RELAY_TURN_S` (the loop's cost when the budget is short)."""
    return max(RELAY_TURN_S, event_latency_ms / 2000)


def gather_pause(turn_started: float, turn_s: float = RELAY_TURN_S) -> int:
    """After a loop turn (begun at ``turn_started``, :func:`time.monotonic`) that relayed messages: sleep until
    ``turn_s`` (:func:`relay_turn_s`) after its start, so that what arrives meanwhile is taken in one turn, and
    return the poll timeout for that turn (0). Messages flowing steadily cost one turn per ``turn_s``, not one
    per message; a message after a quiet spell is taken at once."""
    rest = turn_started + turn_s - time.monotonic()
    if rest > 0:
        time.sleep(rest)
    return 0


class ServedJob(Protocol):
    """One job as the loop turns it (:class:`collector.daemon.collector.Collector`)."""

    relayed_last_step: int
    next_stat_look: float
    stat_look_s: float

    @property
    def name(self) -> str:
        """The job's name."""

    @property
    def ingest_socket(self) -> zmq.Socket | None:
        """The socket the job's ranks send on (None once released)."""

    @property
    def holding(self) -> bool:
        """Whether the job still holds the ranks' events for its first subscriber."""

    def turn(self) -> None:
        """Relay what arrived, then scan and watch ranks as due (no wait)."""

    def next_due(self) -> float:
        """The :func:`time.monotonic` time by which the job must turn again."""

    def entries_moved(self) -> bool:
        """Whether a rank, writer or stat entry came since the job last read its rank table."""

    def stop_intake(self) -> None:
        """Stop, first: the ranks' hand-over (never raises: a failure is recorded, and the job let go all the same)."""

    def finish_round(self) -> None:
        """One round while the events sinks finish: closed windows emitted, delivered marks moved."""


class Served(Protocol):
    """What a :class:`Loop` serves: one job (:class:`collector.daemon.collector.OneJob`) or a node's jobs
    (:class:`collector.daemon.node.NodeCollector`)."""

    @property
    def max_wait_s(self) -> float:
        """The longest the loop waits with nothing due."""

    @property
    def ready_file(self) -> str | None:
        """Where :meth:`start` writes the endpoints, removed once the loop ends."""

    def serving(self) -> Sequence[ServedJob]:
        """The jobs served now."""

    def start(self) -> None:
        """Say where it serves (one line) and write the ready file."""

    def chores(self) -> None:
        """The host's own work at the start of a turn."""

    def due(self) -> float:
        """When the host's own work is next due (:func:`time.monotonic`)."""

    def turned(self, job: ServedJob, failed: Exception | None) -> None:
        """After ``job``'s turn (``failed``: what it raised; re-raise it to end the loop)."""

    @property
    def events_sinks(self) -> EventDelivery | None:
        """The events sinks whose finish the stop waits for (None: none of its own to finish)."""

    def stopping(self) -> None:
        """Stop, first: what the host says or records before its jobs' hand-over."""

    def close_job(self, job: ServedJob, deadline: float | None) -> None:
        """Stop, after every job's hand-over and the sinks' finish: ``job``'s last pass and release (its
        :meth:`ServedJob.last_pass`)."""

    def release(self, deadline: float | None) -> None:
        """Stop, last: the host's own sockets and outputs (``deadline``: the events sinks' close, or None)."""

    def stopped(self) -> None:
        """After :meth:`Loop.stop`, as :meth:`Loop.run` returns: the last lines."""


class Loop:
    """The serving loop over what ``served`` holds: :meth:`run` (signals, start, serve, stop), :meth:`serve` (no
    signals: usable in a thread), :meth:`step` (one turn; what tests drive), :meth:`request_stop`."""

    def __init__(self, served: Served, *, turn_s: float = RELAY_TURN_S) -> None:
        self.served = served
        self.turn_s = turn_s
        """How often the loop turns while messages flow (:func:`relay_turn_s` of the event latency budget)."""
        self.stop_requested = threading.Event()
        self._polled: tuple[zmq.Socket, ...] = ()  # the sockets self._polling polls
        self._polling = zmq.Poller()

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (or :meth:`request_stop`), close, and return 0."""
        if threading.current_thread() is threading.main_thread():
            for sig in stop_signals():
                signal.signal(sig, lambda _s, _f: self.stop_requested.set())
        try:
            self.served.start()
        except BaseException:
            self.stop()
            raise
        try:
            self.serve()
        finally:
            if self.served.ready_file is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.served.ready_file)
        self.served.stopped()
        return 0

    def serve(self) -> None:
        """Turn until :meth:`request_stop`, then :meth:`stop`. One turn runs whatever happens, so a collector
        stopped as soon as it started still reports its counters once."""
        try:
            self.step(0)
            while not self.stop_requested.is_set():
                turn = time.monotonic()
                relayed = any(job.relayed_last_step for job in self.served.serving())
                self.step(gather_pause(turn, self.turn_s) if relayed else self.poll_timeout_ms())
        finally:
            self.stop()

    def stop(self) -> None:
        """The one stop sequence of every collector: the host's first word, every job's hand-over (the ranks' last
        messages taken), the events sinks finishing (:func:`~collector.sinks.kept_events.let_sinks_finish`, every
        job emitting windows and moving delivered marks meanwhile), every job's last pass and release, then the
        host's own outputs. A per-job collector is this with its one job; a node collector lets each job go the
        same way."""
        self.served.stopping()
        jobs = tuple(self.served.serving())
        for job in jobs:
            job.stop_intake()
        sinks, deadline = self.served.events_sinks, None
        if sinks is not None and jobs:
            deadline = time.monotonic() + sinks.close_budget_s
            let_sinks_finish(sinks, {job.name: job.finish_round for job in jobs}, deadline)
        for job in jobs:
            self.served.close_job(job, deadline)
        self.served.release(deadline)

    def request_stop(self) -> None:
        """Ask :meth:`serve` to finish its turn and close (safe from a signal handler and from another thread)."""
        self.stop_requested.set()

    def step(self, poll_timeout_ms: int = 0) -> None:
        """One turn: the host's chores, a wait up to ``poll_timeout_ms`` for messages, then every job's turn."""
        self.served.chores()
        jobs = tuple(self.served.serving())
        if poll_timeout_ms > 0:
            if jobs:
                wait_quietly(self.poller(), poll_timeout_ms, jobs)
            else:
                time.sleep(poll_timeout_ms / 1000)
        for job in jobs:
            try:
                job.turn()
            except Exception as exc:
                self.served.turned(job, exc)
            else:
                self.served.turned(job, None)

    def next_due(self) -> float:
        """The :func:`time.monotonic` time by which the loop must turn again with no message arriving: the host's
        own work, or what a served job has due (soon while it holds events for a first subscriber)."""
        due = self.served.due()
        for job in self.served.serving():
            due = min(due, time.monotonic() + HOLD_LOOK_S if job.holding else job.next_due())
        return due

    def poll_timeout_ms(self) -> int:
        """How long :meth:`step` may wait for messages before something is due (:meth:`next_due`), in ms."""
        wait_s = self.next_due() - time.monotonic()
        return max(0, min(math.ceil(self.served.max_wait_s * 1000), math.ceil(wait_s * 1000)))

    def poller(self) -> zmq.Poller:
        """A poller of every served job's ingest socket (made anew only when the jobs served change)."""
        socks = tuple(s for s in (job.ingest_socket for job in self.served.serving()) if s is not None)
        if socks != self._polled:
            self._polled = socks
            self._polling = zmq.Poller()
            for sock in socks:
                self._polling.register(sock, zmq.POLLIN)
        return self._polling


def wait_quietly(poller: zmq.Poller, timeout_ms: int, jobs: Sequence[ServedJob]) -> None:
    """Wait up to ``timeout_ms`` for a message on ``poller``. The looks for new stats (every :func:`stat_look_s`)
    that fall due meanwhile are made here, one word of each segment (its entries epoch); the wait ends early only
    if one moved (the job's turn then reads the rank table), so a quiet collector turns only when something is due."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        now = time.monotonic()
        until = min([deadline, *(job.next_stat_look for job in jobs)])
        wait_ms = math.ceil((until - now) * 1000)
        if wait_ms > 0 and poller.poll(wait_ms):
            return
        now = time.monotonic()
        if now >= deadline:
            return
        for job in jobs:
            if now >= job.next_stat_look:
                if job.entries_moved():
                    return  # (left due: the turn looks)
                job.next_stat_look = now + job.stat_look_s
