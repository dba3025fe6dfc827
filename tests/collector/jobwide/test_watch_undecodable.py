"""A broken or hostile sender on a node's endpoint: the job-wide watcher (collector.watch's sockets,
:class:`collector.jobwide.watch.NodeStreams`, and ``shmstat top --nodes``) skips each message that does not decode
and counts it (:attr:`JobWatch.undecodable`, the footer of ``top --nodes``), while the valid messages among them are
taken: K bad + M good sent = K counted + M taken.

The publisher is a real ZeroMQ ``XPUB`` on port 0 that waits for the watcher's subscriptions before it sends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import msgpack
import zmq
from kit.procs import REPO
from kit.support import wait_for

from collector.jobwide.watch import TOPICS, JobWatch, NodeStreams
from collector.read.rows import WindowRow
from shmstat import wire
from shmstat.aggregation import Aggregation as A
from shmstat.aggregation import to_mask
from shmstat.shm.layout_records import WindowFigures

JOB = "watchbad"
_TOPIC = b"stat/train/step"


def _good(wid: int) -> list[bytes]:
    """One valid ``stat/train/step`` message of window ``wid`` for ranks 0 and 1, as a node collector sends it."""
    items = [WindowRow("train", "step", wid, 100, to_mask([A.COUNT, A.MEAN]), rank,
                       WindowFigures(5, 50.0, 10.0, 10.0, 10.0, 0)).to_wire() for rank in (0, 1)]
    return [_TOPIC, wire.encode("stat", -1, 1, 0, 0, items), JOB.encode()]


BAD: list[list[bytes]] = [
    [_TOPIC, b"\xc1not msgpack", JOB.encode()],
    [_TOPIC],  # one frame
    [_TOPIC, _good(1)[1], b"not a job id!"],
    [_TOPIC, _good(1)[1], JOB.encode(), b"extra"],  # four frames
    [_TOPIC, msgpack.packb([1, 2, 3]), JOB.encode()],  # not a map
    [wire.HEARTBEAT_TOPIC.encode(), b"junk", JOB.encode()],
    [b"event/shmstat.hang", _good(1)[1][:-3], JOB.encode()],  # truncated
]


class _Publisher:
    """A raw publisher bound on port 0, standing for a node collector's endpoint."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def wait_subscribed(self, pump=lambda: None) -> None:
        """Until the watcher subscribed to every topic it follows (its messages would be dropped before)."""
        wanted = {b"\x01" + t.encode() for t in (*TOPICS, wire.HEARTBEAT_TOPIC)}
        seen: set[bytes] = set()

        def subscribed() -> bool:
            pump()
            while self.sock.poll(0):
                seen.add(self.sock.recv())
            return wanted <= seen

        wait_for(subscribed, 20, what="the watcher's subscriptions")

    def send_all(self, good: int) -> None:
        """Every bad message, with ``good`` valid windows (1..good) among them."""
        for i, frames in enumerate(BAD):
            if i < good:
                self.sock.send_multipart(_good(i + 1))
            self.sock.send_multipart(frames)
        for wid in range(len(BAD) + 1, good + 1):
            self.sock.send_multipart(_good(wid))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_each_undecodable_message_is_counted_and_the_valid_ones_among_them_taken():
    pub = _Publisher()
    jw = JobWatch(windows=1, settle_s=60.0)
    streams = NodeStreams([f"n1={pub.endpoint}"], jw)
    try:
        pub.wait_subscribed(lambda: streams.poll(0.01))
        good = 5
        pub.send_all(good)

        def scored() -> int:
            views = jw.views()
            return views[0].stats[0].wid if views and views[0].stats else -1

        # window good-1 is scored once window good arrived: every valid message was taken
        wait_for(lambda: streams.poll(0.05) is not None and jw.undecodable >= len(BAD) and scored() == good - 1,
                 20, what=f"{len(BAD)} undecodable and window {good - 1} scored")
        streams.poll(0.2)
        assert jw.undecodable == len(BAD)
        assert scored() == good - 1 and jw.late == 0
    finally:
        streams.close()
        pub.close()


def _top_nodes(pub: _Publisher, send: Callable[[], None], *flags: str) -> str:
    """Three frames of a real ``shmstat top --nodes`` on ``pub``'s endpoint (piped) while ``send`` publishes."""
    top = subprocess.Popen([sys.executable, "-m", "collector", "top", "--nodes", f"n1={pub.endpoint}",
                            "--interval", "1", "--iterations", "3", *flags],
                           cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, COLUMNS="100"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pub.wait_subscribed()
        send()
        out, err = top.communicate(timeout=60)
    finally:
        if top.poll() is None:
            top.kill()
        pub.close()
    assert top.returncode == 0, err
    return out


def test_top_nodes_shows_the_undecodable_count_in_its_footer():
    pub = _Publisher()
    out = _top_nodes(pub, lambda: pub.send_all(3))
    counts = re.findall(r"(\d+) undecodable", out)
    assert counts and int(counts[-1]) == len(BAD), out


def test_top_nodes_silent_after_names_a_quiet_node_sooner_than_the_default():
    """``--silent-after 1``: a node heard once and quiet after is shown ``SILENT`` within the frames of 3 s (the
    default, 5 s, would not show it yet)."""
    pub = _Publisher()
    # heard once, then nothing: no row, no heartbeat
    out = _top_nodes(pub, lambda: pub.sock.send_multipart(_good(1)), "--silent-after", "1")
    last = out.split("\n\n")[-1]
    assert re.search(r"^n1\b.*SILENT \d+ s", last, re.M), out
    assert "0 undecodable" in last, out
