"""The rank publisher with real processes and real sockets: backlog before the collector, drops past the
bound counted exactly, order and contiguous sequence numbers, no blocking, fork safety, collector restart."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from kit.support import wait_for

from shmstat import wire
from shmstat.errors import ConfigError
from shmstat.job import _state
from shmstat.publish.publisher import Publisher, PublisherStats, after_fork_in_child
from shmstat.wire.delivered import SYNC_STATE, encode_delivered

# ------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A unique ipc endpoint in a fresh owner-only directory (short path: ipc paths are limited to ~100 B)."""
    d = tempfile.mkdtemp(prefix="sspub-", dir="/tmp")
    os.chmod(d, 0o700)
    try:
        yield f"ipc://{d}/c.ingest"
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Collector:
    """A minimal stand-in for the collector's ingest: XSUB bound at ``endpoint``, subscribed to everything,
    decoding every message with :func:`shmstat.wire.decode`; ``rcvhwm`` messages wait in its socket at most (0: no
    bound)."""

    def __init__(self, endpoint: str, rcvhwm: int = 0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.XSUB)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.bind(endpoint)
        self.sock.send(b"\x01")
        self.messages: list[wire.WireMessage] = []
        self.held: list[wire.WireMessage] = []  # hand-over markers (answers to an unsubscribe)
        self.syncs: list[wire.WireMessage] = []  # re-sync markers (a publisher's answer to a subscription)
        self.acks = True
        self.resent: list[wire.WireMessage] = []  # re-sent behind a re-sync marker, every item received already
        self._next: dict[int, int] = {}  # per pid: the seq after the newest item received
        self._synced: set[int] = set()  # pids whose re-sync marker arrived

    def pump(self, timeout_ms: int = 10) -> None:
        """Receive whatever is there (waiting up to ``timeout_ms`` for the first message)."""
        if self.sock.poll(timeout_ms):
            while True:
                try:
                    topic, payload = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                msg = wire.decode(topic, payload)
                if topic == wire.HELD_TOPIC and msg.items[0].get("state") == SYNC_STATE:
                    self.syncs.append(msg)  # a re-sync marker: re-sent messages follow
                    self._synced.add(msg.pid)
                elif topic == wire.HELD_TOPIC:  # answered as the real collector does
                    self.held.append(msg)
                    self.sock.send(wire.ACK_PREFIX + str(msg.pid).encode())
                elif msg.pid in self._synced and msg.seq + len(msg.items) <= self._next.get(msg.pid, 0):
                    self.resent.append(msg)  # as the real relay drops it (counted in its ``resent``)
                else:
                    self._next[msg.pid] = max(self._next.get(msg.pid, 0), msg.seq + len(msg.items))
                    self.messages.append(msg)
                    if self.acks:  # delivered at once: the publisher forgets it
                        self.sock.send(encode_delivered([(msg.pid, msg.rank, msg.incarnation,
                                                          msg.seq + len(msg.items))])[0])

    def receive_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
        """Keep receiving until ``predicate()`` holds; fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
            self.pump()

    def items(self, pid: int | None = None) -> list[tuple[int, Any, wire.WireMessage]]:
        """(seq, item, message) of every received item, in arrival order, optionally of one pid."""
        return [
            (m.seq + j, item, m)
            for m in self.messages
            if pid is None or m.pid == pid
            for j, item in enumerate(m.items)
        ]

    def forget_received(self) -> None:
        """Hold nothing received so far, as the next collector would (re-sent items are then taken again)."""
        self.messages.clear()
        self._next.clear()

    def count(self, pid: int | None = None) -> int:
        return sum(len(m.items) for m in self.messages if pid is None or m.pid == pid)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def collector_factory(endpoint: str) -> Iterator[Callable[..., Collector]]:
    made: list[Collector] = []

    def make(rcvhwm: int = 0) -> Collector:
        c = Collector(endpoint, rcvhwm)
        made.append(c)
        return c

    yield make
    for c in made:
        if not c.sock.closed:
            c.close()


@pytest.fixture
def publishers() -> Iterator[list[Publisher]]:
    """Publishers created by a test, closed at the end whatever happens."""
    made: list[Publisher] = []
    yield made
    for p in made:
        p.close(linger_ms=0)


def flush_while_pumping(pub: Publisher, c: Collector, timeout_s: float = 10.0) -> bool:
    """``pub.flush()`` while the collector keeps servicing its socket (a passive XSUB never sends its
    subscription to a new connection: libzmq runs a socket's commands only inside calls on that socket)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c.pump(0)
        if pub.flush(0.01):
            return True
    return False


def settled(pub: Publisher) -> PublisherStats | None:
    """The stats once the thread has taken every queued item."""
    s = pub.stats()
    return s if s.queued == s.sent_items + s.dropped + s.backlog else None


# ------------------------------------------------------------------------------------------- rank processes


def _rank_main(
    endpoint: str,
    rank: int,
    n_before: int,
    n_after: int,
    backlog_limit: int,
    drain_first: bool,
    go: Any,
    results: Any,
) -> None:
    """A rank: publish ``n_before`` events (collector absent), report, wait for ``go``, publish ``n_after``
    (once the backlog reached the collector if ``drain_first``, else at once)."""
    pub = Publisher(endpoint, rank=rank, backlog_limit=backlog_limit)
    for i in range(n_before):
        pub.publish_event("step", time.time_ns(), {"i": i, "phase": "before", "rank": rank})
    pub.publish_metric("train", "loss", 0.5, time.time())
    # every item was taken by the thread: what is held and what is dropped is now decided
    deadline = time.monotonic() + 10
    while pub.stats().backlog + pub.stats().dropped != n_before + 1:
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)
    before = pub.stats()
    results.put(("queued", rank, os.getpid(), before.__dict__))
    go.wait(20)
    deadline = time.monotonic() + 10
    while drain_first and pub.stats().backlog and time.monotonic() < deadline:
        time.sleep(0.002)
    for i in range(n_after):
        pub.publish_event("step", time.time_ns(), {"i": i, "phase": "after", "rank": rank})
    flushed = pub.flush(10)
    pub.close(linger_ms=5000)
    results.put(("done", rank, os.getpid(), {**pub.stats().__dict__, "flushed": flushed}))


def _run_ranks(
    endpoint: str,
    collector_factory: Callable[[], Collector],
    n_ranks: int,
    n_before: int,
    n_after: int,
    backlog_limit: int,
    drain_first: bool = False,
) -> tuple[Collector, dict[int, dict[str, Any]], dict[int, dict[str, Any]], dict[int, int]]:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(endpoint, r, n_before, n_after, backlog_limit, drain_first, go, results),
        )
        for r in range(n_ranks)
    ]
    for p in procs:
        p.start()
    try:
        before: dict[int, dict[str, Any]] = {}
        pids: dict[int, int] = {}
        while len(before) < n_ranks:  # every rank queued everything while no collector exists
            tag, rank, pid, stats = results.get(timeout=20)
            assert tag == "queued"
            before[rank] = stats
            pids[rank] = pid
        collector = collector_factory()  # the collector starts late
        go.set()
        done: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 20
        while len(done) < n_ranks:  # receive while the ranks finish (their close() waits for delivery)
            collector.pump()
            while not results.empty():
                tag, rank, _pid, stats = results.get()
                assert tag == "done"
                done[rank] = stats
            assert time.monotonic() < deadline, "ranks did not finish"
        expected = sum(s["sent_items"] for s in done.values())
        collector.receive_until(lambda: collector.count() >= expected, what="every sent item")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():  # pragma: no cover - only on failure
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return collector, before, done, pids


# ------------------------------------------------------------------------------------------- tests


def test_ranks_started_before_the_collector_lose_nothing_within_the_bound(
    endpoint: str, collector_factory: Callable[[], Collector]
) -> None:
    n_ranks, n_before, n_after = 3, 3000, 2000
    collector, before, done, pids = _run_ranks(endpoint, collector_factory, n_ranks, n_before, n_after, 100_000)
    for rank in range(n_ranks):
        assert before[rank]["subscribed"] is False
        assert before[rank]["sent_items"] == 0 and before[rank]["dropped"] == 0
        assert before[rank]["backlog"] == n_before + 1
        stats = done[rank]
        assert stats["flushed"] is True
        assert stats["dropped"] == 0 and stats["backlog"] == 0
        assert stats["queued"] == stats["sent_items"] == n_before + 1 + n_after

        got = collector.items(pids[rank])
        seqs = [seq for seq, _item, _m in got]
        assert seqs == list(range(n_before + 1 + n_after))  # complete, in order, contiguous
        assert {m.rank for _s, _i, m in got} == {rank}
        events = [(item[2]["phase"], item[2]["i"]) for _s, item, m in got if m.kind == "event"]
        assert events == [("before", i) for i in range(n_before)] + [("after", i) for i in range(n_after)]
        metrics = [item for _s, item, m in got if m.kind == "metric"]
        assert len(metrics) == 1 and metrics[0][:3] == ["train", "loss", 0.5]
        assert got[n_before][2].topic == "metric/train/loss"
    # batching happened: far fewer messages than items
    assert len(collector.messages) < collector.count() // 4


def test_items_past_the_bound_are_dropped_and_counted_exactly(
    endpoint: str, collector_factory: Callable[[], Collector]
) -> None:
    n_ranks, n_before, n_after, bound = 2, 2000, 300, 500
    collector, before, done, pids = _run_ranks(
        endpoint, collector_factory, n_ranks, n_before, n_after, bound, drain_first=True
    )
    for rank in range(n_ranks):
        sent = n_before + 1 + n_after
        assert before[rank]["backlog"] == bound
        assert before[rank]["dropped"] == n_before + 1 - bound
        stats = done[rank]
        received = collector.count(pids[rank])
        assert stats["queued"] == sent
        assert received == stats["sent_items"]
        assert received + stats["dropped"] == sent  # every loss is counted
        assert stats["dropped"] == n_before + 1 - bound
        seqs = [seq for seq, _i, _m in collector.items(pids[rank])]
        # the oldest `bound` items were kept; the dropped ones show as one gap of exactly `dropped` seqs
        assert seqs == list(range(bound)) + list(range(n_before + 1, sent))


def test_publishing_never_blocks_without_a_collector(publishers: list[Publisher], endpoint: str) -> None:
    bound = 1000
    pub = Publisher(endpoint, rank=0, backlog_limit=bound)
    publishers.append(pub)
    n = 10 * bound
    for i in range(n):
        pub.publish_event("e", i, {"i": i})
    for i in range(n):
        pub.publish_metric("g", "m", i, 1.0)
    stats = wait_for(lambda: settled(pub), what="the thread to take everything")
    assert stats == PublisherStats(
        queued=2 * n, sent_items=0, sent_messages=0, dropped=2 * n - bound, subscribed=False, backlog=bound
    )
    assert pub.flush(0.05) is False  # nobody to hand the backlog to
    pub.close(linger_ms=0)
    final = pub.stats()
    assert final.dropped == 2 * n and final.backlog == 0 and final.queued == 2 * n


def test_backlog_then_live_items_in_order_with_topic_batching(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    pub = Publisher(endpoint, rank=5, incarnation=3, batch_max=4)
    publishers.append(pub)
    for i in range(10):
        pub.publish_event("a" if i < 6 else "b", i, {"i": i})
    wait_for(lambda: settled(pub))
    c = collector_factory()
    c.receive_until(lambda: c.count() == 10)
    assert wait_for(lambda: pub.stats().subscribed)
    for i in range(10, 13):
        pub.publish_metric("g", "m", i, 2.0)
    assert flush_while_pumping(pub, c)
    c.receive_until(lambda: c.count() == 13)
    shapes = [(m.topic, m.seq, len(m.items)) for m in c.messages]
    # at most batch_max items per message, one topic per message, seq runs on across messages
    assert shapes[:3] == [("event/a", 0, 4), ("event/a", 4, 2), ("event/b", 6, 4)]
    assert [s for s, _i, _m in c.items()] == list(range(13))
    assert {(m.rank, m.incarnation, m.pid) for m in c.messages} == {(5, 3, os.getpid())}


def test_unencodable_items_are_dropped_counted_and_leave_a_seq_gap(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    c = collector_factory()
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    pub.publish_event("e", 0, {"ok": 1})
    pub.publish_event("e", 1, {"bad": [1, 2]})  # not a scalar: cannot go on the wire
    pub.publish_event("e", 2, {"ok": 2})
    pub.publish_event("e", 3, {"big": 1 << 70})
    pub.publish_event("e", 4, {"ok": 3})
    assert flush_while_pumping(pub, c)
    c.receive_until(lambda: c.count() == 3)
    assert [s for s, _i, _m in c.items()] == [0, 2, 4]
    stats = pub.stats()
    assert (stats.queued, stats.sent_items, stats.dropped) == (5, 3, 2)


def test_explicit_unsubscribe_holds_items_until_resubscribed(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    c = collector_factory()
    pub = Publisher(endpoint, rank=1)
    publishers.append(pub)
    pub.publish_event("e", 0, {})
    c.receive_until(lambda: c.count() == 1)
    c.sock.send(b"\x00")  # a collector shutting down cleanly unsubscribes first
    wait_for(lambda: (c.pump(), not pub.stats().subscribed)[1], what="the unsubscribe to arrive")
    for i in range(1, 50):
        pub.publish_event("e", i, {})
    wait_for(lambda: settled(pub))
    assert pub.stats().backlog == 49 and pub.stats().sent_items == 1
    assert pub.flush(0.05) is False
    c.sock.send(b"\x01")
    c.receive_until(lambda: c.count() == 50)
    assert [s for s, _i, _m in c.items()] == list(range(50))
    assert pub.flush(5) and pub.stats().subscribed


def test_handover_request_is_answered_behind_the_last_item_then_items_are_held(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    c = collector_factory()
    pub = Publisher(endpoint, rank=1)
    publishers.append(pub)
    for i in range(300):
        pub.publish_event("e", i, {})
    c.receive_until(lambda: c.count() > 0)  # connected (a request reaches only the publishers connected)
    c.sock.send(wire.HANDOVER_REQUEST)  # a collector shutting down cleanly
    c.receive_until(lambda: len(c.held) == 1, what="the hand-over marker")
    assert (c.held[0].rank, c.held[0].pid, c.held[0].items) == (1, os.getpid(), [{"state": "held"}])
    sent = pub.stats().sent_items
    c.pump(50)
    assert c.count() == sent  # everything sent before the marker had arrived with it
    for i in range(300, 320):
        pub.publish_event("e", i, {})
    wait_for(lambda: settled(pub))
    assert pub.stats().backlog == 320 - sent and not pub.stats().subscribed
    c.sock.send(b"\x01")  # the next collector subscribes (a repeated frame on the same pipe)
    c.receive_until(lambda: c.count() == 320)
    assert [s for s, _i, _m in c.items()] == list(range(320))


def _asleep_in_its_long_wait(pub: Publisher, wait_ms: int) -> bool:
    """Whether the publisher's thread sleeps for good: no wake-up pending on its eventfd (nothing publishes any
    more, so none comes), then the thread blocked in ``poll`` of that one fd for ``wait_ms`` (the latency budget,
    not the shorter retry), as the kernel says in /proc (x86_64's system call numbers)."""
    sender = pub._sender
    assert sender.thread is not None and sender.thread.native_id is not None
    with open(f"/proc/self/fdinfo/{sender._wake.fd}") as f:
        if [line.split()[1] for line in f if line.startswith("eventfd-count:")] != ["0"]:
            return False
    with open(f"/proc/self/task/{sender.thread.native_id}/syscall") as f:
        call = f.read().split()
    return call[0] == "7" and call[2] == "0x1" and int(call[3], 16) == wait_ms  # poll(fds, 1, wait_ms)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86_64 system call numbers in /proc")
def test_a_handover_marker_claims_no_number_zmq_refused(
    publishers: list[Publisher], collector_factory: Callable[..., Collector], endpoint: str, backend: str
) -> None:
    """A collector that read too slowly (the pipe full: zmq refused the batch the thread had numbered) and then
    asks for the hand-over: the marker carries the first number not handed to zmq, so the collector counts no
    gap for the batch the rank still holds, and the next collector gets it, each item once."""
    c = collector_factory(rcvhwm=1)
    # after zmq refused a batch the thread tries again in a second, then sleeps a minute unless woken: the test
    # chooses when it next looks
    pub = Publisher(endpoint, rank=1, sndhwm=1, idle_sleep_s=1, event_latency_ms=60_000)
    publishers.append(pub)
    pub.publish_event("e", 0, {})
    assert flush_while_pumping(pub, c)
    c.receive_until(lambda: c.count() == 1)
    n = 24
    for i in range(1, n):  # ~23 MB: more than the pipes and the kernel's buffers hold
        pub.publish_event("e", i, {"pad": "p" * 1_000_000})
    wait_for(lambda: _asleep_in_its_long_wait(pub, 60_000), 20, 0.01, what="the publisher thread asleep")
    refused_at = pub._sender._outbox.wire_seq()
    sent = pub.stats().sent_items
    assert refused_at > sent  # a batch numbered, refused by the full pipe, still held (the case under test)
    c.receive_until(lambda: c.count() == sent, what="what the pipe held")
    c.sock.send(wire.HANDOVER_REQUEST)
    pub.flush(0.01)  # wakes the thread: it reads the request with room in the pipe again
    c.receive_until(lambda: len(c.held) == 1, what="the hand-over marker")
    c.pump(50)
    # it claims what arrived before it (the thread holds from now on), not the numbers of a batch zmq refused
    assert c.held[0].seq == c.count() < n
    c.sock.send(b"\x01")  # the next collector subscribes
    assert flush_while_pumping(pub, c, 30)  # (woken by each flush: it would sleep its minute when zmq refuses)
    c.receive_until(lambda: c.count() == n, what="the rest")
    assert [s for s, _i, _m in c.items()] == list(range(n))  # each once, none lost


def test_collector_restart(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    """A collector that dies (no unsubscribe) and comes back: items published afterwards arrive; items
    published while it was down arrive too unless in flight when it went; order is kept, nothing doubles."""
    first = collector_factory()
    pub = Publisher(endpoint, rank=2)
    publishers.append(pub)
    for i in range(100):
        pub.publish_event("a", i, {})
    first.receive_until(lambda: first.count() == 100)
    first.close()  # gone without unsubscribing, as after SIGKILL
    for i in range(100):
        pub.publish_event("down", i, {})
    assert pub.flush(5)  # handed to zmq: queued in the pipe to the endpoint, not held here
    assert pub.stats().subscribed  # the XPUB reports nothing when its subscriber disappears
    second = collector_factory()
    for i in range(100):
        pub.publish_event("b", i, {})
    assert pub.flush(5)
    second.receive_until(
        lambda: any(m.topic == "event/b" and m.seq + len(m.items) == 300 for m in second.messages),
        what="the last item published after the restart",
    )
    seqs = [s for s, _i, _m in second.items()]
    assert seqs == sorted(set(seqs))  # in order, no duplicates
    assert set(range(200, 300)) <= set(seqs)  # everything after the restart
    assert all(s >= 100 for s in seqs)  # nothing of the first collector's share is replayed
    assert pub.stats().dropped == 0


def test_fork_child_never_uses_the_parents_publisher(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    c = collector_factory()
    parent = Publisher(endpoint, rank=4)
    publishers.append(parent)
    for i in range(20):
        parent.publish_event("parent", i, {"i": i})
    assert flush_while_pumping(parent, c)
    saved = _state.STATE.publisher
    _state.STATE.publisher = parent
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
            code = 1
            try:
                report: dict[str, Any] = {"state_cleared": _state.STATE.publisher is None}
                report["closed"] = parent.closed
                parent.publish_event("ghost", 0, {})  # a no-op counted as dropped
                parent.close()
                report["flush"] = parent.flush(1)
                report["inherited"] = parent.stats().__dict__
                own = Publisher(endpoint, rank=4)
                for i in range(30):
                    own.publish_event("child", i, {"i": i})
                report["own_flush"] = own.flush(10)
                own.close(linger_ms=5000)
                report["own"] = own.stats().__dict__
                os.write(write_fd, json.dumps(report).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        write_fd = -1
        for i in range(20, 40):  # the parent's publisher keeps working after the fork
            parent.publish_event("parent", i, {"i": i})
        assert parent.flush(5)
        # the collector keeps servicing its socket while the child connects and publishes
        deadline = time.monotonic() + 20
        while True:
            c.pump()
            done_pid, status = os.waitpid(pid, os.WNOHANG)
            if done_pid == pid:
                break
            assert time.monotonic() < deadline, "the child did not finish"

        with os.fdopen(read_fd, "rb") as f:
            report = json.loads(f.read() or b"{}")
        read_fd = -1
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _state.STATE.publisher = saved
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
    assert report["state_cleared"] and report["closed"] and report["flush"]
    assert report["inherited"] == {
        "queued": 1, "sent_items": 0, "sent_messages": 0, "dropped": 1, "subscribed": False, "backlog": 0
    }
    assert report["own_flush"] and report["own"]["sent_items"] == 30 and report["own"]["dropped"] == 0
    c.receive_until(lambda: c.count() == 70, what="40 parent and 30 child items")
    mine = c.items(os.getpid())
    assert [s for s, _i, _m in mine] == list(range(40))  # the child never sent on the parent's socket
    assert {m.topic for _s, _i, m in mine} == {"event/parent"}
    child = c.items(pid)
    assert [s for s, _i, _m in child] == list(range(30)) and {m.rank for _s, _i, m in child} == {4}


def test_after_fork_hook_spares_publishers_of_this_process(publishers: list[Publisher], endpoint: str) -> None:
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    after_fork_in_child()  # nothing was forked: this process owns pub
    assert not pub.closed


def test_lifecycle_and_argument_checks(publishers: list[Publisher], endpoint: str) -> None:
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    assert pub.flush(0) is True  # nothing published, no thread started
    assert pub._sender.thread is None
    pub.close()
    pub.close()  # idempotent
    pub.publish_event("late", 0, {})
    assert pub.stats().dropped == 1 and pub.stats().queued == 1 and pub.closed
    with pytest.raises(ConfigError):
        Publisher("nonsense://nowhere", rank=0)
    for bad in ({"rank": -2}, {"rank": 0, "backlog_limit": 0}, {"rank": 0, "batch_max": 0},
                {"rank": 0, "idle_sleep_s": 0}, {"rank": True}):
        with pytest.raises(ConfigError):
            Publisher(endpoint, **bad)


def test_generic_publish_checks_topic_against_kind_and_item(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    for topic, kind, item in [
        ("event/x", "nope", ["x", 1, {}]),
        ("metric/x", "event", ["x", 1, {}]),
        ("event/y", "event", ["x", 1, {}]),
        ("metric/g/n", "metric", ["g", "other", 1, 1.0]),
        ("event/x", "event", 5),
    ]:
        with pytest.raises(ConfigError):
            pub.publish(topic, kind, item)
    c = collector_factory()
    pub.publish("event/x", "event", ["x", 1, {"a": 1}])
    pub.publish("stat/g/n", "stat", {"count": 3, "mean": None})
    assert flush_while_pumping(pub, c)
    c.receive_until(lambda: c.count() == 2)
    assert [(m.kind, m.items) for m in c.messages] == [
        ("event", [["x", 1, {"a": 1}]]),
        ("stat", [{"count": 3, "mean": None}]),
    ]


def test_event_data_is_copied_at_publish(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    c = collector_factory()
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    data = {"v": 1}
    pub.publish_event("e", 0, data)
    data["v"] = 2
    assert flush_while_pumping(pub, c)
    c.receive_until(lambda: c.count() == 1)
    assert c.messages[0].items[0][2] == {"v": 1}


def test_an_idle_thread_does_not_spin(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    """Idle with a held backlog (waiting for a subscriber) and idle while subscribed: the thread sleeps."""
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    pub.publish_event("e", 0, {})
    wait_for(lambda: settled(pub))

    def cpu_over_half_a_second() -> float:
        cpu0, wall0 = time.process_time(), time.monotonic()
        while time.monotonic() - wall0 < 0.5:  # an interval to measure over, not a wait for a condition
            time.sleep(0.05)
        return time.process_time() - cpu0

    cpu = cpu_over_half_a_second()
    assert cpu < 0.1, f"{cpu:.3f} s of CPU in 0.5 s while holding a backlog"
    c = collector_factory()
    c.receive_until(lambda: c.count() == 1)
    wait_for(lambda: settled(pub) and pub.stats().backlog == 0)
    cpu = cpu_over_half_a_second()
    assert cpu < 0.1, f"{cpu:.3f} s of CPU in 0.5 s while subscribed and idle"


def test_close_waits_for_the_collectors_acknowledgement_so_nothing_queued_is_lost(
    publishers: list[Publisher], endpoint: str
) -> None:
    """libzmq may drop what is still queued when a socket closes while the receiver's queue is full (libzmq
    issue 4660): close() sends the hand-over marker and waits for the collector's acknowledgement."""
    ctx: zmq.Context[Any] = zmq.Context()
    xsub = ctx.socket(zmq.XSUB)
    xsub.setsockopt(zmq.RCVHWM, 1)  # a collector busy elsewhere: its queue is full at once
    xsub.bind(endpoint)
    xsub.send(b"\x01")
    pub = Publisher(endpoint, rank=3, batch_max=4)
    publishers.append(pub)
    try:
        pub.publish_event("e", 0, {})
        wait_for(lambda: xsub.poll(0), what="the first message")
        for i in range(1, 2000):
            pub.publish_event("e", i, {})
        closer = threading.Thread(target=pub.close, kwargs={"linger_ms": 20_000})
        closer.start()
        got, acked = 0, False
        deadline = time.monotonic() + 30
        quiet_after_close = 0
        while time.monotonic() < deadline and quiet_after_close < 100:  # until 0.5 s quiet after close()
            if not xsub.poll(5):
                quiet_after_close += not closer.is_alive()
                continue
            time.sleep(0.0005)  # a slow reader
            topic, payload = xsub.recv_multipart()
            msg = wire.decode(topic, payload)
            if topic == wire.HELD_TOPIC:
                xsub.send(wire.ACK_PREFIX + str(msg.pid).encode())
                acked = True
            else:
                got += len(msg.items)
                # delivered, as a collector says it: the publisher forgets what it keeps for a successor
                for frame in encode_delivered([(msg.pid, msg.rank, msg.incarnation, msg.seq + len(msg.items))]):
                    xsub.send(frame)
        closer.join(1)
        assert got == 2000 and pub.stats().dropped == 0
        assert acked and not closer.is_alive()
    finally:
        xsub.close(0)
        ctx.term()


class _FastPathOnly:
    """A publisher reduced to its public fast-path surface (``outbox``, ``started``, ``start``): what ``log_event``
    (in C and in Python) and ``put_metric`` may use of it."""

    __slots__ = ("outbox", "started", "starts")

    def __init__(self) -> None:
        from shmstat.publish.outbox import new_outbox

        self.outbox = new_outbox(rank=0, pid=1, incarnation=0, batch_max=8, max_items=100, max_bytes=10**6,
                                 max_batch_bytes=10**5, metric_bytes=160)
        self.started = False
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.started = True


def test_log_event_and_put_metric_use_only_the_publishers_public_fast_path(backend: str) -> None:
    import datetime

    from elastic import metrics
    from shmstat import Event, log_event

    for name in ("outbox", "started", "start"):
        assert getattr(Publisher, name).__doc__, name
    pub = _FastPathOnly()
    _state.STATE.publisher = pub  # type: ignore[assignment]
    log_event(Event("e", datetime.datetime(2026, 1, 2), {"a": 1}))
    metrics.put_metric("m", 2, "g")
    log_event(Event("e", datetime.datetime(2026, 1, 2), {"a": 2}))
    assert pub.outbox.counters()[0] == 3 and pub.started and pub.starts == 1
    got: dict[str, list] = {}
    while (frames := pub.outbox.head(wire.MAX_TOPIC)) is not None:
        msg = wire.decode(*frames)
        got.setdefault(msg.kind, []).extend(msg.items)
        pub.outbox.pop()
    assert [item[2] for item in got["event"]] == [{"a": 1}, {"a": 2}]
    assert [item[:3] for item in got["metric"]] == [["g", "m", 2]]


def test_what_no_collector_acknowledged_is_re_sent_behind_a_marker_within_the_bound(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    c = collector_factory()
    c.acks = False  # a collector that received everything and died before its sinks took any of it
    pub = Publisher(endpoint, rank=1, backlog_bytes=64 * 1024)
    publishers.append(pub)
    n = 1000
    for i in range(n):  # ~100 KiB of messages sent one by one: more than the 64 KiB kept
        pub.publish_event("e", i, {"pad": "p" * 80})
        if i % 10 == 9:
            assert flush_while_pumping(pub, c)
    c.receive_until(lambda: c.count() == n)
    assert [m.seq for m in c.syncs] == [0]  # the first subscription: nothing held yet
    c.forget_received()
    c.sock.send(encode_delivered([(os.getpid(), 1, 0, 100)])[0])  # the first 100 were delivered after all
    c.sock.send(b"\x01")  # the next collector subscribes
    c.receive_until(lambda: len(c.syncs) == 2, what="the re-sync marker")
    first = c.syncs[1].seq
    assert 100 < first < n  # what the bound gave up (100..first) is the gap the next collector counts
    c.receive_until(lambda: c.count() == n - first, what="the re-sent messages")
    assert [s for s, _i, _m in c.items()] == list(range(first, n))  # in order, each once
    assert pub._sender.kept_evicted > 0


# ------------------------------------------------------------------------------------------- the latency budget


def _arrival_of(c: Collector, i: int, timeout_s: float = 10.0) -> tuple[float, wire.WireMessage]:
    """Receive until the event whose data is ``{"i": i}`` is there: (the monotonic time it was seen, its message)."""
    def found() -> wire.WireMessage | None:
        return next((m for _seq, item, m in c.items() if item[2] == {"i": i}), None)

    c.receive_until(lambda: found() is not None, timeout_s, what=f"event {i}")
    seen = time.monotonic()
    msg = found()
    assert msg is not None
    return seen, msg


def test_events_within_the_latency_budget_travel_in_few_messages(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a 1 s budget (SHMSTAT_EVENT_LATENCY_MS) the thread holds what comes after a send until the budget is
    up: ten events 10 ms apart leave in at most 3 messages (the step that sent the one before may still be sending
    when the first comes, and one end of the budget may fall among them), and the first still arrives within the
    budget (plus slack for a loaded machine). Without the budget the thread looked every 2 to 20 ms: 5 messages or
    more."""
    monkeypatch.setenv("SHMSTAT_EVENT_LATENCY_MS", "1000")
    c = collector_factory()
    pub = Publisher(endpoint, rank=0)
    publishers.append(pub)
    pub.publish_event("e", time.time_ns(), {"i": -1})
    _arrival_of(c, -1)
    t0 = time.monotonic()
    for i in range(10):
        pub.publish_event("e", time.time_ns(), {"i": i})
        time.sleep(0.01)  # the spacing under test: half the thread's old longest sleep (20 ms)
    seen0, _m = _arrival_of(c, 0)
    _arrival_of(c, 9)
    messages = {id(m) for _seq, item, m in c.items() if item[2]["i"] >= 0}
    assert len(messages) <= 3, f"ten events 10 ms apart within a 1 s budget went in {len(messages)} messages"
    assert seen0 - t0 < 1.0 + 1.0, f"held {seen0 - t0:.3f} s with a 1 s budget"


def test_a_lone_event_arrives_within_the_budget(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    """An idle thread still looks once per budget: a lone event logged at any moment arrives within the budget
    (measured from the publish to the receive, plus slack for a loaded machine), five times over."""
    c = collector_factory()
    pub = Publisher(endpoint, rank=0, event_latency_ms=50)
    publishers.append(pub)
    pub.publish_event("e", time.time_ns(), {"i": -1})
    _arrival_of(c, -1)
    for i in range(5):
        c.pump(37)  # the next event is published at another moment of the thread's cycle (and the collector idles)
        t0 = time.monotonic()
        pub.publish_event("e", time.time_ns(), {"i": i})
        seen, _msg = _arrival_of(c, i)
        assert seen - t0 < 0.05 + 0.25, f"a lone event took {seen - t0:.3f} s with a 50 ms budget"


def test_a_full_batch_and_the_exit_do_not_wait_for_the_budget(
    publishers: list[Publisher], collector_factory: Callable[[], Collector], endpoint: str
) -> None:
    """With a 60 s budget: a batch that fills (batch_max items) is sent at once, and so is what close() finds held;
    neither waits anywhere near the budget."""
    c = collector_factory()
    pub = Publisher(endpoint, rank=0, batch_max=8, event_latency_ms=60_000)
    publishers.append(pub)
    pub.publish_event("e", time.time_ns(), {"i": -1})
    _arrival_of(c, -1)  # the thread sent, and now sleeps for the budget
    t0 = time.monotonic()
    for i in range(8):
        pub.publish_event("e", time.time_ns(), {"i": i})
    seen, msg = _arrival_of(c, 7)
    assert seen - t0 < 5.0 and len(msg.items) == 8
    pub.publish_event("e", time.time_ns(), {"i": 100})
    t0 = time.monotonic()
    closer = threading.Thread(target=pub.close, kwargs={"linger_ms": 10_000})
    closer.start()
    try:
        seen, _msg = _arrival_of(c, 100)
    finally:
        while closer.is_alive():
            c.pump(10)  # the stand-in answers the closing marker as the collector does
        closer.join()
    assert seen - t0 < 5.0
    assert pub.stats().sent_items == 10 and pub.stats().dropped == 0


def test_the_latency_budget_is_checked(publishers: list[Publisher], endpoint: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget out of range is one ConfigError, from the argument or the environment."""
    for bad in (0, -1, 60_001, True, "20"):
        with pytest.raises(ConfigError, match="event_latency_ms"):
            Publisher(endpoint, rank=0, event_latency_ms=bad)  # type: ignore[arg-type]
    monkeypatch.setenv("SHMSTAT_EVENT_LATENCY_MS", "nope")
    with pytest.raises(ConfigError, match="SHMSTAT_EVENT_LATENCY_MS"):
        Publisher(endpoint, rank=0)
