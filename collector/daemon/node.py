"""The node collector: one process that serves every job of this user on this node (``shmstat collect`` with
no ``--job``), as the node's agent.

Every ``discover_interval_s`` it looks at the segments in ``/dev/shm``: a job with a live rank and no collector
is picked up (a :class:`~collector.daemon.collector.Collector` for it, binding the job's ingest and publish endpoints in
the owner-only runtime directory), within a second of its first rank attaching, whatever its id (torchrun's
random run ids included). A job another collector serves (it holds the flock on the segment) is left alone,
said once. A job whose ranks have all exited is let go once its windows are emitted, and its segment removed
when no process of its rank table is alive (a job started again later gets a fresh one). The same holds for a
segment of this user that no process uses when the node collector finds it, at start or later (e.g. a job whose
ranks were all SIGKILLed): it is picked up, every window still in its rings emitted, and removed; a segment in
which no rank ever registered is removed once it is a minute old (:mod:`collector.daemon.sweep` says when a segment
counts as unused). Entries of ``/dev/shm`` that are not this user's segments are skipped: this user's odd ones
(a directory, a FIFO, a link) each said once on stderr, other users' counted in one line said once. Every job's
rows go to
one set of handlers, each row naming its job (``StatMetricData.job``, ``job`` in jsonl rows); each job's
streams are on its own publish endpoint (``shmstat subscribe --job JOB``). With ``publish`` set (``--publish
ENDPOINT``: ipc:// or tcp://, for subscribers on other hosts) the node collector also binds one publish socket
(:class:`~collector.relay.publish_socket.Outlet`, bounded as a job's) that carries every message of every job it serves
— ranks' events and metrics, windows, rank lifecycle, heartbeats, its own events — each followed by a frame naming
its job (:mod:`shmstat.wire`); a subscriber of it keeps its accounting per job. ``ready_file`` gets the node's
endpoints as JSON once it serves (:meth:`NodeCollector.write_ready_file`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import IO, NamedTuple

import zmq

from shmstat.errors import CollectorError, ShmstatError
from shmstat.shm.layout import RankState
from shmstat.shm.segment import Segment, pid_alive
from shmstat.shm.shm_entries import other_users_line, own_skipped_lines, scan_shm

from ..gpu.figures import GPU_GROUP
from ..gpu.sampler import GpuSampler
from ..handlers.console import CompactWindowHandler, status_line, stopping_line
from ..handlers.dispatch import ThreadedDispatcher
from ..prometheus.exporter import PrometheusExporter, start_exporter
from ..relay.curve import CurveServer
from ..relay.publish_socket import Outlet
from ..sinks.delivery import EventDelivery
from .collector import Collector
from .config import (
    SERVING_RANK_LOOK_S,
    CollectorConfig,
    build_dispatcher,
    build_event_delivery,
    start_sampler,
    write_ready_file,
)
from .loop import CHORE_SLACK_S, Loop, ServedJob, relay_turn_s
from .node_lock import NodeLock
from .sweep import Verdict, remove_if_dead

__all__ = ["NodeCollector"]

_RETRY_S = 5.0  # a job another collector serves is looked at again this often (quietly)
_REMOVE_WITHIN_S = 600.0  # a finished job's segment is removed once its processes are gone, if within this
_EMPTY_GRACE_S = 60.0  # a segment with no rank entry is left this long (a rank may be about to register)
NODE_MAX_WAIT_S = 1.0
"""The longest the node collector's loop waits with nothing due (nothing is submitted to its jobs from other threads;
its looks for jobs and at the rank tables come sooner anyway)."""


class NodeCollector:
    """Serves every job of this user on this node (or only ``jobs``), each with its own
    :class:`~collector.daemon.collector.Collector`, all in one loop and with one set of handlers. ``config.publish``
    is the node's publish endpoint (every job's messages, each with its job frame), ``config.ready_file`` where its
    endpoints are written; each job keeps its own default endpoints."""

    def __init__(self, config: CollectorConfig, *, jobs: list[str] | None = None, out: IO[str] | None = None,
                 discover_interval_s: float = SERVING_RANK_LOOK_S) -> None:
        self._node_lock = NodeLock.take() if jobs is None else None  # before anything is bound: one per node
        try:
            self._start(config, jobs, out, discover_interval_s)
        except BaseException:
            if self._node_lock is not None:
                self._node_lock.release()
            raise

    def _start(self, config: CollectorConfig, jobs: list[str] | None, out: IO[str] | None,
               discover_interval_s: float) -> None:
        # one status line for the node, not per job; the jobs' own endpoints are their default ones
        self.config = dataclasses.replace(config, status_interval_s=0.0, publish=None, ready_file=None,
                                          curve=None, gpu="off")  # the node's endpoint and GPUs: the node's, below
        self.ready_file = config.ready_file
        self.status = _NodeStatus(config.status_interval_s)
        self.jobs = list(jobs) if jobs else None
        self.out = out if out is not None else sys.stderr
        """Where notes go (start, jobs picked up and let go, segments removed, the Prometheus endpoint): stderr by
        default, so that stdout carries only data (the default handler's windows and straggler lines)."""
        self.discover_interval_s = discover_interval_s
        self.outlet: Outlet | None = None
        """The node's publish socket (``--publish``), which every job's relay also sends on, or None."""
        self._ctx = zmq.Context()
        self.curve: CurveServer | None = None
        """With ``--curve``: CURVE on the node's endpoint (each job's own ipc endpoint is owner-only)."""
        self._next_key_check = 0.0
        self.events: EventDelivery | None = None
        self.exporter: PrometheusExporter | None = None
        self.gpu: GpuSampler | None = None
        """One GPU sampler for every job of the node (:mod:`collector.gpu.sampler`), or None."""
        try:
            if config.publish is not None:
                if config.curve is not None:
                    self.curve = CurveServer(self._ctx, config.curve)
                try:
                    self.outlet = Outlet(self._ctx, config.publish, config.publish_queue,
                                         curve=self.curve)
                except zmq.ZMQError as exc:
                    raise CollectorError(f"cannot bind the publish endpoint {config.publish}: {exc}") from None
            self.events = build_event_delivery(config)
            """One set of events sinks (``--events``) for every job of the node, or None."""
            self.gpu = start_sampler(config, self.out)
            self.dispatcher = build_dispatcher(config, quiet=(GPU_GROUP,) if self.gpu else ())
            self.exporter = start_exporter(config, self.out) if config.prometheus else None
            """One Prometheus endpoint for every job of the node (``--prometheus``)."""
            if self.exporter is not None and self.outlet is not None:
                self.exporter.add_node(self.endpoint_counters)
            if self.exporter is not None and self.gpu is not None:
                self.exporter.set_gpus(self.gpu.uuids)
        except BaseException:
            if self.events is not None:
                self.events.close()
            if self.gpu is not None:
                self.gpu.close()
            self._close_outlet()
            raise
        self.status.name_jobs(self.dispatcher)
        self.collectors: dict[str, Collector] = {}
        self.let_go: list[str] = []
        """Jobs served and let go once their ranks had exited and their windows were emitted, in order."""
        self._not_now: dict[str, float] = {}  # job -> monotonic time to look at it again
        self._held_by: dict[str, _Holder] = {}  # job another collector served when last tried -> which one
        self._to_remove: dict[str, float] = {}  # finished job -> monotonic time to stop trying to remove it
        self._said: set[str] = set()
        self._done: set[str] = set()  # jobs let go as finished: picked up again only for a live rank
        self._skips_said: set[str] = set()  # the skipped entries of /dev/shm already said
        self._others_said = False  # whether the line counting other users' entries of /dev/shm was said
        self._next_discovery = 0.0
        self._looks: dict[str, int] = {}  # job -> its collector's rank looks when the node last asked if it finished
        self._running_at_stop: dict[str, int] = {}  # job -> its ranks still running as the stop began
        self.max_wait_s = NODE_MAX_WAIT_S
        """The longest the loop waits with nothing due (nothing is submitted to the jobs from other threads)."""
        self.loop = Loop(self, turn_s=relay_turn_s(config.event_latency_ms))
        """The serving loop, every job served in it (a per-job collector serves its one job in the same loop)."""

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM, then let every job go (emitting what it holds) and return 0
        (:meth:`collector.daemon.loop.Loop.run`)."""
        return self.loop.run()

    def start(self) -> None:
        """The start line, and the ready file (:meth:`write_ready_file`)."""
        which = "every job of this user" if self.jobs is None else "jobs " + ", ".join(self.jobs)
        every = f"; every job on {self.outlet.endpoint}" if self.outlet is not None else ""
        print(f"shmstat collector: node pid {os.getpid()} serving {which} on this node "
              f"(streams: shmstat subscribe --job JOB{every})", file=self.out, flush=True)
        self.write_ready_file()

    def write_ready_file(self) -> None:
        """Write the ready file, if asked for: ``{"pid", "publish", "prometheus", "jobs"}`` as JSON (``publish``
        the node's endpoint, the real port when bound to port 0, or null; ``prometheus`` the scrape URL or null;
        ``jobs`` the jobs named, or null for every job of this user)."""
        if self.ready_file is not None:
            write_ready_file(self.ready_file, {
                "pid": os.getpid(), "publish": self.outlet.endpoint if self.outlet is not None else None,
                "prometheus": self.exporter.url if self.exporter is not None else None, "jobs": self.jobs})

    def serving(self) -> Sequence[Collector]:
        """The jobs served now, each by its :class:`~collector.daemon.collector.Collector`."""
        return tuple(self.collectors.values())

    def chores(self) -> None:
        """The node's part of a loop turn, before the wait: discover jobs (every ``discover_interval_s``), the status
        line, the node's publish socket."""
        now = time.monotonic()
        if now + CHORE_SLACK_S >= self._next_discovery:  # (taken with the turn's other looks when due soon)
            self._next_discovery = now + self.discover_interval_s
            try:
                self.discover()
            except Exception as exc:  # whatever is in /dev/shm, the jobs already served go on
                self._say_once(f"discover {exc!r}", f"shmstat collector: looking at /dev/shm failed ({exc!r})",
                               sys.stderr)
        self.status.tick(self)
        if self.outlet is not None:
            if not self.collectors:  # else every job's relay takes them (Relay.receive)
                self.outlet.update()  # subscriptions (and floods of them) are taken even with no job served
            if now >= self._next_key_check:  # with CURVE: cut off whoever connected with a key removed since
                self._next_key_check = now + self.config.heartbeat_interval_s
                self.outlet.cut_off_revoked()

    def due(self) -> float:
        """When the node's own work is next due (:func:`time.monotonic`): the next discovery, status line or key
        check (what a served job has due the loop adds: :meth:`collector.daemon.loop.Loop.next_due`)."""
        due = self._next_discovery + CHORE_SLACK_S
        if self.status.interval_s > 0:
            due = min(due, self.status.next)
        if self.curve is not None:
            due = min(due, self._next_key_check)
        return due

    def turned(self, job: ServedJob, failed: Exception | None) -> None:
        """After a job's turn: a job that failed is let go (one job's trouble must not stop the others), a job
        whose ranks all exited (read anew by that turn) is let go once its windows are emitted."""
        assert isinstance(job, Collector)
        name = job.config.job
        if failed is not None:
            print(f"shmstat collector: job {name} failed ({failed!r}); letting it go", file=sys.stderr, flush=True)
            self._release(name)
            return
        looks, self._looks[name] = self._looks.get(name, -1), job.rank_looks
        if self.jobs is None and looks != job.rank_looks and self._finished(job):  # (its ranks read anew)
            if self._release(name):
                self._to_remove[name] = time.monotonic() + _REMOVE_WITHIN_S
            self._done.add(name)
            self.let_go.append(name)
            print(f"shmstat collector: job {name} done (its ranks exited, windows emitted)", file=self.out,
                  flush=True)

    def stopped(self) -> None:
        """Nothing more: :meth:`close` said the last lines."""

    def discover(self) -> None:
        """Pick up the jobs that need a collector, and sweep this user's segments that no process uses (see the
        module docstring). Entries of ``/dev/shm`` that are not this user's segments are skipped: this user's odd ones
        each said once, other users' counted in one line said once."""
        now = time.monotonic()
        self._remove_finished(now)
        if self.jobs is None:
            scan = scan_shm()
            present = set(own_skipped_lines(scan.skipped))
            for line in sorted(present - self._skips_said):
                print(line, file=sys.stderr, flush=True)
            self._skips_said = present  # bounded by what is there now; an entry made again is said again
            others = other_users_line(scan.skipped)
            if others is not None and not self._others_said:  # once: on a shared node they come and go all day
                print(f"{others}; not said again", file=sys.stderr, flush=True)
                self._others_said = True
            self._done &= set(scan.segments)  # a job whose segment is gone and comes back is a new job
            candidates = scan.segments
        else:
            candidates = self.jobs
        default = self.dispatcher.inner.default
        if isinstance(default, CompactWindowHandler) and default.show_job:  # short ids unique among the node's jobs
            for job, shown in default.know(candidates).items():
                if job in self.collectors:
                    print(f"shmstat collector: job {job} is now shown as {shown}", file=self.out, flush=True)
        for job in candidates:
            if job in self.collectors or (self._not_now.get(job, 0.0) > now and not self._holder_left(job)):
                continue
            if self.jobs is None:
                state = _look(job)
                if state == "empty":
                    self._sweep_empty(job, now)
                    continue
                if state not in ("live", "dead") or (state == "dead" and job in self._done):
                    continue  # unreadable (said by ls), served elsewhere, exiting, or let go and being removed
                if state == "dead":
                    self._say_once(f"dead {job}", f"shmstat collector: job {job} has no live process: emitting "
                                   "what its rings hold, then removing its segment", self.out)
            try:
                collector = Collector(dataclasses.replace(self.config, job=job), out=self.out,
                                      dispatcher=self.dispatcher, exporter=self.exporter, events=self.events,
                                      node_outlet=self.outlet, gpu_sampler=self.gpu)
            except CollectorError as exc:
                self._not_now[job] = now + _RETRY_S
                self._held_by[job] = _Holder.of(job)
                self._say_once(job, f"shmstat collector: leaving job {job} alone: {exc}", sys.stderr)
                continue
            except (ShmstatError, OSError, ValueError) as exc:  # not ours to read (another layout, a race)
                self._not_now[job] = now + 60.0
                self._say_once(job, f"shmstat collector: cannot serve job {job}: {exc}", sys.stderr)
                continue
            self._done.discard(job)
            self._held_by.pop(job, None)
            collector.rank_look_s = SERVING_RANK_LOOK_S
            collector.max_wait_s = NODE_MAX_WAIT_S
            self.collectors[job] = collector
            shown = (f" (shown as {default.shown(job)})" if isinstance(default, CompactWindowHandler)
                     and default.show_job else "")
            print(f"shmstat collector: job {job} picked up{shown}, ingest {collector.ingest_endpoint} publish "
                  f"{collector.publish_endpoint}", file=self.out, flush=True)

    def _holder_left(self, job: str) -> bool:
        """Whether the collector that served ``job`` when it was last left alone may have let it go since (see
        :class:`_Holder`): then it is tried again now rather than :data:`_RETRY_S` after, before the ring wraps."""
        holder = self._held_by.get(job)
        if holder is None or holder.left():
            self._held_by.pop(job, None)
            return holder is not None
        return False

    def _say_once(self, key: str, line: str, stream: IO[str]) -> None:
        if key not in self._said:
            self._said.add(key)
            print(line, file=stream, flush=True)

    def _sweep_empty(self, job: str, now: float) -> None:
        """A segment with no rank entry: removed once it is older than :data:`_EMPTY_GRACE_S` and no process
        uses it (a collector, a rank registering); looked at again every :data:`_RETRY_S`."""
        verdict = remove_if_dead(job, empty_grace_s=_EMPTY_GRACE_S)
        if verdict.removed:
            print(f"shmstat collector: job {job}'s segment removed (no rank ever registered, no process uses it)",
                  file=self.out, flush=True)
        else:
            self._not_now[job] = now + _RETRY_S

    def _remove_finished(self, now: float) -> None:
        """Remove the segments of jobs let go with every window emitted, once none of their processes is alive
        (a rank may still be exiting after its ``shutdown()``); a job started again meanwhile keeps its."""
        for job, until in list(self._to_remove.items()):
            if job in self.collectors or now > until:
                del self._to_remove[job]
                continue
            try:
                verdict = remove_if_dead(job)
            except Exception as exc:  # never stop serving the other jobs for one segment
                verdict = Verdict(False, repr(exc))
            if verdict.removed or verdict.reason == "no segment":
                del self._to_remove[job]
                self._done.discard(job)
            if verdict.removed:
                print(f"shmstat collector: job {job}'s segment removed", file=self.out, flush=True)
            elif not verdict.live and verdict.reason != "no segment":
                del self._to_remove[job]  # not a matter of waiting (e.g. replaced by another user's entry)
                self._say_once(f"keep {job}", f"shmstat collector: job {job}'s segment kept: {verdict.reason}",
                               sys.stderr)

    @staticmethod
    def _finished(c: Collector) -> bool:
        ranks = c.last_ranks  # read by the step just taken: reading the rank table again doubled its cost
        me = os.getpid()  # the entries this process holds (GPU figures) are no process of the job
        return bool(ranks) and not any(r.state == RankState.ACTIVE and r.pid != me and pid_alive(r.pid)
                                       for r in ranks)

    def _release(self, job: str) -> bool:
        """Let ``job`` go; True if its collector emitted every window it held."""
        collector = self.collectors.pop(job, None)
        self._looks.pop(job, None)
        if collector is None:
            return False
        if self.exporter is not None:
            self.exporter.retire_job(job)
        try:
            collector.close()  # emits every window the gone ranks left, releases the job's files
            self.status.let_go(collector)
        except Exception:
            return False
        return collector.emitted_everything

    def close(self) -> None:
        """Let every job go (each emits what it holds, and its final heartbeat), then close the node's publish
        socket and the handlers (:meth:`collector.daemon.loop.Loop.stop`). The events sinks, which every job shares,
        finish first (within their close budget): while the jobs' ranks hold new events and the jobs still emit
        windows and move delivered marks (:func:`~collector.sinks.kept_events.let_sinks_finish`)."""
        self.loop.stop()

    @property
    def events_sinks(self) -> EventDelivery | None:
        """The node's events sinks, shared by every job."""
        return self.events

    def stopping(self) -> None:
        """The stopping line, before the jobs' hand-over: the ranks still running and how long the rings keep
        their windows."""
        self._running_at_stop = running = {job: c.ranks_running() for job, c in self.collectors.items()}
        if self.collectors:
            slack = min(c.ring_slack_s() for c in self.collectors.values())
            line = stopping_line(running, slack, min(c.banks for c in self.collectors.values()))
            if line is not None:
                print(line, file=sys.stderr, flush=True)

    def close_job(self, job: ServedJob, deadline: float | None) -> None:
        """Let ``job`` go as it stops by itself (:meth:`Collector.close`); its segment removed when every window
        was emitted, unless a process of the job lives."""
        if self._release(job.name):
            Segment.unlink_if_unused(job.name)

    def release(self, deadline: float | None) -> None:
        """The node's own, once every job was let go: its publish socket, the events sinks (by ``deadline``), the
        final status line, the handlers, the Prometheus endpoint, the node lock, the GPU sampler."""
        self._close_outlet()
        if self.events is not None:
            self.events.close(deadline)  # before the final status line, which counts what the sinks lost
        self.status.print(self, final=True, running=sum(self._running_at_stop.values()))
        with contextlib.suppress(Exception):
            self.dispatcher.close()
        if self.exporter is not None:
            self.exporter.close()
        if self._node_lock is not None:
            self._node_lock.release()
            self._node_lock = None
        if self.gpu is not None:
            self.gpu.close()

    def endpoint_counters(self) -> dict[str, int]:
        """The node's endpoint's own counters (``shmstat_node_publish_*_total`` on ``/metrics``): times bound anew
        for too many subscription topics, and with CURVE the handshakes refused (a key not allowed) and failed,
        and the revocations. What its subscribers lost counts in each job's ``subscriber_items_lost``."""
        outlet, curve = self.outlet, self.curve
        counts = {"publish_subscription_resets": outlet.resets if outlet is not None else 0}
        if curve is not None:
            counts.update(publish_handshakes_refused=curve.counts.refused,
                          publish_handshakes_failed=curve.counts.failed,
                          publish_key_revocations=curve.counts.revocations)
        return counts

    def _close_outlet(self) -> None:
        if self.outlet is not None:
            self.outlet.close(linger_ms=1000)  # what subscribers were sent last gets a second to leave
            self.status.done["subscription_resets"] += self.outlet.resets
            self.outlet = None
        if self.curve is not None:
            self.curve.close()  # the ZAP handler's sockets, before the context ends
        with contextlib.suppress(Exception):
            self._ctx.term()


class _NodeStatus:
    """The node collector's one-line status every ``interval_s`` (0: none) on stderr, over every job it served
    (:func:`collector.handlers.console.status_line`); and its compact default handler names each line's job."""

    _SUMMED = ("windows_emitted", "events_relayed", "seq_gaps", "windows_overwritten", "frames_rejected",
               "samples_dropped", "subscriber_items_lost", "subscription_resets")

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.next = time.monotonic() + interval_s
        self.done = dict.fromkeys(self._SUMMED, 0)  # what the jobs let go had counted
        self.served: set[str] = set()

    @staticmethod
    def name_jobs(dispatcher: ThreadedDispatcher) -> None:
        default = dispatcher.inner.default
        if isinstance(default, CompactWindowHandler):
            default.show_job = True

    def let_go(self, collector: Collector) -> None:
        self.served.add(collector.config.job)
        counters = collector.counters()
        for key in self._SUMMED:
            self.done[key] += counters[key]

    def tick(self, node: NodeCollector) -> None:
        if self.interval_s > 0 and time.monotonic() >= self.next:
            self.next = time.monotonic() + self.interval_s
            self.print(node)

    def print(self, node: NodeCollector, *, final: bool = False, running: int = 0) -> None:
        """One status line: the jobs served now and their figures; ``final``: the last, the jobs served over the
        node collector's life and the ``running`` ranks still running as it stopped."""
        if self.interval_s <= 0:
            return
        totals = dict(self.done)
        alive = 0
        for c in node.collectors.values():
            counters = c.counters()
            for key in self._SUMMED:
                totals[key] += counters[key]
            alive += sum(1 for r in c.scanner.refresh() if r.state_name == "active" and not r.is_writer)
        totals["handler_dropped"] = node.dispatcher.dropped  # one dispatcher for every job: counted once
        totals["events_dropped"] = node.events.dropped if node.events is not None else 0  # the same
        totals["handler_errors"] = node.dispatcher.errors
        if node.outlet is not None:  # the node's endpoint; messages its subscribers lost count in their job's
            totals["subscription_resets"] += node.outlet.resets
        if node.curve is not None:  # the node's endpoint's handshakes (each job's own endpoint has no CURVE)
            totals["handshakes_refused"] = node.curve.counts.refused
            totals["handshakes_failed"] = node.curve.counts.failed
        jobs = len(self.served | set(node.collectors)) if final else len(node.collectors)
        print(status_line(totals, ranks_alive=running if final else alive, jobs=jobs, final=final), file=sys.stderr,
              flush=True)


class _Holder(NamedTuple):
    """The collector that served a job when the node collector was refused it, as the job's segment header named it.

    The ranks go on writing while that collector stops, and the ring keeps a closed window only ``K - 2`` windows
    (:mod:`shmstat.shm.layout`): a successor coming back only :data:`_RETRY_S` later would find the windows of the
    hand-over overwritten. So at every discovery the header's word is read (the flock, which decides, is taken
    only to serve): the job is tried again at once when the word names another collector or none (a collector
    writes 0 or -1 there as it stops, its pid once it serves), or when the pid, alive when refused, has gone (a
    collector killed). A pid this process cannot see (another PID namespace) is tried every :data:`_RETRY_S`.
    """

    job: str
    pid: int
    alive: bool
    """Whether ``pid`` was a live process of this PID namespace when the job was left alone."""

    @classmethod
    def of(cls, job: str) -> _Holder:
        """The collector ``job``'s header names now (pid 0 if the segment cannot be read)."""
        pid = _collector_pid(job)
        return cls(job, pid, pid > 0 and pid_alive(pid))

    def left(self) -> bool:
        """Whether this holder may have let the job go (one seen as pid 0 or -1, starting or stopping, may have)."""
        if self.pid <= 0 or _collector_pid(self.job) != self.pid:
            return True
        return self.alive and not pid_alive(self.pid)


def _collector_pid(job: str) -> int:
    """The collector pid ``job``'s segment header holds (0 if it cannot be read)."""
    try:
        seg = Segment.open(job, create=False, wait=False)
    except (ShmstatError, OSError, ValueError):
        return 0
    try:
        return seg.header().collector_pid
    finally:
        seg.close()


def _look(job: str) -> str:
    """What a job's segment holds, at a look (no lock taken): ``"live"`` (an active rank's process runs),
    ``"dead"`` (rank entries, none of them a live process, no live collector), ``"empty"`` (no rank entry, no
    live collector), ``"served"`` (a live collector and no live rank), ``"exiting"`` (no active rank, but a
    process of the rank table still runs) or ``"unreadable"``."""
    try:
        seg = Segment.open(job, create=False, wait=False)
    except (ShmstatError, OSError, ValueError):
        return "unreadable"
    try:
        ranks = seg.ranks()
        alive = [r for r in ranks if r.pid and pid_alive(r.pid)]
        if any(r.state == RankState.ACTIVE for r in alive):
            return "live"
        collector = seg.header().collector_pid
        if collector and collector != os.getpid() and pid_alive(collector):
            return "served"
        if alive:
            return "exiting"  # a rank after its shutdown(): looked at again once it has gone
        return "dead" if ranks else "empty"
    finally:
        seg.close()
