"""Events: a rank configured by the environment publishes its first event; every dropped item takes its
sequence number, so the collector's gaps equal the rank's drops; the rank's backlog is bounded in bytes; an
event over the wire's maximum is refused clearly. Real rank processes, a real collector, real sockets."""

from __future__ import annotations

import json
import os

import psutil
import pytest
from kit.faults import Subscriber
from kit.procs import spawn, start_collector
from kit.support import wait_for

import shmstat
from shmstat.publish.publisher import Publisher
from shmstat.wire import MAX_EVENT_BYTES


def _env_rank(rank: int, torchrun: bool, events: int, n_metrics: int) -> None:
    if torchrun:  # the job as torchrun names it, not SHMSTAT_JOB
        job = os.environ.pop("SHMSTAT_JOB")
        for name in ("SHMSTAT_RANK", "SHMSTAT_LOCAL_RANK", "SHMSTAT_WORLD_SIZE"):
            del os.environ[name]
        os.environ.update(TORCHELASTIC_RUN_ID=job, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="1",
                          LOCAL_WORLD_SIZE="1")
    import datetime

    import elastic.metrics as metrics
    import shmstat

    for i in range(events):  # before any Stat or metric: log_event itself attaches
        shmstat.log_event(shmstat.Event("early", datetime.datetime.now(), {"i": i}))
    for i in range(n_metrics):
        metrics.put_metric("m", i, "g")
    shmstat.shutdown(flush_timeout_s=20)


@pytest.mark.parametrize("torchrun", [False, True], ids=["shmstat-env", "torchrun-env"])
def test_a_rank_configured_by_the_environment_publishes_its_first_events(shmstat_job, torchrun):
    shmstat_job.run_ranks(_env_rank, 1, args=(torchrun, 100, 10))
    events = shmstat_job.wait_for_event("early", count=100, timeout=20)
    assert sorted(e.data["i"] for e in events) == list(range(100)) and {e.rank for e in events} == {0}
    metrics = shmstat_job.wait_for_metric("m", count=10, group="g", timeout=20)
    assert sorted(m.value for m in metrics) == list(range(10))


def _burst(job: str, n: int, backlog_mb: float, out: str) -> None:
    import datetime

    import shmstat

    shmstat.init(job, rank=0, backlog_mb=backlog_mb)
    pub = shmstat.job._state.STATE.publisher
    assert pub is not None
    assert pub.flush(30) or True
    ev = shmstat.Event("burst", datetime.datetime.now(), {"payload": "x" * 200})
    for _ in range(n):
        shmstat.log_event(ev)
    shmstat.shutdown(flush_timeout_s=30)
    stats = pub.stats()
    with open(out, "w") as f:
        json.dump({"queued": stats.queued, "sent": stats.sent_items, "dropped": stats.dropped}, f)


def test_every_dropped_event_takes_its_sequence_number_so_gaps_equal_drops(job, tmp_path):
    coll = start_collector(job, "--handler", "*=null")
    sub = Subscriber(coll.publish, (b"event/burst", b"stat/shmstat/usage"))
    try:
        out = str(tmp_path / "out.json")
        p = spawn(_burst, job, 300_000, 1.0, out)  # a 1 MiB backlog: a burst overflows it while the collector is up
        p.join(120)
        assert p.exitcode == 0
        with open(out) as f:
            rank = json.load(f)
        assert rank["queued"] == 300_000
        assert rank["dropped"] > 0, "the burst did not overflow the backlog; the test proves nothing"
        assert rank["sent"] + rank["dropped"] == 300_000
        wait_for(lambda: sub.received("event") == rank["sent"], 30, what="every sent event at the subscriber")
        (stream,) = sub.snapshot_streams().values()
        assert stream.received == rank["sent"]
        # the collector's own count of the gaps, published in its shmstat group every second
        wait_for(lambda: sub.counter("collector.seq_gaps") == rank["dropped"], 30,
                 what=f"collector.seq_gaps == {rank['dropped']} (the rank's drops)")
    finally:
        sub.close()
        coll.stop()


def test_the_backlog_is_bounded_in_bytes_without_a_collector(job):
    pub = Publisher(f"ipc:///tmp/shmstat-nobody-{job}", rank=0, backlog_bytes=64 * 1024 * 1024)
    proc = psutil.Process()
    before = proc.memory_info().rss
    big = "y" * 900_000
    try:
        for i in range(1500):  # 1.35 GB offered
            pub.publish_event("big", i, {"blob": big + str(i)})
        pub.flush(0.5)
        grown = proc.memory_info().rss - before
        stats = pub.stats()
        assert stats.queued == 1500
        assert stats.dropped + stats.backlog + stats.sent_items == 1500
        assert stats.dropped >= 1500 - 2 * 72  # at most twice the bound (waiting + pending) is kept
        assert grown < 400 * 1024 * 1024, f"rank grew by {grown / 2**20:.0f} MiB"
    finally:
        pub.close(linger_ms=0)


def test_an_event_over_the_maximum_is_refused_and_nothing_is_queued(job):
    import datetime

    shmstat.init(job, rank=0)
    pub = shmstat.job._state.STATE.publisher
    with pytest.raises(shmstat.EventTooLargeError, match="maximum"):
        shmstat.log_event(shmstat.Event("huge", datetime.datetime.now(), {"blob": "z" * (MAX_EVENT_BYTES + 1)}))
    with pytest.raises(shmstat.EventTooLargeError):  # counted in UTF-8 bytes, not characters
        shmstat.log_event(shmstat.Event("huge", datetime.datetime.now(), {"blob": "\u00e9" * (MAX_EVENT_BYTES // 2)}))
    assert pub.stats().queued == 0
    shmstat.log_event(shmstat.Event("fine", datetime.datetime.now(), {"blob": "z" * (MAX_EVENT_BYTES // 2)}))
    assert pub.stats().queued == 1


def test_backlog_size_from_the_environment_is_checked(monkeypatch, job):
    monkeypatch.setenv("SHMSTAT_BACKLOG_MB", "lots")
    with pytest.raises(shmstat.ConfigError, match="SHMSTAT_BACKLOG_MB"):
        Publisher(f"ipc:///tmp/shmstat-nobody-{job}", rank=0)


def _big_events(job: str, n: int) -> None:
    import datetime

    import shmstat

    shmstat.init(job, rank=0)
    blob = "b" * 900_000
    for i in range(n):
        shmstat.log_event(shmstat.Event("big", datetime.datetime.now(), {"blob": blob, "i": i}))
    shmstat.shutdown(flush_timeout_s=30)


def test_a_stopped_subscriber_and_large_events_keep_the_collector_bounded_in_bytes(job):
    import zmq

    coll = start_collector(job, "--handler", "*=null", "--publish-queue", "16")
    proc = psutil.Process(coll.proc.pid)
    ctx = zmq.Context()
    stopped = ctx.socket(zmq.SUB)  # subscribes to everything, then never reads
    stopped.setsockopt(zmq.RCVHWM, 1)
    stopped.setsockopt(zmq.SUBSCRIBE, b"")
    stopped.connect(coll.publish)
    try:
        before = proc.memory_info().rss
        p = spawn(_big_events, job, 400)  # 360 MB of events through the collector
        peak = before
        while p.is_alive():
            peak = max(peak, proc.memory_info().rss)
            p.join(0.05)
        assert p.exitcode == 0
        peak = max(peak, proc.memory_info().rss)
        assert peak - before < 150 * 1024 * 1024, f"collector grew by {(peak - before) / 2**20:.0f} MiB"
        assert coll.proc.poll() is None
    finally:
        stopped.close(0)
        ctx.term()
        assert coll.stop() == 0
