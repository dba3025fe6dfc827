"""``shmstat report``: the page of a real job (``shmstat run`` of tests/kit/programs/report_job.py: three ranks, the
last a straggler, rank 0 crashing once and restarted, a stat of group ``gpu``), opened in a real headless chromium:
it draws without console errors or network requests, and every number it shows (summary, each chart's data,
straggler marks, events) equals what the jsonl and events files hold. Plus the reader's answers to bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict

import pytest
from kit.browser import Browser, needs_chromium
from kit.procs import REPO, read_jsonl
from kit.support import unique_job

from collector.cli.report import load_report, render_html
from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "report_job.py")
RANKS = 3
THRESHOLD = 0.75

needs_plotly = pytest.mark.skipif(importlib.util.find_spec("plotly") is None,
                                  reason="shmstat report draws with plotly: pip install 'shmstat[report]'")


def run_report_job(tmp_path, *, seconds: float = 2.0, crash: bool = True, put: bool = False) -> tuple[str, str, str]:
    """Run tests/kit/programs/report_job.py under ``shmstat run`` with its windows (the ``shmstat`` group's scores and
    counters included) in a jsonl file and its events in another; returns (job, windows path, events path)."""
    job = unique_job("rep")
    windows, events = str(tmp_path / "windows.jsonl"), str(tmp_path / "events.jsonl")
    env = dict(os.environ, PYTHONPATH=REPO, SECONDS_TO_RUN=str(seconds), WINDOW_S="0.2",
               **({"CRASH_ONCE": "1"} if crash else {}), **({"PUT_METRICS": "1"} if put else {}))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", str(RANKS),
             "--max-restarts", "1", "--monitor-interval", "0.05", "--grace-ms", "20", "--handler",
             f"*=jsonl:{windows}", "--handler", f"shmstat=jsonl:{windows}", "--events", f"jsonl:{events}", SCRIPT],
            env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=180)
    finally:
        Segment.unlink(job)
    assert done.returncode == 0, done.stderr
    return job, windows, events


def _by_window(rows: list[dict], group: str, name: str, rank: int | None) -> dict[float, float]:
    return {r["window_start"]: r["value"] for r in rows
            if r["group"] == group and r["name"] == name and r["rank"] == rank}


CHARTS_JS = """JSON.stringify(Array.from(document.querySelectorAll('div.chart')).map(d => ({
  stat: d.dataset.stat, kind: d.dataset.kind, svg: d.querySelectorAll('.main-svg').length,
  drawn: (d._fullData || []).length, legend: d._fullLayout.showlegend && d.querySelectorAll('g.legend').length,
  layout: d.layout,
  traces: d.data.map(t => ({meta: t.meta, name: t.name, x: t.x, y: t.y, z: t.z, customdata: t.customdata,
                            zmin: t.zmin, zmax: t.zmax, colorbar: t.colorbar}))})))"""
STRAGGLERS_JS = """JSON.stringify(Array.from(document.querySelectorAll('#stragglers li')).map(li => ({
  stat: li.dataset.stat, rank: Number(li.dataset.rank), windows: Number(li.dataset.windows),
  score: Number(li.dataset.score), text: li.textContent})))"""
SUMMARY_JS = """JSON.stringify(Object.fromEntries(Array.from(document.querySelectorAll('#summary tr')).map(
  tr => [tr.dataset.name, [tr.dataset.value, tr.querySelector('td').textContent]])))"""


@needs_chromium
@needs_plotly
def test_the_report_of_a_real_job_renders_in_chromium_with_the_jsonl_numbers(tmp_path):
    _job, windows, events = run_report_job(tmp_path, put=True)
    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "collector", "report", windows, "--events", events, "-o", str(page)],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"wrote {page}" in done.stdout, done.stderr
    rows = read_jsonl(windows)
    kept = read_jsonl(events)
    with Browser() as browser:
        browser.open(page.as_uri(), "document.body && document.body.dataset.chartsDrawn")
        charts = json.loads(browser.evaluate(CHARTS_JS))
        summary = json.loads(browser.evaluate(SUMMARY_JS))
        said = json.loads(browser.evaluate(STRAGGLERS_JS))
        shown_note = browser.evaluate("document.getElementById('events').textContent")
        images = browser.evaluate("document.querySelectorAll('img').length")
        log = browser.log
    assert log.errors() == []
    assert [u for u in log.requests if u != page.as_uri() and not u.startswith("data:")] == [], log.requests
    assert images == 0 and "<img src=x onerror=alert(1)>" in shown_note  # markup in an event is shown as text

    # the summary, against the files
    stat_rows = [r for r in rows if r["window_start"] is not None and r["group"] != "shmstat"]
    joined: dict[int, set[int]] = defaultdict(set)
    for e in kept:
        if e.get("name") == "rank/joined":
            joined[e["data"]["rank"]].add(e["data"]["incarnation"])
    expected = {
        "ranks": len({r["rank"] for r in stat_rows if r["rank"] is not None}),
        "windows": len({r["window_start"] for r in stat_rows}),
        "samples": sum(r["value"] for r in stat_rows if r["rank"] is None and r["name"].endswith(".count")),
        "events": sum(1 for e in kept if "gap" not in e),
        "events_lost": sum(e["gap"] for e in kept if "gap" in e),
        "restarts": sum(len(v) - 1 for v in joined.values()),
        "stats": 3,
        # the job's put metrics: its ranks' train/lr and shmstat run's agent's; not the collector's own points
        "put_metrics": sum(1 for r in rows if r["window_start"] is None and r["group"] != "shmstat"),
    }
    assert any(r["name"] == "rank.cpu_percent" for r in rows)  # the collector's points are in the file
    assert expected["ranks"] == RANKS and expected["restarts"] == RANKS  # every worker restarted once
    for name, value in expected.items():
        assert summary[name] == [str(value), str(value)], (name, summary[name], value)

    by = defaultdict(list)
    for c in charts:
        assert c["svg"] >= 1 and c["drawn"] == len(c["traces"]), c["stat"]  # plotly drew every trace
        assert c["legend"] == 1, c["stat"]  # every chart says what its lines are
        by[(c["stat"], c["kind"])].append(c)
    puts: dict[str, dict[int | None, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["window_start"] is None and r["group"] != "shmstat":
            puts[f"{r['group']}/{r['name']}"][r["rank"]].append((r["timestamp"] * 1000, r["value"]))
    assert set(puts["train/lr"]) == set(range(RANKS))
    assert {k for k in by if k[0] != "events"} == {
        ("train/step_ms", "time"), ("train/step_ms", "percentiles"), ("train/step_ms", "heatmap"),
        ("train/loss", "time"), ("train/loss", "heatmap"), ("gpu/util_percent", "time"),
        ("gpu/util_percent", "heatmap")} | {(key, "put") for key in puts}
    for key, per_rank in puts.items():  # every put metric drawn: one line per rank, every point
        (chart,) = by[(key, "put")]
        assert {t["meta"]: list(zip(t["x"], t["y"], strict=True)) for t in chart["traces"]} == {
            rank: sorted(points) for rank, points in per_rank.items()}, key

    for group, stat in (("train", "step_ms"), ("train", "loss"), ("gpu", "util_percent")):
        key = f"{group}/{stat}"
        traces = {t["meta"]: t for t in by[(key, "time")][0]["traces"]}
        merged = _by_window(rows, group, f"{stat}.mean", None)
        starts = sorted({r["window_start"] for r in rows if r["group"] == group
                         and r["name"].startswith(stat + ".") and r["window_start"] is not None})
        assert traces["merged"]["x"] == [s * 1000 for s in starts]
        assert traces["merged"]["y"] == [merged.get(s) for s in starts]
        per_rank = {rank: _by_window(rows, group, f"{stat}.mean", rank) for rank in range(RANKS)}
        assert traces["low"]["y"] == [min(p[s] for p in per_rank.values() if s in p) for s in starts]
        assert traces["high"]["y"] == [max(p[s] for p in per_rank.values() if s in p) for s in starts]
        figure = "p50" if stat == "step_ms" else "mean"
        heat = {t["meta"]: t for t in by[(key, "heatmap")][0]["traces"]}
        assert heat["figure"]["y"] == list(range(RANKS))
        # coloured by figure / the window's median across ranks, on a fixed scale the colorbar names
        figures = [_by_window(rows, group, f"{stat}.{figure}", rank) for rank in range(RANKS)]
        medians = [statistics.median(f[s] for f in figures if s in f) for s in starts]
        for rank in range(RANKS):
            assert heat["figure"]["customdata"][rank] == [figures[rank].get(s) for s in starts]
            assert heat["figure"]["z"][rank] == [None if s not in figures[rank] else figures[rank][s] / m
                                                 for s, m in zip(starts, medians, strict=True)]
        assert (heat["figure"]["zmin"], heat["figure"]["zmax"]) == (0.5, 1.5)
        assert "median" in heat["figure"]["colorbar"]["title"]["text"]

    # percentiles, and the straggler marks: the collector's own scores under the threshold
    pct = {t["meta"]: t for t in by[("train/step_ms", "percentiles")][0]["traces"]}
    assert set(pct) == {"p50", "p99"}
    for p, trace in pct.items():
        values = _by_window(rows, "train", f"step_ms.{p}", None)
        assert trace["x"] == [s * 1000 for s in sorted(values)]
        assert trace["y"] == [values[s] for s in sorted(values)]
    scores = {(r["rank"], r["window_start"]) for r in rows
              if r["name"] == "straggler.score.train/step_ms" and r["value"] < THRESHOLD}
    marks = {t["meta"]: t for t in by[("train/step_ms", "heatmap")][0]["traces"]}["stragglers"]
    assert {(y, x) for x, y in zip(marks["x"], marks["y"], strict=True)} == {(r, s * 1000) for r, s in scores}
    assert scores and {rank for rank, _ in scores} == {RANKS - 1}  # the slow rank, and only it

    # the stragglers in words: each (stat, rank) with a window under the threshold, its windows and its score
    slow: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in rows:
        if r["name"].startswith("straggler.score.") and r["value"] < THRESHOLD:
            slow[(r["name"][len("straggler.score."):], r["rank"])].append(r["value"])
    assert {(s["stat"], s["rank"]): s["windows"] for s in said} == {k: len(v) for k, v in slow.items()}
    step = next(s for s in said if s["stat"] == "train/step_ms")
    assert step["score"] == statistics.median(slow[("train/step_ms", RANKS - 1)])
    assert step["text"].startswith(f"rank {RANKS - 1} was slow on train/step_ms in {step['windows']} of the ")
    assert f"score {step['score']:.3g}" in step["text"] and " UTC)" in step["text"]

    # the events timeline: every event, by name
    timeline = {t["name"]: len(t["x"]) for t in by[("events", "events")][0]["traces"] if t["meta"] == "event"}
    names: dict[str, int] = defaultdict(int)
    for e in kept:
        if "gap" not in e:
            names[e["name"]] += 1
    assert timeline == dict(names)
    assert {"shmstat.straggler", "rank/joined", "train.checkpoint"} <= set(timeline)


def test_the_reader_reconciles_a_real_jsonl_and_counts_what_it_skips(tmp_path):
    job, windows, events = run_report_job(tmp_path, seconds=1.0, crash=False)
    rows = read_jsonl(windows)
    with open(windows, "a") as f:
        f.write("not json\n[1, 2]\n")
    report = load_report(windows, events, job=job)
    assert report.bad_lines == 2
    summary = report.summary()
    # the script puts no metric: the put metrics are shmstat run's agent's, never the collector's own points
    assert any(r["group"] == "shmstat" and r["name"] == "rank.cpu_percent" for r in rows)
    assert summary["put_metrics"] == sum(1 for r in rows if r["window_start"] is None and r["group"] != "shmstat")
    assert not any(group == "shmstat" for group, _ in report.puts)
    # the job as the collector prints it: a prefix of its id
    assert load_report(windows, events, job=job[:-4]).summary() == summary
    assert summary["samples"] == sum(r["value"] for r in rows if r["rank"] is None and r["window_start"] is not None
                                     and r["name"].endswith(".count") and r["group"] != "shmstat")
    assert summary["restarts"] == 0 and summary["ranks"] == RANKS
    assert report.counters["windows_emitted"] > 0
    # without the collector's scores (the shmstat group not kept) the page scores the rows by the same rule
    for series in report.stats.values():
        kept = dict(series.scores)
        series.scores.clear()
        assert kept and series.score_grid() == pytest.approx(kept, rel=1e-12), series.key
    page = render_html(report, js="/* plotly.js left out */")
    assert page.count('class="chart"') == 8 + len(report.puts) and "</script><img" not in page


def test_bad_input_is_one_sentence(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)

    def report(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "collector", "report", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    missing = report(str(tmp_path / "nothing.jsonl"))
    assert missing.returncode == 2 and "cannot read the jsonl" in missing.stderr and "Traceback" not in missing.stderr
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"timestamp": 1.0, "group": "g", "name": "s.count", "value": 1, "rank": None,
                                       "window_start": 0.0, "window_end": 1.0, "job": j}) + "\n" for j in ("a", "b")))
    several = report(str(two))
    assert several.returncode == 2 and "choose one with --job" in several.stderr
    absent = report(str(two), "--job", "c")
    assert absent.returncode == 2 and "no row of job 'c'" in absent.stderr
    nodes = report(str(two), str(two), "--job", "c")  # one file per node: the same sentences, of the files
    assert nodes.returncode == 2 and nodes.stderr.count("\n") == 1 and "the 2 jsonl files hold no row of job 'c'" \
        in nodes.stderr, nodes.stderr
    one_missing = report(str(two), str(tmp_path / "nothing.jsonl"))
    assert one_missing.returncode == 2 and "cannot read the jsonl" in one_missing.stderr
    prefixed = tmp_path / "prefixed.jsonl"
    prefixed.write_text(two.read_text().replace('"job": "a"', '"job": "bb132e7f-0"').replace('"job": "b"',
                                                                                              '"job": "bb1d"'))
    ambiguous = report(str(prefixed), "--job", "bb1")
    assert ambiguous.returncode == 2 and "Traceback" not in ambiguous.stderr, ambiguous.stderr
    assert ambiguous.stderr.count("\n") == 1 and "bb132e7f-0, bb1d" in ambiguous.stderr, ambiguous.stderr
    short = report(str(prefixed), "--job", "bb132e7f", "-o", str(tmp_path / "short.html"))
    if importlib.util.find_spec("plotly") is not None:
        assert short.returncode == 0 and (tmp_path / "short.html").exists(), short.stderr
    threshold = report(str(two), "--job", "a", "--threshold", "2")
    assert threshold.returncode == 2 and "--threshold must be between 0 and 1" in threshold.stderr
    assert not (tmp_path / "two.html").exists()


def test_a_rates_straggler_is_its_slow_rank_with_and_without_the_collectors_scores(tmp_path):
    """A real job (tests/kit/programs/names_rate_job.py) whose rate ``train/tok[/s]`` is declared
    higher_is_better, rank 1 the fastest and rank 2 the slow one: its jsonl rows carry the direction, the
    collector's own scores mark rank 2 alone, and the report's scores without them (the ``shmstat`` rows left
    out) are the collector's, exactly as the collector's code computes them; names like markup are kept as
    written, and the page shows them as text."""
    from kit.names_rate import HOSTILE, RATE, SLOW_RANK, start_job

    job = unique_job("reprate")
    windows = str(tmp_path / "windows.jsonl")
    try:
        done = start_job(job, tmp_path, "--handler", f"*=jsonl:{windows}", "--handler", f"shmstat=jsonl:{windows}",
                         seconds=2.0, wait=True)
    finally:
        Segment.unlink(job)
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(windows)
    rate_rows = [r for r in rows if r["group"] == RATE[0] and r["name"].startswith(RATE[1] + ".")]
    assert rate_rows and all(r.get("higher_is_better") is True for r in rate_rows)
    assert not any("higher_is_better" in r for r in rows if r not in rate_rows)
    report = load_report(windows, job=job)
    assert report.bad_lines == 0 and set(HOSTILE) <= set(report.stats)
    series = report.stats[RATE]
    assert series.higher_is_better
    collector = dict(series.scores)
    slow = {rank for ((_node, rank), _), score in collector.items() if score < THRESHOLD}
    assert slow == {SLOW_RANK}, collector
    series.scores.clear()
    assert series.score_grid() == collector  # the same code: the same floats
    others = load_report(windows, job=job)
    for key, s in others.stats.items():  # a time's scores too: the collector's, from the rows alone
        kept = dict(s.scores)
        s.scores.clear()
        assert s.score_grid() == kept, key
    page = render_html(report, js="/* plotly.js left out */")
    assert "<script>" not in page.replace("<script>/* plotly.js left out */", "").replace(
        '<script id="figures"', "").replace("<script>(function", "")
    assert "&lt;script&gt;" in page and "tok[/s]" in page


def _bad_lines() -> list[bytes]:
    """Lines that are not rows: every field of a good row given a wrong type or value, non-finite and huge numbers,
    non-UTF-8 bytes, JSON that is not an object, fields missing."""
    good = {"timestamp": 100.2, "group": "g", "name": "s.mean", "value": 2.5, "rank": 0, "window_start": 100.0,
            "window_end": 100.2, "job": "j", "node": "n"}
    wrong = ["x", None, [1], {"a": 1}, True, float("nan"), float("inf"), -float("inf"), 10 ** 400, -1, 1.5, 1e300,
             "\ud800"]
    required = {"group", "name", "value"}
    lines = []
    for field in good:
        for w in wrong:
            if (w is None and field not in required) or (w == "x" and field in ("group", "job", "node")):
                continue  # a row: merged, a put metric, of one job; of group or job "x" (a window's "x": no row)
            if (field == "value" and (isinstance(w, float) or w in (-1, 1.5))) or (field == "timestamp" and w == 1.5) \
                    or (field in ("window_start", "window_end") and w == 1.5):
                continue  # a figure may be any number (written NaN and infinities as strings); a time may be 1.5 s
            lines.append(json.dumps({**good, field: w}).encode())
        missing = dict(good)
        missing.pop(field)
        if field in required:
            lines.append(json.dumps(missing).encode())
    lines += [json.dumps({**good, "name": "s.count", "value": v}).encode() for v in (2.5, "NaN", -3, True)]
    lines += [json.dumps({**good, "group": "shmstat", "name": "collector.samples_dropped", "window_start": None,
                          "rank": None, "value": v}).encode() for v in ("NaN", "Infinity", 10 ** 400)]
    lines += [json.dumps({**good, f: "x"}).encode() for f in ("torn", "higher_is_better")]
    lines += [b'\xff\xfe{"group": "g"}', b'{"group": "g", "name": "s.mean", "value": 1, "rank": "\xe9"}',
              b"not json", b'{"group": "g",', b"[1, 2]", b"3", b'"text"', b"null", b"true", b"{}",
              json.dumps(good).encode()[:-1] + b"\x00}"]
    return lines


def _bad_events() -> list[bytes]:
    good = {"timestamp": 100.1, "name": "train.checkpoint", "rank": 0, "job": "j", "data": {"step": 1}}
    lines = [json.dumps({**good, f: w}).encode() for f in ("timestamp", "rank", "job", "name", "node")
             for w in ("x", [1], {"a": 1}, float("nan"), 10 ** 400, -1, "\ud800") if not (f in ("job", "name")
                                                                                   and w in ("x", -1))
             and not (f == "node" and w == "x")]
    lines += [json.dumps({"gap": g, "at": "rank", "rank": 0, "timestamp": 100.0}).encode()
              for g in ("x", -1, float("nan"), None, [1], 1.5)]
    lines += [b"\xff", b"[]", b"{}"]
    return lines


def test_every_kind_of_bad_line_is_skipped_and_counted_never_a_crash(tmp_path):
    """The report's readers (windows jsonl and events) given good rows and, between them, lines of every kind that
    is not a row: each bad line is skipped and counted (no more, no fewer), the good rows are all read, and the
    page and the command are made (exit 0, no traceback)."""
    good_rows = [{"timestamp": 100.2 + w, "group": "g", "name": f"s.{agg}", "value": value, "rank": rank,
                  "window_start": 100.0 + w, "window_end": 100.2 + w, "job": "j"}
                 for w in range(3) for rank in (None, 0, 1) for agg, value in (("count", 4), ("mean", 2.5 + w))]
    good_events = [{"timestamp": 100.1, "name": "train.checkpoint", "rank": 0, "job": "j", "data": {"step": 1}},
                   {"gap": 3, "at": "rank", "rank": 1, "timestamp": 100.3, "job": "j"},
                   {"timestamp": 100.2, "name": "rank/joined", "job": "j", "data": {"rank": [1], "incarnation": {}}}]
    bad, bad_events = _bad_lines(), _bad_events()
    windows, events = tmp_path / "w.jsonl", tmp_path / "e.jsonl"
    lines = [json.dumps(r).encode() for r in good_rows]
    lines = [line for pair in zip(lines, bad, strict=False) for line in pair] + bad[len(lines):]  # interleaved
    windows.write_bytes(b"\n".join(lines) + b"\n")
    events.write_bytes(b"\n".join([json.dumps(e).encode() for e in good_events] + bad_events) + b"\n")
    report = load_report(str(windows), str(events), job="j")
    assert report.bad_lines == len(bad) + len(bad_events)
    summary = report.summary()
    assert summary["samples"] == 3 * 4 and summary["ranks"] == 2 and summary["windows"] == 3, summary
    assert summary["events"] == 2 and summary["events_lost"] == 3 and summary["restarts"] == 0
    assert {r: {w: f["mean"] for w, f in per.items()} for r, per in report.stats[("g", "s")].ranks.items()} == {
        ("", r): {100.0 + w: 2.5 + w for w in range(3)} for r in (0, 1)}  # (node, rank): rows naming no node
    render_html(report, js="/* plotly.js left out */")
    done = subprocess.run([sys.executable, "-m", "collector", "report", str(windows), "--events", str(events),
                           "--job", "j", "-o", str(tmp_path / "page.html")], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=120)
    if importlib.util.find_spec("plotly") is not None:
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
