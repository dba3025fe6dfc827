"""The publisher's socket protocol: the thread that owns the ``XPUB`` socket, sends sealed batches without
blocking, reads the collector's subscription and hand-over frames, and marks the end of what it sent.

These are the publisher thread's methods (a mixin of :class:`shmstat.publisher.Publisher`, which owns the
state they use; the module docstring of :mod:`shmstat.publisher` says what the ``XPUB`` reports and why).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import zmq

from . import wire
from .backlog import _GONE, _Batch
from .errors import WireError
from .runtime import env_number

__all__ = ["DEFAULT_SNDHWM", "DEFAULT_UNCOLLECTED_WARNING_S", "unacked_warning_from_env"]

_log = logging.getLogger("shmstat")

DEFAULT_SNDHWM = 64
"""zmq's send high-water mark, in messages (each message batches up to ``batch_max`` items and, except for one
large event, at most :data:`MAX_BATCH_BYTES`): what waits inside zmq stays within ~16 MiB, the rest is in the
publisher's own byte-bounded backlog, where a drop is counted and numbered."""

_MAX_IDLE_SLEEP_S = 0.02

_WARNED_UNCOLLECTED = False  # the uncollected-events warning is said once per process
DEFAULT_UNCOLLECTED_WARNING_S = 10.0


def unacked_warning_from_env() -> float:
    """Seconds after the first publish with no collector before the warning (``SHMSTAT_UNCOLLECTED_WARNING_S``,
    default 10); a bad value is a ConfigError."""
    seconds = env_number("SHMSTAT_UNCOLLECTED_WARNING_S", 0, 86400, "seconds")
    return DEFAULT_UNCOLLECTED_WARNING_S if seconds is None else seconds


class _SocketProtocol:
    """The thread side of the socket (mixed into the publisher)."""

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        sleep_s = self._idle_sleep_s
        failures = 0
        try:
            while True:
                try:
                    progressed = self._step(sock)
                except zmq.ContextTerminated:
                    return
                except Exception:  # the thread must survive anything
                    failures += 1
                    if failures == 1:
                        _log.exception("shmstat: unexpected error in the publisher thread (continuing)")
                    progressed = False
                if self._stop:
                    return
                if not self._ever_subscribed:
                    self._check_uncollected()
                if progressed:
                    sleep_s = self._idle_sleep_s
                    if self._q:
                        continue  # more work right now
                    wait_s = sleep_s  # items are flowing: let the next ones gather into a batch
                else:
                    wait_s = sleep_s  # idle: back off up to _max_sleep_s
                    sleep_s = min(sleep_s * 2, self._max_sleep_s)
                if self._pending and not self._subscribed:
                    # only a subscription frame can unblock the backlog: wait on the socket
                    sock.poll(max(1, int(wait_s * 1000)), zmq.POLLIN)
                elif self._wake.wait(wait_s):
                    self._wake.clear()
        finally:
            if self._subscribed and not self._pending:
                self._send_held(sock)  # all sent: the collector need not wait for more from us
                self._await_ack(sock, self._close_linger_ms)
            elif self._subscribed:
                # closing with items left: they are dropped, and the marker carries the sequence number after
                # them, so the collector counts them as a gap (sealed batches are numbered already)
                self._send_held(sock, self._wire_seq + len(self._q) + (self._overflow - self._overflow_numbered)
                                + sum(b.skip or len(b.items) for b in self._pending if b.frames is None))
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=self._close_linger_ms)

    def _step(self, sock: zmq.Socket[Any]) -> bool:
        """One round: subscriptions, flush requests, take queued items, send. True if anything moved."""
        waiting = len(self._q)
        bounded = self._append == self._append_bounded
        if (not bounded and waiting > self._backlog_limit // 2) or (bounded and waiting < self._backlog_limit // 4):
            with self._lock:  # close() swaps in _drop_late under the same lock
                if not self._closed and not self._dead:
                    self._append = self._q.append if bounded else self._append_bounded
        if sock.get(zmq.EVENTS) & zmq.POLLIN:
            self._read_subscriptions(sock)
        requests = self._flush_requests
        while requests:
            req = requests.popleft()
            req.target = self._next_seq + len(self._q)
            self._flush_waiting.append(req)
        progressed = self._take()
        if self._subscribed and self._pending and self._send(sock):
            progressed = True
        if self._flush_waiting:
            self._resolve_flushes()
        return progressed

    def _read_subscriptions(self, sock: zmq.Socket[Any]) -> None:
        prefixes = self._prefixes
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame[:1] == b"\x01":
                prefixes.add(frame[1:])
                self._handed_over = False
            elif frame[:1] == b"\x00":
                prefixes.discard(frame[1:])
            elif frame == wire.HANDOVER_REQUEST and not self._handed_over:
                if self._subscribed:
                    self._send_held(sock)
                self._handed_over = True
            self._subscribed = b"" in prefixes and not self._handed_over  # the collector subscribes to all
            if self._subscribed:
                self._ever_subscribed = True

    def _check_uncollected(self) -> None:
        """Warn once per process when no collector has taken this publisher's items in time."""
        global _WARNED_UNCOLLECTED
        if _WARNED_UNCOLLECTED or time.monotonic() - self._first_publish < self._unacked_warning_s:
            return
        _WARNED_UNCOLLECTED = True
        job = self.job or "?"
        _log.warning(
            "shmstat: no collector has taken the events of job %s (rank %s) within %g s of the first one; "
            "they wait in this process (up to the backlog bound, then dropped and counted) and stats keep "
            "accumulating in shared memory. Collect them with: shmstat collect  (every job on this node) or "
            "shmstat collect --job %s", job, self.rank, self._unacked_warning_s, job)

    def _await_ack(self, sock: zmq.Socket[Any], budget_ms: int) -> None:
        """Wait up to ``budget_ms`` for the collector's acknowledgement of our marker: everything sent before it
        has been received, so closing the socket now loses nothing."""
        ack = wire.ACK_PREFIX + str(self.pid).encode()
        deadline = time.monotonic() + budget_ms / 1000
        with contextlib.suppress(zmq.ZMQError):
            while (left := deadline - time.monotonic()) > 0:
                if sock.poll(max(1, int(left * 1000)), zmq.POLLIN) and sock.recv(zmq.NOBLOCK) == ack:
                    return

    def _send_held(self, sock: zmq.Socket[Any], next_seq: int | None = None) -> None:
        """Tell the collector that everything sent before has been sent: the marker travels behind it in the
        same pipe. Sent when a collector that shuts down unsubscribes (from then on items are held for the
        next one) and when this publisher closes with nothing left."""
        seq = self._wire_seq if next_seq is None else next_seq
        payload = wire.encode("rank", self.rank, self.pid, self.incarnation, seq, [{"state": "held"}])
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([wire.HELD_TOPIC, payload], zmq.NOBLOCK)

    def _send(self, sock: zmq.Socket[Any]) -> bool:
        """Send pending batches in order until zmq says EAGAIN; True if at least one message left."""
        pending = self._pending
        sent = False
        while pending:
            batch = pending[0]
            if batch.skip:  # dropped items: their sequence numbers are skipped here
                self._wire_seq += batch.skip
                pending.popleft()
                continue
            if batch.frames is None:
                batch.first_seq = self._wire_seq  # sealed now: numbered in send order
                self._wire_seq += len(batch.items)
                good = self._encode(batch)
                if good is not None:
                    batch.frames = _GONE
                    pending.popleft()
                    pending.extendleft(reversed(good))
                    self._held_bytes -= batch.nbytes - sum(part.nbytes for part in good)
                if not pending:
                    break
                batch = pending[0]
                if batch.frames is None:  # pragma: no cover - _encode always seals what it returns
                    continue
            try:
                sock.send_multipart(batch.frames, zmq.NOBLOCK)
            except zmq.Again:
                break
            pending.popleft()
            n = len(batch.items)
            self._held -= n
            self._held_bytes -= batch.nbytes
            self._sent_items += n
            self._sent_messages += 1
            sent = True
        return sent

    def _encode(self, batch: _Batch) -> list[_Batch] | None:
        """Seal ``batch`` with its frames; None if it encoded as is, else the encodable parts (in order)."""
        try:
            topic_b = batch.topic.encode("utf-8")
        except (UnicodeEncodeError, AttributeError):
            topic_b = b""
        if not topic_b or len(topic_b) > wire.MAX_TOPIC:
            self._give_up(len(batch.items), f"topic {batch.topic!r} is not sendable")
            return []
        try:
            payload = wire.encode(batch.kind, self.rank, self.pid, self.incarnation, batch.first_seq, batch.items)
        except WireError as exc:
            if len(batch.items) == 1:
                self._give_up(1, str(exc))
                return []
            half = len(batch.items) // 2
            out: list[_Batch] = []
            for first_seq, items in (
                (batch.first_seq, batch.items[:half]),
                (batch.first_seq + half, batch.items[half:]),
            ):
                part = _Batch(batch.topic, batch.kind, batch.taken, items, first_seq)
                part.nbytes = batch.nbytes * len(items) // len(batch.items)
                sub = self._encode(part)
                out.extend([part] if sub is None else sub)
            return out
        batch.frames = (topic_b, payload)
        return None
