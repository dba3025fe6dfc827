"""The one serving loop (collector/daemon/loop.py): a per-job collector is the loop serving its one job, a node
collector the same loop serving every job it picked up; both stop the same way. Real segments, real sockets, a real
rank (this process), collectors serving in a thread as ``shmstat run``'s does."""

from __future__ import annotations

import threading

from kit.support import wait_for

from collector import Collector, CollectorConfig
from collector.daemon.loop import Loop
from collector.daemon.node import NodeCollector
from shmstat.job.attach import init


def _serve_in_a_thread(loop: Loop) -> threading.Thread:
    thread = threading.Thread(target=loop.serve, daemon=True)
    thread.start()
    return thread


def test_a_job_alone_and_a_node_s_jobs_are_served_and_stopped_by_the_same_loop(job):
    init(job, rank=0, publish=False)
    c = Collector(CollectorConfig(job=job, status_interval_s=0.0, hold_ms=0))
    thread = _serve_in_a_thread(c.loop)
    wait_for(lambda: c.rank_looks >= 1 and c.last_ranks, 10, what="the per-job collector's first rank look")
    c.request_stop()
    thread.join(10)
    assert not thread.is_alive() and c.relay is None and c.segment is None, "the stop did not close the job"
    assert not c.emitted_everything  # this process, a live rank, still adds to its open windows

    node = NodeCollector(CollectorConfig(job="", status_interval_s=0.0, hold_ms=0), jobs=[job],
                         discover_interval_s=0.05)
    thread = _serve_in_a_thread(node.loop)
    try:
        wait_for(lambda: job in node.collectors and node.collectors[job].rank_looks >= 1, 10,
                 what="the node collector to pick the job up and turn it")
        served = node.collectors[job]
        assert type(served.loop) is type(node.loop) is type(c.loop) is Loop
    finally:
        node.loop.request_stop()
        thread.join(10)
    assert not thread.is_alive() and node.collectors == {} and served.relay is None, "the stop did not let it go"


def test_a_stop_asked_before_serving_still_takes_one_turn(job):
    """A collector stopped as soon as it started still reports its counters once (one turn, then the close)."""
    init(job, rank=0, publish=False)
    c = Collector(CollectorConfig(job=job, status_interval_s=0.0, hold_ms=0))
    c.request_stop()
    c.serve()
    assert c.rank_looks == 1 and c.relay is None
