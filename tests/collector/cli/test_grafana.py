"""``shmstat grafana``: the dashboard it prints, every panel's PromQL run against a real Prometheus (Debian's 2.42)
scraping the real collector of a running job (``shmstat run`` of tests/kit/programs/report_job.py: three ranks, the
last a straggler, and a stat of group ``gpu`` standing in for the collector's GPU figures, which are stats of that
group): each query returns data, the straggler score picks out the slow rank, and the template variables'
queries find the job. The panels of sections, hangs and nodes are run against a real Prometheus that loads the
rules of ``shmstat prometheus-rules`` while it scrapes two nodes' collectors of one job (each node a ``shmstat run``
of tests/kit/programs/sections_job.py, its series relabelled to one job as a Prometheus of many nodes sees them),
one node slow and then a rank of the other held in a section."""

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
from kit.prometheus import file_sd_job, needs_prometheus, query, scraping, start_prometheus, start_prometheus_as_written
from kit.support import unique_job, wait_for

from collector.cli.grafana import PANELS, dashboard
from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "report_job.py")
SECTIONS_SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "sections_job.py")
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
            for panel, entry in zip(model["panels"], PANELS, strict=True):
                if entry.needs:  # a job with sections, the rules: the next test's
                    continue
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


def test_every_panel_needs_nothing_or_what_the_test_of_sections_hangs_and_nodes_gives_it():
    assert {p.needs for p in PANELS} == {"", "sections", "rules"}
    kinds = {p["type"] for p in dashboard()["panels"]}
    assert kinds == {"timeseries", "status-history"}


NODE_A_RANKS, NODE_B_RANKS = 3, 2  # node-b's ranks twice as slow: the job-wide median is node-a's


@needs_prometheus
def test_the_panels_of_sections_hangs_and_nodes_from_a_real_prometheus_loading_the_rules(tmp_path):
    """Two nodes of one job: node-a (3 ranks) and node-b (2 ranks, every one twice as slow in ``data`` and
    ``[b]forward[/b]``: a slow node whose ranks equal each other), each a ``shmstat run`` with its own collector
    (--prometheus-node, --hang-after 2) of tests/kit/programs/sections_job.py, scraped every second by a real
    Prometheus that loads the printed rules (--interval 4 --windows 1) and relabels both runs' job ids to one job.
    Every panel that needs sections or the rules returns data as Grafana sends it; the section split gives each
    rank's share of its time in data and forward, with allreduce as the wait; the node heatmap puts
    node-b alone under the threshold (0.5: 8 ms against the median 4) and node-a at 1; the straggler panel names
    node-b and its two ranks, on data and on forward, and nothing of node-a. Then rank 0 of node-a is held in
    ``data``: the hung panel goes to 1 for node-a (0 for node-b) and the progress-age panel names rank 0 in data
    and ranks 1 and 2 in allreduce (wait), past the hang threshold."""
    model = _printed_dashboard()
    by_title = {p.title: (p, m) for p, m in zip(PANELS, model["panels"], strict=True)}
    base_job = unique_job("grafsec")
    jobs = {"node-a": f"{base_job}-na", "node-b": f"{base_job}-nb"}
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    rules_path = tmp_path / "shmstat-rules.yml"
    printed = subprocess.run([sys.executable, "-m", "collector", "prometheus-rules", "--interval", "4", "--windows",
                              "1"], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    rules_path.write_text(printed.stdout)
    relabel = ("    metric_relabel_configs:\n      - source_labels: [job]\n"
               f"        regex: '{base_job}-n[ab]'\n        target_label: job\n"
               f"        replacement: '{base_job}'\n")
    config = ("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
              f"rule_files: ['{rules_path}']\nscrape_configs:\n" + file_sd_job(sd_dir, extra=relabel))
    prom, base = start_prometheus_as_written(tmp_path, config)
    stuck = tmp_path / "stuck"
    runs = []
    for node, ranks, slow in (("node-a", NODE_A_RANKS, ""), ("node-b", NODE_B_RANKS, "*")):
        work = tmp_path / node
        work.mkdir()
        env = dict(os.environ, PYTHONPATH=REPO, SECONDS_TO_RUN="150", SHMSTAT_SECTION_WINDOW_S="0.5",
                   SLOW_RANKS=slow, SLOW_FACTOR="2", STUCK_FILE=str(stuck) if node == "node-a" else "",
                   STUCK_RANK="0")
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "collector", "run", "--job", jobs[node], "--nproc-per-node", str(ranks),
             "--grace-ms", "20", "--handler", "*=null", "--hang-after", "2", "--prometheus", "127.0.0.1:0",
             "--prometheus-sd", str(sd_dir / f"{node}.json"), "--prometheus-node", node, SECTIONS_SCRIPT],
            env=env, cwd=str(work), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def ask(title: str, target: int = 0, stat: str = "data") -> list[dict]:
        expr = by_title[title][1]["targets"][target]["expr"]
        return query(base, expr.replace("$job", base_job).replace("$stat", stat).replace("$node", ".*")
                     .replace("$__rate_interval", "4s"))

    try:
        wait_for(lambda: scraping(base) and len(query(base, 'up{job="shmstat"} == 1')) == 2, 60,
                 what=f"Prometheus scraping both nodes (log: {tmp_path / 'prometheus.log'})")
        empty: dict[str, list[int]] = {}

        def every_panel_has_data() -> bool:
            empty.clear()
            for title, (panel, shown) in by_title.items():
                for i in range(len(shown["targets"]) if panel.needs else 0):
                    if not ask(title, i):
                        empty.setdefault(title, []).append(i)
            return not empty

        wait_for(every_panel_has_data, 120, interval_s=1.0, what=f"data in every panel (still empty: {empty})")

        def heatmap() -> dict[str, float] | None:
            rows = {r["metric"]["node"]: float(r["value"][1]) for r in ask(
                "Node heatmap: each node's score against the job's median")}
            return rows if len(rows) == 2 and rows["node-b"] < 0.6 and rows["node-a"] > 0.9 else None

        nodes = wait_for(heatmap, 60, interval_s=0.5, what="node-b alone under the line in the heatmap")
        assert all(r["metric"]["job"] == base_job for r in ask("Node heatmap: each node's score against the job's "
                                                               "median")), nodes
        assert 0.4 <= nodes["node-b"] <= 0.6 and 0.9 <= nodes["node-a"] <= 1.1, nodes
        slow_nodes = {(r["metric"]["node"], r["metric"]["stat"]) for r in ask("Straggler nodes and ranks", 0)}
        slow_ranks = {(r["metric"]["node"], r["metric"]["rank"], r["metric"]["stat"])
                      for r in ask("Straggler nodes and ranks", 1)}
        assert slow_nodes == {("node-b", "data"), ("node-b", "[b]forward[/b]")}, slow_nodes
        assert slow_ranks == {("node-b", str(r), s) for r in range(NODE_B_RANKS)
                              for s in ("data", "[b]forward[/b]")}, slow_ranks
        split = "Section split per rank (share of its time)"
        shares = {(r["metric"]["node"], r["metric"]["rank"], r["metric"]["stat"]): float(r["value"][1])
                  for r in ask(split, 0)}
        waits = {(r["metric"]["node"], r["metric"]["rank"], r["metric"]["stat"]) for r in ask(split, 1)}
        every = [("node-a", str(r)) for r in range(NODE_A_RANKS)] + [("node-b", str(r)) for r in range(NODE_B_RANKS)]
        assert waits == {(n, r, "allreduce") for n, r in every}, waits
        assert set(shares) == {(n, r, s) for n, r in every for s in ("data", "[b]forward[/b]")}, shares
        assert all(v > 0 for v in shares.values()), shares

        stuck.touch()
        hung_title, age_title = "Hangs: jobs hung", "Hangs: seconds since each rank's last progress"

        def hung() -> dict[str, float] | None:
            rows = {r["metric"]["node"]: float(r["value"][1]) for r in ask(hung_title)}
            return rows if rows.get("node-a") == 1 else None

        assert wait_for(hung, 60, interval_s=0.5, what="node-a hung in the hung panel") == {"node-a": 1.0,
                                                                                             "node-b": 0.0}
        threshold = by_title[age_title][1]["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]
        assert threshold == 30.0
        holding = {(r["metric"]["rank"], r["metric"]["section"]) for r in ask(age_title, 0)
                   if r["metric"]["node"] == "node-a" and float(r["value"][1]) >= 2}
        waiting = {(r["metric"]["rank"], r["metric"]["section"]) for r in ask(age_title, 1)
                   if r["metric"]["node"] == "node-a" and float(r["value"][1]) >= 2}
        assert holding == {("0", "data")}, holding
        assert waiting == {("1", "allreduce"), ("2", "allreduce")}, waiting
    finally:
        for run in runs:
            run.send_signal(signal.SIGINT)
        try:
            for run in runs:
                run.wait(60)
        finally:
            prom.terminate()
            prom.wait(30)
            for job in jobs.values():
                Segment.unlink(job)
