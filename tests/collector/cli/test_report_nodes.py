"""``shmstat report`` across nodes, sections and hangs: one job run by ``shmstat run`` on two simulated hosts
(tests/kit/cluster.py: hostnames ``node0``, ``node1``; each host's ranks numbered 0 and 1), a synchronous loop in
sections (tests/kit/programs/nodes_sections_job.py) with a compute straggler on node1 and a rank of node1 stuck in
``data`` for a while. Each host's collector writes its own windows and events files; the report of both files is
one job of four ranks, opened in a real headless chromium."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
from kit.browser import Browser, needs_chromium
from kit.cluster import Cluster
from kit.procs import REPO, read_jsonl
from kit.support import unique_job

from collector.cli.report import load_report, window_label
from collector.daemon.scoring import score_ranks

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "nodes_sections_job.py")
THRESHOLD = 0.75
SLOW, STUCK = ("node1", 1), ("node1", 0)

needs_plotly = pytest.mark.skipif(importlib.util.find_spec("plotly") is None,
                                  reason="shmstat report draws with plotly: pip install 'shmstat[report]'")


def run_on_two_nodes(cluster: Cluster, tmp_path) -> tuple[str, list[str], list[str]]:
    """The job on both hosts at once, same job id; returns (job, windows files, events files), node0's first."""
    job = unique_job("repn")
    sync = tmp_path / "sync"
    sync.mkdir()
    windows = [str(tmp_path / f"{h.name}.jsonl") for h in cluster.hosts]
    events = [str(tmp_path / f"{h.name}.events.jsonl") for h in cluster.hosts]
    procs = []
    for host, w, e in zip(cluster.hosts, windows, events, strict=True):
        env = dict(host.env, PYTHONPATH=REPO, SYNC_DIR=str(sync), SLOW="/".join(map(str, SLOW)),
                   STUCK="/".join(map(str, STUCK)), SECONDS_TO_RUN="4", HANG_AT_S="1.5", HANG_S="2.5",
                   SHMSTAT_SECTION_WINDOW_S="0.5")
        procs.append(host.popen(
            [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2", "--hang-after", "1",
             "--grace-ms", "20", "--handler", f"*=jsonl:{w}", "--events", f"jsonl:{e}", SCRIPT],
            name="run", env=env, cwd=str(tmp_path)))
    for p in procs:
        assert p.wait(180) == 0, cluster.tails()
    return job, windows, events


def _figures(rows: list[dict], stat: str) -> dict[float, dict[tuple[str, int], float]]:
    """Each window's p50 of ``section/<stat>`` by (node, rank), from the rows as written."""
    out: dict[float, dict[tuple[str, int], float]] = defaultdict(dict)
    for r in rows:
        if r["group"] == "section" and r["name"] == f"{stat}.p50" and r["rank"] is not None:
            out[r["window_start"]][(r["node"], r["rank"])] = r["value"]
    return out


CHARTS_JS = """JSON.stringify(Array.from(document.querySelectorAll('div.chart')).map(d => ({
  stat: d.dataset.stat, kind: d.dataset.kind, drawn: (d._fullData || []).length, layout: d.layout,
  traces: d.data.map(t => ({meta: t.meta, name: t.name, x: t.x, y: t.y, z: t.z, customdata: t.customdata,
                            text: t.text}))})))"""
STRAGGLERS_JS = """JSON.stringify(Array.from(document.querySelectorAll('#stragglers li')).map(li => ({
  stat: li.dataset.stat, node: li.dataset.node, rank: Number(li.dataset.rank), text: li.textContent})))"""
RANKS_JS = """JSON.stringify(Array.from(document.querySelectorAll('#ranks tr[data-node]')).map(tr => [
  tr.dataset.node, Number(tr.dataset.rank), tr.querySelector('td').textContent]))"""
HANGS_JS = """JSON.stringify(Array.from(document.querySelectorAll('#hangs li')).map(li => ({
  node: li.dataset.node, text: li.textContent})))"""


@needs_chromium
@needs_plotly
def test_two_nodes_files_make_one_job_with_its_nodes_sections_and_hangs(sim_cluster: Cluster, tmp_path):
    job, windows, events = run_on_two_nodes(sim_cluster, tmp_path)
    rows = {f"node{i}": read_jsonl(w) for i, w in enumerate(windows)}
    kept = {f"node{i}": read_jsonl(e) for i, e in enumerate(events)}
    # every row and event says which node's collector wrote it (each host's name: the collector's default)
    for node in rows:
        assert rows[node] and {r.get("node") for r in rows[node]} == {node}, node
        assert kept[node] and {e.get("node") for e in kept[node]} == {node}, node
    every = rows["node0"] + rows["node1"]

    # one job: four ranks, none merged with the rank of the same number on the other node
    report = load_report(windows, events, job=job)
    assert report.bad_lines == 0
    assert report.ranks() == [("node0", 0), ("node0", 1), ("node1", 0), ("node1", 1)]
    assert report.nodes() == ["node0", "node1"]
    assert report.summary()["samples"] == sum(r["value"] for r in every if r["rank"] is None
                                              and r["window_start"] is not None and r["name"].endswith(".count"))

    # the straggler against the job-wide median (per node, node1's two ranks score 22.5/30 = 0.75: not under it)
    forward = _figures(every, "forward")
    expected = {}
    for start, figures in forward.items():
        _, scores = score_ranks(figures)
        expected.update({(key, start): s for key, s in scores.items()})
    assert report.stats[("section", "forward")].score_grid() == pytest.approx(expected, rel=1e-12)
    flagged = [key for (key, _), s in expected.items() if s < THRESHOLD]
    # the compute straggler, in most of its windows; a healthy rank (they wait longest) at most in a window its
    # sleep overslept on this loaded machine
    assert flagged.count(SLOW) >= len(forward) // 2 and all(flagged.count(k) < flagged.count(SLOW) for k in flagged
                                                            if k != SLOW), flagged
    slow = [g for g in report.stragglers(THRESHOLD) if g.stat == "section/forward"]
    assert (slow[0].node, slow[0].rank) == SLOW and [(g.node, g.rank) for g in slow] == sorted(
        set(flagged), key=lambda k: (-flagged.count(k), k))
    assert not report.stats[("section", "allreduce")].score_grid()  # a wait section is no rank's fault

    # the hangs, from both nodes' events: node1's names its stuck rank in data, node0's says it is elsewhere
    hangs = report.hangs()
    by_node = {h.node: h for h in hangs}
    assert set(by_node) == {"node0", "node1"} and len(hangs) == 2, hangs
    assert by_node["node1"].data["suspects"] == str(STUCK[1]) and by_node["node1"].data["rank.0.section"] == "data"
    assert by_node["node0"].data["elsewhere"] is True
    for h in hangs:
        assert h.end is not None and h.end > h.start

    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "collector", "report", *windows, "--events", events[0], "--events",
                           events[1], "--job", job, "-o", str(page)], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"wrote {page}" in done.stdout, done.stderr
    with Browser() as browser:
        browser.open(page.as_uri(), "document.body && document.body.dataset.chartsDrawn")
        charts = json.loads(browser.evaluate(CHARTS_JS))
        said = json.loads(browser.evaluate(STRAGGLERS_JS))
        ranks = json.loads(browser.evaluate(RANKS_JS))
        hang_lines = json.loads(browser.evaluate(HANGS_JS))
        log = browser.log
    assert log.errors() == []
    by = {(c["stat"], c["kind"]): c for c in charts}
    for c in charts:
        assert c["drawn"] == len(c["traces"]), c["stat"]

    # the node column: every rank of the job with its node
    assert [(n, r) for n, r, _ in ranks] == report.ranks() and [cell for *_, cell in ranks] == ["node0", "node0",
                                                                                              "node1", "node1"]
    # the rank x window heatmap across nodes: one row per node/rank, each window's p50 as written
    assert by[("section/forward", "heatmap")]["layout"]["title"]["text"].startswith("section/forward p50 per rank")
    heat = {t["meta"]: t for t in by[("section/forward", "heatmap")]["traces"]}
    assert heat["figure"]["y"] == ["node0/0", "node0/1", "node1/0", "node1/1"]
    starts = sorted(forward)
    assert heat["figure"]["x"] == [s * 1000 for s in starts]
    for i, key in enumerate(report.ranks()):
        assert heat["figure"]["customdata"][i] == [forward[s].get(key) for s in starts]
    assert set(heat["stragglers"]["y"]) == {f"{node}/{rank}" for node, rank in flagged}
    forward_said = [s for s in said if s["stat"] == "section/forward"]
    assert [(s["node"], s["rank"]) for s in forward_said] == [(g.node, g.rank) for g in slow]
    assert forward_said[0]["text"].startswith("node1: rank 1 was slow on section/forward")
    assert "scored against the job-wide median of its window, across the 2 nodes" in page.read_text()

    # the section breakdown: per window and node/rank, each section's time (its sum), the wait section apart
    split = {t["meta"]["section"]: t for t in by[("section", "sections")]["traces"]}
    assert set(split) == {"data", "forward", "allreduce"}
    assert split["allreduce"]["meta"]["wait"] is True and split["forward"]["meta"]["wait"] is False
    assert "wait" in split["allreduce"]["name"]
    for name, trace in split.items():
        sums = {(r["window_start"], f"{r['node']}/{r['rank']}"): r["value"] for r in every
                if r["group"] == "section" and r["name"] == f"{name}.sum" and r["rank"] is not None}
        shown = {(w, key): v for w, key, v in zip(trace["x"][0], trace["x"][1], trace["y"], strict=True)
                 if v is not None}
        assert shown == {(window_label(w), key): v for (w, key), v in sums.items()}, name

    # the hangs on the timeline: a band from each hang to its resolution, its line in words as text
    timeline = by[("events", "events")]
    bands = [s for s in timeline["layout"]["shapes"] if s.get("name", "").startswith("hang")]
    assert sorted((b["x0"], b["x1"]) for b in bands) == sorted((h.start * 1000, h.end * 1000) for h in hangs)
    assert sorted(h["node"] for h in hang_lines) == ["node0", "node1"]
    node1_line = next(h["text"] for h in hang_lines if h["node"] == "node1")
    assert node1_line.startswith("node1: hang: job ") and "rank 0 in data" in node1_line

