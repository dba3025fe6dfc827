"""One job's collector on this node, and its lifecycle: open, serve and stop, hand-over, close, finish.

A :class:`Collector` is the job's state as the one serving loop (:mod:`collector.daemon.loop`) turns it: a per-job
collector (``shmstat collect --job J``, ``shmstat run``'s) is that loop serving this one job (:class:`OneJob`), a
node collector (:mod:`collector.daemon.node`) the same loop serving every job it picked up. Each turn of a job
(:meth:`Collector.turn`) relays the ranks' messages and, when due, looks at the rank table and scans; tests drive
it with an injected clock through :meth:`Collector.step`. Only one collector serves a job on a node, whoever's
runtime directory it uses: it holds an exclusive ``flock`` on the job's segment file itself for its whole life
(:mod:`collector.daemon.job_segment`; released by the kernel if it dies), and a second one exits naming the
first's pid.

What the job's collector is cut into, by concept:

- the job's passes and their commit (:mod:`collector.daemon.job_pass`): everything the loop hands on goes out as a
  :class:`collector.read.passes.Pass` through one fan-out (:attr:`Collector.fanout`, :mod:`collector.daemon.fanout`),
  which calls every consumer once per pass: the straggler scorer
  (:class:`collector.daemon.straggler.StragglerScorer`), the handlers' dispatcher
  (:class:`collector.handlers.dispatch.ThreadedDispatcher`: every handler takes a pass as columns, the console
  straggler lines after it), the relay's ``stat/`` topics (:class:`collector.daemon.stat_topics.StatTopics`) and
  the Prometheus exporter; a pass's watermark reaches the segment once every handler took it
  (:mod:`collector.daemon.commits`);
- the events kept (:mod:`collector.sinks.kept_events`): what the job's collector hands its events sinks
  (``--events``), and how a stopping collector lets them finish; the delivered marks of what they took
  (:mod:`collector.daemon.delivered_marks`);
- the lifecycle (this module): open (:class:`Collector`), serve and stop (:meth:`Collector.step`,
  :meth:`Collector.serve`, :meth:`Collector.request_stop`, all the loop's), the hand-over
  (:meth:`Collector.stop_intake`, then :meth:`Collector.finish_round` while the sinks finish:
  :func:`collector.sinks.kept_events.let_sinks_finish`), :meth:`Collector.last_pass`: the loop's one stop sequence
  (:meth:`collector.daemon.loop.Loop.stop`, which :meth:`Collector.close` runs), and :meth:`Collector.finish`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

import zmq

from elastic.metrics import MetricData, MetricHandler
from shmstat import wire
from shmstat.shm.layout import RankState
from shmstat.shm.layout_records import RankInfo
from shmstat.shm.runtime import ingest_endpoint, publish_endpoint, validate_job
from shmstat.shm.segment import Segment, pid_alive

from ..gpu.figures import GPU_GROUP
from ..gpu.sampler import GpuSampler, JobGpu
from ..handlers.console import status_line, stopping_line
from ..handlers.dispatch import ThreadedDispatcher
from ..prometheus.exporter import PrometheusExporter, start_exporter
from ..read.passes import Put
from ..read.scanner import Scanner
from ..relay.intake import Received
from ..relay.publish_socket import Outlet
from ..sinks.delivery import EventDelivery
from ..sinks.kept_events import KeptEvents
from .commits import PendingCommits
from .config import (
    PLATFORM_GROUP,
    SERVING_RANK_LOOK_S,
    CollectorConfig,
    build_dispatcher,
    build_event_delivery,
    start_sampler,
    write_ready_file,
)
from .delivered_marks import DeliveredMarks
from .fanout import FanOut
from .hangs import HangWatcher
from .job_pass import JobPass, Submitted, drop_counters, puts_of, relay_counts, usage_points
from .job_segment import remove_if_done, take_instance_lock
from .liveness import Lifecycle, Liveness
from .loop import CHORE_SLACK_S, COMMIT_POLL_S, MAX_POLL_MS, Loop, relay_turn_s, stat_look_s
from .stat_topics import StatTopics
from .straggler import EVENT_TOPICS, StragglerDetector, StragglerScorer

if TYPE_CHECKING:
    from ..relay.relay import Relay

__all__ = ["PLATFORM_GROUP", "Collector", "CollectorConfig", "OneJob"]

_log = logging.getLogger("shmstat.collector")


class Collector:
    """One job's collector on this node. Construct, then :meth:`run` (or :meth:`serve` in a thread, or
    :meth:`step` in tests), then :meth:`close` and :meth:`finish`. Raises :class:`~shmstat.errors.CollectorError`
    if another collector serves the job.
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
            segment = self._open_segment(config)  # first: a collector refused the job opens no output of the first's
            self._open_outputs(config, handler_objects, dispatcher, events, gpu_sampler)
            relay = self._open_relay(config, segment, node_outlet)
            self._start_exports(config, segment)
        except BaseException:
            self._abandon_start(config)
            raise
        self._init_counters(config)
        self.fanout = self._fan_out(config, relay)
        self.passes = JobPass(config.job, segment, self.scanner, relay, self.fanout, self.dispatcher, self.commits)
        """The job's passes, what they counted, and their commit."""
        self.hangs = HangWatcher(config.job, segment, hang_after_s=config.hang_after_s, fanout=self.fanout,
                                 publish=self.publish_event, exporter=self.exporter, clock=self.clock)
        self._serve_the_job(config, segment, relay)
        self.loop = Loop(OneJob(self), turn_s=relay_turn_s(config.event_latency_ms))
        """The serving loop of this job alone (a node collector turns the job in its own: :meth:`turn`)."""

    def _init_state(self, config: CollectorConfig, out: IO[str] | None, exporter: PrometheusExporter | None,
                    events: EventDelivery | None, gpu_sampler: GpuSampler | None) -> None:
        """The first step of :meth:`__init__`: the attributes, with nothing opened yet (what is given is kept)."""
        self.config = config
        self.clock = config.clock
        self.out = out if out is not None else sys.stderr
        """Where notes go (where it serves, the Prometheus endpoint): stderr by default, so that stdout carries only
        data (the default handler's window and straggler lines)."""
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
        """The longest the loop waits with nothing due (what other threads submit waits at most this long; a node
        collector, whose jobs nobody submits to, waits longer)."""
        self.stat_look_s = stat_look_s(config.grace_ms)
        """Between rank looks, how often the loop looks for stats made since (:func:`stat_look_s`)."""
        self.next_stat_look = 0.0
        """When the loop looks next for new stats (:func:`collector.daemon.loop.wait_quietly`)."""
        self._entries_epoch = -1  # the segment's entries epoch when the rank table was last read
        self.relayed_last_step = 0
        """Messages the last :meth:`step` relayed (then a serving loop lets more gather: :func:`gather_pause`)."""
        self.exporter = exporter
        self._owns_exporter = False
        self._owns_dispatcher = False
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
        """The job's ranks still running as :meth:`close` began (for the collector's last lines)."""
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
        if self._owns_dispatcher:  # built by this start: its handlers' files and threads go too
            with contextlib.suppress(Exception):
                self.dispatcher.close()
        if created:  # a failed start (a port in use, ...) leaves nothing of what it made: no rank came yet
            with contextlib.suppress(Exception):
                Segment.unlink_if_unused(config.job)

    def _init_counters(self, config: CollectorConfig) -> None:
        """A step of :meth:`__init__`: the counters and the times of the loop's periodic work."""
        self.lifecycle: list[Lifecycle] = []
        self.emitted_everything = False
        """Set by :meth:`close` once no rank was alive and every window holding data was emitted."""
        self.not_emitted = ""
        """What :meth:`close` could not emit, in words, when :attr:`emitted_everything` is False."""
        self._next_usage = 0.0
        self._next_status = time.monotonic() + config.status_interval_s
        self._due_work_at = 0.0  # monotonic time when the next of _due_work's looks falls due
        self._window_due_ns: int | None = None  # clock time when the next window closes (None: unknown)
        self._submitted = Submitted()  # from other threads (the launcher's agent)
        self._stopping = False  # stop_intake began: the GPU entries closed, the ranks running counted
        self._handover_failed = False

    def _serve_the_job(self, config: CollectorConfig, segment: Segment, relay: Relay) -> None:
        """The last step of :meth:`__init__`: the segment names this collector, the relay is polled, the ranks'
        events are held for subscribers (``config.hold_ms``), the exporter serves the job's counters."""
        segment.set_collector(os.getpid(), self.clock())
        self._hold_until = time.monotonic() + config.hold_ms / 1000
        self._release_hold()
        if self.exporter is not None:
            self.exporter.add_job(config.job, self.counters)

    @property
    def name(self) -> str:
        """The job's name."""
        return self.config.job

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

    # -- the lifecycle: serve and stop (the one loop's), close, finish --------------------------------------
    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (or :meth:`request_stop`), then emit what is held and return 0
        (:meth:`collector.daemon.loop.Loop.run`)."""
        self.rank_look_s = SERVING_RANK_LOOK_S
        return self.loop.run()

    def serve(self) -> None:
        """Turn until :meth:`request_stop`, then :meth:`close` (no signal handling: usable in a thread)."""
        self.loop.serve()

    def step(self, poll_timeout_ms: int = 0) -> None:
        """One turn of this job's loop: wait up to ``poll_timeout_ms`` for messages, then :meth:`turn`."""
        self.loop.step(poll_timeout_ms)

    def request_stop(self) -> None:
        """Ask :meth:`run` or :meth:`serve` to finish its turn, flush and return (safe from a signal handler)."""
        self.loop.request_stop()

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

    # -- the job's turn ------------------------------------------------------------------------------------
    @property
    def ingest_socket(self) -> zmq.Socket | None:
        """The socket the ranks send on, which the loop waits on (None once released)."""
        return self.relay.xsub if self.relay is not None else None

    @property
    def holding(self) -> bool:
        """Whether the ranks' events are still held for a first subscriber (``config.hold_ms``)."""
        return self.relay is not None and not self.relay.ranks_subscribed

    def _release_hold(self) -> None:
        assert self.relay is not None
        self.relay.update_subscriptions()
        if self.relay.subscribed or time.monotonic() >= self._hold_until:
            self.relay.subscribe_ranks()

    def next_due(self) -> float:
        """The :func:`time.monotonic` time by which the loop must turn again with no message arriving: the
        earliest of the next window's end (plus grace), the next rank look, usage figures, status line and
        heartbeat (each of these four may be :data:`~collector.daemon.loop.CHORE_SLACK_S` late), soon while passes
        wait for their commit, and at most :attr:`max_wait_s` from now (what other threads submit is taken then).
        Messages wake the loop sooner, and so does a new stat (:func:`collector.daemon.loop.wait_quietly` looks for
        one every :attr:`stat_look_s`)."""
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
        word of the segment's header; True once the segment is gone, so the turn finds out)."""
        return self.segment is None or self.segment.entries_epoch() != self._entries_epoch

    def turn(self) -> None:
        """The job's part of a loop turn (no wait): relay what arrived, then scan and watch ranks as due."""
        assert self.relay is not None and self.segment is not None
        if not self.relay.ranks_subscribed:
            self._release_hold()
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
            self.passes.puts(self.clock(), puts)
        mono = time.monotonic()
        self.marks.step_if_due(mono)  # the delivered marks and acknowledgements: every ACK_INTERVAL_S
        if mono < self._due_work_at and self._window_due_ns is not None and self.clock() < self._window_due_ns:
            return  # nothing else is due: a turn while messages flow costs only the relay (and the acks)
        self._due_work(mono)

    def _due_work(self, mono: float) -> None:
        """The part of :meth:`turn` that is not the relay: the rank look, the look for new stats, a pass when a
        window closed, commits, usage figures, the status line, acknowledgements and heartbeats, each when due;
        then when the next of them falls due (:attr:`_due_work_at`, and :attr:`_window_due_ns` on the clock)."""
        assert self.relay is not None and self.segment is not None
        now = self.clock()
        soon = mono + CHORE_SLACK_S  # a periodic look due this soon is taken in this turn rather than its own
        looked = soon >= self._next_rank_look
        if looked:  # the rank table and liveness: at most every rank_look_s, however often messages arrive
            self.rank_looks += 1
            self._next_rank_look = mono + self.rank_look_s
            self.next_stat_look = mono + self.stat_look_s
            self._entries_epoch = self.segment.entries_epoch()  # (read before the table: a later bump is seen)
            self.last_ranks = self.scanner.refresh()
            for change in self.liveness.poll(self.last_ranks):
                self._lifecycle(change)
            self.marks.settle(self.last_ranks)  # what gone senders could not deliver: counted
            self.hangs.look(self.last_ranks)  # every phase word: a hang named while it happens
            if self.gpu is not None:  # the newest GPU sample, written once, into windows still open
                self.gpu.step(self.last_ranks)
        elif mono >= self.next_stat_look:  # a stat made since is found before its first windows leave the ring
            self.next_stat_look = mono + self.stat_look_s
            if self.entries_moved():  # one word: the table is read only when an entry or stat came
                self._entries_epoch = self.segment.entries_epoch()
                self.scanner.refresh()
        if self.scanner.due(now):
            self._emit_scan(now, final=False)
        self._apply_commits(now)
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
        due = min(self._next_rank_look, self.next_stat_look, self._next_usage, self.relay.next_beat)
        if self.config.status_interval_s > 0:
            due = min(due, self._next_status)
        if len(self.commits):
            due = min(due, mono + COMMIT_POLL_S)
        self._due_work_at = due
        self._window_due_ns = self.scanner.next_due_ns()  # None (no stat known yet): every step looks

    def close(self) -> None:
        """Stop as the serving loop stops every job (:meth:`~collector.daemon.loop.Loop.stop`): the ranks' hand-over,
        the events sinks finishing when they are this job's own, then :meth:`last_pass` (idempotent)."""
        self.loop.stop()

    def last_pass(self, deadline: float | None) -> None:
        """Stopping, after :meth:`stop_intake` (and the events sinks' finish, by ``deadline``): emit the closed
        windows (and, once no rank is alive, every window that holds data), flush handlers, release everything."""
        if self.relay is None:
            return
        try:
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
            if self.segment is not None:  # the windows lost in the last pass count in the last counters
                self.commits.settle(self.segment, self.dispatcher.close_budget_s)
            self._emit_usage(now, ranks)  # the final counters, however short the run was
            self.emitted_everything = not live and not self._handover_failed
            if live:
                self.not_emitted = (f"the open windows of rank{'s' if len(live) > 1 else ''} "
                                    f"{', '.join(map(str, live))}, still running")
        except Exception as exc:  # whatever happens, the sockets and files below are released
            self.emitted_everything = False
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
        """After :meth:`close`: remove the job's segment and lock file if every window was emitted and no
        process of the job's rank table lives (``shmstat run`` and ``shmstat collect --job`` call it on every
        exit); returns "" then, otherwise one line saying what was kept, why, and how to look and clean."""
        return remove_if_done(self.config.job, self.emitted_everything, self.not_emitted)

    def stop_intake(self) -> None:
        """Stopping, first: the job's GPU entries closed (they are the collector's own, not processes of the job),
        then the ranks' hand-over (:meth:`Relay.hand_over`): their last messages taken, put metrics dispatched,
        events offered to the sinks; from then on the ranks hold what they log for the next collector. A second call
        returns at once (every rank's marker arrived). A failure is said and recorded (the job's last pass follows
        all the same)."""
        if self.relay is None:
            return
        if not self._stopping:
            self._stopping = True
            with contextlib.suppress(Exception):  # what the stopping line and the last status say (as it stopped)
                self.running_at_stop = self.ranks_running()
            if self.gpu is not None:
                with contextlib.suppress(Exception):
                    self.gpu.close()
        try:
            self._drain_ingest()
            if self.segment is not None:  # what gone senders could not deliver: counted before the sinks finish
                self.marks.settle(self.scanner.refresh(), final=True)
            self._take_submitted()
        except Exception as exc:
            self._handover_failed = True
            self.not_emitted = f"the hand-over, which failed ({exc!r})"
            print(f"shmstat collector: job {self.config.job}: the hand-over failed ({exc!r})", file=sys.stderr,
                  flush=True)

    def finish_round(self) -> None:
        """One round while stopping, after :meth:`stop_intake`, as the events sinks finish
        (:func:`~collector.sinks.kept_events.let_sinks_finish`):
        the windows that closed are emitted and what the handlers took committed, and the delivered marks follow
        what the sinks took and are acknowledged, so the ranks do not send it to the next collector again."""
        if self.segment is None or self.relay is None:
            return
        now = self.clock()
        if self.scanner.due(now):
            self._emit_scan(now, final=False)
        self._apply_commits(now)
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
        self.passes.puts(self.clock(), puts)

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
        self.passes.puts(self.clock(), self._submitted.drain(self.publish_event))

    def publish_event(self, name: str, ts_ns: int, data: dict[str, str | int | float | bool]) -> None:
        """Publish an event the collector made on ``event/<name>`` and keep it for the events sinks (the loop's
        thread only; other threads use :meth:`submit_event`)."""
        assert self.relay is not None
        self.relay.publish(wire.event_topic(name), "event", [[name, ts_ns, data]])
        self.events.own(name, ts_ns, data)

    # -- the job's passes ------------------------------------------------------------------------------------
    def _emit_scan(self, now: int, *, final: bool) -> None:
        self.passes.scan(now, final=final, lost=lambda: self._emit_usage(now, self.last_ranks))

    def _apply_commits(self, now: int) -> None:
        """Commit the passes every handler took; windows lost to the ring count once committed, so the counters
        are handed on when that moved them."""
        assert self.segment is not None
        shown = self.commits.lost_committed
        self.commits.apply(self.segment)
        if self.commits.lost_committed != shown:
            self._emit_usage(now, self.last_ranks)

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
        self.passes.usage(now, lambda: usage_points(
            self.config.job, now, ranks, self.liveness,
            {**self.counters(), **{f"handler_dropped.{g}": n for g, n in self.dispatcher.dropped_by_group.items()}}))

    def print_status(self, ranks: list | None = None, *, final: bool = False) -> None:
        """Print the one-line status (:func:`collector.handlers.console.status_line`) on stderr; ``ranks`` as the
        scanner last read them. ``final``: the last line, after :meth:`close`, with the ranks still running."""
        alive = self.ranks_running() if final else sum(
            1 for r in ranks or () if r.state_name == "active" and not r.is_writer)
        print(status_line(self.counters(), ranks_alive=alive, job=self.config.job, final=final), file=sys.stderr,
              flush=True)

    def ranks_running(self) -> int:
        """The job's ranks (not their workers) whose process lives now: in the rank table as it is while the segment
        is open (the last look may predate ranks that joined since), else as it was when :meth:`close` began."""
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
            "windows_emitted": self.passes.windows_emitted, "rows_emitted": self.passes.rows_emitted,
            **relay_counts(self.relay_counters),
            "handler_errors": self.dispatcher.errors, "handler_dropped": self.dispatcher.dropped,
            **self.events.counters(),
            "windows_overwritten": self.passes.overwritten, "windows_torn": self.passes.torn,
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


class OneJob:
    """What a per-job collector's :class:`~collector.daemon.loop.Loop` serves: ``collector``'s job alone. Its start
    line says where it serves, its ready file names the job's endpoints, a job's trouble ends the loop (a node
    collector lets that job go and serves on), and it stops by closing the job."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    @property
    def max_wait_s(self) -> float:
        """The job's :attr:`Collector.max_wait_s`."""
        return self.collector.max_wait_s

    @property
    def ready_file(self) -> str | None:
        """The job's ``config.ready_file``."""
        return self.collector.config.ready_file

    def serving(self) -> Sequence[Collector]:
        """The job, until it is closed."""
        return (self.collector,) if self.collector.relay is not None else ()

    def start(self) -> None:
        """The start line (``shmstat collector: job J pid N ingest ... publish ...``) and the ready file."""
        c = self.collector
        print(f"shmstat collector: job {c.config.job} pid {os.getpid()} ingest {c.ingest_endpoint} "
              f"publish {c.publish_endpoint}", file=c.out, flush=True)
        c.write_ready_file()

    def chores(self) -> None:
        """None: the job's own chores are in its turn."""

    def due(self) -> float:
        """Never: what is due is the job's (:meth:`Collector.next_due`)."""
        return math.inf

    def turned(self, job: object, failed: Exception | None) -> None:
        """A failed turn ends the loop (which closes the job)."""
        if failed is not None:
            raise failed

    @property
    def events_sinks(self) -> EventDelivery | None:
        """The job's own events sinks (``--events``), which the stop lets finish."""
        events = self.collector.events
        return events.delivery if events.owns else None

    def stopping(self) -> None:
        """Nothing yet: the stopping line is said once stopped (:meth:`stopped`)."""

    def close_job(self, job: object, deadline: float | None) -> None:
        """The job's last pass and release (:meth:`Collector.last_pass`)."""
        self.collector.last_pass(deadline)

    def release(self, deadline: float | None) -> None:
        """Nothing more: the job released what it owns in its last pass."""

    def stopped(self) -> None:
        """The stopping line, if ranks still run, and the final status line."""
        c = self.collector
        c.say_stopping()
        if c.config.status_interval_s > 0:
            c.print_status(final=True)
