"""``shmstat subscribe``: tail one or more collectors' streams as JSON lines on stdout."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import zmq

from shmstat import wire
from shmstat.errors import ConfigError, WireError
from shmstat.shm.shm_entries import Skipped, entry_problem

__all__ = ["message_to_json", "subscribe"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def message_to_json(msg: wire.WireMessage, endpoint: str) -> str:
    """One JSON line for a decoded message: topic, kind, rank, pid, incarnation, seq, items, source."""
    return json.dumps(
        {"topic": msg.topic, "kind": msg.kind, "rank": msg.rank, "pid": msg.pid, "incarnation": msg.incarnation,
         "seq": msg.seq, "items": _jsonable(msg.items), "source": endpoint},
        allow_nan=False,
    )


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


def subscribe(
    endpoints: Sequence[str], *, topics: Sequence[str] = (), count: int | None = None,
    timeout_s: float | None = None, out: IO[str] | None = None,
) -> int:
    """Print every message from ``endpoints`` whose topic starts with one of ``topics`` (all if none).

    Stops after ``count`` messages or ``timeout_s`` seconds if given, else on Ctrl-C. Malformed messages are
    counted on stderr at the end, never printed as data. An ``ipc://`` endpoint whose path is not this user's
    socket is skipped with one line (none left: :class:`ConfigError`). Returns the exit status.
    """
    out = out if out is not None else sys.stdout
    if count is not None and count < 1:
        raise ConfigError(f"--count must be at least 1, got {count}")
    usable = [ep for ep in endpoints if _usable(ep)]
    if not usable:
        raise ConfigError(f"no endpoint to subscribe to: {', '.join(endpoints)} skipped")
    endpoints = usable
    ctx = zmq.Context()
    socks: dict[zmq.Socket, str] = {}
    poller = zmq.Poller()
    try:
        for ep in endpoints:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1)
            try:
                sock.connect(ep)
            except zmq.ZMQError as exc:
                sock.close()
                raise ConfigError(f"cannot connect to {ep!r}: {exc}") from None
            for t in topics or [""]:
                sock.setsockopt(zmq.SUBSCRIBE, t.encode("utf-8"))
            socks[sock] = ep
            poller.register(sock, zmq.POLLIN)
        seen = bad = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while count is None or seen < count:
            wait = 200 if deadline is None else max(0, min(200, int((deadline - time.monotonic()) * 1000)))
            if deadline is not None and time.monotonic() >= deadline:
                break
            for sock, _ in poller.poll(wait):
                while count is None or seen < count:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = wire.decode_frames(frames)
                    except WireError:
                        bad += 1
                        continue
                    out.write(message_to_json(msg, socks[sock]) + "\n")
                    seen += 1
                out.flush()
        if bad:
            print(f"shmstat subscribe: {bad} malformed messages skipped", file=sys.stderr)
        if seen == 0:
            print(f"shmstat subscribe: nothing received from {', '.join(endpoints)} (is a collector running there?)",
                  file=sys.stderr)
        if count is not None and seen < count:
            print(f"shmstat subscribe: {seen} of {count} messages received before the timeout", file=sys.stderr)
            return 1
        return 0
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
