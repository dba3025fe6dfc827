"""One fan-out per collector pass: a consumer added with one class and one registration sees every pass's windows
and put metrics exactly once, on the loop or on a thread of its own (real segment, real sockets, injected clock)."""

from __future__ import annotations

import threading

from kit.handlers.user import Recording
from kit.support import FakeClock, step_and_wait, wait_for

from collector import Collector, CollectorConfig
from collector.read.passes import Pass, PassConsumer
from elastic.metrics import MetricData
from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init, shutdown
from shmstat.writer.stat import Stat


class _Tally:
    """The smallest consumer: counts the windows (merged rows) and put metrics of every pass it takes."""

    def __init__(self, on_loop: bool) -> None:
        self.on_loop = on_loop
        self.windows: list[tuple[str, int]] = []
        self.puts: list[str] = []
        self.passes = 0
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def wants(self, group: str, what: str) -> bool:
        return group == "g" or what == "puts"

    def take(self, pass_: Pass) -> None:
        with self.lock:
            self.passes += 1
            self.threads.add(threading.current_thread().name)
            cols = pass_.columns
            if cols is not None and len(cols):
                merged = cols.merged()
                self.windows += list(zip(merged.stat.tolist(), merged.wid.tolist(), strict=True))
            self.puts += [p.metric.name for p in pass_.puts]


def test_a_registered_consumer_sees_every_window_and_put_metric_once(job):
    clock = FakeClock()
    clock.to_window(100)
    c = Collector(CollectorConfig(job=job, grace_ms=0, clock=clock, usage_interval_s=3600.0),
                  handler_objects={"*": Recording()})
    on_loop, threaded = _Tally(on_loop=True), _Tally(on_loop=False)
    assert isinstance(on_loop, PassConsumer)
    c.fanout.register(on_loop)
    c.fanout.register(threaded)
    step_and_wait(c)
    try:
        init(job, rank=0, publish=False)
        s = Stat("lat", [A.COUNT], 0.1, clock=clock, group="g")
        for w in range(5):
            s.add(1.0)
            c.submit_metric(MetricData(clock.now / 1e9, "agent", f"m{w}", float(w)))
            clock.advance_ms(100)
            c.step()
            c.step()  # a turn with nothing new: no window or metric again
        shutdown()
    finally:
        c.close()
    first = on_loop.windows[0][1]
    assert on_loop.windows == [("lat", first + w) for w in range(5)]
    assert on_loop.puts == [f"m{w}" for w in range(5)]
    assert on_loop.threads == {threading.main_thread().name}
    wait_for(lambda: threaded.passes == on_loop.passes, 5, what="the threaded consumer took every pass")
    assert threaded.windows == on_loop.windows and threaded.puts == on_loop.puts
    assert not threaded.threads & {threading.main_thread().name}
    assert c.fanout.dropped == 0 and c.fanout.errors == 0
