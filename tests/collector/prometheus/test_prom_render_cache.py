"""The cached ``/metrics`` rendering (collector/prometheus/server.py), over a real HTTP server on a free loopback port:
a cheap rendering is redone for a scrape that finds new figures; while an expensive one is under way a scrape
gets the previous rendering at once (not a half-built one) and the next scrape the new one; a failing
rendering answers 500 with the reason; the exporter's figures reach a scrape right after ``observe``."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from collector.prometheus.exporter import PrometheusExporter
from collector.prometheus.server import MetricsServer, RenderCache
from collector.read.columns import Columns
from collector.read.rows import WindowRow
from shmstat.shm.layout_records import WindowFigures


class _Source:
    """A registry collector yielding one gauge whose value the test sets; can be made to block or fail."""

    def __init__(self) -> None:
        self.value = 0.0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail = False

    def collect(self):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("figures unavailable")
        g = GaugeMetricFamily("probe", "a probe")
        g.add_metric([], self.value)
        yield g


def _scrape(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    return fams["probe"].samples[0].value


@pytest.fixture
def served():
    src = _Source()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(src)
    made = []

    def make(**kw):
        cache = RenderCache(registry, **kw)
        server = MetricsServer(cache, "127.0.0.1", 0)
        made.append((cache, server))
        return cache, f"http://127.0.0.1:{server.port}/metrics"

    yield src, make
    for cache, server in made:
        server.close()
        cache.close()


def test_a_cheap_rendering_serves_the_newest_figures(served):
    src, make = served
    cache, url = make()
    for value in (1.0, 2.0, 3.0):
        src.value = value
        cache.invalidate()
        assert _scrape(url) == value


def test_a_scrape_during_an_expensive_rendering_gets_the_previous_one_at_once(served):
    src, make = served
    cache, url = make(cheap_s=0.0, max_share=1.0)  # every rendering counts as expensive
    src.value = 1.0
    cache.invalidate()
    assert cache.wait_rendered(10)
    assert _scrape(url) == 1.0
    src.gate, src.entered = threading.Event(), threading.Event()
    src.value = 2.0
    cache.invalidate()
    assert src.entered.wait(10), "the background thread renders new figures"
    assert _scrape(url) == 1.0  # returns while the rendering is held: the previous complete one
    src.gate.set()
    assert cache.wait_rendered(10)
    assert _scrape(url) == 2.0


def test_a_failing_rendering_answers_500_with_the_reason(served):
    src, make = served
    src.fail = True  # from the start: no rendering exists, so every scrape renders itself
    cache, url = make()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 500 and "figures unavailable" in err.value.read().decode()
    src.fail = False
    cache.invalidate()
    assert _scrape(url) == 0.0


def test_bad_share_is_refused():
    with pytest.raises(ValueError, match="max_share"):
        RenderCache(CollectorRegistry(), max_share=0.0)


def test_the_exporter_serves_figures_right_after_observe():
    ex = PrometheusExporter("127.0.0.1:0", node="n1")
    url = ex.start()
    try:
        for n in (1, 2, 3):
            row = WindowRow("g", "g.s", 1, 1000, 0b100, None, WindowFigures(5, 5.0, 1.0, 1.0, 1.0, 1))
            ex.observe_columns(Columns.from_rows("j", [row]))
            with urllib.request.urlopen(url, timeout=10) as r:
                fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            assert [s.value for s in fams["shmstat_stat_count"].samples] == [5.0 * n]
    finally:
        ex.close()
