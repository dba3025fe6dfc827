"""The per-node collector: one loop that scans windows, relays messages, watches ranks and dispatches.

Arbiter-style: signal handlers only set a flag; :meth:`Collector.step` does one round of work and is what
tests drive with an injected clock. Only one collector serves a job on a node, whoever's runtime directory it
uses: it holds an exclusive ``flock`` on the job's segment file itself for its whole life (released by the
kernel if it dies), and a second one exits naming the first's pid.

Everything the loop hands on goes out as a :class:`collector.read.passes.Pass` through one fan-out
(:attr:`Collector.fanout`, :mod:`collector.daemon.fanout`), which calls every consumer once per pass: the
straggler scorer (:class:`collector.daemon.straggler.StragglerScorer`), the handlers' dispatcher
(:class:`collector.handlers.dispatch.ThreadedDispatcher`: every handler takes a pass as columns, the console
straggler lines after it), the relay's ``stat/`` topics (:class:`collector.daemon.stat_topics.StatTopics`) and the
Prometheus exporter. A scan pass (:meth:`Collector._scan_pass`) reads the closed windows some consumer wants as
:class:`collector.read.columns.Columns` (merged by the one merge, :func:`collector.read.columns.merge_parts`).
Its watermark moves at once in the scanner's memory, and into the segment only once every handler took the pass
(:mod:`collector.daemon.commits`), so a collector killed mid-pass leaves that pass to the next one.

Passes of metrics that belong to no window: the ``put_metric`` points a loop turn took (:func:`puts_of`), with
what other threads of the collector's process submitted (the launcher's agent: queued without a lock, a
deque's appends and pops being atomic, and taken by the loop each turn, :meth:`Submitted.drain`); and the
collector's own figures in the platform group, every rank's CPU and RSS and the collector's counters
(:func:`usage_points`; those the segment holds: :func:`drop_counters`).

What one job's collector hands its events sinks (``--events``), as :class:`collector.sinks.kept_events.KeptEvents`.
Kept: every event a rank publishes on ``event/<name>`` (``shmstat.log_event``, ``elastic.events.record``), the
backlog a rank held before the collector started included (it arrives through the relay once the collector
subscribes); the collector's own events (``rank/joined|exited|died`` as they are published on ``rank/``,
``shmstat.straggler[.recovered]``, the launcher's ``torchelastic.worker.status.<STATE>``), numbered per job;
and every gap the relay finds in a rank's stream (:class:`~collector.sinks.events.GapRecord`, ``at="rank"``).
Not kept: put metrics (``metric/`` topics go to the metric handlers) and stat windows.

The job's segment as its collector holds it: the exclusive lock that makes a collector the job's only one on
this node (:func:`take_instance_lock`), and, once it is done, the removal of what the job left
(:func:`remove_if_done`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, NamedTuple

import numpy as np
import zmq

from elastic.metrics import MetricData, MetricHandler, StatMetricData
from shmstat import wire
from shmstat.errors import CollectorError, WireError
from shmstat.shm.layout import MAX_GRACE_MS, RING_BUDGET_MS, RankState
from shmstat.shm.layout_codec import rank_problem
from shmstat.shm.layout_records import RankInfo
from shmstat.shm.runtime import ingest_endpoint, publish_endpoint, segment_name, validate_job
from shmstat.shm.segment import Segment, pid_alive

from ..gpu.figures import GPU_GROUP
from ..gpu.sampler import GpuSampler, JobGpu
from ..handlers.console import status_line, stopping_line
from ..handlers.dispatch import ThreadedDispatcher
from ..prometheus.exporter import PrometheusExporter, start_exporter
from ..read.passes import Pass, Put
from ..read.scanner import Scanner
from ..relay.intake import Received
from ..relay.publish_socket import Outlet
from ..sinks.delivery import EventDelivery
from ..sinks.kept_events import KeptEvents
from .commits import PendingCommits
from .config import (
    PLATFORM_GROUP,
    CollectorConfig,
    build_dispatcher,
    build_event_delivery,
    start_sampler,
    write_ready_file,
)
from .config import SERVING_RANK_LOOK_S as SERVING_RANK_LOOK_S
from .delivered_marks import DeliveredMarks
from .fanout import FanOut
from .hangs import HangWatcher
from .liveness import Lifecycle, Liveness
from .stat_topics import StatTopics
from .straggler import EVENT_TOPICS, StragglerDetector, StragglerScorer

if TYPE_CHECKING:
    from ..relay.relay import Relay, RelayCounters

__all__ = ["PLATFORM_GROUP", "Collector", "CollectorConfig", "build_dispatcher", "stop_signals"]


def stop_signals() -> list[signal.Signals]:
    """The signals that stop a collector as SIGTERM does: SIGINT, SIGTERM, and SIGHUP (the terminal closed) unless
    it was ignored when the process started (``nohup``)."""
    return [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN
                                              else [])


_log = logging.getLogger("shmstat.collector")

MAX_POLL_MS = 100
"""The longest a serving loop waits with nothing due (what other threads submit waits at most this long)."""
RELAY_TURN_S = 0.003
"""While messages flow, a serving loop turns at most this often (:func:`gather_pause`): it adds at most this
much to an event's way to subscribers."""
STAT_LOOK_S = (RING_BUDGET_MS - MAX_GRACE_MS) / 2000
"""Between rank looks, how often a serving loop reads the rank table for stats made since (25 ms): a new stat's
windows must be read before its ring wraps, which the layout allows as soon as RING_BUDGET_MS - MAX_GRACE_MS
after a window's end (shmstat/shm/layout.py)."""


def stat_look_s(grace_ms: int) -> float:
    """How often a collector of grace ``grace_ms`` looks for new stats between rank looks: half of what the layout
    leaves it to read a new stat's first window, RING_BUDGET_MS less its own grace (which the layout bounds by
    MAX_GRACE_MS: :data:`STAT_LOOK_S`, 25 ms, at the longest grace; 40 ms at the default 20 ms)."""
    return (RING_BUDGET_MS - min(max(grace_ms, 0), MAX_GRACE_MS)) / 2000


CHORE_SLACK_S = 0.05
"""The periodic looks of a serving loop (rank table, usage figures, status line, heartbeat; a node collector's look
for jobs) are taken up to this much early or late, so that they share the loop's turns: an idle collector turns a
few times a second instead of once per look."""
COMMIT_POLL_S = 0.02
"""While a pass waits for its handlers (:class:`PendingCommits`), the loop looks this often whether it was taken."""


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


class Collector:
    """One job's collector on this node. Construct, then :meth:`run` (or :meth:`step` in tests), then
    :meth:`close`. Raises :class:`~shmstat.errors.CollectorError` if another collector serves the job.
    ``node_outlet``: a node collector's publish socket, which this job's messages also go out on (with the job's
    frame: :mod:`shmstat.wire`). ``gpu_sampler``: a node collector's GPU sampler, shared by its jobs (without one,
    the collector starts its own as ``config.gpu`` asks: :func:`collector.daemon.config.start_sampler`)."""

    def __init__(
        self, config: CollectorConfig, *, handler_objects: dict[str, MetricHandler] | None = None,
        out: IO[str] | None = None, dispatcher: ThreadedDispatcher | None = None,
        exporter: PrometheusExporter | None = None, events: EventDelivery | None = None,
        node_outlet: Outlet | None = None, gpu_sampler: GpuSampler | None = None,
    ) -> None:
        validate_job(config.job)
        self._init_state(config, out, exporter, events, gpu_sampler)
        try:  # each step makes what _release (or the events' close) undoes
            self._open_outputs(config, handler_objects, dispatcher, events, gpu_sampler)
            segment = self._open_segment(config)
            relay = self._open_relay(config, segment, node_outlet)
            self._start_exports(config, segment)
        except BaseException:
            self._abandon_start(config)
            raise
        self._init_counters(config)
        self.fanout = self._fan_out(config, relay)
        self.hangs = HangWatcher(config.job, segment, hang_after_s=config.hang_after_s, fanout=self.fanout,
                                 publish=self.publish_event, exporter=self.exporter, clock=self.clock)
        self._serve_the_job(config, segment, relay)

    def _init_state(self, config: CollectorConfig, out: IO[str] | None, exporter: PrometheusExporter | None,
                    events: EventDelivery | None, gpu_sampler: GpuSampler | None) -> None:
        """The first step of :meth:`__init__`: the attributes, with nothing opened yet (what is given is kept)."""
        self.config = config
        self.clock = config.clock
        self.out = out if out is not None else sys.stderr
        """Where notes go (where it serves, the Prometheus endpoint): stderr by default, so that stdout carries only
        data (the default handler's window and straggler lines)."""
        self.stop_requested = threading.Event()
        self._lock_fd: int | None = None
        self.segment: Segment | None = None
        self.relay: Relay | None = None
        self.last_ranks: list[RankInfo] = []
        """The rank entries the last :meth:`step` read (a node collector decides with them whether the job is over)."""
        self.rank_look_s = 0.0
        """Seconds between looks at the rank table and liveness in :meth:`step` (0: every step; serving:
        :data:`~collector.daemon.config.SERVING_RANK_LOOK_S`)."""
        self._next_rank_look = 0.0  # monotonic time of the next look at the rank table
        self.rank_looks = 0
        """Looks at the rank table so far (:attr:`last_ranks` changes only then)."""
        self.max_wait_s = MAX_POLL_MS / 1000
        """The longest :meth:`run` waits with nothing due (what other threads submit waits at most this long; a node
        collector, whose jobs nobody submits to, waits longer)."""
        self.stat_look_s = stat_look_s(config.grace_ms)
        """Between rank looks, how often the loop looks for stats made since (:func:`stat_look_s`)."""
        self._next_stat_look = 0.0
        self._entries_epoch = -1  # the segment's entries epoch when the rank table was last read
        self.relayed_last_step = 0
        """Messages the last :meth:`step` relayed (then a serving loop lets more gather: :func:`gather_pause`)."""
        self.exporter = exporter
        self._owns_exporter = False
        self.events = KeptEvents(config.job, events, owns=events is None)
        """What goes to the events sinks (``--events``; a node collector's, shared, as ``events``)."""
        self.gpu_sampler = gpu_sampler
        self._owns_sampler = False
        self.gpu: JobGpu | None = None
        """This job's GPU figures (None: GPU telemetry off)."""

    def _open_outputs(self, config: CollectorConfig, handler_objects: dict[str, MetricHandler] | None,
                      dispatcher: ThreadedDispatcher | None, events: EventDelivery | None,
                      gpu_sampler: GpuSampler | None) -> None:
        """A step of :meth:`__init__`: the events sinks, the GPU sampler and the dispatcher, unless given."""
        if events is None:
            self.events.delivery = build_event_delivery(config)
        if gpu_sampler is None:
            self.gpu_sampler = start_sampler(config, self.out)
            self._owns_sampler = self.gpu_sampler is not None
        self._owns_dispatcher = dispatcher is None
        self.dispatcher = dispatcher or build_dispatcher(config, handler_objects,
                                                         quiet=(GPU_GROUP,) if self.gpu_sampler else ())

    def _open_segment(self, config: CollectorConfig) -> Segment:
        """A step of :meth:`__init__`: the job's segment, held as its one collector (:func:`take_instance_lock`),
        and what reads it."""
        self.segment = segment = Segment.open(config.job, geometry=config.geometry)
        self._lock_fd = take_instance_lock(segment)
        self.scanner = Scanner(segment, config.grace_ms * 1_000_000)
        self.banks = segment.geometry.banks
        """The banks of every slot's ring in the job's segment."""
        self.running_at_stop = 0
        """The job's ranks still running as :meth:`shutdown` began (for the collector's last lines)."""
        self.commits = PendingCommits(config.commit_wait_s)
        self.liveness = Liveness(segment)
        self.stragglers = StragglerDetector(config.job, threshold=config.straggler_threshold,
                                            windows=config.straggler_windows)
        return segment

    def _open_relay(self, config: CollectorConfig, segment: Segment, node_outlet: Outlet | None) -> Relay:
        """A step of :meth:`__init__`: the relay of the ranks' messages, and the marks of what its sinks took."""
        from ..relay.relay import Relay

        self.relay = relay = Relay(config.ingest or ingest_endpoint(config.job),
                                   config.publish or publish_endpoint(config.job),
                                   sndhwm=config.publish_queue,
                                   heartbeat_interval_s=config.heartbeat_interval_s, node=node_outlet,
                                   job=config.job, curve=config.curve)
        self.relay_counters = relay.counters  # outlives the sockets, for the final report
        if self.events.delivery is not None:
            relay.on_gap = self.events.gap
        self.marks = DeliveredMarks(segment, relay, self.events)
        return relay

    def _start_exports(self, config: CollectorConfig, segment: Segment) -> None:
        """A step of :meth:`__init__`: the Prometheus exporter (unless given) and this job's GPU figures, as
        ``config`` asks."""
        if self.exporter is None and config.prometheus:
            self.exporter = start_exporter(config, self.out)
            self._owns_exporter = True
        if self.gpu_sampler is not None:
            self.gpu = JobGpu(segment, self.gpu_sampler, self.publish_event, clock=self.clock)
            if self.exporter is not None:
                self.exporter.set_gpus(self.gpu_sampler.uuids)

    def _fan_out(self, config: CollectorConfig, relay: Relay) -> FanOut:
        """A step of :meth:`__init__`: the consumers of every pass, in the order they take it (the straggler
        scorer first: the others read what it finds). Another consumer is one :meth:`FanOut.register` away."""
        dispatcher, exporter = self.dispatcher, self.exporter

        def scoring_needed() -> bool:  # scores to our group, events to subscribers, lines to the console handlers
            return (not dispatcher.discards(PLATFORM_GROUP) or any(map(relay.wants, EVENT_TOPICS))
                    or dispatcher.says_stragglers())

        fanout = FanOut()
        fanout.register(StragglerScorer(
            self.stragglers, needed=scoring_needed,
            all_scores=lambda: exporter is not None or not dispatcher.discards(PLATFORM_GROUP),
            publish=self.publish_event, describe=self.gpu.describe if self.gpu is not None else None))
        fanout.register(dispatcher)
        fanout.register(StatTopics(relay))
        if exporter is not None:
            fanout.register(exporter)
        return fanout

    def _abandon_start(self, config: CollectorConfig) -> None:
        """:meth:`__init__` failed: release what it opened."""
        created = self.segment is not None and self.segment.created
        self._release()
        self.events.close()
        if created:  # a failed start (a port in use, ...) leaves nothing of what it made: no rank came yet
            with contextlib.suppress(Exception):
                Segment.unlink_if_unused(config.job)

    def _init_counters(self, config: CollectorConfig) -> None:
        """A step of :meth:`__init__`: the counters and the times of the loop's periodic work."""
        self.windows_emitted = 0
        self.rows_emitted = 0
        self.overwritten = 0
        self.torn = 0
        self.lifecycle: list[Lifecycle] = []
        self.emitted_everything = False
        """Set by :meth:`shutdown` once no rank was alive and every window holding data was emitted."""
        self.not_emitted = ""
        """What :meth:`shutdown` could not emit, in words, when :attr:`emitted_everything` is False."""
        self._next_usage = 0.0
        self._next_status = time.monotonic() + config.status_interval_s
        self._due_work_at = 0.0  # monotonic time when the next of _due_work's looks falls due
        self._window_due_ns: int | None = None  # clock time when the next window closes (None: unknown)
        self._submitted = Submitted()  # from other threads (the launcher's agent)

    def _serve_the_job(self, config: CollectorConfig, segment: Segment, relay: Relay) -> None:
        """The last step of :meth:`__init__`: the segment names this collector, the relay is polled, the ranks'
        events are held for subscribers (``config.hold_ms``), the exporter serves the job's counters."""
        segment.set_collector(os.getpid(), self.clock())
        self.poller = zmq.Poller()
        self.poller.register(relay.xsub, zmq.POLLIN)
        self._hold_until = time.monotonic() + config.hold_ms / 1000
        self._release_hold()
        if self.exporter is not None:
            self.exporter.add_job(config.job, self.counters)

    @property
    def publish_endpoint(self) -> str:
        """The XPUB endpoint subscribers connect to (the real port when bound to port 0)."""
        assert self.relay is not None
        return self.relay.publish_endpoint

    @property
    def ingest_endpoint(self) -> str:
        """The ipc endpoint ranks publish to."""
        assert self.relay is not None
        return self.relay.ingest_endpoint

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (or :meth:`request_stop`), then emit what is held and return 0."""
        self._install_signals()
        self.rank_look_s = SERVING_RANK_LOOK_S
        try:
            print(
                f"shmstat collector: job {self.config.job} pid {os.getpid()} ingest {self.ingest_endpoint} "
                f"publish {self.publish_endpoint}",
                file=self.out, flush=True,
            )
            self.write_ready_file()
        except BaseException:
            self.shutdown()
            raise
        try:
            self.serve()
        finally:
            if self.config.ready_file is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.config.ready_file)
        self.say_stopping()
        if self.config.status_interval_s > 0:
            self.print_status(final=True)
        return 0

    def say_stopping(self) -> None:
        """Say on stderr, when ranks still run as this collector stops, what a successor must be started within
        (:func:`collector.handlers.console.stopping_line`)."""
        line = stopping_line({self.config.job: self.ranks_running()}, self.ring_slack_s(), self.banks)
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    def write_ready_file(self) -> None:
        """Write ``config.ready_file``, if set: ``{"job", "pid", "ingest", "publish", "prometheus"}`` as JSON
        (``prometheus`` the scrape URL or null), how the program that started the collector learns where it
        serves without reading its output."""
        if self.config.ready_file is not None:
            url = self.exporter.url if self.exporter is not None else None
            write_ready_file(self.config.ready_file, {
                "job": self.config.job, "pid": os.getpid(), "ingest": self.ingest_endpoint,
                "publish": self.publish_endpoint, "prometheus": url})

    def serve(self) -> None:
        """Loop until :meth:`request_stop`, then :meth:`shutdown` (no signal handling: usable in a thread). One
        step runs whatever happens, so a collector stopped as soon as it started still reports its counters once."""
        try:
            self.step(0)
            while not self.stop_requested.is_set():
                turn = time.monotonic()
                self.step(self._poll_timeout_ms() if not self.relayed_last_step
                          else gather_pause(turn, relay_turn_s(self.config.event_latency_ms)))
        finally:
            self.shutdown()

    def request_stop(self) -> None:
        """Ask :meth:`run` to finish its round, flush and return (safe from a signal handler)."""
        self.stop_requested.set()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in stop_signals():
            signal.signal(sig, lambda _s, _f: self.stop_requested.set())

    def _release_hold(self) -> None:
        assert self.relay is not None
        self.relay.update_subscriptions()
        if self.relay.subscribed or time.monotonic() >= self._hold_until:
            self.relay.subscribe_ranks()

    def _poll_timeout_ms(self) -> int:
        """How long the loop may wait for messages before something else is due (:meth:`next_due`), in ms."""
        assert self.relay is not None
        if not self.relay.ranks_subscribed:  # watch for the first subscriber
            return 10
        wait_s = self.next_due() - time.monotonic()
        return max(0, min(math.ceil(self.max_wait_s * 1000), math.ceil(wait_s * 1000)))

    def next_due(self) -> float:
        """The :func:`time.monotonic` time by which the loop must turn again with no message arriving: the
        earliest of the next window's end (plus grace), the next rank look, usage figures, status line and
        heartbeat (each of these four may be :data:`CHORE_SLACK_S` late), soon while passes wait for their
        commit, and at most :attr:`max_wait_s` from now (what other threads submit is taken then). Messages wake
        the loop sooner, and so does a new stat (:func:`wait_quietly` looks for one every :attr:`stat_look_s`)."""
        assert self.relay is not None
        mono = time.monotonic()
        # the periodic looks may be late by CHORE_SLACK_S (and early: see _due_work), so that they share turns
        due = min(self._next_rank_look, self._next_usage, self.relay.next_beat)
        if self.config.status_interval_s > 0:
            due = min(due, self._next_status)
        due = min(due + CHORE_SLACK_S, mono + self.max_wait_s)
        window = self.scanner.next_due_ns()
        if window is not None:
            due = min(due, mono + (window - self.clock()) / 1e9)
        if len(self.commits):
            due = min(due, mono + COMMIT_POLL_S)
        return due

    def entries_moved(self) -> bool:
        """Whether a rank or writer entry was taken or a stat published since the rank table was last read (one
        word of the segment's header; True once the segment is gone, so the step finds out)."""
        return self.segment is None or self.segment.entries_epoch() != self._entries_epoch

    def step(self, poll_timeout_ms: int = 0) -> None:
        """One round: wait up to ``poll_timeout_ms`` for messages, relay them, then scan and watch ranks."""
        assert self.relay is not None and self.segment is not None
        if not self.relay.ranks_subscribed:
            self._release_hold()
        if poll_timeout_ms > 0:
            wait_quietly(self.poller, poll_timeout_ms, (self,))
        relayed = 0
        senders: set[tuple[int, int, int]] = set()
        puts: list[Put] = []
        for msg in self.relay.receive():
            relayed += 1
            kind = msg.kind
            if kind == "metric":
                puts += self._puts_of(msg)
            elif kind == "event":
                self.events.message(msg)
            senders.add((msg.rank, msg.pid, msg.incarnation))
        if senders:  # handed on: a SIGKILL from now on does not hand it on twice (one move per sender and turn)
            self.marks.handed_on(senders)
        self.relayed_last_step = relayed
        if self._submitted:
            puts += self._submitted.drain(self.publish_event)
        if puts:  # the turn's put metrics, one pass
            self.fanout.take(Pass(self.config.job, self.clock(), puts=puts))
        mono = time.monotonic()
        self.marks.step_if_due(mono)  # the delivered marks and acknowledgements: every ACK_INTERVAL_S
        if mono < self._due_work_at and self._window_due_ns is not None and self.clock() < self._window_due_ns:
            return  # nothing else is due: a turn while messages flow costs only the relay (and the acks)
        self._due_work(mono)

    def _due_work(self, mono: float) -> None:
        """The part of :meth:`step` that is not the relay: the rank look, the look for new stats, a pass when a
        window closed, commits, usage figures, the status line, acknowledgements and heartbeats, each when due;
        then when the next of them falls due (:attr:`_due_work_at`, and :attr:`_window_due_ns` on the clock)."""
        assert self.relay is not None and self.segment is not None
        now = self.clock()
        soon = mono + CHORE_SLACK_S  # a periodic look due this soon is taken in this turn rather than its own
        looked = soon >= self._next_rank_look
        if looked:  # the rank table and liveness: at most every rank_look_s, however often messages arrive
            self.rank_looks += 1
            self._next_rank_look = mono + self.rank_look_s
            self._next_stat_look = mono + self.stat_look_s
            self._entries_epoch = self.segment.entries_epoch()  # (read before the table: a later bump is seen)
            self.last_ranks = self.scanner.refresh()
            for change in self.liveness.poll(self.last_ranks):
                self._lifecycle(change)
            self.marks.settle(self.last_ranks)  # what gone senders could not deliver: counted
            self.hangs.look(self.last_ranks)  # every phase word: a hang named while it happens
            if self.gpu is not None:  # the newest GPU sample, written once, into windows still open
                self.gpu.step(self.last_ranks)
        elif mono >= self._next_stat_look:  # a stat made since is found before its first windows leave the ring
            self._next_stat_look = mono + self.stat_look_s
            if self.entries_moved():  # one word: the table is read only when an entry or stat came
                self._entries_epoch = self.segment.entries_epoch()
                self.scanner.refresh()
        if self.scanner.due(now):
            self._emit_scan(now, final=False)
        self.commits.apply(self.segment)
        if soon >= self._next_usage:
            self._next_usage = mono + self.config.usage_interval_s
            self._emit_usage(now, self.last_ranks)
        if self.config.status_interval_s > 0 and soon >= self._next_status:
            self._next_status = mono + self.config.status_interval_s
            self.print_status(self.last_ranks)
        if soon >= self.relay.next_beat:  # (the next one an interval after this one was due, not after now)
            self.relay.heartbeat_if_due(max(mono, self.relay.next_beat))
        if looked:  # the collector's mark in the segment header, for ranks and other collectors
            self.segment.set_collector(os.getpid(), now)
        due = min(self._next_rank_look, self._next_stat_look, self._next_usage, self.relay.next_beat)
        if self.config.status_interval_s > 0:
            due = min(due, self._next_status)
        if len(self.commits):
            due = min(due, mono + COMMIT_POLL_S)
        self._due_work_at = due
        self._window_due_ns = self.scanner.next_due_ns()  # None (no stat known yet): every step looks

    def shutdown(self) -> None:
        """Stop the ranks sending and take their last messages, emit the closed windows (and, once no rank is
        alive, every window that holds data), flush handlers, release everything."""
        if self.relay is None:
            return
        with contextlib.suppress(Exception):  # what the stopping line and the last status say (as it stopped)
            self.running_at_stop = self.ranks_running()
        if self.gpu is not None:  # first: its entries are the collector's own, not processes of the job
            with contextlib.suppress(Exception):
                self.gpu.close()
        deadline = None
        try:
            self.stop_intake()
            self._take_submitted()
            if self.events.owns and self.events.delivery is not None:  # (a node collector's: it does this for all)
                deadline = time.monotonic() + self.events.delivery.close_budget_s
                let_sinks_finish(self.events.delivery, [self], deadline)
            now = self.clock()
            for change in self.liveness.poll(self.scanner.refresh()):
                self._lifecycle(change)
            # A live rank still adds to its open windows: they stay in the ring for the next collector (emitting
            # them now would commit their watermark and lose every sample added after this moment).
            ranks = self.scanner.refresh()
            live = sorted({r.rank for r in ranks if r.state == RankState.ACTIVE})
            self._emit_scan(now, final=not live)
            self.events.close(deadline)  # what the sinks held is taken (or counted) before the final counters
            self.marks.step()  # the ranks forget what was delivered; the next collector drops it if re-sent
            self.marks.settle(ranks)  # the entries of gone senders whose end is marked now: cleared
            self.relay.update_subscriptions()  # the loss reports subscribers sent meanwhile count in the last rows
            self._emit_usage(now, ranks)  # the final counters, however short the run was
            self.emitted_everything = not live
            if live:
                self.not_emitted = (f"the open windows of rank{'s' if len(live) > 1 else ''} "
                                    f"{', '.join(map(str, live))}, still running")
        except Exception as exc:  # whatever happens, the sockets and files below are released
            self.not_emitted = f"the last pass, which failed ({exc!r})"
        self.events.close(deadline)
        self.fanout.close()  # the consumers on threads of their own take what was queued
        if self._owns_dispatcher:  # a node collector's jobs share one: it closes it
            try:
                self.dispatcher.close()
            except Exception as exc:
                self.emitted_everything = False
                self.not_emitted = f"rows queued for handlers, which failed to close ({exc!r})"
        if self.segment is not None:
            with contextlib.suppress(Exception):  # the watermarks of the passes the handlers took (and of the rest)
                self.commits.drain(self.segment, 0.0 if self._owns_dispatcher else self.dispatcher.close_budget_s)
            with contextlib.suppress(Exception):  # -1: windows left for the next collector (ranks keep the segment)
                self.segment.set_collector(0 if self.emitted_everything else -1, self.clock())
        with contextlib.suppress(Exception):  # behind every message sent: subscribers know they have the tail
            self.relay.final_heartbeat(job_ended=self.emitted_everything)
        self._release()

    def finish(self) -> str:
        """After :meth:`shutdown`: remove the job's segment and lock file if every window was emitted and no
        process of the job's rank table lives (``shmstat run`` and ``shmstat collect --job`` call it on every
        exit); returns "" then, otherwise one line saying what was kept, why, and how to look and clean."""
        return remove_if_done(self.config.job, self.emitted_everything, self.not_emitted)

    def stop_intake(self) -> None:
        """Stopping, first: the ranks' hand-over (:meth:`Relay.hand_over`): their last messages taken, put metrics
        dispatched, events offered to the sinks; from then on the ranks hold what they log for the next collector.
        A second call returns at once (every rank's marker arrived)."""
        if self.relay is not None:
            self._drain_ingest()
            if self.segment is not None:  # what gone senders could not deliver: counted before the sinks finish
                self.marks.settle(self.scanner.refresh(), final=True)

    def finish_round(self) -> None:
        """One round while stopping, after :meth:`stop_intake`, as the events sinks finish (:func:`let_sinks_finish`):
        the windows that closed are emitted and what the handlers took committed, and the delivered marks follow
        what the sinks took and are acknowledged, so the ranks do not send it to the next collector again."""
        if self.segment is None or self.relay is None:
            return
        now = self.clock()
        if self.scanner.due(now):
            self._emit_scan(now, final=False)
        self.commits.apply(self.segment)
        self.marks.step_if_due(time.monotonic())

    def _drain_ingest(self) -> None:
        """The hand-over (:meth:`Relay.hand_over`): the ranks' last messages, put metrics dispatched."""
        assert self.relay is not None

        def live_ranks() -> set[tuple[int, int, int]]:
            return {(r.rank, r.pid, r.incarnation) for r in self.scanner.refresh()
                    if r.state == RankState.ACTIVE and pid_alive(r.pid)}

        puts: list[Put] = []
        for msg in self.relay.hand_over(live_ranks):
            if msg.kind == "metric":
                puts += self._puts_of(msg)
            elif msg.kind == "event":
                self.events.message(msg)
        if puts:
            self.fanout.take(Pass(self.config.job, self.clock(), puts=puts))

    def close(self) -> None:
        """Same as :meth:`shutdown` (idempotent)."""
        self.shutdown()

    def _release(self) -> None:
        if getattr(self, "liveness", None) is not None:
            self.liveness.close()
        if self._owns_sampler and self.gpu_sampler is not None:
            self.gpu_sampler.close()
            self._owns_sampler = False
        if self._owns_exporter and self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.segment is not None:
            if getattr(self, "marks", None) is not None:
                self.marks.close()  # no sink's thread writes a mark into the segment from now on
            self.segment.close()
            self.segment = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    # -- submissions from other threads of this process (the launcher's agent) ------------------------------
    def submit_metric(self, metric: MetricData) -> None:
        """Queue a metric made in this process (thread-safe; the agent's): dispatched, exported to Prometheus with
        no rank label, and published by the loop."""
        self._submitted.metric(metric)

    def submit_event(self, name: str, data: dict[str, str | int | float | bool]) -> None:
        """Queue an event made in this process (thread-safe); published on ``event/<name>`` by the loop."""
        self._submitted.event(name, data)

    def _take_submitted(self) -> None:
        """What other threads submitted: events published, metrics handed on as one pass."""
        puts = self._submitted.drain(self.publish_event)
        if puts:
            self.fanout.take(Pass(self.config.job, self.clock(), puts=puts))

    def publish_event(self, name: str, ts_ns: int, data: dict[str, str | int | float | bool]) -> None:
        """Publish an event the collector made on ``event/<name>`` and keep it for the events sinks (the loop's
        thread only; other threads use :meth:`submit_event`)."""
        assert self.relay is not None
        self.relay.publish(wire.event_topic(name), "event", [[name, ts_ns, data]])
        self.events.own(name, ts_ns, data)

    # -- emission -------------------------------------------------------------------------------------------
    def _emit_scan(self, now: int, *, final: bool) -> None:
        counts = self._scan_pass(now, final=final)
        self.windows_emitted += counts.windows
        self.rows_emitted += counts.rows
        self.overwritten += counts.overwritten
        self.torn += counts.torn
        if counts.overwritten or counts.torn:
            # Windows found lost or torn are counted in the pass whose watermark moves past them: the counters go
            # to the handlers before that watermark is committed, so a collector killed in between leaves both to
            # the next one, which counts them again, and never the watermark without the count.
            self._emit_usage(now, self.last_ranks)
        self._commit_pass()

    def _scan_pass(self, now: int, *, final: bool) -> PassCounts:
        """Scan the segment at ``now`` (every window with data if ``final``) for the groups some consumer wants,
        and hand the pass to every consumer (:attr:`fanout`); returns what the pass counted (the collector's
        counters are left to the caller). The caller then hands the pass to :meth:`_commit_pass`."""
        assert self.relay is not None
        self.relay.update_subscriptions()  # first: rows nobody receives are never built
        fanout = self.fanout
        result = self.scanner.scan(now, final=final, want=lambda group: fanout.wants(group, "windows"))
        cols = result.columns
        if len(cols) and self.segment is not None:  # before any handler sees it: a successor knows (see scanner)
            self.segment.set_dispatched(result.dispatch_until_ns)
        fanout.take(Pass(self.config.job, now, columns=cols))
        return PassCounts(windows=result.skipped_windows + int(np.count_nonzero(cols.rank < 0)),
                          rows=result.skipped_rows + len(cols), overwritten=result.overwritten, torn=result.torn)

    def _commit_pass(self) -> None:
        """Flush the handlers and hand the last pass's watermarks to ``self.commits``, which writes them into the
        segment once every handler took what was dispatched so far (:mod:`collector.daemon.commits`): the pass's rows
        and whatever was dispatched after them, such as the counters of the windows it found lost."""
        self.commits.add(self.dispatcher.flush(), self.scanner.advance())

    def _puts_of(self, msg: Received) -> list[Put]:
        return puts_of(self.config.job, msg, self.fanout, self.relay_counters)

    def _lifecycle(self, change: Lifecycle) -> None:
        self.lifecycle.append(change)
        assert self.relay is not None
        item = change.to_wire()
        self.relay.publish(wire.rank_topic(change.state), "rank", [item])
        self.events.own(wire.rank_topic(change.state), self.clock(), item)  # type: ignore[arg-type]
        _log.info("rank %d (pid %d, incarnation %d) %s", change.rank, change.pid, change.incarnation, change.state)

    def _emit_usage(self, now: int, ranks: list) -> None:
        if not self.fanout.wants(PLATFORM_GROUP, "usage"):
            return  # nobody would see a figure (a null or compact handler, no subscriber): none is made
        figures = usage_points(self.config.job, now, ranks, self.liveness,
                               {**self.counters(), **{f"handler_dropped.{g}": n
                                                      for g, n in self.dispatcher.dropped_by_group.items()}})
        self.fanout.take(Pass(self.config.job, now, usage=figures))

    def print_status(self, ranks: list | None = None, *, final: bool = False) -> None:
        """Print the one-line status (:func:`collector.handlers.console.status_line`) on stderr; ``ranks`` as the
        scanner last read them. ``final``: the last line, after :meth:`shutdown`, with the ranks still running."""
        alive = self.ranks_running() if final else sum(
            1 for r in ranks or () if r.state_name == "active" and not r.is_writer)
        print(status_line(self.counters(), ranks_alive=alive, job=self.config.job, final=final), file=sys.stderr,
              flush=True)

    def ranks_running(self) -> int:
        """The job's ranks (not their workers) whose process lives now: in the rank table as it is while the segment
        is open (the last look may predate ranks that joined since), else as it was when :meth:`shutdown` began."""
        if self.segment is None:  # closed: as it was when the collector stopped
            return self.running_at_stop
        ranks = self.scanner.refresh()
        return sum(1 for r in ranks if r.state_name == "active" and not r.is_writer and pid_alive(r.pid))

    def ring_slack_s(self) -> float:
        """How long after now a window a rank closes stays in its ring for a successor: the ring's banks less two
        (the window being written, and the grace) of the job's shortest window."""
        shortest_ns = self.scanner.shortest_window_ns() or 1_000_000_000
        return (self.banks - 2) * shortest_ns / 1e9

    def counters(self) -> dict[str, int]:
        """The collector's own counters (also emitted in the platform group)."""
        return {
            "windows_emitted": self.windows_emitted, "rows_emitted": self.rows_emitted,
            **relay_counts(self.relay_counters),
            "handler_errors": self.dispatcher.errors, "handler_dropped": self.dispatcher.dropped,
            **self.events.counters(),
            "windows_overwritten": self.overwritten, "windows_torn": self.torn,
            "passes_not_taken": self.commits.not_taken,
            "ranks_refused": self.scanner.reader.bad_ranks, "descriptors_refused": self.scanner.reader.bad_descriptors,
            **drop_counters(self.segment),
            **self._gpu_counters(),
        }

    def _gpu_counters(self) -> dict[str, int]:
        if self.gpu_sampler is None:
            return {}
        return {"gpu_samples": self.gpu_sampler.samples, "gpu_errors": self.gpu_sampler.errors,
                "gpu_figures_written": self.gpu.samples_written if self.gpu is not None else 0}


FINISH_ROUND_S = 0.02
"""How often a stopping collector emits windows and moves delivered marks while its events sinks finish."""


def let_sinks_finish(delivery: EventDelivery, collectors: list[Collector], deadline: float) -> None:
    """Stopping, after every collector's :meth:`Collector.stop_intake`: until the events sinks took what was offered
    to them, or ``deadline`` (:func:`time.monotonic`), each collector takes a :meth:`Collector.finish_round` every
    :data:`FINISH_ROUND_S`. A successor starts only once this process exited, and the ring keeps a closed window
    only a few windows long (:mod:`shmstat.shm.layout`): windows closing while a slow sink finishes are emitted here
    rather than lost; and what the sinks take is acknowledged while the marks still can be (after the jobs are let
    go it would come again from the ranks)."""
    while not delivery.drained() and time.monotonic() < deadline:
        for c in collectors:
            try:
                c.finish_round()
            except Exception as exc:  # one job's trouble stops neither the others nor the stop
                _log.warning("job %s: a round while stopping failed (%r)", c.config.job, exc)
        time.sleep(FINISH_ROUND_S)


def wait_quietly(poller: zmq.Poller, timeout_ms: int, collectors: tuple[Collector, ...]) -> None:
    """Wait up to ``timeout_ms`` for a message on ``poller``. The looks for new stats (every :func:`stat_look_s`)
    that fall due meanwhile are made here, one word of each segment (its entries epoch); the wait ends early only
    if one moved (the step then reads the rank table), so a quiet collector turns only when something is due."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        now = time.monotonic()
        until = min([deadline, *(c._next_stat_look for c in collectors)])
        wait_ms = math.ceil((until - now) * 1000)
        if wait_ms > 0 and poller.poll(wait_ms):
            return
        now = time.monotonic()
        if now >= deadline:
            return
        for c in collectors:
            if now >= c._next_stat_look:
                if c.entries_moved():
                    return  # (left due: the step looks)
                c._next_stat_look = now + c.stat_look_s


# -- one pass's counts and its stat topics ---------------------------------------------------------------------
class PassCounts(NamedTuple):
    """What one pass did, for the collector to add to its counters."""

    windows: int
    """Windows emitted (merged rows, plus the windows nobody wanted, skipped unread)."""
    rows: int
    """Rows emitted (every row of the pass, plus those skipped unread)."""
    overwritten: int
    """Windows lost to a bank overwritten before they were read."""
    torn: int
    """Windows flagged torn (a writer died in the middle of an ``add``)."""


# -- metrics that belong to no window: put metrics, the collector's own figures ----------------------------
def puts_of(job: str, msg: Received, fanout: FanOut, relay_counters: RelayCounters) -> list[Put]:
    """The points of one ``metric/`` message, for a pass (none, left undecoded, when no consumer wants its
    group's put metrics); a message decode refuses is counted in ``relay_counters.rejected``."""
    if not any(fanout.wants(group, "puts") for group in candidate_groups(msg.raw_topic)):
        return []  # nobody would see an item: they stay undecoded (the relay re-published the frames)
    try:
        items = msg.items
    except WireError:  # the C check let through what decode refuses (a bug): count it, never stop
        relay_counters.rejected += 1
        _log.error("a metric message on %r passed the intake check but not wire.decode", msg.topic)
        return []
    rank = msg.rank
    return [Put(point(float(ts), group, name, value, rank, job), rank) for group, name, value, ts in items]


def usage_points(job: str, now: int, ranks: list[RankInfo], liveness: Liveness,
                 counters: dict[str, int]) -> list[StatMetricData]:
    """The collector's figures in the platform group at ``now``: every active rank's CPU and RSS, the
    collector's own CPU and RSS, and ``counters``."""
    ts = now / 1e9
    rows: list[StatMetricData] = []
    for u in liveness.usage(ranks):
        rows.append(point(ts, PLATFORM_GROUP, "rank.cpu_percent", u.cpu_percent, u.rank, job))
        rows.append(point(ts, PLATFORM_GROUP, "rank.rss_bytes", u.rss_bytes, u.rank, job))
    cpu_s, rss = Liveness.self_usage()
    for name, value in {**counters, "cpu_seconds": cpu_s, "rss_bytes": rss}.items():
        rows.append(point(ts, PLATFORM_GROUP, f"collector.{name}", value, None, job))
    return rows


def relay_counts(c: RelayCounters) -> dict[str, int]:
    """The relay's counters by the names the collector reports them (status line, platform group, /metrics)."""
    return {
        "events_relayed": c.events, "metrics_relayed": c.metrics,
        "frames_rejected": c.rejected, "seq_gaps": c.gaps, "subscription_resets": c.subscription_resets,
        "items_resent": c.resent,
        "subscriber_items_lost": sum(c.subscriber_lost.values()),
        "subscriber_queue_full": sum(c.queue_full.values()),
        "handshakes_refused": c.handshakes.refused, "handshakes_failed": c.handshakes.failed,
        "key_revocations": c.handshakes.revocations,
        **{f"subscriber_items_lost_{kind}": n for kind, n in c.subscriber_lost.items()},
        **{f"subscriber_queue_full_{kind}": n for kind, n in c.queue_full.items()},
    }


def drop_counters(segment: Segment | None) -> dict[str, int]:
    """What the job's processes could not write (read from the segment: header and rank entries); zeros once
    the segment is released."""
    if segment is None:
        return {"samples_dropped": 0, "no_room_ranks": 0, "no_room_workers": 0, "no_room_stats": 0}
    try:
        h = segment.header()
        geometry = segment.geometry
        ranks = [r for r in segment.ranks() if rank_problem(r, geometry) is None]  # garbage entries count nothing
    except (ValueError, TypeError):  # released at shutdown
        return {"samples_dropped": 0, "no_room_ranks": 0, "no_room_workers": 0, "no_room_stats": 0}
    return {"samples_dropped": h.dropped + sum(r.dropped for r in ranks), "no_room_ranks": h.ranks_refused,
            "no_room_workers": sum(r.writers_refused for r in ranks),
            "no_room_stats": sum(r.stats_refused for r in ranks)}


def candidate_groups(topic: bytes) -> list[str]:
    """The group a valid ``metric/<group>/<name>`` message on ``topic`` carries, as a list (empty for a topic no
    valid message has): a group holds no ``/`` (:mod:`shmstat.names`, checked by the wire), a name may."""
    group, sep, _ = bytes(topic)[len(b"metric/"):].decode("utf-8").partition("/")
    return [group] if sep else []


def point(ts: float, group: str, name: str, value: float, rank: int | None, job: str) -> StatMetricData:
    """A metric that belongs to no window (a rank's put_metric, a usage sample), with its rank and job."""
    return StatMetricData(ts, group, name, value, rank=rank, window_start=None, window_end=None,  # type: ignore[arg-type]
                          job=job)


# -- what other threads of the collector's process submit -----------------------------------------------------
_EventItem = tuple[str, int, dict[str, str | int | float | bool]]  # (name, ts_ns, data)


class Submitted:
    """Metrics and events made in this process, in the order submitted; any thread may add, one loop takes."""

    def __init__(self) -> None:
        self._items: deque[MetricData | _EventItem] = deque()

    def __bool__(self) -> bool:
        """Whether something waits to be taken."""
        return bool(self._items)

    def metric(self, metric: MetricData) -> None:
        """Queue a metric (thread-safe)."""
        self._items.append(metric)

    def event(self, name: str, data: dict[str, str | int | float | bool]) -> None:
        """Queue an event stamped now (thread-safe); ``data`` is copied."""
        self._items.append((name, time.time_ns(), dict(data)))

    def drain(self, publish_event: Callable[[str, int, dict[str, str | int | float | bool]], None]) -> list[Put]:
        """On the loop's thread: hand every queued event to ``publish_event``, and return every queued metric as
        a put metric made here (no rank), in the order submitted, for the loop's next pass."""
        puts: list[Put] = []
        while self._items:
            item = self._items.popleft()
            if isinstance(item, MetricData):
                puts.append(Put(item, None, here=True))
            elif isinstance(item, tuple):
                publish_event(*item)
        return puts


# -- the job's segment as its collector holds it: its lock, and its removal once done ---------------------------
def take_instance_lock(segment: Segment) -> int:
    """An exclusive ``flock`` on the segment file itself, held for the collector's life (the returned fd; the
    kernel releases it if the collector dies): the check that one collector serves the job does not depend on
    anyone's runtime directory. Raises :class:`CollectorError` naming the holder's pid if another holds it."""
    path = "/dev/shm" + segment_name(segment.job)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = segment.header().collector_pid
        holder: int | str = pid if pid > 0 else "?"
        raise CollectorError(
            f"a collector for job {segment.job!r} is already running on this node (pid {holder}); stop it first"
        ) from None
    return fd


def remove_if_done(job: str, emitted_everything: bool, not_emitted: str) -> str:
    """Remove ``job``'s segment and lock file if every window was emitted (``emitted_everything``) and no
    process of the job's rank table lives; "" then, otherwise one line saying what was kept (``not_emitted``
    when windows were), why, and how to look and clean."""
    how = f"(inspect: shmstat top --job {job}; remove: shmstat clean {job})"
    if not emitted_everything:
        return f"job {job}'s segment kept: {not_emitted or 'not every window was emitted'} {how}"
    if not os.path.exists("/dev/shm" + segment_name(job)):
        Segment.unlink(job)  # the lock file alone (its last rank may have removed the segment)
        return ""
    if Segment.unlink_if_unused(job):
        return ""
    return f"job {job}'s segment kept: a process of the job started or is still running {how}"
