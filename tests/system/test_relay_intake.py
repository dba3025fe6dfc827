"""The collector's intake end to end: a real rank process logs events and put_metrics into a real collector.

Events are counted, sequence-checked and re-published from their header alone (never decoded in Python);
metric items are decoded only for groups someone uses (a handler that does not discard them, or the Prometheus
exporter). The same guarantees hold on the pure-Python path.
"""

from __future__ import annotations

import zmq
from kit.handlers.user import Recording
from kit.procs import spawn
from kit.support import FakeClock, step_and_wait, unique_job, wait_for

from collector import Collector, CollectorConfig
from elastic.metrics import NullMetricHandler
from shmstat import wire
from shmstat.shm.segment import Segment

N_EVENTS = 5000
N_METRICS = 300


def rank_process(job: str) -> None:
    """A rank: N_EVENTS events, then N_METRICS metrics in group "kept" and as many in "quiet", then shutdown."""
    import shmstat
    from elastic import metrics

    shmstat.init(job, rank=3)
    event = shmstat.Event("tick", __import__("datetime").datetime.now(), {"step": 1, "loss": 0.5, "tag": "x"})
    for _ in range(N_EVENTS):
        shmstat.log_event(event)
    for i in range(N_METRICS):
        metrics.put_metric("m", i, "kept")
        metrics.put_metric("m", i, "quiet")
    shmstat.shutdown(flush_timeout_s=30)


def test_events_and_metrics_of_a_real_rank(monkeypatch, backend) -> None:
    """On the C backend the intake decodes no event and only the metric groups someone uses; on both, every item
    is counted once (the rank runs the same backend: it inherits the test's)."""
    pure = backend == "python"
    decoded: list[bytes] = []
    real_decode = wire.decode

    def spy(topic, payload):
        decoded.append(bytes(topic))
        return real_decode(topic, payload)

    monkeypatch.setattr(wire, "decode", spy)
    job = unique_job("intake")
    rec = Recording()
    col = Collector(CollectorConfig(job=job, grace_ms=0, clock=FakeClock()),
                    handler_objects={"*": rec, "quiet": NullMetricHandler()})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"event/")
    sub.connect(col.publish_endpoint)
    proc = None
    try:
        step_and_wait(col)
        wait_for(lambda: col.step(5) or col.relay.prefixes, 10, what="the subscription to reach the collector")
        proc = spawn(rank_process, job)
        c = col.relay_counters
        republished = [0]

        def taken() -> bool:
            col.step(5)
            while sub.poll(0):
                frames = sub.recv_multipart()
                msg = real_decode(frames[0], frames[1])  # the frames go out as they came in: still valid
                assert msg.kind == "event" and msg.rank == 3
                republished[0] += len(msg.items)
            return c.events >= N_EVENTS and c.metrics >= 2 * N_METRICS and republished[0] >= N_EVENTS

        wait_for(taken, 60, what="every event and metric of the rank")
        # served as a running collector serves it: the rank waits at exit for the acknowledgement of what it sent
        wait_for(lambda: col.step(5) or not proc.is_alive(), 30, what="the rank to exit")
        proc.join(30)
        assert proc.exitcode == 0
        assert (c.events, c.metrics, c.gaps, c.rejected, republished[0]) == (N_EVENTS, 2 * N_METRICS, 0, 0, N_EVENTS)
        assert sorted(m.value for m in rec.got if m.group_name == "kept") == list(range(N_METRICS))
        assert not [m for m in rec.got if m.group_name == "quiet"]
        if not pure:
            assert not [t for t in decoded if t.startswith((b"event/", b"metric/quiet/"))], "decoded needlessly"
            assert any(t.startswith(b"metric/kept/") for t in decoded)
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
        sub.close(0)
        ctx.term()
        col.close()
        Segment.unlink(job)


def test_the_group_a_metric_topic_carries_is_its_first_segment() -> None:
    from collector.daemon.job_pass import candidate_groups

    assert candidate_groups(b"metric/a/b/c") == ["a"]  # a group holds no '/' (shmstat.names; the wire checks it)
    assert candidate_groups(b"metric/g/m") == ["g"]
