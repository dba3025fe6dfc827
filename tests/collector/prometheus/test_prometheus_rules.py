"""``shmstat prometheus-rules``: the printed rules file passes ``promtool check rules``; the ``promtool test rules``
unit tests kept in tests/collector/prometheus/rules/ (synthetic series: a slow rank, a slow node, a hang, a clean
job with noise, data lost, a collector down) pass against it; and live, a real Prometheus loading it while it
scrapes a real collector of a running job with a slow rank scores that rank as the collector does and fires
``ShmstatStragglerRank`` for it alone."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.procs import REPO
from kit.prometheus import file_sd_job, needs_prometheus, query, scraping, start_prometheus_as_written, value
from kit.support import unique_job, wait_for

from collector.cli.prometheus_rules import ALERTS, rules
from shmstat.shm.segment import Segment

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULE_TESTS = Path(__file__).parent / "rules"
needs_promtool = pytest.mark.skipif(not os.path.exists(PROMTOOL), reason="needs promtool, from Debian's prometheus "
                                    "package (apt-get install -y --no-install-recommends prometheus)")


def _printed(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", "prometheus-rules", *flags],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)


def _write_rules(directory: Path, *flags: str) -> Path:
    done = _printed(*flags)
    assert done.returncode == 0, done.stderr
    path = directory / "shmstat-rules.yml"
    path.write_text(done.stdout)
    return path


@needs_promtool
@pytest.mark.parametrize("flags", [(), ("--threshold", "0.6", "--windows", "5", "--interval", "30",
                                        "--hang-after", "120", "--scrape-job", "gpu-nodes")])
def test_the_printed_rules_pass_promtool_check_rules(tmp_path, flags):
    path = _write_rules(tmp_path, *flags)
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout, done.stdout
    text = path.read_text()
    assert all(f'alert: "{name}"' in text for name in ALERTS)
    if flags:
        assert "< 0.6" in text and 'for: "150s"' in text
        assert "[30s]" in text and "> 120.0" in text and 'up{job="gpu-nodes"' in text


@needs_promtool
@pytest.mark.parametrize("name", sorted(p.name for p in RULE_TESTS.glob("*.yml")))
def test_the_promtool_unit_tests_pass_against_the_printed_rules(tmp_path, name):
    """Each file of tests/collector/prometheus/rules/ (its scenario is its header comment) next to the printed
    rules file (default flags), as ``promtool test rules`` reads it."""
    _write_rules(tmp_path)
    shutil.copy(RULE_TESTS / name, tmp_path / name)
    done = subprocess.run([PROMTOOL, "test", "rules", name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_unit_tests_cover_every_scenario():
    assert {p.stem for p in RULE_TESTS.glob("*.yml")} == {
        "slow_rank", "slow_node", "hang", "clean", "data_lost", "collector_down", "flap", "torn"}


@pytest.mark.parametrize("flags, says", [
    (("--threshold", "1.5"), "--threshold must be between 0 and 1 (exclusive), got 1.5"),
    (("--windows", "0"), "--windows must be between 1 and 1000, got 0"),
    (("--interval", "0"), "--interval must be 1 second or more, got 0"),
    (("--hang-after", "-1"), "--hang-after must be positive, got -1.0"),
    (("--scrape-job", 'a"b'), "--scrape-job 'a\"b' is not a scrape job name"),
])
def test_a_bad_flag_is_one_sentence(flags, says):
    done = _printed(*flags)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_the_for_duration_is_windows_rate_windows():
    alerts = {r["alert"]: r for r in rules(windows=4, interval_s=15)["groups"][1]["rules"]}
    assert alerts["ShmstatStragglerRank"]["for"] == alerts["ShmstatStragglerNode"]["for"] == "60s"
    assert "[15s]" in rules(interval_s=15)["groups"][0]["rules"][0]["expr"]


SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "report_job.py")
RANKS = 3
SLOW = str(RANKS - 1)  # report_job.py: the last rank is three times slower


@contextlib.contextmanager
def _live_job(tmp_path: Path, name: str, window_s: str, script: str) -> Iterator[tuple[str, str]]:
    """A real Prometheus loading the printed rules (``--interval 4 --windows 1``), scraping every second the job
    ``script`` runs under ``shmstat run --prometheus`` (3 ranks, ``WINDOW_S`` windows, node ``node-a``, found by
    file discovery): yields the job and Prometheus's base URL; stops both after."""
    job = unique_job(name)
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    path = _write_rules(tmp_path, "--interval", "4", "--windows", "1")
    config = ("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
              f"rule_files: ['{path}']\nscrape_configs:\n" + file_sd_job(sd_dir))
    prom, base = start_prometheus_as_written(tmp_path, config)
    env = dict(os.environ, PYTHONPATH=REPO, SECONDS_TO_RUN="120", WINDOW_S=window_s)
    run = subprocess.Popen(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", str(RANKS), "--grace-ms", "20",
         "--handler", "*=null", "--prometheus", "127.0.0.1:0", "--prometheus-sd", str(sd_dir / "node.json"),
         "--prometheus-node", "node-a", script],
        env=env, cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield job, base
    finally:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(60)
        finally:
            prom.terminate()
            prom.wait(30)
            Segment.unlink(job)


@needs_prometheus
def test_live_the_rules_score_the_slow_rank_as_the_collector_and_alert_on_it_alone(tmp_path):
    """A real job (3 ranks, the last three times slower, 0.2 s windows) under ``shmstat run --prometheus``, scraped
    every second by a real Prometheus that loads the printed rules (``--interval 4 --windows 1``): once
    ``ShmstatStragglerRank`` fires, it names the slow rank (and node) alone for the step time, and the recording
    rule's score of that rank is the collector's ``shmstat_stat_straggler_score`` within 5%."""
    with _live_job(tmp_path, "rules", "0.2", SCRIPT) as (job, base):
        sel = f'job="{job}", stat="step_ms"'
        wait_for(lambda: scraping(base), 60, what=f"Prometheus scraping the job (log: {tmp_path / 'prometheus.log'})")
        firing = f'ALERTS{{alertname="ShmstatStragglerRank", alertstate="firing", {sel}}}'
        wait_for(lambda: query(base, firing), 90, interval_s=0.5, what="ShmstatStragglerRank firing for the step time")
        named = {(r["metric"]["node"], r["metric"]["rank"]) for r in query(base, firing)}
        assert named == {("node-a", SLOW)}, named
        both = query(base, f'shmstat:straggler_score{{{sel}, rank="{SLOW}"}} '
                           f'/ on (job, node, group, stat, rank) shmstat_stat_straggler_score{{{sel}}}')
        assert len(both) == 1, both
        ratio = float(both[0]["value"][1])
        ours = value(base, f'shmstat:straggler_score{{{sel}, rank="{SLOW}"}}')
        assert abs(ratio - 1) <= 0.05, (ratio, ours)
        assert ours is not None and ours < 0.75


SKEWED = os.path.join(REPO, "tests", "kit", "programs", "skewed_steps.py")


def _both_scores(base: str, sel: str) -> dict[str, tuple[float, float]]:
    """``{rank: (the rules' score, the collector's score)}`` at one instant, ranks that have both."""
    rules_ = {r["metric"]["rank"]: float(r["value"][1]) for r in query(base, f'shmstat:straggler_score{{{sel}}}')
              if r["metric"].get("rank")}
    ours = {r["metric"]["rank"]: float(r["value"][1]) for r in query(base, f"shmstat_stat_straggler_score{{{sel}}}")}
    return {rank: (rules_[rank], ours[rank]) for rank in rules_.keys() & ours.keys()}


@needs_prometheus
def test_live_the_rules_score_every_rank_by_the_figure_the_collector_scores(tmp_path):
    """A real job of 3 ranks whose typical step and mean step disagree (skewed_steps.py: the healthy ranks' p50 is
    10 ms and their mean 32.5 ms, the last rank takes 15 ms every step), under ``shmstat run --prometheus``,
    scraped every second by a real Prometheus loading the printed rules: each rank's ``shmstat:straggler_score``
    equals the collector's ``shmstat_stat_straggler_score`` of the same window within float error (the slow rank
    about 0.67, the healthy ones 1), the node's score is 1 (its median rank is the job's) with its target's
    ``instance``, and the rank alert
    names the last rank alone. Scored by the mean, the last rank would be the fastest (about 2.2)."""
    with _live_job(tmp_path, "rulesfig", "0.5", SKEWED) as (job, base):
        sel = f'job="{job}", stat="step_ms"'
        wait_for(lambda: scraping(base), 60, what=f"Prometheus scraping the job (log: {tmp_path / 'prometheus.log'})")
        wait_for(lambda: len(_both_scores(base, sel)) == RANKS, 60, interval_s=0.5,
                 what="both scores of every rank in Prometheus")
        seen: list[dict[str, tuple[float, float]]] = []

        def equal() -> bool:
            seen.append(_both_scores(base, sel))
            return len(seen[-1]) == RANKS and all(math.isclose(a, b, rel_tol=1e-9) for a, b in seen[-1].values())

        try:
            wait_for(equal, 20, interval_s=0.5, what="the rules' and the collector's scores equal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; (rules, collector) by rank, last seen: {seen[-3:]}") from None
        scores = seen[-1]
        assert scores[SLOW][1] < 0.75 and all(scores[r][1] == 1.0 for r in scores if r != SLOW), scores
        node = query(base, f'shmstat:straggler_score{{{sel}, rank=""}}')
        assert [(r["metric"]["node"], "instance" in r["metric"], float(r["value"][1])) for r in node] == [
            ("node-a", True, 1.0)], node  # the node's series keeps its target's labels, as its ranks' do
        firing = f'ALERTS{{alertname="ShmstatStragglerRank", alertstate="firing", {sel}}}'
        wait_for(lambda: query(base, firing), 60, interval_s=0.5, what="ShmstatStragglerRank firing for the step time")
        assert {(r["metric"]["node"], r["metric"]["rank"]) for r in query(base, firing)} == {("node-a", SLOW)}
