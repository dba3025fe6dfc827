"""``shmstat subscribe``: tail collectors' streams as JSON lines on stdout, and say on stderr what was lost.

Three ways to name what to follow (:mod:`collector.cli.served_jobs`): ``ENDPOINT``s (followed until stopped), jobs
(``--job J``: followed until J ends, after its collector's last message, unless ``--follow``), or nothing: every
job a collector serves on this node, picked up as it starts and let go as it ends, until stopped. Every collector
sends heartbeats (:mod:`shmstat.wire.heartbeat`); they are compared with what arrived, and each loss is one line on
stderr (and a ``{"record": "gap"}`` line with ``--json``), and reported to the collector that sent it (an
``XSUB`` socket sends :func:`shmstat.wire.heartbeat.encode_loss_report` upstream), which counts it in
``collector.subscriber_items_lost``. Heartbeats are not data: they are printed only with
``--json``, as messages of kind ``heartbeat``. A node collector's endpoint (``shmstat collect --publish ENDPOINT``)
carries every job it serves, each message with a third frame naming its job (:mod:`shmstat.wire`): each line
says its job, losses are accounted per job (every job of a node collector shares its pid), and a job that ends
there is said without leaving the endpoint, which is followed until stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import zmq

from shmstat import wire
from shmstat.errors import ConfigError, WireError
from shmstat.shm.runtime import publish_endpoint
from shmstat.shm.shm_entries import Skipped, entry_problem
from shmstat.wire.heartbeat import SENDER_STREAM, Gap, GapTracker, encode_loss_report, followed_kinds
from shmstat.wire.records import item_record

from ..daemon.node_lock import node_collector_pid
from ..relay.curve import (
    CLIENT,
    CURVE_FRAME_OVERHEAD,
    ClientKeys,
    handshake_failures,
    load_client,
    secure_client,
    watch_client,
)
from .served_jobs import job_over, served_jobs, socket_identity

__all__ = ["gap_line", "message_to_json", "subscribe"]

_RCVHWM = 64  # messages queued in this process at most (each at most 2 MiB)
_DISCOVER_S = 0.1  # node-wide: how often /dev/shm is looked at for jobs that start
_GONE_S = 1.0  # a job whose socket and segment are gone this long, with no final heartbeat seen, has ended


_HANDSHAKE = {  # (kind, this subscriber uses CURVE): what to tell
    ("refused", True): "the collector refused this CURVE key (not one of its client keys, or revoked); ask its "
                       "operator for one (shmstat keys DIR --client NAME)",
    ("mismatch", True): "the collector there does not use CURVE; subscribe without --curve",
    ("mismatch", False): "the collector there lets in only CURVE subscribers; subscribe with --curve DIR (its "
                         "server.key and your key from its operator)",
    ("failed", True): "the CURVE handshake keeps failing: is the server.key in the --curve directory this "
                      "collector's?",
}


def message_to_json(msg: wire.WireMessage, endpoint: str, job: str | None = None) -> str:
    """One JSON line for a decoded message: topic, kind, rank, pid, incarnation, seq, items, source, job; every
    item the record :func:`shmstat.wire.records.item_record` makes of it (what the Python stream API returns)."""
    return json.dumps(
        {"topic": msg.topic, "kind": msg.kind, "rank": msg.rank, "pid": msg.pid, "incarnation": msg.incarnation,
         "seq": msg.seq, "items": [item_record(msg, j, job) for j in range(len(msg.items))],
         "source": endpoint, "job": job},
        allow_nan=False,
    )


def gap_line(gap: Gap, job: str | None) -> str:
    """The one stderr line of a gap: which job, sender and stream, how many items."""
    who = f"job {job}, " if job else f"{gap.source}, "
    sender = (f"the collector (pid {gap.pid})" if gap.rank == wire.COLLECTOR_RANK
              else f"rank {gap.rank} (pid {gap.pid}, incarnation {gap.incarnation})")
    if gap.stream == SENDER_STREAM:
        return f"shmstat subscribe: gap: {who}{sender}: {gap.items} items dropped before they reached the collector"
    return f"shmstat subscribe: gap: {who}{sender}: {gap.items} {gap.stream} items lost on the way to this subscriber"


def _usable(endpoint: str) -> bool:
    """False (saying why, in one line on stderr) for an ``ipc://`` path that exists but is not this user's
    socket: another user's entry, a directory, a FIFO, a link. A missing path is fine (the collector may start
    later: zmq connects when it appears)."""
    if not endpoint.startswith("ipc://"):
        return True
    path = endpoint[len("ipc://"):]
    try:
        st = os.lstat(path)
    except OSError:
        return True
    problem = entry_problem(st, expect="socket")
    if problem is None and not stat.S_ISSOCK(st.st_mode):
        problem = "a regular file, not a collector's socket"
    if problem is None:
        return True
    print(f"shmstat subscribe: {Skipped(path, problem).line()}", file=sys.stderr)
    return False


@dataclass
class _Source:
    """One endpoint followed: the job it is (None for a given endpoint), whether its end ends the command."""

    endpoint: str
    job: str | None
    ends: bool
    discovered: bool = False  # node-wide: let go when the job ends, picked up again if it starts again
    sock: zmq.Socket | None = None
    inode: int | None = None  # the socket file's identity while it was there (node-wide: to tell a new one)
    seen: bool = False  # its socket file (or a message) was seen: it can end
    gone_since: float | None = None
    done: bool = False
    monitor: zmq.Socket | None = None  # tcp://: its failed handshakes (collector.relay.curve.handshake_failures)
    failures: dict[str, int] = field(default_factory=dict)  # failed handshakes by kind
    told: set[str] = field(default_factory=set)  # the lines said about them already


class _Subscriber:
    """The sockets, the gap tracker and the output of one ``shmstat subscribe``."""

    def __init__(self, topics: Sequence[str], out: IO[str], records: bool, curve: ClientKeys | None = None) -> None:
        self.topics = [t.encode("utf-8") for t in topics] or [b""]
        self.kinds = followed_kinds(topics)
        if not any(wire.HEARTBEAT_TOPIC.encode().startswith(t) for t in self.topics):
            self.topics.append(wire.HEARTBEAT_TOPIC.encode())  # last: its first beat follows the others' start
        self.out, self.records, self.curve = out, records, curve
        self.ctx = zmq.Context()
        self.tracker = GapTracker(self.kinds)
        self.sources: dict[zmq.Socket, _Source] = {}
        self.poller = zmq.Poller()
        self.seen = self.bad = self.gaps = 0

    def connect(self, source: _Source) -> None:
        sock = self.ctx.socket(zmq.XSUB)  # not SUB: it sends its loss reports upstream too
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1)
        if self.curve is not None:  # libzmq counts CURVE's bytes against the limit
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1 + CURVE_FRAME_OVERHEAD)
            secure_client(sock, self.curve)
        if source.endpoint.startswith("tcp://"):
            source.monitor = watch_client(sock)
        try:
            sock.connect(source.endpoint)
        except zmq.ZMQError as exc:
            self._unwatch(source, sock)
            sock.close()
            raise ConfigError(f"cannot connect to {source.endpoint!r}: {exc}") from None
        for t in self.topics:  # kept by the XSUB and sent again on every reconnect, as a SUB does
            sock.send(b"\x01" + t)
        source.sock = sock
        source.inode = socket_identity(source.endpoint)
        source.seen = source.seen or source.inode is not None
        self.sources[sock] = source
        self.poller.register(sock, zmq.POLLIN)

    def _unwatch(self, source: _Source, sock: zmq.Socket) -> None:
        if source.monitor is not None:
            sock.disable_monitor()
            source.monitor.close(0)
            source.monitor = None

    def handshakes(self) -> None:
        """Say once per endpoint why its handshakes fail (a refused key, CURVE on one side only, another
        server key): without it a subscriber turned away would wait in silence."""
        for source in self.sources.values():
            if source.monitor is None:
                continue
            for kind in handshake_failures(source.monitor):
                n = source.failures[kind] = source.failures.get(kind, 0) + 1
                if kind == "failed" and (n < 3 or "refused" in source.failures or "mismatch" in source.failures):
                    continue  # the first failures of a refused or mismatched handshake say nothing more
                line = _HANDSHAKE.get((kind, self.curve is not None))
                if line is not None and line not in source.told:
                    source.told.add(line)
                    print(f"shmstat subscribe: {source.endpoint}: {line}", file=sys.stderr, flush=True)

    def disconnect(self, source: _Source) -> None:
        if source.sock is not None:
            self._unwatch(source, source.sock)
            self.poller.unregister(source.sock)
            self.sources.pop(source.sock, None)
            source.sock.close(0)
            source.sock = None
        self.tracker.forget(source.endpoint)

    def drain(self, sock: zmq.Socket, limit: int | None) -> None:
        """Take what ``sock`` holds (data messages up to ``limit`` more)."""
        source = self.sources[sock]
        while limit is None or self.seen < limit:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg, tagged = wire.decode_with_job(frames)
            except WireError:
                self.bad += 1
                continue
            source.seen = True
            job = source.job if tagged is None else tagged
            key = _key(source, tagged)
            beat = self.tracker.take(key, msg)
            if beat is None:
                self._write(message_to_json(msg, source.endpoint, job))
                self.seen += 1
                continue
            if self.records:
                self._write(message_to_json(msg, source.endpoint, job))
            self._report(sock, beat.gaps, tagged)
            for gap in beat.gaps:
                self.gaps += gap.items
                print(gap_line(gap, job), file=sys.stderr, flush=True)
                if self.records:
                    self._write(json.dumps({"record": "gap", "source": source.endpoint, "job": job,
                                            "rank": gap.rank, "pid": gap.pid, "incarnation": gap.incarnation,
                                            "stream": gap.stream, "items": gap.items}))
            if beat.final:
                self._final(source, beat.job_ended, tagged)
                if source.sock is None:
                    break
        self.out.flush()

    @staticmethod
    def _report(sock: zmq.Socket, gaps: list[Gap], tagged: str | None) -> None:
        """Tell the collector what a heartbeat showed lost on the way here (not what a sender dropped before it:
        the collector counted that itself)."""
        lost: dict[str, int] = {}
        for gap in gaps:
            if gap.stream != SENDER_STREAM:
                lost[gap.stream] = lost.get(gap.stream, 0) + gap.items
        frame = encode_loss_report(lost, tagged or "")
        if frame is not None:
            with contextlib.suppress(zmq.ZMQError):  # never blocks: a report that finds no room is not sent
                sock.send(frame, zmq.NOBLOCK)

    def _final(self, source: _Source, job_ended: bool, tagged: str | None) -> None:
        job = source.job if tagged is None else tagged
        name = f"job {job}" if job else source.endpoint
        if not job_ended:
            print(f"shmstat subscribe: {name}: its collector stopped while the job runs; waiting for the next one",
                  file=sys.stderr, flush=True)
            return
        self.end(source, f"shmstat subscribe: {name} ended (its collector's last message received)", tagged)

    def end(self, source: _Source, line: str, tagged: str | None = None) -> None:
        """``source``'s job is over: say so; a ``--job`` one is done (unless followed on), a discovered one let go
        (picked up again if the job starts again). ``tagged``: a job of a node collector's endpoint, which ends
        alone (the endpoint goes on)."""
        print(line, file=sys.stderr, flush=True)
        if self.records:
            self._write(json.dumps({"record": "end", "source": source.endpoint,
                                    "job": source.job if tagged is None else tagged}))
        if tagged is not None:
            self.tracker.forget(_key(source, tagged))  # that job's next collector there starts anew
        elif source.ends or source.discovered:
            self.disconnect(source)
            source.done = True
        else:
            self.tracker.forget(source.endpoint)  # followed on: the next collector there starts anew

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")

    def close(self) -> None:
        for sock, source in list(self.sources.items()):
            self._unwatch(source, sock)
            sock.close(0)
        self.ctx.term()


def _nothing_served() -> str:
    """What a node-wide subscriber that finds no job served says: whether a node collector runs, waiting for a
    job, or none does (and how to start it)."""
    pid = node_collector_pid()
    if pid is not None:
        return f"the node collector (pid {pid}) serves no job of yours yet; waiting for one to start"
    return "no collector runs for you on this node; waiting for one (start the node's collector: shmstat collect)"


def _key(source: _Source, tagged: str | None) -> str:
    """What the gap tracker follows as one collector: the endpoint, or on a node collector's endpoint one job of
    it (all its jobs share the node collector's pid, so without the job their heartbeats would mix)."""
    return source.endpoint if tagged is None else f"{source.endpoint} job {tagged}"


def subscribe(
    endpoints: Sequence[str] = (), *, jobs: Sequence[str] = (), follow: bool = False, topics: Sequence[str] = (),
    count: int | None = None, timeout_s: float | None = None, records: bool = False, out: IO[str] | None = None,
    curve: str | None = None, curve_client: str | None = None,
) -> int:
    """Print every data message of ``endpoints``, of ``jobs``' collectors, or (neither) of every job served on
    this node, whose topic starts with one of ``topics`` (all if none); report losses on stderr.

    Stops after ``count`` data messages or ``timeout_s`` seconds if given, once every job of ``jobs`` has ended
    (unless ``follow`` or endpoints are given too), else on Ctrl-C. ``records``: also print heartbeats and
    ``{"record": "gap" | "end"}`` lines. Malformed messages are counted on stderr at the end, never printed. An
    ``ipc://`` endpoint whose path is not this user's socket is skipped with one line (none left:
    :class:`ConfigError`). ``curve``: a key directory; every endpoint must then be ``tcp://`` and is connected as a
    CURVE client with ``curve/NAME.key_secret`` (``curve_client``, default ``client``) against ``curve/server.key``
    (:mod:`collector.relay.curve`). Returns the exit status.
    """
    out = out if out is not None else sys.stdout
    if count is not None and count < 1:
        raise ConfigError(f"--count must be at least 1, got {count}")
    if follow and not jobs:
        raise ConfigError("--follow keeps following a --job after it ends; name the job with --job JOB")
    keys = _curve_keys(curve, curve_client, endpoints, jobs)
    node_wide = not endpoints and not jobs
    named = [*((ep, None) for ep in endpoints), *((publish_endpoint(job), job) for job in jobs)]
    sources = [_Source(ep, job, job is not None and not follow) for ep, job in named if _usable(ep)]
    if not node_wide and not sources:
        raise ConfigError(f"no endpoint to subscribe to: {', '.join(ep for ep, _ in named)} skipped")
    sub = _Subscriber(topics, out, records, keys)
    try:
        for source in sources:
            sub.connect(source)
        return _loop(sub, sources, node_wide, bool(endpoints), count, timeout_s)
    finally:
        sub.close()


def _curve_keys(curve: str | None, name: str | None, endpoints: Sequence[str],
                jobs: Sequence[str]) -> ClientKeys | None:
    if curve is None:
        if name is not None:
            raise ConfigError("--curve-client NAME picks a key of a --curve DIR; add --curve DIR")
        return None
    plain = [ep for ep in endpoints if not ep.startswith("tcp://")]
    if jobs or not endpoints or plain:
        raise ConfigError("--curve connects to collectors' tcp:// endpoints: name them, as in shmstat subscribe "
                          f"--curve DIR tcp://HOST:PORT{f' ({plain[0]!r} is not one)' if plain else ''}")
    return load_client(curve, name or CLIENT)


def _loop(sub: _Subscriber, sources: list[_Source], node_wide: bool, fixed: bool, count: int | None,
          timeout_s: float | None) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    discovered: dict[str, _Source] = {}
    idle_said = False
    next_look = 0.0
    while count is None or sub.seen < count:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        if now >= next_look:
            next_look = now + _DISCOVER_S
            if node_wide:
                _discover(sub, discovered)
                if sub.sources:
                    idle_said = False
                elif not idle_said:
                    idle_said = True
                    print(f"shmstat subscribe: {_nothing_served()}", file=sys.stderr, flush=True)
            _watch_ends(sub, sources + list(discovered.values()), now)
            jobs = [s for s in sources if s.ends]
            if jobs and not fixed and all(s.done for s in jobs):
                break
        wait = 100 if deadline is None else max(0, min(100, int((deadline - now) * 1000)))
        for sock, _ in sub.poller.poll(wait):
            if sock in sub.sources:
                sub.drain(sock, count)
        sub.handshakes()
    if sub.bad:
        print(f"shmstat subscribe: {sub.bad} malformed messages skipped", file=sys.stderr)
    never = [s.job for s in sources if s.job is not None and not s.seen]
    if never and sub.seen == 0:
        print(f"shmstat subscribe: job {never[0]} did not appear on this node before the timeout: no collector served "
              "it and nothing was received (see shmstat ls)", file=sys.stderr)
        return 1
    if sub.seen == 0 and not node_wide and not any(s.seen for s in sources):
        names = ", ".join(s.job or s.endpoint for s in sources)
        print(f"shmstat subscribe: nothing received from {names} (is a collector running there?)", file=sys.stderr)
    if count is not None and sub.seen < count:
        print(f"shmstat subscribe: {sub.seen} of {count} messages received before the timeout", file=sys.stderr)
        return 1
    return 0


def _discover(sub: _Subscriber, discovered: dict[str, _Source]) -> None:
    """Node-wide: follow every job whose collector's socket is there now; a job that ended and started again
    (a new socket) is followed anew."""
    served = served_jobs()
    for job in [j for j, src in discovered.items() if src.sock is None and j not in served]:
        del discovered[job]  # ended and its socket gone: whatever binds there next is new
    for job, endpoint in served.items():
        known = discovered.get(job)
        if known is not None and (known.sock is not None or known.inode == socket_identity(endpoint)):
            continue
        if known is not None:
            sub.tracker.forget(known.endpoint)
        source = discovered[job] = _Source(endpoint, job, False, discovered=True)
        sub.connect(source)
        print(f"shmstat subscribe: following job {job}", file=sys.stderr, flush=True)


def _watch_ends(sub: _Subscriber, sources: list[_Source], now: float) -> None:
    """A job whose final heartbeat did not arrive (its collector killed, or the heartbeat lost to a full queue)
    has ended once its socket is gone and :func:`job_over` says so, for :data:`_GONE_S`."""
    for source in sources:
        if source.job is None or source.done or source.sock is None:
            continue
        if not source.ends and not source.discovered:
            continue  # --follow: a job that is gone may start again
        there = socket_identity(source.endpoint) is not None
        source.seen = source.seen or there
        if there or not source.seen or not job_over(source.job):
            source.gone_since = None
            continue
        if source.gone_since is None:
            source.gone_since = now
        elif now - source.gone_since >= _GONE_S:
            for sock in [s for s, src in sub.sources.items() if src is source]:
                sub.drain(sock, None)  # whatever arrived before it went
            if source.sock is not None:
                sub.end(source, f"shmstat subscribe: job {source.job} ended without its collector's final "
                                "heartbeat (its last messages may be missing)")
