"""One publish socket for subscribers (``XPUB``): bound owner-only, the topics its subscribers asked for, and
messages sent without ever blocking the collector's loop.

A job's :class:`~collector.relay.relay.Relay` owns one, at the job's endpoint; a node collector that publishes every
job it serves on one endpoint (``shmstat collect --publish ENDPOINT`` without ``--job``) owns one more, which every
job's relay sends on too, each message followed by the frame naming its job (:mod:`shmstat.wire`). Both are bounded
the same way: a subscriber's queue holds at most ``sndhwm`` messages; a message that finds a subscriber's queue
full is reported (``XPUB_NODROP``), so the sender counts it, and is then handed to the other subscribers
(libzmq then skips that subscriber without a word until it has read half its queue: what it lost, a subscriber that
can send reports, :attr:`Outlet.lost`); past
:data:`~collector.relay.subscriptions.MAX_PREFIXES` subscription topics the socket is bound anew at the same
endpoint (every subscriber reconnects and subscribes again), counted in :attr:`Outlet.resets`. With a
:class:`~collector.relay.curve.CurveServer` every socket it binds is a CURVE server, secured before it is bound, and
:meth:`Outlet.cut_off_revoked` binds it anew when a client key was removed. The socket is made and bound in one
place, :meth:`Outlet._bind`.
"""

from __future__ import annotations

import contextlib
import time

import zmq

from shmstat import wire

from .curve import CurveServer
from .subscriptions import bind_owner_only, configure_xpub, remove_ipc_file, take_subscriptions, wants_topic

__all__ = ["MAX_MESSAGE_BYTES", "Outlet"]

_SEND = zmq.backend.Socket.send  # pyzmq's own send, below its Python wrapper (which adds options never used here)
_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)

MAX_MESSAGE_BYTES = 2 * wire.MAX_EVENT_BYTES
"""The largest message a rank may send, and the largest the collector makes (its publisher seals batches far
below; one event is at most :data:`shmstat.wire.MAX_EVENT_BYTES`)."""


class Outlet:
    """An ``XPUB`` bound at ``endpoint`` (the real port once bound to port 0: :attr:`endpoint`), with the
    prefixes its subscribers asked for. Single-threaded. Raises :class:`zmq.ZMQError` if it cannot bind."""

    def __init__(self, ctx: zmq.Context, endpoint: str, sndhwm: int, *, curve: CurveServer | None = None) -> None:
        self.ctx = ctx
        self.sndhwm = sndhwm
        self.curve = curve
        self.prefixes: set[bytes] = set()
        """Topic prefixes some subscriber asked for (what libzmq reports: a prefix appears with its first
        subscriber and goes with its last)."""
        self.resets = 0
        """Times the socket was bound anew because its subscribers asked for too many topics."""
        self.lost: dict[str, dict[str, int]] = {}
        """``{job: {kind: items}}`` its subscribers reported lost (:func:`shmstat.wire.heartbeat.encode_loss_report`),
        not yet taken by a relay (:meth:`take_lost`)."""
        self.sock = self._bind(endpoint)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _bind(self, endpoint: str, retry_s: float = 0.0) -> zmq.Socket:
        """A new publish socket with its bounds (:func:`~collector.relay.subscriptions.configure_xpub`), CURVE if
        asked for, bound owner-only at ``endpoint``; the one place a publish socket is made."""
        sock = self.ctx.socket(zmq.XPUB)
        try:
            configure_xpub(sock, self.sndhwm)
            if self.curve is not None:
                self.curve.secure(sock)
            bind_owner_only(sock, endpoint, retry_s=retry_s)
        except BaseException:
            self._close_socket(sock, 0)
            raise
        return sock

    def _close_socket(self, sock: zmq.Socket, linger_ms: int) -> None:
        if self.curve is not None:
            self.curve.release(sock)
        with contextlib.suppress(Exception):
            sock.close(linger=linger_ms)

    def rebind(self) -> None:
        """Drop every subscriber (and libzmq's subscription state with them) by binding a fresh socket at the same
        endpoint; well-behaved subscribers reconnect and subscribe again."""
        self._close_socket(self.sock, 0)
        remove_ipc_file(self.endpoint)
        self.prefixes.clear()
        # a TCP port is released by libzmq's I/O thread a moment after close: wait for it
        self.sock = self._bind(self.endpoint, retry_s=2.0)

    def cut_off_revoked(self) -> bool:
        """With CURVE: bind anew if a client key that was allowed is gone (its holder is cut off, the others
        reconnect); True if so. Counted in the CURVE server's ``counts.revocations``."""
        if self.curve is None or not self.curve.revoked():
            return False
        self.rebind()
        return True

    def update(self) -> bool:
        """Take the (un)subscribe frames queued (a bounded number per call); True if there were too many topics
        and the socket was bound anew."""
        if not take_subscriptions(self.sock, self.prefixes, self.lost):
            return False
        self.resets += 1
        self.rebind()
        return True

    def take_lost(self, job: str | None = None) -> dict[str, int]:
        """The items per kind that subscribers reported lost since the last call: of ``job``'s messages (on a node
        outlet), or of every message (None: a job's own outlet carries one job)."""
        if job is not None:
            return self.lost.pop(job, {})
        total: dict[str, int] = {}
        for counts in self.lost.values():
            for kind, n in counts.items():
                total[kind] = total.get(kind, 0) + n
        self.lost.clear()
        return total

    def wants(self, topic: str) -> bool:
        """Whether a subscriber would receive a message on ``topic`` (or, for a topic ending in ``/``, on some
        topic under it)."""
        return wants_topic(self.prefixes, topic)

    def send(self, frames: list[bytes], tail: bytes | None = None) -> bool:
        """Send without blocking (``frames``, then ``tail`` as one more frame if given); False when a subscriber's
        queue was full (it lost the message, the others got it)."""
        sock, send = self.sock, _SEND
        last = len(frames) - 1
        first = _MORE if last > 0 or tail is not None else _LAST
        try:  # frame by frame with plain int flags: pyzmq's send_multipart cost 5x more
            send(sock, frames[0], first)
        except zmq.Again:  # a subscriber's queue looks full (only the first frame of a message can find it so)
            try:
                # libzmq learns of what subscribers read from commands it takes at most once a millisecond on a
                # send: asking EVENTS takes them now, so a queue read meanwhile is not taken for a full one
                sock.get(_EVENTS)
                send(sock, frames[0], first)
            except zmq.Again:  # full: give it to the others
                self._send_lossy(frames if tail is None else [*frames, tail])
                return False
        for i in range(1, last):
            send(sock, frames[i], _MORE)
        if tail is None:
            if last > 0:
                send(sock, frames[last], _LAST)
        else:
            if last > 0:
                send(sock, frames[last], _MORE)
            send(sock, tail, _LAST)
        return True

    def _send_lossy(self, frames: list[bytes]) -> None:
        """Give a message that found a subscriber's queue full to the others."""
        self.sock.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        finally:
            self.sock.setsockopt(zmq.XPUB_NODROP, 1)

    def send_patiently(self, frames: list[bytes], deadline: float) -> bool:
        """:meth:`send`, waiting until ``deadline`` (:func:`time.monotonic`) for a full queue to make room first
        (for a collector's last message); False when a subscriber lost it."""
        while time.monotonic() < deadline:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.Again:
                time.sleep(0.005)
        return self.send(frames)

    def offer(self, frames: list[bytes]) -> None:
        """Send again to whoever has room now (a repeat for subscribers that overflowed: nothing is counted)."""
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart(frames, zmq.NOBLOCK)

    def close(self, linger_ms: int = 1000) -> None:
        """Close the socket (what was sent last gets ``linger_ms`` to leave) and remove its ``ipc://`` file."""
        self._close_socket(self.sock, linger_ms)
        remove_ipc_file(self.endpoint)
