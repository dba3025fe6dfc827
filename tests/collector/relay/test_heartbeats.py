"""Heartbeats with a real relay and real sockets (a raw socket plays the rank): a subscriber that stopped reading
is told exactly what it lost, at the tail too; senders it joined late are counted from its first heartbeat; a
sender's own drops show; beats stay bounded in size; a rank cannot forge one; the collector's messages are split
under the per-message bound that makes the subscriber queue's byte bound true."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from itertools import pairwise

import msgpack
import pytest
import zmq
from kit.support import wait_for

from collector.relay.heartbeats import SenderBook
from collector.relay.publish_socket import MAX_MESSAGE_BYTES
from collector.relay.relay import Relay
from shmstat import wire
from shmstat.wire.heartbeat import ITEMS_PER_MESSAGE, MAX_LISTED, SENDER_STREAM, GapTracker, followed_kinds

RANK_PID = 4242


class _Rig:
    """A relay, a raw XPUB standing for a rank's publisher, and subscribers of the relay's XPUB."""

    def __init__(self, sndhwm: int = 4) -> None:
        self.dir = tempfile.mkdtemp(prefix="hb-", dir="/tmp")  # Unix socket paths must stay short
        self.relay = Relay(f"ipc://{self.dir}/in", f"ipc://{self.dir}/pub", sndhwm=sndhwm, heartbeat_interval_s=3600,
                           job="heartbeats")
        self.ctx = zmq.Context()
        self.rank = self.ctx.socket(zmq.XPUB)
        self.rank.setsockopt(zmq.LINGER, 0)
        self.rank.connect(self.relay.ingest_endpoint)
        self.relay.subscribe_ranks()
        # the relay's socket takes in the connection when it is used, as the collector's loop does all the time
        wait_for(lambda: (self.relay.xsub.poll(0), self.rank.poll(50))[1], 10, what="the relay's subscription")
        self.rank.recv()
        self.seq = 0
        self.socks: list[zmq.Socket] = []

    def subscriber(self, *topics: bytes, rcvhwm: int = 1) -> zmq.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(self.relay.publish_endpoint)
        for t in topics or (b"",):
            sock.setsockopt(zmq.SUBSCRIBE, t)
        self.socks.append(sock)
        want = set(topics or (b"",))  # distinct from other subscribers' topics, so that this shows it arrived
        wait_for(lambda: (self.relay.update_subscriptions(), want <= self.relay.prefixes)[1], 10,
                 what="the subscription")
        return sock

    def send_events(self, n: int, pad: int = 0, seq: int | None = None, pid: int = RANK_PID) -> None:
        """``n`` events from the rank, one per message, relayed as they arrive."""
        if seq is not None:
            self.seq = seq
        for i in range(n):
            item = ["tick", time.time_ns(), {"i": i, "pad": "x" * pad}]
            self.rank.send_multipart([b"event/tick", wire.encode("event", 0, pid, 0, self.seq, [item])])
            self.seq += 1
        got = 0
        deadline = time.monotonic() + 10
        while got < n and time.monotonic() < deadline:
            self.relay.xsub.poll(20)
            got += sum(1 for _ in self.relay.receive())
        assert got == n

    def beat(self) -> None:
        self.relay._next_beat = 0.0
        self.relay.heartbeat_if_due()

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.rank.close(0)
        self.relay.close()
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def rig() -> Iterator[_Rig]:
    r = _Rig(sndhwm=64)  # room for what these tests send at once: no loss unless a test makes one
    yield r
    r.close()


@pytest.fixture
def tight_rig() -> Iterator[_Rig]:
    r = _Rig(sndhwm=4)  # a queue of 4 messages (libzmq learns of reads in steps of 2: 3 to 4 in practice)
    yield r
    r.close()


def _drain(sock: zmq.Socket, tracker: GapTracker, want: int | None = None, timeout_s: float = 20) -> tuple[int, list]:
    """Read ``sock`` into ``tracker``: until ``want`` data items came, or (None) until 0.3 s pass with nothing;
    returns (data items, gaps)."""
    items, gaps = 0, []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (want is None or items < want):
        if not sock.poll(300):
            if want is None:
                break
            continue
        msg = wire.decode_frames(sock.recv_multipart())
        beat = tracker.take("src", msg)
        if beat is None:
            items += len(msg.items)
        else:
            gaps += beat.gaps
    assert want is None or items == want, f"{items} of {want} items came"
    return items, gaps


def _beat(rig: _Rig, sock: zmq.Socket, tracker: GapTracker, timeout_s: float = 20) -> tuple[int, list]:
    """Send heartbeats until one reaches ``sock`` (one that finds its queue full is skipped, as a collector's
    next one would come a second later; a repeat tells nothing new); returns the data items read and the gaps."""
    items, gaps = 0, []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rig.beat()
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            if not sock.poll(50):
                continue
            msg = wire.decode_frames(sock.recv_multipart())
            beat = tracker.take("src", msg)
            if beat is None:
                items += len(msg.items)
                continue
            return items, gaps + beat.gaps
    raise AssertionError("no heartbeat came")


def test_a_subscriber_that_stopped_reading_is_told_exactly_what_it_lost_at_the_tail(tight_rig):
    rig = tight_rig
    sub = rig.subscriber(b"event/", b"heartbeat/")
    tracker = GapTracker(followed_kinds(["event/"]))
    assert _beat(rig, sub, tracker) == (0, [])  # the first beat: counting starts here (a new sender: from its start)
    rig.send_events(60, pad=100_000)  # 6 MB while it does not read: its queue holds 4 messages
    kept, _ = _drain(sub, tracker)
    assert 0 < kept < 60  # the loss is at the tail: nothing after the last item it got says so...
    more, gaps = _beat(rig, sub, tracker)  # ...but the next heartbeat does
    kept += more
    assert [(g.rank, g.pid, g.stream) for g in gaps] == [(0, RANK_PID, "event")]
    assert kept + gaps[0].items == 60
    assert rig.relay.counters.queue_full["event"] >= 1  # the collector counted that a subscriber overflowed
    assert _beat(rig, sub, tracker) == (0, [])  # said once


def test_a_healthy_subscriber_beside_a_stopped_one_gets_everything_and_no_gap(tight_rig):
    rig = tight_rig
    stopped = rig.subscriber(b"event/", b"heartbeat/")
    healthy = rig.subscriber(b"", rcvhwm=0)
    tracker = GapTracker(followed_kinds([]))
    assert _beat(rig, healthy, tracker) == (0, [])
    for _ in range(30):  # bursts of 2, within the healthy one's queue, read whole between them
        rig.send_events(2, pad=100_000)
        assert _drain(healthy, tracker, want=2) == (2, [])
    assert _beat(rig, healthy, tracker) == (0, [])  # 60 sent, 60 received, no gap
    assert rig.relay.counters.queue_full["event"] >= 1 and stopped.poll(0)  # the stopped one overflowed


def test_senders_older_than_the_subscriber_are_counted_from_its_first_heartbeat(rig):
    rig.send_events(5)  # before anyone listens
    rig.beat()
    sub = rig.subscriber(b"", rcvhwm=0)
    tracker = GapTracker(followed_kinds([]))
    assert _beat(rig, sub, tracker) == (0, [])  # the 5 were before it: not a loss
    rig.send_events(3)
    assert _beat(rig, sub, tracker) == (3, [])


def test_a_senders_own_drops_show_as_a_sender_gap_whatever_the_topics(rig):
    sub = rig.subscriber(b"stat/", b"heartbeat/", rcvhwm=0)
    tracker = GapTracker(followed_kinds(["stat/"]))
    assert tracker.kinds == {"stat"}
    _beat(rig, sub, tracker)
    rig.send_events(2)
    rig.send_events(2, seq=7)  # seqs 2..6 were dropped by the rank
    items, gaps = _beat(rig, sub, tracker)
    assert items == 0 and [(g.stream, g.items) for g in gaps] == [(SENDER_STREAM, 5)]
    assert rig.relay.counters.gaps == 5


def test_the_final_heartbeat_comes_after_the_last_message_and_says_whether_the_job_ended(rig):
    sub = rig.subscriber(b"", rcvhwm=0)
    tracker = GapTracker(followed_kinds([]))
    _beat(rig, sub, tracker)
    rig.relay.publish("rank/exited", "rank", [{"rank": 0, "state": "exited"}])
    rig.relay.final_heartbeat(job_ended=True)
    msgs = []
    while sub.poll(1000):
        msgs.append(wire.decode_frames(sub.recv_multipart()))
        if msgs[-1].kind == "heartbeat":
            break
    assert [m.kind for m in msgs] == ["rank", "heartbeat"]
    beat = tracker.take("src", msgs[0]) or tracker.take("src", msgs[1])
    assert beat is not None and beat.final and beat.job_ended and beat.gaps == []


def test_a_rank_cannot_forge_a_heartbeat(rig):
    sub = rig.subscriber(b"", rcvhwm=0)
    forged = wire.encode("heartbeat", -1, 1, 0, 0, [{"beat": 0, "final": True, "job_ended": True}])
    rig.rank.send_multipart([b"heartbeat/", forged])
    deadline = time.monotonic() + 10
    while rig.relay.counters.rejected == 0 and time.monotonic() < deadline:
        rig.relay.xsub.poll(20)
        list(rig.relay.receive())
    assert rig.relay.counters.rejected == 1 and not sub.poll(100)
    from shmstat.errors import ConfigError
    from shmstat.publish.item_encoding import check_topic

    with pytest.raises(ConfigError, match="kind"):  # and a rank's own publisher refuses the kind
        check_topic("heartbeat/", "heartbeat", {})


def test_collector_messages_are_split_under_the_per_message_bound(rig):
    sub = rig.subscriber(b"stat/", rcvhwm=0)
    items = [{"group": "g", "name": "s", "rank": r, "pad": "y" * 3000} for r in range(2000)]  # ~6 MB
    rig.relay.publish("stat/g/s", "stat", items)
    got, seqs = [], []
    while len(got) < len(items) and sub.poll(2000):
        topic, payload, _job = sub.recv_multipart()
        assert len(payload) <= MAX_MESSAGE_BYTES
        msg = wire.decode(topic, payload)
        seqs.append((msg.seq, len(msg.items)))
        got += msg.items
    assert got == items and len(seqs) > 2
    assert all(s + n == nxt for (s, n), (nxt, _) in pairwise(seqs))


def test_a_beat_lists_the_newest_senders_at_most_in_messages_of_bounded_size():
    book = SenderBook(pid=7)
    for rank in range(MAX_LISTED + 500):
        book.relayed((rank, 1000 + rank, 0), "event", 1, 1)
    messages = book.heartbeat()
    assert len(messages) == MAX_LISTED // ITEMS_PER_MESSAGE
    listed = []
    for topic, payload in messages:
        assert len(payload) < 100 * 1024
        msg = wire.decode(topic, payload)
        assert msg.kind == "heartbeat" and msg.items[0]["beat"] == 0 and msg.items[0]["senders"] == MAX_LISTED + 500
        listed += [it["rank"] for it in msg.items[1:]]
    assert sorted(listed) == list(range(500, MAX_LISTED + 500))  # the most recently active
    assert msgpack.unpackb(messages[0][1])["s"] == 0 and book.beat == 1


def test_followed_kinds_are_those_received_whole():
    assert followed_kinds([]) == {"event", "metric", "stat", "rank"}
    assert followed_kinds(["event/", "stat"]) == {"event", "stat"}
    assert followed_kinds(["event/tick", "stat/train/"]) == frozenset()


def test_the_book_of_senders_is_bounded_and_forgets_the_least_recently_active():
    book = SenderBook(pid=7, max_senders=1000)
    for rank in range(5000):
        book.relayed((rank, 1, 0), "event", 1, 1)
        book.relayed((0, 1, 0), "metric", 1, 1)  # one sender stays active all along
    assert len(book._senders) <= 1000
    assert (0, 1, 0) in book._senders and (4999, 1, 0) in book._senders and (100, 1, 0) not in book._senders
