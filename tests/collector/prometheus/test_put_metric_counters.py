"""Put metrics are countable on ``/metrics``: real ranks calling a ``@prof`` function (some calls raising) through a
real collector, scraped and read with prometheus_client's own parser: ``shmstat_metric_count_total`` of
``.success`` / ``.failure`` adds up over the ranks to exactly the calls made, ``shmstat_metric_sum_total`` to the
values put, beside the newest-value gauge. The series a job may hold are bounded in bytes, values past the
bound dropped and counted; counts are ints in the exporter."""

from __future__ import annotations

import contextlib
import time
import urllib.request

import numpy as np
from kit.procs import spawn, start_collector
from kit.support import wait_for

from collector.prometheus.exporter import PrometheusExporter
from collector.prometheus.put_metrics import SERIES_OVERHEAD_BYTES
from collector.read.columns import Columns
from collector.read.rows import WindowRow
from elastic import metrics
from elastic.metrics import MetricData
from shmstat.shm.layout_records import WindowFigures

RANKS, CALLS, FAIL_EVERY = 3, 200, 7
SUCCESSES, FAILURES = CALLS - CALLS // FAIL_EVERY, CALLS // FAIL_EVERY


@metrics.prof(group="work")
def work_step(i: int) -> None:
    """The profiled function: every FAIL_EVERY-th call raises."""
    if i % FAIL_EVERY == FAIL_EVERY - 1:
        raise ValueError(f"call {i} fails on purpose")


def prof_rank(job: str, rank: int, world: int, calls: int = CALLS, pause_s: float = 0.0) -> None:
    """A rank calling ``work_step`` ``calls`` times (``pause_s`` apart), plus one ``put_metric`` of its rank."""
    import shmstat

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    for i in range(calls):
        with contextlib.suppress(ValueError):
            work_step(i)
        if pause_s:
            time.sleep(pause_s)
    metrics.put_metric("rank_id", rank, "work")
    shmstat.shutdown()


def _families(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def _by(fams: dict, family: str, sample: str, suffix: str) -> dict[str, float]:
    """``{rank label: value}`` of the samples named ``sample`` whose ``name`` label ends with ``suffix``."""
    fam = fams.get(family)
    if fam is None:
        return {}
    return {s.labels["rank"]: s.value for s in fam.samples if s.name == sample and s.labels["name"].endswith(suffix)}


def test_prof_success_and_failure_counts_add_up_exactly_across_ranks(job):
    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--prometheus", "127.0.0.1:0",
                           "--status-interval", "0")
    try:
        procs = [spawn(prof_rank, job, r, RANKS) for r in range(RANKS)]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        url = coll.prometheus

        def complete():
            fams = _families(url)
            durations = _by(fams, "shmstat_metric_count", "shmstat_metric_count_total", ".work_step.duration.ms")
            return fams if sum(durations.values()) == RANKS * CALLS else None

        fams = wait_for(complete, 30, what="every @prof call counted on /metrics")
        count = ("shmstat_metric_count", "shmstat_metric_count_total")
        total = ("shmstat_metric_sum", "shmstat_metric_sum_total")
        ranks = {str(r) for r in range(RANKS)}
        assert _by(fams, *count, ".work_step.success") == dict.fromkeys(ranks, SUCCESSES)
        assert _by(fams, *count, ".work_step.failure") == dict.fromkeys(ranks, FAILURES)
        assert sum(_by(fams, *count, ".work_step.success").values()) == RANKS * SUCCESSES  # exactly the calls
        assert sum(_by(fams, *count, ".work_step.failure").values()) == RANKS * FAILURES
        assert _by(fams, *total, ".work_step.success") == dict.fromkeys(ranks, SUCCESSES)  # each put 1
        assert _by(fams, *count, ".work_step.duration.ms") == dict.fromkeys(ranks, CALLS)
        newest = _by(fams, "shmstat_metric", "shmstat_metric", "rank_id")
        assert newest == {r: float(r) for r in ranks}  # the gauge: the newest value, beside the counters
        assert _by(fams, *total, "rank_id") == {r: float(r) for r in ranks}
        for family in ("shmstat_metric", "shmstat_metric_count", "shmstat_metric_sum"):
            assert all(s.labels["job"] == job and s.labels["group"] == "work" and s.labels["node"]
                       for s in fams[family].samples)
        dropped = [s for s in fams["shmstat_metric_dropped"].samples if s.labels["job"] == job]
        assert [s.value for s in dropped] == [0]
    finally:
        coll.stop()


def _exposed(ex: PrometheusExporter) -> dict[str, list]:
    """``{sample name: [Sample, ...]}`` of what the exporter would serve (its families, not parsed text)."""
    out: dict[str, list] = {}
    for fam in ex.collect():
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_put_series_are_bounded_per_job_in_bytes_and_every_value_past_the_bound_is_counted():
    name_of = "step{:04d}.success".format
    cost = len("g") + len(name_of(0)) + SERIES_OVERHEAD_BYTES
    ex = PrometheusExporter("127.0.0.1:0", node="n", max_put_bytes=10 * cost)  # room for 10 series per job
    for i in range(25):
        for _ in range(3):
            ex.observe_metric("a", MetricData(1.0, "g", name_of(i), 1), rank=0)
    ex.observe_metric("a", MetricData(1.0, "g", name_of(0), "text"), rank=0)  # not a number: dropped, counted
    for i in range(4):
        ex.observe_metric("b", MetricData(1.0, "g", name_of(i), 2.5), rank=1)  # another job has its own room
    ex.observe_metric("b", MetricData(1.0, "g", name_of(0), float("inf")), rank=1)
    ex.observe_metric("b", MetricData(1.0, "g", "agent.calls", 7), rank=None)  # the agent's: no rank
    got = _exposed(ex)
    counts = {(s.labels["job"], s.labels["name"], s.labels.get("rank")): s.value
              for s in got["shmstat_metric_count_total"]}
    assert len([k for k in counts if k[0] == "a"]) == 10  # the first ten series, each still counting
    assert all(counts[("a", name_of(i), "0")] == 3 for i in range(10))
    assert {s.labels["job"]: s.value for s in got["shmstat_metric_dropped_total"]} == {"a": 15 * 3 + 1, "b": 0}
    assert ex.put_dropped("a") == 46 and ex.put_dropped("b") == 0
    sums = {(s.labels["job"], s.labels["name"], s.labels.get("rank")): s.value for s in got["shmstat_metric_sum_total"]}
    assert sums[("b", name_of(0), "1")] == 2.5  # the infinity is counted, not summed
    assert counts[("b", name_of(0), "1")] == 2
    assert [s.value for s in got["shmstat_metric"] if s.labels["name"] == name_of(0) and s.labels["job"] == "b"] == [
        float("inf")]
    assert counts[("b", "agent.calls", None)] == 1
    ex.retire_job("a")
    ex.clock = lambda: time.monotonic() + 3600.0
    assert not [s for s in _exposed(ex)["shmstat_metric_count_total"] if s.labels["job"] == "a"]
    for i in range(10, 20):  # a retired job's room is free again
        ex.observe_metric("a", MetricData(1.0, "g", name_of(i), 1), rank=0)
    assert ex.put_dropped("a") == 0


def test_counts_are_ints_in_the_exporter():
    ex = PrometheusExporter("127.0.0.1:0", node="n")
    row = WindowRow("g", "lat", 100, 50, 0b111, None, WindowFigures(3, 6.0, 1.0, 3.0, 3.0, 5, hist=None), ranks=2)
    for _ in range(2):
        per_rank = WindowRow("g", "lat", 100, 50, 0b111, 0, WindowFigures(3, 6.0, 1.0, 3.0, 3.0, 5))
        ex.observe_columns(Columns.from_rows("j", [row, per_rank]))
    for value in (1, 1, True):
        ex.observe_metric("j", MetricData(1.0, "g", "calls.success", value), rank=0)
    got = _exposed(ex)
    assert [(type(s.value), s.value) for s in got["shmstat_stat_count_total"]] == [(int, 6), (int, 6)]
    assert [(type(s.value), s.value) for s in got["shmstat_metric_count_total"]] == [(int, 3)]
    assert [(type(s.value), s.value) for s in got["shmstat_metric_sum_total"]] == [(int, 3)]  # ints add exactly
    big = 2**60  # past float64's exact integers: an int counter stays exact
    ex.observe_metric("j", MetricData(1.0, "g", "big", big), rank=0)
    ex.observe_metric("j", MetricData(1.0, "g", "big", 1), rank=0)
    assert [s.value for s in _exposed(ex)["shmstat_metric_sum_total"] if s.labels["name"] == "big"] == [big + 1]
    assert np.float64(big) + 1 == np.float64(big)  # what a float running total would have said


def test_the_agents_prof_calls_and_metrics_are_counted_without_a_rank_label(tmp_path):
    import os
    import sys
    import threading

    from kit.procs import REPO
    from kit.support import unique_job

    from collector import Collector, CollectorConfig
    from collector.launch.agent import Agent
    from shmstat.shm.segment import Segment

    job = unique_job("agentprom")
    collector = Collector(CollectorConfig(job=job, handlers={"*": "null"}, prometheus="127.0.0.1:0",
                                          status_interval_s=0))
    thread = threading.Thread(target=collector.serve, daemon=True)
    thread.start()
    try:
        env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, STEPS="5", FAIL_RANK="-1")
        program = os.path.join(REPO, "tests", "kit", "programs", "elastic_job.py")
        agent = Agent(collector, job, [sys.executable, program], 2, monitor_interval_s=0.05, env=env)
        assert agent.run().exit_code == 0
        assert collector.exporter is not None
        url = collector.exporter.url
        count = ("shmstat_metric_count", "shmstat_metric_count_total")

        def seen():
            fams = _families(url)
            agent_runs = [s for s in fams["shmstat_metric_count"].samples
                          if s.labels["name"] == "workers.default.run_total"]
            steps = _by(fams, *count, "train_step.success")
            return fams if agent_runs and sum(steps.values()) == 2 * 5 else None

        fams = wait_for(seen, 30, what="the agent's and the ranks' put metrics on /metrics")
        agent_series = {s.labels["name"]: s for s in fams["shmstat_metric_count"].samples
                        if s.labels["group"] == "torchelastic"}
        assert agent_series["workers.default.run_total"].value == 1
        assert agent_series["Agent._start_workers.success"].value == 1
        assert all("rank" not in s.labels and s.labels["job"] == job for s in agent_series.values())
        assert _by(fams, *count, "train_step.success") == {"0": 5, "1": 5}
    finally:
        collector.request_stop()
        thread.join(30)
        Segment.unlink(job)
