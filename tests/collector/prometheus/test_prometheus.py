"""The Prometheus endpoint, tested against the real thing: Debian's ``prometheus`` (2.42) scrapes two collectors
that stand for two nodes (found through the ``file_sd`` files they write), and its HTTP API reconciles: the
counts summed across both nodes equal the samples the ranks added, per-rank series exist for every rank, and a
p99 merged by ``histogram_quantile`` over both nodes is within the bucket error of the exact one. Plus the
exposition itself, read with prometheus_client's own parser, and bad options."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from kit.percentiles import percentile_rank
from kit.procs import REPO, spawn, start_collector
from kit.prometheus import file_sd_job, needs_prometheus, query, scraping, start_prometheus, value
from kit.support import unique_job, wait_for

from collector.prometheus.exporter import BUCKET_BOUNDS
from shmstat.shm.segment import Segment


def _metrics_url(coll) -> str:
    """The collector's ``/metrics`` URL, from its ready file."""
    assert coll.prometheus is not None, "the collector was started without --prometheus"
    return coll.prometheus


def _start(job: str, node: str, sd: str):
    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--prometheus", "127.0.0.1:0",
                           "--prometheus-node", node, "--prometheus-sd", sd, "--status-interval", "0")
    return coll


def _start_prometheus(tmp_path, sd_dir) -> tuple[subprocess.Popen, str]:
    """A real Prometheus scraping, every second, the targets of the ``file_sd`` files in ``sd_dir``; returns it
    and its base URL."""
    return start_prometheus(tmp_path, file_sd_job(sd_dir))


@needs_prometheus
def test_a_real_prometheus_merges_two_nodes_exactly(tmp_path):
    jobs = {"node-a": unique_job("pa"), "node-b": unique_job("pb")}
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    colls = {node: _start(job, node, str(sd_dir / f"{node}.json")) for node, job in jobs.items()}
    prom, base = _start_prometheus(tmp_path, sd_dir)
    n, window_ms = 3000, 100
    try:
        for node in jobs:
            assert json.loads((sd_dir / f"{node}.json").read_text())[0]["labels"] == {"node": node}
        procs = [spawn(percentile_rank, job, r, 2, n, window_ms, str(tmp_path / f"{node}.r{r}.json"))
                 for node, job in jobs.items() for r in range(2)]
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        total = 4 * n
        merged = 'sum(shmstat_stat_count_total{stat="step_ms",rank=""})'
        wait_for(lambda: value(base, merged) == total, 60,
                 what=f"Prometheus to see all {total} samples (log: {tmp_path / 'prometheus.log'})")
        by_node = {r["metric"]["node"]: float(r["value"][1])
                   for r in query(base, 'sum by (node) (shmstat_stat_count_total{stat="step_ms",rank=""})')}
        assert by_node == {"node-a": 2 * n, "node-b": 2 * n}
        per_rank = query(base, 'shmstat_stat_count_total{stat="step_ms",rank!=""}')
        assert sorted((r["metric"]["node"], r["metric"]["rank"], float(r["value"][1])) for r in per_rank) == [
            ("node-a", "0", n), ("node-a", "1", n), ("node-b", "0", n), ("node-b", "1", n)]
        assert value(base, 'sum(shmstat_stat_count_total{stat="step_ms",rank!=""})') == total
        samples = []
        for node in jobs:
            for r in range(2):
                with open(tmp_path / f"{node}.r{r}.json") as f:
                    samples += [v for vs in json.load(f).values() for v in vs]
        assert len(samples) == total
        exact = float(np.quantile(samples, 0.99, method="inverted_cdf"))
        p99 = value(base, 'histogram_quantile(0.99, sum by (le) (shmstat_stat_hist_bucket{stat="step_ms"}))')
        assert p99 is not None and abs(p99 - exact) / exact <= 2 ** 0.25 - 1, (p99, exact)
        assert value(base, 'sum(shmstat_stat_hist_count{stat="step_ms"})') == total
    finally:
        prom.terminate()
        prom.wait(30)
        for coll in colls.values():
            coll.stop()
        for job in jobs.values():
            Segment.unlink(job)
    assert not list(sd_dir.glob("*.json")), "a clean exit removes the file_sd file"


def test_the_exposition_parses_and_reconciles(job, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--prometheus", "127.0.0.1:0",
                           "--status-interval", "0")
    try:
        p = spawn(percentile_rank, job, 0, 1, 2000, 100, str(tmp_path / "r0.json"))
        p.join(60)
        assert p.exitcode == 0
        url = _metrics_url(coll)

        def families():
            with urllib.request.urlopen(url, timeout=5) as r:
                return {f.name: f for f in text_string_to_metric_families(r.read().decode())}

        def counted():
            fams = families()
            c = fams.get("shmstat_stat_count")
            return fams if c and [s.value for s in c.samples if "rank" not in s.labels] == [2000] else None

        fams = wait_for(counted, 20, what="every sample counted on /metrics")
        hist = fams["shmstat_stat_hist"]
        buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
        assert len(buckets) == len(BUCKET_BOUNDS) + 1 and buckets[-1].labels["le"] == "+Inf"
        values = [s.value for s in buckets]
        assert values == sorted(values) and values[-1] == 2000  # cumulative, ending at the count
        rank_series = [s for s in fams["shmstat_stat_count"].samples if s.labels.get("rank") == "0"]
        assert [s.value for s in rank_series] == [2000]
        assert all(s.labels["job"] == job for s in rank_series)
        p99 = [s.value for s in fams["shmstat_stat_p99"].samples if "rank" not in s.labels]
        assert len(p99) == 1 and math.isfinite(p99[0]) and p99[0] > 0
    finally:
        coll.stop()


@pytest.mark.parametrize(("args", "says"), [
    (("--prometheus", "nowhere"), "HOST:PORT"),
    (("--prometheus", "127.0.0.1:99999"), "HOST:PORT"),
    (("--prometheus-sd", "/tmp/x.json"), "--prometheus-sd needs --prometheus"),
])
def test_bad_prometheus_options_are_one_sentence(job, args, says):
    r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, *args], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not [f for f in os.listdir("/dev/shm") if job in f]


def test_a_port_taken_is_one_sentence(job):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--prometheus",
                            f"127.0.0.1:{port}"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                           capture_output=True, text=True, timeout=60)
    Segment.unlink(job)
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr, r.stderr


@needs_prometheus
def test_a_real_prometheus_counts_put_metrics_and_prof_calls_exactly(tmp_path):
    from test_put_metric_counters import FAILURES, SUCCESSES, prof_rank

    job = unique_job("pm")
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    coll = _start(job, "node-a", str(sd_dir / "node-a.json"))
    prom, base = _start_prometheus(tmp_path, sd_dir)
    ranks, calls = 3, 200
    try:
        wait_for(lambda: scraping(base), 30, what="Prometheus scraping the collector")
        # 10 ms between calls: the counters grow over several scrapes, so rate() has something to say
        procs = [spawn(prof_rank, job, r, ranks, calls, 0.01) for r in range(ranks)]
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        count = f'shmstat_metric_count_total{{job="{job}", name=~".*work_step.%s"}}'
        wait_for(lambda: value(base, f"sum({count % 'duration.ms'})") == ranks * calls, 60,
                 what=f"Prometheus to see every @prof call (log: {tmp_path / 'prometheus.log'})")
        assert value(base, f"sum({count % 'success'})") == ranks * SUCCESSES
        assert value(base, f"sum({count % 'failure'})") == ranks * FAILURES
        per_rank = {r["metric"]["rank"]: float(r["value"][1]) for r in query(base, count % "success")}
        assert per_rank == {str(r): SUCCESSES for r in range(ranks)}
        total = f'shmstat_metric_sum_total{{job="{job}", name=~".*work_step.success"}}'
        assert value(base, f"sum({total})") == ranks * SUCCESSES
        # counters, as Prometheus reads them: never reset, and rate() sees them grow on every rank
        assert value(base, f"sum(resets({count % 'success'}[5m]))") == 0
        rates = query(base, f"max_over_time(rate({count % 'success'}[3s])[5m:1s])")
        assert len(rates) == ranks and all(float(r["value"][1]) > 0 for r in rates), rates
        assert value(base, f'sum(shmstat_metric_dropped_total{{job="{job}"}})') == 0
    finally:
        prom.terminate()
        prom.wait(30)
        coll.stop()
        Segment.unlink(job)
