"""The relay's publish side: which topics subscribers asked for (bounded), and its sockets bound owner-only.

Subscribers' (un)subscribe frames queue on the ``XPUB``; :func:`take_subscriptions` keeps the set of prefixes
someone listens to, at most :data:`_MAX_SUBSCRIPTION_FRAMES` frames a round, and says when the set grew past
:data:`MAX_PREFIXES` (the relay then binds its publish socket anew). The loss reports of subscribers that can send
(:func:`shmstat.wire.heartbeat.decode_loss_report`) queue there too: it adds them up per job and kind. Used by
:class:`collector.relay.relay.Relay`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import cast

import zmq

from shmstat.wire.heartbeat import decode_loss_report

__all__ = ["MAX_PREFIXES", "MAX_SUBSCRIPTION_BYTES", "bind_owner_only", "configure_xpub", "remove_ipc_file",
           "take_subscriptions", "wants_topic"]

_MAX_SUBSCRIPTION_FRAMES = 5000  # (un)subscribe frames taken per round: a flood cannot starve the loop

MAX_SUBSCRIPTION_BYTES = 512
"""The longest subscription frame a subscriber may send (a longer one disconnects it)."""
MAX_PREFIXES = 1024
"""Distinct subscription topics at most, over all subscribers; past it the publish socket is bound anew."""


def configure_xpub(sock: zmq.Socket, sndhwm: int) -> None:
    """Set a publish socket's options: ``sndhwm`` messages per subscriber, subscription frames of at most
    :data:`MAX_SUBSCRIPTION_BYTES`, and a full subscriber queue reported (``zmq.Again``) rather than skipped."""
    sock.setsockopt(zmq.LINGER, 500)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES + 1)
    sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full subscriber queue is reported (zmq.Again): see Relay._send


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: zmq's enums cost more than the call


def take_subscriptions(xpub: zmq.Socket, prefixes: set[bytes], lost: dict[str, dict[str, int]]) -> bool:
    """Apply the (un)subscribe frames queued on ``xpub`` to ``prefixes``, and add the loss reports to ``lost``
    (``{job: {kind: items}}``, at most :data:`MAX_PREFIXES` jobs: reports for more are ignored until the caller
    takes its own); True as soon as ``prefixes`` holds more than :data:`MAX_PREFIXES` topics (the rest of the
    frames are left: the caller binds the socket anew)."""
    for _ in range(_MAX_SUBSCRIPTION_FRAMES):
        if not cast(int, xpub.get(_EVENTS)) & _POLLIN:  # nothing queued (asking is far cheaper than a zmq.Again)
            return False
        try:
            frame = xpub.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if frame[:1] == b"\x01":
            prefixes.add(frame[1:])
            if len(prefixes) > MAX_PREFIXES:
                return True
        elif frame[:1] == b"\x00":
            prefixes.discard(frame[1:])
        else:
            report = decode_loss_report(frame)
            if report is not None and (report[0] in lost or len(lost) < MAX_PREFIXES):
                counts = lost.setdefault(report[0], {})
                for kind, n in report[1].items():
                    counts[kind] = counts.get(kind, 0) + n
    return False


def wants_topic(prefixes: set[bytes], topic: str) -> bool:
    """Whether a subscriber of ``prefixes`` would receive a message on ``topic`` (or, for a topic ending in
    ``/``, on some topic under it)."""
    if not prefixes:
        return False
    raw = topic.encode("utf-8")
    return any(raw.startswith(p) or (raw.endswith(b"/") and p.startswith(raw)) for p in prefixes)


def bind_owner_only(sock: zmq.Socket, endpoint: str, retry_s: float = 0.0) -> None:
    """Bind ``sock``; an ``ipc://`` socket file is created owner-only (mode 0600, in a 0700 directory).

    ``retry_s``: for binding again where a socket was just closed, how long to retry while the address is still
    in use (libzmq closes the old listener in its I/O thread, a moment later: a TCP port rebound at once failed
    about once in fifty here)."""
    deadline = time.monotonic() + retry_s
    while True:
        old_umask = os.umask(0o077)
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
        finally:
            os.umask(old_umask)
        time.sleep(0.005)


def remove_ipc_file(endpoint: str) -> None:
    """Remove the socket file of an ``ipc://`` path endpoint (none for others, abstract ``ipc://@`` included)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        with contextlib.suppress(OSError):
            os.unlink(endpoint[len("ipc://"):])
