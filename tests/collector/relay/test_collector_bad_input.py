"""Bad input on the collector's ingest socket: every malformed frame is counted as rejected, nothing stops it.

Real collector (driven step by step with an injected clock), real ipc socket, frames sent by a raw ZeroMQ
socket the way a broken or hostile rank would; hypothesis generates the random ones.
"""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.handlers.user import Recording
from kit.support import FakeClock, step_and_wait, unique_job, wait_for

from collector import Collector, CollectorConfig
from collector.relay.publish_socket import MAX_MESSAGE_BYTES
from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init, shutdown
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat


class _Rig:
    """A collector and a raw sender connected to its ingest socket (subscription seen before any send)."""

    def __init__(self) -> None:
        self.job = unique_job("bad")
        self.clock = FakeClock()
        self.rec = Recording()
        self.collector = Collector(CollectorConfig(job=self.job, grace_ms=0, clock=self.clock),
                                   handler_objects={"*": self.rec})
        step_and_wait(self.collector)
        self.ctx = zmq.Context()
        self.sender = self.ctx.socket(zmq.XPUB)
        self.sender.setsockopt(zmq.LINGER, 0)
        self.sender.connect(self.collector.ingest_endpoint)

        def subscribed() -> bool:
            self.collector.step(5)
            return bool(self.sender.poll(0)) and self.sender.recv() == b"\x01"

        wait_for(subscribed, 10, what="the collector's subscription")

    def send_and_count(self, frames: list[bytes]) -> int:
        """Send one multipart message; step the collector until it was taken; return the rejected delta."""
        counters = self.collector.relay_counters
        before = counters.rejected + counters.messages
        rejected = counters.rejected
        self.sender.send_multipart(frames)
        wait_for(lambda: self.collector.step(1) or counters.rejected + counters.messages > before, 10,
                 what="the collector to take the message")
        return counters.rejected - rejected

    def close(self) -> None:
        self.sender.close(0)
        self.ctx.term()
        self.collector.close()
        shutdown()
        Segment.unlink(self.job)


@pytest.fixture(scope="module")
def rig():
    r = _Rig()
    yield r
    r.close()


def _valid(kind="event", **over):
    body = {"v": 1, "k": kind, "r": 0, "p": 1, "i": 1, "s": 0, "items": [["e", 1, {"x": 1}]]}
    body.update(over)
    return msgpack.packb(body)


CRAFTED = [
    [b"event/e"],  # one frame
    [b"event/e", _valid(), b"extra"],  # three frames
    [b"\xff\xfe", _valid()],  # topic not UTF-8
    [b"nosuch/e", _valid()],  # unknown topic
    [b"event/e", _valid(v=2)],  # another wire version
    [b"event/e", _valid(v="1")],
    [b"event/e", b"\xc1not msgpack"],
    [b"event/e", _valid()[:-3]],  # truncated
    [b"event/e", msgpack.packb([1, 2, 3])],  # not a map
    [b"event/e", _valid(items=[["e", 1, {"x": [1, 2]}]])],  # nested value
    [b"event/e", _valid(items=[["other", 1, {}]])],  # name does not match the topic
    [b"event/e", _valid(items=[["e", 1, {"\xff": 1}]]).replace(b"\xa2\xc3\xbf", b"\xa2\xff\xfe")],  # bad UTF-8
    [b"event/e", msgpack.packb({"v": 1, "k": "event", "r": 0, "p": 1, "i": 1, "s": 0,
                                "items": [["e", 1, {b"bin": 1}]]}, use_bin_type=True)],
    [b"event/e", msgpack.packb(msgpack.ExtType(1, b"x"))],
    [b"metric/g/n", _valid("metric", items=[["g", "n", "not a number", 1.0]])],
    [b"event/e", b"\x00" * (MAX_MESSAGE_BYTES - 100)],  # under zmq's bound, not msgpack
]


def test_crafted_bad_frames_are_each_rejected_once(rig):
    for frames in CRAFTED:
        assert rig.send_and_count(frames) == 1, frames[:1]


def test_a_message_over_the_size_bound_never_reaches_the_collector_and_it_goes_on(rig):
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.XPUB)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(rig.collector.ingest_endpoint)
    try:
        wait_for(lambda: rig.collector.step(5) or rogue.poll(0), 10, what="the collector's subscription")
        before = rig.collector.relay_counters.messages + rig.collector.relay_counters.rejected
        rogue.send_multipart([b"event/e", b"\x00" * (MAX_MESSAGE_BYTES + 1)])  # zmq drops it and the connection
        assert rig.send_and_count(CRAFTED[0]) == 1  # the collector still takes the next sender's message
        assert rig.collector.relay_counters.messages + rig.collector.relay_counters.rejected == before + 1
    finally:
        rogue.close(0)
        ctx.term()


def test_a_pickle_payload_is_rejected_never_unpickled(rig, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    assert rig.send_and_count([b"event/e", pickle.dumps(Exploit())]) == 1
    assert not marker.exists()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_random_frames_are_rejected(rig, frames):
    assert rig.send_and_count(frames) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=60), flip=st.integers(min_value=0, max_value=255))
def test_truncated_or_corrupted_valid_payloads_never_crash(rig, cut, flip):
    payload = bytearray(_valid())
    payload = payload[: max(0, len(payload) - cut)]
    if payload:
        payload[len(payload) // 2] ^= flip
    before = rig.collector.relay_counters.messages
    rejected = rig.send_and_count([b"event/e", bytes(payload)])
    accepted = rig.collector.relay_counters.messages - before
    assert rejected + accepted == 1


def test_the_collector_keeps_aggregating_after_bad_input(rig):
    for frames in CRAFTED[:5]:
        rig.send_and_count(frames)
    init(rig.job, rank=0, publish=False)
    clock = rig.clock
    clock.to_window(100)
    s = Stat("after", [A.COUNT], 0.1, clock=clock, group="g")
    for _ in range(7):
        s.add(1.0)
    clock.advance_ms(100)
    rig.collector.step()
    assert [m.value for m in rig.rec.got if m.name == "after.count"] == [7.0, 7.0]  # merged and rank 0
    s.close()
    shutdown()
    assert os.path.exists("/dev/shm/shmstat." + rig.job)
