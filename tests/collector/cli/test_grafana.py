"""``shmstat grafana``: the dashboard it prints, every panel's PromQL run against a real Prometheus (Debian's 2.42)
scraping the real collector of a running job (``shmstat run`` of tests/kit/programs/report_job.py: three ranks, the
last a straggler, and a stat of group ``gpu`` standing in for the collector's GPU figures, which are stats of that
group): each query returns data, the straggler score picks out the slow rank, and the template variables'
queries find the job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import urllib.request

from kit.procs import REPO
from kit.prometheus import file_sd_job, needs_prometheus, query, scraping, start_prometheus
from kit.support import unique_job, wait_for

from collector.cli.grafana import PANELS, dashboard
from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "report_job.py")
RANKS = 3


def _printed_dashboard() -> dict:
    done = subprocess.run([sys.executable, "-m", "collector", "grafana", "--title", "jobs", "--uid", "u1"],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_printed_dashboard_is_the_model_with_one_panel_per_entry():
    model = _printed_dashboard()
    assert model == dashboard(title="jobs", uid="u1")
    panels = model["panels"]
    assert [p["title"] for p in panels] == [p.title for p in PANELS]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    assert [v["name"] for v in model["templating"]["list"]] == ["datasource", "job", "stat", "node"]


def _substitute(expr: str, job: str) -> str:
    """A panel's PromQL as Grafana sends it for this job, the stat ``step_ms`` and every node."""
    return (expr.replace("$job", job).replace("$stat", "step_ms").replace("$node", ".*")
            .replace("$__rate_interval", "4s"))


def _series(base: str, selector: str) -> list[dict]:
    url = f"{base}/api/v1/series?" + urllib.parse.urlencode({"match[]": selector})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["data"]


@needs_prometheus
def test_every_panel_query_returns_data_from_a_real_prometheus_scraping_a_running_job(tmp_path):
    model = _printed_dashboard()
    job = unique_job("graf")
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    prom, base = start_prometheus(tmp_path, file_sd_job(sd_dir))
    env = dict(os.environ, PYTHONPATH=REPO, SECONDS_TO_RUN="120", WINDOW_S="0.2")
    run = subprocess.Popen(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", str(RANKS), "--grace-ms", "20",
         "--handler", "*=null", "--prometheus", "127.0.0.1:0", "--prometheus-sd", str(sd_dir / "node.json"),
         "--prometheus-node", "node-a", "--events", f"jsonl:{tmp_path / 'events.jsonl'}", SCRIPT],
        env=env, cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: scraping(base), 60, what=f"Prometheus scraping the job (log: {tmp_path / 'prometheus.log'})")
        empty: dict[str, list[str]] = {}

        def every_panel_has_data() -> bool:
            empty.clear()
            for panel in model["panels"]:
                for target in panel["targets"]:
                    if not query(base, _substitute(target["expr"], job)):
                        empty.setdefault(panel["title"], []).append(target["expr"])
            return not empty

        wait_for(every_panel_has_data, 90, interval_s=1.0, what=f"data in every panel (still empty: {empty})")
        # the GPU panel holds the gpu group's stat, per rank
        gpu = next(p for p in model["panels"] if p["title"] == "GPU per rank")
        rows = query(base, _substitute(gpu["targets"][0]["expr"], job))
        assert {(r["metric"]["stat"], r["metric"]["rank"]) for r in rows} == {
            ("util_percent", str(rank)) for rank in range(RANKS)}
        # the straggler score: the last rank (three times slower) under the threshold, the others not
        score = next(p for p in model["panels"] if p["title"] == "Straggler score per rank")
        threshold = score["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]

        def scores() -> dict[str, float] | None:
            found = {r["metric"]["rank"]: float(r["value"][1])
                     for r in query(base, _substitute(score["targets"][0]["expr"], job))}
            return found if len(found) == RANKS else None

        by_rank = wait_for(scores, 30, what="a score for every rank")
        assert by_rank[str(RANKS - 1)] < threshold <= min(by_rank[str(r)] for r in range(RANKS - 1)), by_rank
        # the template variables' queries find this job, its stats and its node
        for variable in model["templating"]["list"][1:]:
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
            values = {s[label] for s in _series(base, selector.replace("$job", job))}
            wanted = {"job": job, "stat": "step_ms", "node": "node-a"}[variable["name"]]
            assert wanted in values, (variable["name"], values)
    finally:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(60)
        finally:
            prom.terminate()
            prom.wait(30)
            Segment.unlink(job)


@needs_prometheus
def test_the_score_panel_puts_a_rates_slow_rank_alone_under_the_line_as_the_collector_scores_it(tmp_path):
    """A real job (tests/kit/programs/names_rate_job.py) whose rate ``train/tok[/s]`` is declared higher_is_better,
    rank 1 the fastest (1600/s) and rank 2 the slow one (300/s, the median 1000), scraped by a real Prometheus:
    the dashboard's straggler score panel, as Grafana sends it for that stat, gives rank 2 alone a score under its
    threshold line, and each rank the collector's own score (figure / median: 1.0, 1.6, 0.3); the time
    ``step time [ms]`` (rank 2 three times slower) still puts rank 2 alone under the line."""
    from kit.names_rate import RANKS, RATE, RATES, SLOW_RANK, STEP, start_job, stop_job

    model = _printed_dashboard()
    score = next(p for p in model["panels"] if p["title"] == "Straggler score per rank")
    threshold = score["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]
    job = unique_job("grafrate")
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    prom, base = start_prometheus(tmp_path, file_sd_job(sd_dir))
    run = start_job(job, tmp_path, "--handler", "*=null", "--prometheus", "127.0.0.1:0", "--prometheus-sd",
                    str(sd_dir / "node.json"), "--prometheus-node", "node-a", seconds=120)
    try:
        wait_for(lambda: scraping(base), 60, what=f"Prometheus scraping the job (log: {tmp_path / 'prometheus.log'})")

        def scores(stat: str) -> dict[str, float] | None:
            regex = re.escape(stat).replace("\\", "\\\\")  # Grafana escapes a chosen value; PromQL a backslash
            expr = score["targets"][0]["expr"].replace("$job", job).replace("$stat", regex).replace("$node", ".*")
            found = {r["metric"]["rank"]: float(r["value"][1]) for r in query(base, expr.replace(
                "$__rate_interval", "4s")) if r["metric"]["stat"] == stat}
            return found if len(found) == RANKS else None

        median = sorted(RATES.values())[1]
        by_rank = wait_for(lambda: scores(RATE[1]), 60, what="a score of the rate for every rank")
        assert by_rank == {str(r): RATES[r] / median for r in range(RANKS)}, by_rank
        assert [r for r, s in by_rank.items() if s < threshold] == [str(SLOW_RANK)], by_rank
        times = wait_for(lambda: scores(STEP[1]), 60, what="a score of the time for every rank")
        assert [r for r, s in times.items() if s < threshold] == [str(SLOW_RANK)], times
    finally:
        stop_job(run)
        prom.terminate()
        prom.wait(30)
        Segment.unlink(job)
