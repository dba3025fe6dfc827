"""A restarted collector and a rank that re-sends (real sockets, a real Relay, a rank's XPUB played by hand): what the
last collector delivered (its delivered mark, restored) is dropped when re-sent, what the rank no longer holds is a
gap counted before the first message, messages that arrive ahead of the rank's re-sync marker wait for it, and a
new process under a dead sender's name (its pid used again) starts afresh."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from kit.support import wait_for

from collector.relay.relay import Relay
from shmstat import wire
from shmstat.wire.delivered import SYNC_STATE, delivered_in, encode_delivered


@pytest.fixture
def relay(tmp_path) -> Iterator[Relay]:
    r = Relay(f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock", job="resync")
    yield r
    r.close()


class _Rank:
    """A rank's XPUB connected to the relay's ingest, sending hand-made messages."""

    def __init__(self, relay: Relay, pid: int) -> None:
        self.pid = pid
        self.ctx: zmq.Context = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(relay.ingest_endpoint)
        relay.subscribe_ranks()
        # the relay's socket sends its subscription to a new peer only inside a call on it
        wait_for(lambda: relay.xsub.poll(0) is not None and self.sock.poll(10) and self.sock.recv() == b"\x01", 10,
                 what="the subscription")

    def events(self, first: int, n: int) -> None:
        items = [["e", 1, {"i": first + j}] for j in range(n)]
        self.sock.send_multipart([b"event/e", wire.encode("event", 1, self.pid, 0, first, items)])

    def sync(self, first: int, origin: int) -> None:
        marker = wire.encode("rank", 1, self.pid, 0, first, [{"state": SYNC_STATE, "origin": origin}])
        self.sock.send_multipart([wire.HELD_TOPIC, marker])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _take(relay: Relay, want: int, timeout_s: float = 10.0) -> list[int]:
    """The sequence numbers of the items relayed until ``want`` were (waiting up to ``timeout_s``)."""
    got: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        relay.xsub.poll(20)
        for msg in relay.receive():
            got.extend(range(msg.seq, msg.seq + msg.n_items))
    return got


def test_a_restarted_collector_drops_what_was_delivered_and_counts_what_the_rank_no_longer_holds(relay):
    gaps: list[tuple[int, int, int, int, int]] = []
    relay.on_gap = lambda *gap: gaps.append(gap)
    relay.restore({(1, 4242, 0): (5, 77)})  # the last collector delivered items 0..4
    rank = _Rank(relay, 4242)
    try:
        rank.events(8, 2)  # still in the rank's pipe from before: ahead of its marker, so it comes again
        rank.sync(8, 77)  # the rank holds items from 8 on: 5..7 are gone (beyond its bound)
        rank.events(8, 2)
        rank.events(6, 2)  # re-sent below what is now expected: dropped
        rank.events(10, 3)
        assert _take(relay, 5) == [8, 9, 10, 11, 12]
        assert _take(relay, 1, 0.3) == []
        assert gaps == [(1, 4242, 0, 5, 3)] and relay.counters.gaps == 3
        assert relay.counters.resent == 4
    finally:
        rank.close()


def test_items_re_sent_below_the_delivered_mark_are_dropped_and_none_is_a_gap(relay):
    relay.restore({(1, 4242, 0): (6, 77)})  # a mark is a message boundary: re-sent messages are the same frames
    rank = _Rank(relay, 4242)
    try:
        rank.sync(2, 77)  # the rank still holds 2.. (no acknowledgement reached it)
        for first in range(2, 12, 2):
            rank.events(first, 2)
        assert _take(relay, 6) == [6, 7, 8, 9, 10, 11]  # 2..5 were delivered by the last collector
        assert relay.counters.gaps == 0 and relay.counters.resent == 4
    finally:
        rank.close()


def test_a_new_process_under_a_dead_senders_name_starts_afresh(relay):
    relay.restore({(1, 4242, 0): (50, 77)})
    rank = _Rank(relay, 4242)
    try:
        rank.sync(0, 99)  # another publisher (origin 99) got the dead one's pid, rank and incarnation
        rank.events(0, 3)
        assert _take(relay, 3) == [0, 1, 2]
        assert relay.counters.gaps == 0 and relay.counters.resent == 0
    finally:
        rank.close()


def test_an_acknowledgement_names_each_sender_once_and_is_found_by_its_key():
    frame = encode_delivered([(10, 0, 1, 500), (11, 1, 0, 7), (10, 1, 0, 9)])[0]
    assert delivered_in(frame, 10, 0, 1) == 500
    assert delivered_in(frame, 11, 1, 0) == 7
    assert delivered_in(frame, 10, 1, 0) == 9
    assert delivered_in(frame, 12, 0, 0) is None
    assert delivered_in(b"\x02shmstat/handover", 10, 0, 1) is None


def test_a_sender_heard_before_its_marker_gets_its_earlier_items_once(relay):
    """A dead collector kept no mark of a new sender; the rank's pipe still held its later messages, which reach
    the next collector before the rank's marker: the re-sent earlier ones are taken, the later ones not twice."""
    rank = _Rank(relay, 4244)
    try:
        rank.events(8, 2)  # heard before the marker: taken (nothing says it comes again)
        assert _take(relay, 2) == [8, 9]
        rank.sync(0, 5)  # the rank holds 0.. (nothing was acknowledged)
        for first in range(0, 12, 2):
            rank.events(first, 2)
        assert _take(relay, 10) == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11]
        assert relay.counters.gaps == 0 and relay.counters.resent == 2
        assert (1, 4244, 0) in relay.closed_windows and relay.windows == {}
    finally:
        rank.close()
