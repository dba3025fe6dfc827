"""A node collector's one publish endpoint, with real relays and real sockets (raw sockets play the ranks): two
jobs' relays share one node outlet; every message there is ``[topic, payload, job]``, the job's own endpoint
keeps ``[topic, payload]``; ``wants`` is true for a subscriber of either; a subscriber that stopped reading is
told per job exactly what it lost (the jobs share the collector's pid: keyed by job, nothing mixes); a flood of
subscriptions rebinds the node endpoint alone; bad frames are refused with one sentence, never a crash."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from kit.support import wait_for

from collector.relay.publish_socket import Outlet
from collector.relay.relay import Relay
from collector.relay.subscriptions import MAX_PREFIXES
from shmstat import wire
from shmstat.errors import WireError
from shmstat.wire.heartbeat import GapTracker, followed_kinds

JOBS = ("job-a", "job-b")
RANK_PID = {"job-a": 5001, "job-b": 5002}


class _NodeRig:
    """One node outlet, and per job a relay publishing on it and a raw XPUB standing for the job's rank."""

    def __init__(self, sndhwm: int = 64) -> None:
        self.dir = tempfile.mkdtemp(prefix="no-", dir="/tmp")  # Unix socket paths must stay short
        self.ctx = zmq.Context()
        self.node = Outlet(self.ctx, "tcp://127.0.0.1:0", sndhwm)
        self.relays: dict[str, Relay] = {}
        self.ranks: dict[str, zmq.Socket] = {}
        self.seq = dict.fromkeys(JOBS, 0)
        self.socks: list[zmq.Socket] = []
        for job in JOBS:
            relay = Relay(f"ipc://{self.dir}/{job}.in", f"ipc://{self.dir}/{job}.pub", sndhwm=sndhwm,
                          heartbeat_interval_s=3600, node=self.node, job=job)
            rank = self.ctx.socket(zmq.XPUB)
            rank.setsockopt(zmq.LINGER, 0)
            rank.connect(relay.ingest_endpoint)
            relay.subscribe_ranks()
            wait_for(lambda relay=relay, rank=rank: (relay.xsub.poll(0), rank.poll(50))[1], 10,
                     what="the relay's subscription")
            rank.recv()
            self.relays[job], self.ranks[job] = relay, rank

    def subscriber(self, endpoint: str, *topics: bytes, rcvhwm: int = 0) -> zmq.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvhwm:
            sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(endpoint)
        for t in topics or (b"",):
            sock.setsockopt(zmq.SUBSCRIBE, t)
        self.socks.append(sock)
        outlet = self.node if endpoint == self.node.endpoint else None
        want = set(topics or (b"",))
        wait_for(lambda: (self.update(), want <= (outlet.prefixes if outlet else self._job_prefixes(endpoint)))[1],
                 10, what="the subscription")
        return sock

    def _job_prefixes(self, endpoint: str) -> set[bytes]:
        return next(r.prefixes for r in self.relays.values() if r.publish_endpoint == endpoint)

    def update(self) -> None:
        for relay in self.relays.values():
            relay.update_subscriptions()  # the job's outlet and the node's

    def send_events(self, job: str, n: int, pad: int = 0) -> None:
        """``n`` events from ``job``'s rank, one per message, relayed as they arrive."""
        relay, rank = self.relays[job], self.ranks[job]
        for i in range(n):
            item = ["tick", time.time_ns(), {"i": i, "pad": "x" * pad}]
            rank.send_multipart([b"event/tick", wire.encode("event", 0, RANK_PID[job], 0, self.seq[job], [item])])
            self.seq[job] += 1
        got = 0
        deadline = time.monotonic() + 10
        while got < n and time.monotonic() < deadline:
            relay.xsub.poll(20)
            got += sum(1 for _ in relay.receive())
        assert got == n

    def beat(self) -> None:
        for relay in self.relays.values():
            relay._next_beat = 0.0
            relay.heartbeat_if_due()

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        for job in JOBS:
            self.ranks[job].close(0)
            self.relays[job].close()
        self.node.close(linger_ms=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def rig() -> Iterator[_NodeRig]:
    r = _NodeRig()
    yield r
    r.close()


def _read(sock: zmq.Socket, quiet_ms: int = 300) -> list[list[bytes]]:
    out = []
    while sock.poll(quiet_ms):
        out.append(sock.recv_multipart())
    return out


def test_every_message_of_both_jobs_reaches_the_node_endpoint_with_its_job_and_each_job_endpoint_its_own(rig):
    node_sub = rig.subscriber(rig.node.endpoint)
    own = {job: rig.subscriber(rig.relays[job].publish_endpoint) for job in JOBS}
    rig.send_events("job-a", 7)
    rig.send_events("job-b", 5)
    rig.relays["job-a"].publish("rank/exited", "rank", [{"rank": 0, "state": "exited"}])
    rig.relays["job-b"].publish("stat/g/s", "stat", [{"name": "s.count", "value": 3}])
    raw = _read(node_sub)
    assert {len(frames) for frames in raw} == {3}  # [topic, payload, job]
    got = [wire.decode_with_job(frames) for frames in raw]
    by_job = {job: [(m.kind, len(m.items)) for m, j in got if j == job] for job in JOBS}
    assert by_job == {"job-a": [("event", 1)] * 7 + [("rank", 1)], "job-b": [("event", 1)] * 5 + [("stat", 1)]}
    assert {m.pid for m, j in got if j == "job-a" and m.kind == "event"} == {RANK_PID["job-a"]}
    for job, sock in own.items():  # the job's own endpoint: only its job, named as on the node's (issue 44)
        frames = _read(sock)
        assert {len(f) for f in frames} == {3} and {wire.decode_with_job(f)[1] for f in frames} == {job}
        assert sum(1 for f in frames if f[0] == b"event/tick") == (7 if job == "job-a" else 5)


def test_wants_is_true_when_a_subscriber_of_either_endpoint_wants_the_topic(rig):
    relay = rig.relays["job-a"]
    assert not relay.wants("stat/train/") and not relay.subscribed
    rig.subscriber(rig.node.endpoint, b"stat/train/")
    assert relay.wants("stat/train/") and relay.wants("stat/train/steps") and not relay.wants("event/x")
    assert relay.subscribed and not relay.prefixes  # nobody on the job's own endpoint
    rig.subscriber(relay.publish_endpoint, b"event/")
    assert relay.wants("event/x") and relay.wants("stat/train/steps")


def test_topic_filtering_on_the_node_endpoint_keeps_working(rig):
    events_only = rig.subscriber(rig.node.endpoint, b"event/")
    rig.send_events("job-a", 3)
    rig.relays["job-b"].publish("stat/g/s", "stat", [{"name": "s.count", "value": 3}])
    rig.send_events("job-b", 2)
    got = [wire.decode_with_job(f) for f in _read(events_only)]
    assert [(m.topic, j) for m, j in got] == [("event/tick", "job-a")] * 3 + [("event/tick", "job-b")] * 2


def test_a_stopped_node_subscriber_is_told_per_job_exactly_what_it_lost():
    rig = _NodeRig(sndhwm=4)  # a queue of 4 messages on either endpoint
    try:
        sub = rig.subscriber(rig.node.endpoint, b"event/", b"heartbeat/", rcvhwm=1)
        tracker = GapTracker(followed_kinds(["event/"]))
        kept = dict.fromkeys(JOBS, 0)
        lost = dict.fromkeys(JOBS, 0)

        def take(frames: list[bytes]) -> bool:
            msg, job = wire.decode_with_job(frames)
            assert job in JOBS
            beat = tracker.take(f"node job {job}", msg)  # keyed by job: both jobs' beats carry the same pid
            if beat is None:
                kept[job] += len(msg.items)
                return False
            for gap in beat.gaps:
                assert gap.source == f"node job {job}" and gap.pid == RANK_PID[job] and gap.stream == "event"
                lost[job] += gap.items
            return True

        def beat_both() -> None:  # until a beat of each job got through (one finding a full queue is skipped)
            seen: set[str] = set()
            deadline = time.monotonic() + 20
            while seen != set(JOBS) and time.monotonic() < deadline:
                rig.beat()
                until = time.monotonic() + 0.5
                while time.monotonic() < until and seen != set(JOBS):
                    if sub.poll(50):
                        frames = sub.recv_multipart()
                        if take(frames):
                            seen.add(frames[2].decode())
            assert seen == set(JOBS), "no heartbeat of each job came"

        beat_both()  # counting starts here for both jobs
        sent = {"job-a": 40, "job-b": 25}
        for _ in range(5):  # interleaved: the jobs' messages share the stopped subscriber's one queue
            for job, n in sent.items():
                rig.send_events(job, n // 5, pad=100_000)
        for frames in _read(sub):
            take(frames)
        beat_both()
        assert all(lost[job] > 0 for job in JOBS), (kept, lost)
        assert {job: kept[job] + lost[job] for job in JOBS} == sent  # per job: kept + told lost = sent
        node_overflows = sum(r.counters.queue_full["event"] for r in rig.relays.values())
        assert node_overflows >= 1  # each job's relay counts what its messages lost there
    finally:
        rig.close()


def test_a_subscription_flood_on_the_node_endpoint_rebinds_it_alone(rig):
    job_sub = rig.subscriber(rig.relays["job-a"].publish_endpoint, b"event/")
    flooder = rig.ctx.socket(zmq.SUB)
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.setsockopt(zmq.SNDHWM, 100_000)  # libzmq's default passes 1,000 subscriptions per connection
    flooder.connect(rig.node.endpoint)
    rig.socks.append(flooder)
    flooder.setsockopt(zmq.SUBSCRIBE, b"stat/flood-first")
    wait_for(lambda: (rig.update(), b"stat/flood-first" in rig.node.prefixes)[1], 10, what="the flooder connected")
    for i in range(MAX_PREFIXES + 200):  # taken as they come, as the collector's loop does all the time
        flooder.setsockopt(zmq.SUBSCRIBE, f"stat/flood-{i}-".encode() + b"x" * 300)
        if i % 100 == 0:
            rig.update()
    wait_for(lambda: (rig.update(), rig.node.resets >= 1)[1], 20, what="the node endpoint bound anew")
    assert len(rig.node.prefixes) <= MAX_PREFIXES
    rig.send_events("job-a", 9)
    assert sum(1 for f in _read(job_sub) if f[0] == b"event/tick") == 9  # the job's subscriber lost nothing
    assert rig.relays["job-a"].counters.subscription_resets == 0  # its endpoint was not touched
    node_sub = rig.subscriber(rig.node.endpoint, b"event/")  # the node endpoint serves again at the same port
    rig.send_events("job-b", 4)
    assert [wire.decode_with_job(f)[1] for f in _read(node_sub)] == ["job-b"] * 4


def test_a_bad_job_frame_or_frame_count_is_refused_in_one_sentence():
    payload = wire.encode("event", 0, 1, 0, 0, [["tick", 1, {}]])
    ok = [b"event/tick", payload]
    assert wire.decode_with_job(ok)[1] is None
    assert wire.decode_with_job([*ok, b"a" * 64])[1] == "a" * 64
    for frames, reason in (([b"event/tick"], "1 frames"), ([*ok, b"j", b"x"], "4 frames"),
                           ([*ok, b"\xff\xfe"], "not valid UTF-8"), ([*ok, b"a" * 65], "more than 64"),
                           ([*ok, b""], "not a job id"), ([*ok, "jöb".encode()], "not a job id"),
                           ([*ok, b"x.lock"], "not a job id"), ([*ok, b"a/b"], "not a job id")):
        with pytest.raises(WireError, match=reason) as err:
            wire.decode_with_job(frames)
        assert str(err.value).count(". ") == 0 and "\n" not in str(err.value)


class _RawNode:
    """A raw XPUB standing for a node collector's endpoint: sends whatever frames a test makes, to one
    ``shmstat subscribe`` run in a thread of this process."""

    def __init__(self, *args: str, count: int) -> None:
        from collector.cli.subscribe import subscribe

        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.out = io.StringIO()
        self.status: list[int] = []
        self.thread = threading.Thread(target=lambda: self.status.append(
            subscribe([self.endpoint], topics=list(args), count=count, timeout_s=30, records=True, out=self.out)))
        self.thread.start()
        assert self.pub.poll(10_000), "the subscriber did not subscribe"
        self.pub.recv()

    def send(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def finish(self) -> list[dict]:
        self.thread.join(40)
        self.pub.close(0)
        self.ctx.term()
        assert self.status == [0]
        return [json.loads(line) for line in self.out.getvalue().splitlines()]


def _event(job_seq: int, pid: int = 777) -> list[bytes]:
    return [b"event/tick", wire.encode("event", 0, pid, 0, job_seq, [["tick", 1, {"i": job_seq}]])]


def test_shmstat_subscribe_counts_bad_frames_and_prints_every_message_with_its_job(capsys):
    node = _RawNode(count=3)
    good = _event(0)
    for frames in ([*good, b"job-a"], [*good, b"\xff"], [*good, b"j" * 65], [*good, b"a", b"b"], [good[0]],
                   [*good, b"../x"], good, [*good, b"job-b"]):
        node.send(frames)
    lines = node.finish()
    assert [(line["job"], line["topic"]) for line in lines] == [("job-a", "event/tick"), (None, "event/tick"),
                                                                ("job-b", "event/tick")]
    assert "shmstat subscribe: 5 malformed messages skipped" in capsys.readouterr().err


def test_shmstat_subscribe_on_a_node_endpoint_keeps_gaps_and_ends_per_job(capsys):
    """Both jobs' collector-made streams share the node collector's pid and, here, a sender key: keyed by job,
    job A's loss is told as A's (mixed with B's items it would vanish), and job A's end does not end following
    the endpoint."""
    from collector.relay.heartbeats import SenderBook

    node = _RawNode(count=7)
    books = {job: SenderBook(pid=4000) for job in JOBS}  # one node collector: one pid for both jobs' beats
    sender = (0, 777, 0)

    def beat(job: str, **kw: bool) -> None:
        for frames in books[job].heartbeat(**kw):
            node.send([*frames, job.encode()])

    beat("job-a")
    beat("job-b")
    node.send([*_event(0), b"job-a"])  # job A's collector relayed 3: 2 are lost on the way to this subscriber
    books["job-a"].relayed(sender, "event", 3, 3)
    for seq in range(5):
        node.send([*_event(seq), b"job-b"])
    books["job-b"].relayed(sender, "event", 5, 5)
    beat("job-b")
    beat("job-a")
    beat("job-a", final=True, job_ended=True)
    node.send([*_event(5), b"job-b"])  # the endpoint is still followed after job A ended
    lines = node.finish()
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "gap:" in line] == [
        "shmstat subscribe: gap: job job-a, rank 0 (pid 777, incarnation 0): 2 event items lost on the way to this "
        "subscriber"]
    assert "job job-a ended" in err and "job job-b ended" not in err
    gaps = [line for line in lines if line.get("record") == "gap"]
    assert [(g["job"], g["items"], g["source"]) for g in gaps] == [("job-a", 2, node.endpoint)]
    assert {"record": "end", "source": node.endpoint, "job": "job-a"} in lines
    assert [line["job"] for line in lines if line.get("kind") == "event"] == ["job-a"] + ["job-b"] * 6


def test_loss_reports_count_for_their_job_and_malformed_ones_count_nothing(rig):
    """A subscriber's loss reports (from an XSUB, as ``shmstat subscribe`` sends them) count in the job they name
    on the node's endpoint, in every job's relay on its own endpoint, and nothing else counts: a frame that is not
    a valid report (another version, another key, a negative, huge or non-int count, an unknown kind, too long)."""
    from shmstat.wire.heartbeat import LOSS_REPORT_PREFIX, decode_loss_report, encode_loss_report

    def reporter(endpoint: str) -> zmq.Socket:
        sock = rig.ctx.socket(zmq.XSUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(b"\x01heartbeat/")
        rig.socks.append(sock)
        return sock

    node, own = reporter(rig.node.endpoint), reporter(rig.relays["job-b"].publish_endpoint)
    wait_for(lambda: (rig.update(), b"heartbeat/" in rig.node.prefixes
                      and b"heartbeat/" in rig._job_prefixes(rig.relays["job-b"].publish_endpoint))[1], 10,
             what="the reporters' subscriptions")
    bad = [LOSS_REPORT_PREFIX + msgpack.packb(body) for body in (
        {"v": 2, "job": "job-a", "lost": {"event": 5}}, {"v": 1, "job": "job-a", "lost": {"event": 5}, "x": 1},
        {"v": 1, "job": "job-a", "lost": {"event": -5}}, {"v": 1, "job": "job-a", "lost": {"event": 1 << 60}},
        {"v": 1, "job": "job-a", "lost": {"event": 5.0}}, {"v": 1, "job": "job-a", "lost": {"heartbeat": 5}},
        {"v": 1, "job": 7, "lost": {"event": 5}})] + [LOSS_REPORT_PREFIX + b"\xc1", b"\x02"]
    long = LOSS_REPORT_PREFIX + msgpack.packb({"v": 1, "job": "x" * 600, "lost": {"event": 5}})
    assert decode_loss_report(long) is None and encode_loss_report({"event": 5}, "x" * 600) is None
    for frame in bad:  # before the good ones, on the same pipe: read first
        node.send(frame)
    node.send(encode_loss_report({"event": 7, "stat": 2}, "job-a"))
    node.send(encode_loss_report({"event": 3}, "job-b"))
    node.send(encode_loss_report({"event": 1000}, "no-such-job"))  # nobody's: counted by no relay
    own.send(encode_loss_report({"metric": 4}))
    want = {"job-a": {"event": 7, "metric": 0, "stat": 2, "rank": 0}, "job-b": {"event": 3, "metric": 4, "stat": 0,
                                                                             "rank": 0}}
    wait_for(lambda: (rig.update(), {j: r.counters.subscriber_lost for j, r in rig.relays.items()} == want)[1], 10,
             what=f"the counters {want}")
