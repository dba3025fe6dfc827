"""A stand-in for the collector's ingest side in rank-side tests: a real XSUB socket, decoding with the wire."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from shmstat import wire


class FakeCollector:
    """The collector's ingest side: an XSUB bound at an ipc endpoint, subscribed to everything."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XSUB)
        self.sock.bind(endpoint)
        self.sock.send(b"\x01")
        self.seen: list[wire.WireMessage] = []

    def receive_until(self, done: Callable[[list[wire.WireMessage]], bool], timeout_s: float = 10.0) -> None:
        """Receive and decode messages until ``done(self.seen)`` holds; fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not done(self.seen):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out; received {[m.topic for m in self.seen]}")
            if self.sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                topic, payload = self.sock.recv_multipart()
                self.seen.append(wire.decode(topic, payload))

    def items(self, topic: str) -> list[Any]:
        """Every item received under ``topic``."""
        return [item for m in self.seen if m.topic == topic for item in m.items]

    def has(self, topic: str) -> Callable[[list[wire.WireMessage]], bool]:
        """A ``done`` predicate: a message with ``topic`` was received."""
        return lambda seen: any(m.topic == topic for m in seen)

    def close(self) -> None:
        """Close the socket and its context."""
        self.sock.close(linger=0)
        self.ctx.term()
