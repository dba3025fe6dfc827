"""The relay: ranks' messages in on XSUB, everything out on XPUB for subscribers.

The XSUB socket is bound at the job's ``ipc://`` path in the owner-only runtime directory and subscribes to
everything upstream, so every rank's publisher sees a subscriber and releases its backlog. Each frame pair is
validated as :func:`shmstat.wire.decode` would (:func:`collector.relay.intake.inspect`: event and metric messages by
the optional C check, without decoding their items); valid messages are re-published unchanged, invalid ones
are counted and dropped. The XPUB socket binds the job's ``ipc://`` publish path in the same owner-only directory
by default (a TCP port, even on loopback, is readable by every local user). Memory stays bounded in bytes: a
rank's message is at most :data:`MAX_MESSAGE_BYTES` (larger ones are refused by zmq), and so is every message
the collector makes (:meth:`Relay.publish` splits a larger one), so a subscriber's queue of at most ``sndhwm``
messages (libzmq counts messages, not bytes) holds at most ``sndhwm * MAX_MESSAGE_BYTES`` bytes. A slow
subscriber loses its own messages past it: the XPUB runs with ``XPUB_NODROP``, so a message that finds a
subscriber's queue full comes back (``zmq.Again``), is counted per kind in :attr:`RelayCounters.queue_full` and
is then handed to the other subscribers (lossy send); libzmq then offers that subscriber nothing until it has
read half its queue, unseen here. What each subscriber lost, it learns exactly from the heartbeats
(:mod:`collector.relay.heartbeats`, :mod:`shmstat.wire.heartbeat`), and one that can send (``shmstat subscribe``)
reports it upstream: the relay adds those reports up in :attr:`RelayCounters.subscriber_lost`. A subscription topic is
at most :data:`~collector.relay.subscriptions.MAX_SUBSCRIPTION_BYTES`, and past
:data:`~collector.relay.subscriptions.MAX_PREFIXES` distinct topics (kept by that module) the publish socket is
bound anew (every subscriber reconnects and subscribes again, counted in ``subscription_resets``), so a flood of
subscriptions from a local client neither grows the
collector nor starves its loop. The publish socket, its topics and its bounds are an
:class:`~collector.relay.publish_socket.Outlet`; a node collector that publishes every job on one endpoint hands each
job's relay its own outlet too (``node``), on which every message goes out with a third frame naming the job
(:mod:`shmstat.wire`), heartbeats included. With a key directory (``curve``) the job's outlet is a CURVE server
that lets in only the subscribers holding a client key of it (:mod:`collector.relay.curve`); once per heartbeat
interval a revoked key makes it bind anew, cutting that subscriber off.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import zmq

from shmstat import wire
from shmstat.errors import CollectorError, WireError
from shmstat.wire.delivered import SYNC_STATE, encode_delivered

from .._backend import intake_check
from .curve import CurveServer, HandshakeCounts
from .heartbeats import SenderBook
from .intake import Received, inspect_with
from .publish_socket import MAX_MESSAGE_BYTES, Outlet
from .subscriptions import bind_owner_only, remove_ipc_file

__all__ = ["Relay", "RelayCounters"]

_MAX_BATCH = 2048
_MAX_BATCH_ITEMS = 16_384  # items per receive() call: bounds a round's time and the memory its messages hold
_MAX_TRACKED = 100_000  # (rank, pid, incarnation) sequences followed at most

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: zmq's enums cost more than the call
_NOBLOCK = int(zmq.NOBLOCK)
_HELD_TOPIC = wire.HELD_TOPIC
_BUNCH = 64
"""Messages checked, then sent on in one go, then yielded (see :meth:`Relay.receive`)."""
_BUNCH_BYTES = 4 << 20
"""...and at most about this many bytes of them held at once."""
SUBSCRIPTION_LOOK_S = 0.02
"""How often a relay takes the subscription frames its publish sockets queued (a subscriber that subscribes is
served from at most this much later; every frame is taken, bounded per look: :mod:`collector.relay.subscriptions`)."""
_OVERFLOW_KINDS: tuple[str, ...] = (*wire.KINDS, wire.HEARTBEAT_KIND)


@dataclass
class RelayCounters:
    """What went through the relay."""

    messages: int = 0
    events: int = 0
    metrics: int = 0
    rejected: int = 0
    published: int = 0
    gaps: int = 0
    """Items missing according to per-rank sequence numbers (dropped by a rank or lost on the way)."""
    resent: int = 0
    """Items a rank sent again (it re-sends what no collector acknowledged) that were delivered already, or that
    arrived before its re-sync marker (they come again behind it): dropped, not lost."""
    subscription_resets: int = 0
    """Times the publish socket was bound anew because subscribers asked for too many topics."""
    queue_full: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_OVERFLOW_KINDS, 0))
    """Per kind (``event``, ``metric``, ``stat``, ``rank``, ``heartbeat``): times a message found a subscriber's
    queue full (that subscriber lost it, and goes on losing, unseen here, until it has read half its queue: not
    a count of what it lost, see :attr:`subscriber_lost`); on the job's endpoint or on the node's."""
    subscriber_lost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(wire.KINDS, 0))
    """Per data kind: items subscribers reported lost on the way to them, exactly as their heartbeats showed
    (:func:`shmstat.wire.heartbeat.encode_loss_report`; ``shmstat subscribe`` reports, a plain ``SUB`` cannot),
    summed over subscribers; on the job's endpoint or on the node's."""
    handshakes: HandshakeCounts = field(default_factory=HandshakeCounts)
    """With CURVE: handshakes refused and failed, and revocations (:class:`collector.relay.curve.HandshakeCounts`)."""


class Relay:
    """Owns the collector's two sockets; single-threaded (the collector loop calls it). ``node``: a node
    collector's outlet, which every message also goes out on, followed by the frame ``job`` (the relay's sockets
    are then made in the outlet's context, and the relay leaves it to its owner)."""

    def __init__(self, ingest: str, publish: str, *, pid: int | None = None, sndhwm: int = 1000,
                 rcvhwm: int = 8, heartbeat_interval_s: float = 1.0, node: Outlet | None = None,
                 job: str, curve: str | None = None) -> None:
        # a node collector's relays share its context: one libzmq I/O thread for every socket of the node, which
        # cost a third less than one per context (each woken for its own sockets); CURVE keeps its own (its ZAP
        # handler is one per context)
        shared = node.ctx if node is not None and curve is None else None
        self._own_ctx = shared is None
        self.ctx = shared if shared is not None else zmq.Context()
        self.counters = RelayCounters()
        self.curve: CurveServer | None = None  # with a key directory: CURVE on the job's publish socket
        self.pid = os.getpid() if pid is None else pid
        self.book = SenderBook(self.pid, _MAX_TRACKED)  # every sender's newest seq and items, for heartbeats
        self.heartbeat_interval_s = heartbeat_interval_s
        self._next_beat = 0.0
        self._seq = 0
        self._next_seq: dict[tuple[int, int, int], int] = {}
        self.node = node
        self._job = job
        self._job_frame = [job.encode("utf-8")]
        self.outlet: Outlet | None = None
        self.xsub = self.ctx.socket(zmq.XSUB)
        self.xsub.setsockopt(zmq.LINGER, 500)
        # Both queues are bounded (in messages of at most MAX_MESSAGE_BYTES: a rank's message batches up to 1024
        # items, sealed at 256 KiB; per rank connection RCVHWM messages, per subscriber SNDHWM), so the collector's
        # memory stays bounded when it falls behind the ranks or a subscriber stops reading: past RCVHWM a
        # rank's pipe pushes back (its publisher holds, then drops and counts), past SNDHWM a slow subscriber
        # loses messages (it sees the gap in the per-rank seqs).
        self.xsub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.xsub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            bind_owner_only(self.xsub, ingest)
        except zmq.ZMQError as exc:
            self.close()
            raise CollectorError(f"cannot bind the ingest endpoint {ingest}: {exc}") from None
        self.ingest_endpoint = ingest
        try:
            if curve is not None:
                self.curve = CurveServer(self.ctx, curve, self.counters.handshakes)
            self.outlet = Outlet(self.ctx, publish, sndhwm, curve=self.curve)
        except BaseException as exc:
            self.close()
            if isinstance(exc, zmq.ZMQError):
                raise CollectorError(f"cannot bind the publish endpoint {publish}: {exc}") from None
            raise
        self.ranks_subscribed = False
        """Whether the ranks were asked to send (see :meth:`subscribe_ranks`)."""
        self._check = intake_check()  # the C intake check (None: decode checks), looked up once
        self._next_subscriptions = 0.0
        self.held: set[tuple[int, int, int]] = set()
        """Senders (rank, pid, incarnation) whose hand-over marker arrived (an answer to :meth:`request_handover`, or
        their publisher closed): everything they sent before it has arrived."""
        self._awaiting_sync: set[tuple[int, int, int]] = set()
        self.origins: dict[tuple[int, int, int], int] = {}
        """Each re-syncing sender's publisher id (from its re-sync marker, or restored): the senders whose
        re-sent items are dropped below what is expected, and whose delivered marks are kept."""
        self._first_heard: dict[tuple[int, int, int], int] = {}  # senders heard before their marker: first seq
        self.windows: dict[tuple[int, int, int], list[int]] = {}
        """Per sender, ``[low, high)``: re-sent items to take although below what is expected (a sender heard
        before its marker, whose re-sent items begin earlier than what was heard: see :meth:`_sync`)."""
        self.closed_windows: set[tuple[int, int, int]] = set()
        """Senders whose window closed since the owner last cleared this set."""
        self.touched: set[tuple[int, int, int]] = set()
        """Senders whose expected sequence number moved since the owner last cleared this set."""
        self.on_gap: Callable[[int, int, int, int, int], None] | None = None
        """Called with ``(rank, pid, incarnation, first missing seq, count)`` for every gap found (also counted in
        ``counters.gaps``), on the loop that called :meth:`receive`; the collector keeps gaps for its events sinks."""

    def restore(self, delivered: dict[tuple[int, int, int], tuple[int, int]]) -> None:
        """Take the delivered watermarks a previous collector left (``(rank, pid, incarnation)`` -> (the first
        seq not delivered, the sender's publisher id)): such a sender's messages are dropped until its re-sync
        marker arrives (they come again behind it), then a re-sent item below its watermark is dropped and a hole
        above it is a gap."""
        for key, (seq, origin) in delivered.items():
            self._next_seq[key] = seq
            self.origins[key] = origin
            self._awaiting_sync.add(key)

    def expected(self, key: tuple[int, int, int]) -> int | None:
        """The sequence number expected next from sender ``key`` (every item below it was received, or counted
        as a gap); None for a sender not followed."""
        return self._next_seq.get(key)

    def acknowledge(self, marks: list[tuple[int, int, int, int]]) -> None:
        """Tell the ranks what was delivered: ``(pid, rank, incarnation, delivered)`` per sender
        (:mod:`shmstat.wire.delivered`); a rank forgets the messages it kept below its watermark."""
        for frame in encode_delivered(marks):
            with contextlib.suppress(zmq.ZMQError):
                self.xsub.send(frame, zmq.NOBLOCK)

    @property
    def publish_endpoint(self) -> str:
        """The job's publish endpoint (the real port when bound to port 0)."""
        assert self.outlet is not None
        return self.outlet.endpoint

    @property
    def prefixes(self) -> set[bytes]:
        """Topic prefixes some subscriber of the job's endpoint asked for."""
        assert self.outlet is not None
        return self.outlet.prefixes

    @property
    def subscribed(self) -> bool:
        """Whether anyone subscribed to anything, on the job's endpoint or on the node's."""
        assert self.outlet is not None
        return bool(self.outlet.prefixes) or (self.node is not None and bool(self.node.prefixes))

    def subscribe_ranks(self) -> None:
        """Ask every rank to send everything (until then their publishers hold their items, bounded)."""
        if not self.ranks_subscribed:
            self.xsub.send(b"\x01")
            self.ranks_subscribed = True

    def receive(self, limit: int = _MAX_BATCH, max_items: int = _MAX_BATCH_ITEMS) -> Iterator[Received]:
        """Take up to ``limit`` waiting messages (and about ``max_items`` items) from the ranks: re-publish the
        valid ones and yield them one by one (a generator, so a round never holds more than a few messages' items:
        a rank's message can batch a thousand items, and a backlog of them decoded at once took gigabytes).

        Messages are checked by :func:`collector.relay.intake.inspect` (what :func:`shmstat.wire.decode` accepts,
        without decoding event and metric items): sequence tracking, counters and re-publishing use the header only, and
        a yielded message decodes its ``items`` when the caller reads them. They are taken in bunches of at most
        :data:`_BUNCH` messages (and :data:`_BUNCH_BYTES`): a bunch is checked and tracked, then sent to the
        subscribers in one go (one wake-up of libzmq's I/O thread rather than one per message), then yielded.
        Before each message libzmq is asked whether one waits (EVENTS), which cost less than the ``zmq.Again``
        that ended the round otherwise."""
        c = self.counters
        now = time.monotonic()
        if now >= self._next_subscriptions:  # what subscribes meanwhile is taken at the next look
            self._next_subscriptions = now + SUBSCRIPTION_LOOK_S
            self._drain_subscriptions()
        xsub = self.xsub
        recv, events, check = xsub.recv, xsub.get, self._check
        next_seq, awaiting, book = self._next_seq, self._awaiting_sync, self.book
        bunch: list[Received] = []
        held = 0
        items = 0
        for _ in range(limit):
            if items >= max_items or not cast(int, events(_EVENTS)) & _POLLIN:
                break
            try:  # as frames: their ``more`` is libzmq's flag, where asking RCVMORE went through pyzmq's enums
                first = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            if not first.more:
                c.rejected += 1
                continue
            second = recv(_NOBLOCK, copy=False)
            if second.more:  # more than two frames: not a rank's message
                while recv(_NOBLOCK, copy=False).more:
                    pass
                c.rejected += 1
                continue
            topic, payload = first.bytes, second.bytes
            if topic == _HELD_TOPIC:  # a rank's hand-over marker (see request_handover)
                self._held([topic, payload])
                continue
            try:
                msg = inspect_with(check, topic, payload)
            except WireError:
                c.rejected += 1
                continue
            if msg.kind == wire.HEARTBEAT_KIND:  # the collector's own kind: a rank's would mislead subscribers
                c.rejected += 1
                continue
            n, kind = msg.n_items, msg.kind
            key = (msg.rank, msg.pid, msg.incarnation)
            expected = next_seq.get(key)
            if expected is not None and msg.seq == expected and key not in awaiting:
                # the common case, what _admit and _track_seq find for it: the next items of a sender followed
                end = expected + n
                next_seq[key] = end
                self.touched.add(key)  # (not held in a local: its owner swaps the set between calls)
                book.relayed(key, kind, n, end)
            elif self._admit(msg):
                self._track_seq(msg)
            else:
                continue
            c.messages += 1
            if kind == "event":
                c.events += n
            elif kind == "metric":
                c.metrics += n
            items += n
            bunch.append(msg)
            held += len(payload)
            if len(bunch) >= _BUNCH or held >= _BUNCH_BYTES:
                self._send_bunch(bunch)
                yield from bunch
                bunch = []
                held = 0
        if bunch:
            self._send_bunch(bunch)
            yield from bunch

    def _send_bunch(self, bunch: list[Received]) -> None:
        """Re-publish a bunch of rank messages, unchanged, on the job's outlet and the node's."""
        for msg in bunch:
            self._send([msg.raw_topic, msg.payload], msg.kind)

    def _admit(self, msg: Received) -> bool:
        """Whether a valid message is new: not sent again by a rank that re-syncs (see :meth:`restore`)."""
        key = (msg.rank, msg.pid, msg.incarnation)
        if key in self._awaiting_sync:
            self.counters.resent += msg.n_items
            return False
        if key not in self.origins:  # a sender that never re-synced (none yet, or not a shmstat publisher)
            return True
        expected = self._next_seq.get(key)
        end = msg.seq + msg.n_items
        if expected is not None and end <= expected and msg.seq < expected:
            window = self.windows.get(key)
            if window is not None and window[0] <= msg.seq and end <= window[1]:
                if end == window[1]:
                    del self.windows[key]
                    self.closed_windows.add(key)
                return True
            self.counters.resent += msg.n_items
            return False
        return True

    def _sync(self, key: tuple[int, int, int], first: int, origin: int) -> None:
        """A rank's re-sync marker: what it sends from now on starts at ``first`` (re-sent, then new); ``origin``
        tells a new publisher from the one this key named before (a pid used again)."""
        self._awaiting_sync.discard(key)
        expected = self._next_seq.get(key)
        heard = self._first_heard.pop(key, None)
        if self.origins.get(key, origin) != origin:
            expected = None  # another process under a dead sender's name: it starts afresh
        if len(self.origins) >= _MAX_TRACKED and key not in self.origins:
            self.origins.clear()
        self.origins[key] = origin
        if expected is None:
            if len(self._next_seq) >= _MAX_TRACKED:
                self._next_seq.clear()
            self._next_seq[key] = first
            self.touched.add(key)
        elif first > expected:  # the rank no longer holds what the last collector had not delivered: a gap
            self._gap(key, expected, first - expected)
            self._next_seq[key] = first
            self.book.held(key, first, first - expected)
            self.touched.add(key)
        elif heard is not None and first < heard:
            # heard before its marker (messages a dead collector left in the rank's pipe, when no mark of it
            # was kept): its re-sent items from ``first`` up to what was heard first are still to take
            self.windows[key] = [first, heard]

    def ended(self, key: tuple[int, int, int], end: int, delivered: int, origin: int) -> int:
        """Sender ``key`` is gone, having numbered its items up to ``end`` (its rank entry says so): what never
        arrived — from what is expected of it, or from ``delivered`` (its mark, ``origin`` its publisher's id) for a
        sender not followed — is a gap (counted, and reported to :attr:`on_gap`). An item of it below ``end`` that
        still comes is dropped from now on (counted already). Returns the gap's size."""
        self._awaiting_sync.discard(key)
        self.windows.pop(key, None)
        self.origins.setdefault(key, origin)  # (so its mark follows, and what comes late is dropped)
        expected = self._next_seq.get(key, delivered)
        self._next_seq[key] = max(expected, end)
        self.touched.add(key)
        if end <= expected:
            return 0
        self._gap(key, expected, end - expected)
        self.book.held(key, end, end - expected)
        return end - expected

    def _held(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames[0], frames[1])
        except WireError:
            self.counters.rejected += 1
            return
        key = (msg.rank, msg.pid, msg.incarnation)
        item = msg.items[0] if len(msg.items) == 1 else None
        if isinstance(item, dict) and item.get("state") == SYNC_STATE:
            origin = item.get("origin")
            self._sync(key, msg.seq, origin if type(origin) is int else 0)
            return
        self.held.add(key)
        expected = self._next_seq.get(key)
        if key in self._awaiting_sync:
            # a sender whose re-sync marker has not come yet still keeps every item from its mark on (it re-sends
            # them to the next collector): what it holds is no loss, and its mark must not move past it
            expected = None
        if expected is not None and msg.seq > expected:  # items the rank dropped at the end: a gap
            self._gap(key, expected, msg.seq - expected)
            self._next_seq[key] = msg.seq
            self.book.held(key, msg.seq, msg.seq - expected)
            self.touched.add(key)
        with contextlib.suppress(zmq.ZMQError):
            self.xsub.send(wire.ACK_PREFIX + str(msg.pid).encode(), zmq.NOBLOCK)

    def _track_seq(self, msg: Received) -> None:
        key = (msg.rank, msg.pid, msg.incarnation)
        expected = self._next_seq.get(key)
        dropped = 0
        if expected is not None and msg.seq > expected:
            dropped = msg.seq - expected
            self._gap(key, expected, dropped)
        if expected is None:
            if len(self._next_seq) >= _MAX_TRACKED:
                self._next_seq.clear()  # bounded whatever the senders claim to be (gaps then restart from here)
                self._first_heard.clear()
            if key not in self.origins:
                self._first_heard[key] = msg.seq
        end = msg.seq + msg.n_items
        self._next_seq[key] = end if expected is None or key not in self.origins else max(expected, end)
        self.touched.add(key)
        self.book.relayed(key, msg.kind, msg.n_items, msg.seq + msg.n_items, dropped)

    def _gap(self, key: tuple[int, int, int], first: int, count: int) -> None:
        self.counters.gaps += count
        if self.on_gap is not None:
            self.on_gap(key[0], key[1], key[2], first, count)

    def update_subscriptions(self) -> None:
        """Take the subscription changes the XPUB has queued (also done by every :meth:`receive`)."""
        self._drain_subscriptions()

    def wants(self, topic: str) -> bool:
        """Whether a subscriber of the job's endpoint or of the node's would receive a message on ``topic`` (or,
        for a topic ending in ``/``, on some topic under it); callers skip building what nobody would receive."""
        assert self.outlet is not None
        return self.outlet.wants(topic) or (self.node is not None and self.node.wants(topic))

    def publish(self, topic: str, kind: str, items: list) -> None:
        """Publish collector-made items (stat windows, rank lifecycle) on XPUB, in messages of at most
        :data:`MAX_MESSAGE_BYTES` (a larger batch is split; a single larger item goes alone)."""
        if not items:
            return
        payload = wire.encode(kind, wire.COLLECTOR_RANK, self.pid, 0, self._seq, items)
        if len(payload) > MAX_MESSAGE_BYTES and len(items) > 1:
            half = len(items) // 2
            self.publish(topic, kind, items[:half])
            self.publish(topic, kind, items[half:])
            return
        self._seq += len(items)
        self.book.relayed((wire.COLLECTOR_RANK, self.pid, 0), kind, len(items), self._seq)
        self._send([topic.encode("utf-8"), payload], kind)

    def heartbeat_if_due(self, now: float | None = None) -> None:
        """Publish a heartbeat (:mod:`shmstat.wire.heartbeat`) every ``heartbeat_interval_s`` (``now``:
        :func:`time.monotonic`) if someone listens on its topic."""
        now = time.monotonic() if now is None else now
        if now < self._next_beat:
            return
        self._next_beat = now + self.heartbeat_interval_s
        assert self.outlet is not None
        self.outlet.cut_off_revoked()  # whoever connected with a removed key reconnects, and is refused
        if self.wants(wire.HEARTBEAT_TOPIC):
            for frames in self.book.heartbeat():
                self._send(frames, wire.HEARTBEAT_KIND)

    @property
    def next_beat(self) -> float:
        """When :meth:`heartbeat_if_due` next has something to do (:func:`time.monotonic`)."""
        return self._next_beat

    def final_heartbeat(self, job_ended: bool, wait_s: float = 1.0) -> None:
        """The last heartbeat, as the collector closes (``job_ended``: no rank alive, every window emitted); it
        comes after everything this relay sent, so a subscriber that reads it has had the job's last messages.
        A subscriber whose queue is full gets up to ``wait_s`` to make room for it; after an overflow libzmq
        skips an overflowed subscriber unseen until it has read half its queue, so then the beat is sent again
        every 0.1 s within ``wait_s`` (a repeat tells nothing new: subscribers count it once). On a node outlet
        the beat goes out with the job's frame, as everything else."""
        self._drain_subscriptions()
        outlets = [(outlet, tail) for outlet, tail in self._outlets() if outlet.wants(wire.HEARTBEAT_TOPIC)]
        if not outlets:
            return
        c = self.counters
        deadline = time.monotonic() + wait_s
        beat = self.book.heartbeat(final=True, job_ended=job_ended)
        for frames in beat:
            for outlet, tail in outlets:
                if not outlet.send_patiently(frames + tail, deadline):
                    c.queue_full[wire.HEARTBEAT_KIND] += 1
                c.published += 1
        while any(c.queue_full.values()) and time.monotonic() + 0.1 < deadline:
            time.sleep(0.1)
            for frames in beat:
                for outlet, tail in outlets:
                    outlet.offer(frames + tail)

    def _outlets(self) -> list[tuple[Outlet, list[bytes]]]:
        """Where messages go, each followed by the job's frame: the job's outlet and the node's (if any)."""
        assert self.outlet is not None
        if self.node is None:
            return [(self.outlet, self._job_frame)]
        return [(self.outlet, self._job_frame), (self.node, self._job_frame)]

    def _send(self, frames: list[bytes], kind: str) -> None:
        c = self.counters
        outlet = self.outlet
        assert outlet is not None
        if outlet.prefixes:  # else nobody subscribed: the XPUB would discard it anyway
            if not outlet.send(frames, self._job_frame[0]):
                c.queue_full[kind] = c.queue_full.get(kind, 0) + 1
            c.published += 1
        node = self.node
        if node is not None and node.prefixes:
            if not node.send(frames, self._job_frame[0]):
                c.queue_full[kind] = c.queue_full.get(kind, 0) + 1
            c.published += 1

    def _drain_subscriptions(self) -> None:
        assert self.outlet is not None
        c = self.counters
        if self.outlet.update():  # past MAX_PREFIXES topics: bound anew, every subscriber reconnects
            c.subscription_resets += 1
        reported = [self.outlet.take_lost()]
        if self.node is not None:
            self.node.update()  # its resets are the node's (Outlet.resets)
            reported.append(self.node.take_lost(self._job))
        for counts in reported:
            for kind, n in counts.items():
                c.subscriber_lost[kind] = c.subscriber_lost.get(kind, 0) + n

    def request_handover(self) -> None:
        """Ask every rank to stop sending (:data:`shmstat.wire.HANDOVER_REQUEST`): their publishers answer with
        a marker behind their last message (recorded in :attr:`held`) and hold new items (bounded, counted)
        for the next collector. Messages already on their way still arrive: take them with :meth:`receive`."""
        with contextlib.suppress(zmq.ZMQError):
            self.xsub.send(wire.HANDOVER_REQUEST, zmq.NOBLOCK)
        self.ranks_subscribed = False

    def hand_over(self, live_ranks: Callable[[], set[tuple[int, int, int]]], budget_s: float = 3.0,
                  quiet_s: float = 0.1) -> Iterator[Received]:
        """Before closing: ask the ranks for the hand-over and yield what they sent before answering.

        Every publisher answers with a marker behind its last message (a closed one sent it already). Waits for
        the markers of ``live_ranks()`` (``(rank, pid, incarnation)`` of ranks alive and registered), asking
        again every 50 ms for one that connected meanwhile, and for ``quiet_s`` of silence if some other sender
        has not answered; at most ``budget_s``. Then unsubscribes (a rank connecting now is not asked to send)
        and yields the stragglers.
        """
        self.request_handover()
        start = asked = time.monotonic()
        deadline, quiet_since = start + budget_s, start
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        while True:
            got = False
            for msg in self.receive(limit=100_000, max_items=1 << 62):
                got = True
                yield msg
            now = time.monotonic()
            if got:
                quiet_since = now
            unmarked = self.senders() - self.held
            waiting = bool(unmarked & live_ranks())
            if not unmarked or (not waiting and now - quiet_since >= quiet_s) or now >= deadline:
                break
            if waiting and now - asked >= 0.05:
                self.request_handover()  # idempotent for ranks that answered already
                asked = now
            poller.poll(5)
        self.unsubscribe()
        while poller.poll(20) and time.monotonic() < deadline + 1.0:
            yield from self.receive(limit=100_000, max_items=1 << 62)

    def unsubscribe(self) -> None:
        """Withdraw the subscription: a rank that connects from now on is not asked to send."""
        with contextlib.suppress(zmq.ZMQError):
            self.xsub.send(b"\x00", zmq.NOBLOCK)
        self.ranks_subscribed = False

    def senders(self) -> set[tuple[int, int, int]]:
        """Every (rank, pid, incarnation) that sent this collector something (a sender whose mark was restored
        counts once its re-sync marker arrived)."""
        return set(self._next_seq) - self._awaiting_sync

    def close(self) -> None:
        """Unsubscribe (so ranks hold their items in their own counted backlog again), close the sockets."""
        if getattr(self, "xsub", None) is not None:
            self.unsubscribe()
        # what subscribers were sent last (the final windows) gets a second to leave; a stuck one costs that
        if getattr(self, "xsub", None) is not None:
            with contextlib.suppress(Exception):
                self.xsub.close(linger=200)
        if self.outlet is not None:
            self.outlet.close(linger_ms=1000)  # its socket file goes too
        if self.curve is not None:
            self.curve.close()  # the ZAP handler's sockets, before the context ends
        with contextlib.suppress(Exception):
            if self._own_ctx:
                self.ctx.term()
        endpoint = getattr(self, "ingest_endpoint", None)
        if endpoint:
            remove_ipc_file(endpoint)  # a clean exit leaves no socket file behind

