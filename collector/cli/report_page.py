"""The page ``shmstat report`` writes: :func:`render_html` draws a :class:`~collector.cli.report_job.JobReport`
as one self-contained HTML document, with plotly.js (the ``plotly`` package's own copy, from the optional extra
``shmstat[report]``) and every figure's data inline, so nothing is fetched when the page is opened.
"""

from __future__ import annotations

import html
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from shmstat.errors import ConfigError
from shmstat.writer.sections import GPU_SUFFIX, SECTION_GROUP

from ..daemon.straggler import DEFAULT_THRESHOLD
from .report_job import GPU_GROUP, PERCENTILES, JobReport, RankKey, StatSeries, rank_label, utc_text

__all__ = ["RELATIVE_RANGE", "plotly_js", "render_html", "window_label"]

_MAX_EVENT_ROWS = 1000  # events listed in the page's table (the timeline has all of them)


def plotly_js() -> str:
    """plotly.js, minified, as the ``plotly`` package ships it (``shmstat[report]``); :class:`ConfigError` with the
    command that installs it when the package is missing."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ConfigError("shmstat report draws with plotly: pip install 'shmstat[report]'") from None
    return str(get_plotlyjs())


def _ms(start: float) -> float:
    return start * 1000.0


def _clean(values: Iterable[float | None]) -> list[float | None]:
    return [v if v is not None and math.isfinite(v) else None for v in values]


def _over_time(s: StatSeries) -> dict[str, Any] | None:
    agg = s.main_aggregation()
    if agg is None:
        return None
    windows = s.windows()
    x = [_ms(w) for w in windows]
    traces: list[dict[str, Any]] = []
    if len(s.ranks) >= 2:
        lows, highs = [], []
        for w in windows:
            vals = [v for per in s.ranks.values() if w in per and (v := per[w].get(agg)) is not None
                    and math.isfinite(v)]
            lows.append(min(vals) if vals else None)
            highs.append(max(vals) if vals else None)
        traces.append({"type": "scatter", "mode": "lines", "name": f"lowest rank {agg}", "x": x, "y": lows,
                       "line": {"width": 0}, "showlegend": False, "meta": "low"})
        traces.append({"type": "scatter", "mode": "lines", "name": f"rank {agg}: lowest..highest", "x": x,
                       "y": highs, "fill": "tonexty", "fillcolor": "rgba(31,119,180,0.2)", "line": {"width": 0},
                       "meta": "high"})
    merged = [s.merged.get(w, {}).get(agg) for w in windows]
    traces.append({"type": "scatter", "mode": "lines+markers", "name": f"merged {agg}", "x": x,
                   "y": _clean(merged), "line": {"color": "#1f77b4"}, "meta": "merged"})
    return {"kind": "time", "aggregation": agg, "data": traces,
            "layout": _layout(f"{s.key} {agg} over time (merged; band: spread across ranks)", agg)}


def _percentiles(s: StatSeries) -> dict[str, Any] | None:
    if not any(p in figures for figures in s.merged.values() for p in PERCENTILES):
        return None  # across nodes the page merges no percentile
    windows = sorted(s.merged)
    x = [_ms(w) for w in windows]
    traces = [{"type": "scatter", "mode": "lines+markers", "name": p, "x": x,
               "y": _clean(s.merged[w].get(p) for w in windows), "meta": p}
              for p in PERCENTILES if any(p in s.merged[w] for w in windows)]
    return {"kind": "percentiles", "data": traces, "layout": _layout(f"{s.key} percentiles over time (merged)", "")}


RELATIVE_RANGE = (0.5, 1.5)
"""The heatmap's fixed colour range of figure / window median: noise around the median stays pale, whatever the
figures' own spread; a figure past either end takes that end's colour."""


def _heatmap(report: JobReport, s: StatSeries, threshold: float) -> dict[str, Any] | None:
    if len(s.ranks) < 2:
        return None
    windows = s.windows()
    ranks = sorted(s.ranks)
    several = len(report.nodes()) > 1
    labels = [rank_label(r, several) for r in ranks]
    x = [_ms(w) for w in windows]
    raw = [[s.figure(s.ranks[r][w]) if w in s.ranks[r] else None for w in windows] for r in ranks]
    medians = [_median(row[i] for row in raw) for i in range(len(windows))]
    relative = all(m is not None and m > 0 for m, col in zip(medians, zip(*raw, strict=True), strict=True)
                   if any(v is not None for v in col)) and all(v is None or v >= 0 for row in raw for v in row)
    figure_name = "p50" if s.has_percentiles() else "mean"
    if relative:  # colour by figure / median: the same noise looks the same on any stat
        z = [[None if v is None or m is None else v / m for v, m in zip(row, medians, strict=True)] for row in raw]
        colour: dict[str, Any] = {
            "colorscale": "RdBu", "reversescale": False, "zmin": RELATIVE_RANGE[0], "zmax": RELATIVE_RANGE[1],
            "zmid": 1.0, "colorbar": {"title": {"text": f"{figure_name} / window median<br>(scale fixed "
                                                         f"{RELATIVE_RANGE[0]:g} to {RELATIVE_RANGE[1]:g})"}}}
        hover = f"rank %{{y}}<br>%{{x}}<br>{figure_name} %{{customdata}}<br>÷ median %{{z:.3f}}<extra></extra>"
    else:  # a figure under 0 (or a median of 0): no ratio means anything, the figures on their own scale
        z = raw
        colour = {"colorscale": "Viridis",
                  "colorbar": {"title": {"text": f"{figure_name}<br>(own scale: figures not all above 0)"}}}
        hover = f"rank %{{y}}<br>%{{x}}<br>{figure_name} %{{customdata}}<extra></extra>"
    scores = s.score_grid()
    slow = sorted((w, r) for (r, w), score in scores.items() if score < threshold)
    traces: list[dict[str, Any]] = [
        {"type": "heatmap", "name": figure_name, "x": x, "y": labels, "z": z, "customdata": raw, "meta": "figure",
         "showlegend": True, "hovertemplate": hover, **colour},
        {"type": "scatter", "mode": "markers", "name": f"straggler (score < {threshold:g})",
         "x": [_ms(w) for w, _ in slow], "y": [rank_label(r, several) for _, r in slow],
         "text": [f"score {scores[(r, w)]:.3g}" for w, r in slow], "meta": "stragglers",
         "marker": {"symbol": "x", "size": 10, "color": "#222222", "line": {"width": 2, "color": "#ffffff"}}},
    ]
    scale = (f"figure / the window's median across {'every node' if several else 'ranks'}" if relative
             else figure_name)
    layout = _layout(f"{s.key} {figure_name} per rank and window, coloured by {scale} (x: straggler windows)", "")
    layout["yaxis"] = ({"title": {"text": "node/rank"}, "type": "category", "autorange": "reversed"} if several else
                       {"title": {"text": "rank"}, "dtick": 1, "autorange": "reversed"})
    layout["height"] = max(260, 60 + 22 * len(ranks))
    return {"kind": "heatmap", "data": traces, "layout": layout}


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _put_chart(report: JobReport, key: tuple[str, str],
               per_rank: dict[tuple[str, int | None], list[tuple[float, float]]]) -> dict[str, Any]:
    traces = []
    several = len(report.nodes()) > 1
    for node, rank in sorted(per_rank, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        points = sorted(per_rank[(node, rank)])
        name = "no rank" if rank is None else f"rank {rank}"
        traces.append({"type": "scatter", "mode": "lines+markers",
                       "name": html.escape(f"{node}: {name}") if several else name,
                       "x": [_ms(t) for t, _ in points], "y": _clean(v for _, v in points),
                       "meta": None if rank is None else rank_label((node, rank), several)})
    layout = _layout(f"{key[0]}/{key[1]} as put (each point its time), per rank", "")
    layout["xaxis"]["title"] = {"text": "time (UTC)"}
    return {"kind": "put", "data": traces, "layout": layout}


def window_label(start: float) -> str:
    """A window's name on the section breakdown's axis: its start, UTC, to the millisecond."""
    return utc_text(start)[11:]


def _sections(report: JobReport) -> dict[str, Any] | None:
    """The time split of each rank's windows across its sections: per window and rank a stacked bar, one part per
    section (its ``sum``: milliseconds spent in it in the window), the wait sections hatched."""
    series = sorted((s for s in report.stats.values() if s.group == SECTION_GROUP and not s.name.endswith(GPU_SUFFIX)
                     and any("sum" in f for per in s.ranks.values() for f in per.values())),
                    key=lambda s: (s.wait, s.name))
    if not series:
        return None
    bars = sorted({(w, key) for s in series for key, per in s.ranks.items() for w in per})
    several = len(report.nodes()) > 1
    x = [[window_label(w) for w, _ in bars], [str(rank_label(key, several)) for _, key in bars]]
    traces = []
    for s in series:
        figures = [s.ranks[key].get(w, {}) if key in s.ranks else {} for w, key in bars]
        name = f"{s.name} (wait)" if s.wait else s.name
        traces.append({
            "type": "bar", "name": html.escape(name), "x": x, "y": _clean(f.get("sum") for f in figures),
            "customdata": [[f.get("count"), f.get("mean")] for f in figures], "meta": {"section": s.name,
                                                                                     "wait": s.wait},
            "marker": {"pattern": {"shape": "/" if s.wait else ""}},
            "hovertemplate": "%{fullData.name}<br>%{x}<br>%{y:.3g} ms in the window<br>"
                             "%{customdata[0]} times, mean %{customdata[1]:.3g} ms<extra></extra>"})
    layout = _layout("time in each section per window and rank (ms: the section's sum; hatched: waits for other "
                     "ranks)", "ms in the window")
    layout["barmode"] = "stack"
    layout["xaxis"] = {"type": "multicategory", "title": {"text": "window start (UTC) / rank"}}
    layout["height"] = 480
    layout["margin"] = {**layout["margin"], "b": 120}
    layout["legend"] = {"orientation": "v"}  # beside the bars: under them are the two rows of the axis
    return {"kind": "sections", "data": traces, "layout": layout}


def _timeline(report: JobReport) -> dict[str, Any] | None:
    if not report.events and not report.gaps:
        return None
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in report.events:
        by_name[e["name"]].append(e)
    traces: list[dict[str, Any]] = []
    for name in sorted(by_name):
        evs = by_name[name]
        traces.append({"type": "scatter", "mode": "markers", "name": name, "meta": "event",
                       "x": [_ms(float(e.get("timestamp") or 0.0)) for e in evs], "y": [name] * len(evs),
                       "text": [html.escape(_event_text(e)) for e in evs], "hoverinfo": "x+text"})
    if report.gaps:
        traces.append({"type": "scatter", "mode": "markers", "name": "lost (gap)", "meta": "gap",
                       "x": [_ms(float(g.get("timestamp") or 0.0)) for g in report.gaps],
                       "y": ["lost"] * len(report.gaps), "marker": {"symbol": "x", "color": "#d62728", "size": 10},
                       "text": [f"{g.get('gap')} lost at the {g.get('at')} (rank {g.get('rank')})"
                                for g in report.gaps], "hoverinfo": "x+text"})
    layout = _layout("events (shaded: hangs, from the hang named to its resolution)", "")
    layout["height"] = max(260, 80 + 26 * len(traces))
    layout["yaxis"] = {"type": "category", "automargin": True}
    last = max([float(e.get("timestamp") or 0.0) for e in report.events] + report.windows())
    layout["shapes"] = [{"type": "rect", "name": f"hang {h.node}".rstrip(), "xref": "x", "yref": "paper",
                         "x0": _ms(h.start), "x1": _ms(h.end if h.end is not None else max(last, h.start)),
                         "y0": 0, "y1": 1, "fillcolor": "rgba(214,39,40,0.15)", "line": {"width": 0},
                         "layer": "below"} for h in report.hangs()]
    return {"kind": "events", "data": traces, "layout": layout}


def _event_text(e: dict[str, Any]) -> str:
    who = "collector" if e.get("rank") is None else f"rank {e.get('rank')}"
    node = e.get("node")
    return f"{node + ' ' if node else ''}{who}: {json.dumps(e.get('data', {}), sort_keys=True)[:300]}"


def _layout(title: str, y_title: str) -> dict[str, Any]:
    return {"title": {"text": html.escape(title)}, "height": 320, "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
            "xaxis": {"type": "date", "title": {"text": "window start (UTC)"}},
            "yaxis": {"title": {"text": y_title}}, "legend": {"orientation": "h"},
            "showlegend": True}  # plotly hides the legend of a chart with one trace: say what even one line is


def _json_for_script(obj: Any) -> str:
    """JSON safe inside an inline ``<script>`` (no ``</script>``, no ``<!--``)."""
    return json.dumps(obj, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


class _Charts:
    """The page's charts in order: each a placeholder ``div`` in the page and its figure in the page's JSON."""

    def __init__(self) -> None:
        self.charts: list[tuple[str, dict[str, Any]]] = []

    def div(self, key: str, chart: dict[str, Any] | None) -> str:
        if chart is None:
            return ""
        ident = f"chart-{len(self.charts)}"
        self.charts.append((ident, chart))
        return (f'<div class="chart" id="{ident}" data-stat="{html.escape(key)}" '
                f'data-kind="{chart["kind"]}"></div>')

    def figures(self) -> list[dict[str, Any]]:
        return [{"id": ident, "data": chart["data"], "layout": chart["layout"]} for ident, chart in self.charts]


def render_html(report: JobReport, *, threshold: float = DEFAULT_THRESHOLD, js: str | None = None) -> str:
    """The report page of ``report``: one HTML document with plotly.js (``js``, default :func:`plotly_js`) and
    every figure's data inline. Each chart is a ``div.chart`` with ``data-stat`` (``group/name``, or ``events``) and
    ``data-kind`` (``time``, ``percentiles``, ``heatmap``, ``events``); the summary is ``table#summary``, one
    ``tr`` per figure with ``data-name`` and ``data-value``."""
    if not 0 < threshold < 1:
        raise ConfigError(f"--threshold must be between 0 and 1 (exclusive), got {threshold:g}")
    js = (plotly_js() if js is None else js).replace("</script", "<\\/script")
    charts = _Charts()
    sections = [_job_section(report, threshold), _sections_part(report, charts),
                *_stat_parts(report, threshold, charts), _puts_part(report, charts), _events_part(report, charts)]
    return _document(report.job, js, "".join(sections), charts.figures())


def _on_node(report: JobReport, node: str) -> str:
    """Across nodes, each sentence starts with the rank's node."""
    return f"{node}: " if len(report.nodes()) > 1 else ""


def _job_section(report: JobReport, threshold: float) -> str:
    """The job summary: its figures, its ranks by node, its stragglers and hangs in words, the collector's
    counters."""
    rows = "".join(f'<tr data-name="{k}" data-value="{v}"><th>{k.replace("_", " ")}</th><td>{v}</td></tr>'
                   for k, v in report.summary().items())
    counters = "".join(f'<tr data-name="{html.escape(k)}" data-value="{v:g}"><th>{html.escape(k)}</th>'
                       f"<td>{v:g}</td></tr>" for k, v in sorted(report.counters.items()))
    windows = report.windows()
    span = (f"{utc_text(windows[0])} to {utc_text(windows[-1])} UTC" if windows else "no window")
    return (f"<section><h2>Job {html.escape(report.job)}</h2><p>{span}</p>"
            f'<table id="summary">{rows}</table>{_ranks_table(report)}{_stragglers_part(report, threshold)}'
            f"{_hangs_part(report)}"
            + (f'<details><summary>Collector counters (newest)</summary><table id="counters">{counters}'
               "</table></details>" if counters else "") + "</section>")


def _stragglers_part(report: JobReport, threshold: float) -> str:
    slow = report.stragglers(threshold)
    nodes = report.nodes()
    said = ("".join(f'<li data-stat="{html.escape(g.stat)}" data-node="{html.escape(g.node)}" data-rank="{g.rank}" '
                    f'data-windows="{len(g.windows)}" data-score="{statistics.median(g.scores)!r}">'
                    f"{html.escape(_on_node(report, g.node))}{html.escape(g.sentence(threshold))}</li>"
                    for g in slow))
    against = (f"<p>Every rank is scored against the job-wide median of its window, across the {len(nodes)} "
               "nodes.</p>" if len(nodes) > 1 else "")
    return (f'<h3>Stragglers</h3>{against}<ul id="stragglers">{said}</ul>' if slow else
            f'<h3>Stragglers</h3>{against}<p id="stragglers">no rank scored under {threshold:g} in any '
            "window</p>")


def _hangs_part(report: JobReport) -> str:
    hangs = report.hangs()
    hung = "".join(
        f'<li data-node="{html.escape(h.node)}" data-start="{h.start!r}">'
        f"{html.escape(_on_node(report, h.node) + h.line)} "
        + html.escape(f"({utc_text(h.start)} UTC; " + ("not resolved in the files)" if h.end is None else
                      f"resolved {h.end - h.start:.1f} s later{': ' + h.reason if h.reason else ''})")) + "</li>"
        for h in hangs)
    return f'<h3>Hangs</h3><ul id="hangs">{hung}</ul>' if hangs else ""


def _ranks_table(report: JobReport) -> str:
    samples: dict[RankKey, float] = defaultdict(float)
    for s in report.stats.values():
        for key, per in s.ranks.items():
            samples[key] += sum(f.get("count") or 0 for f in per.values())
    rank_rows = "".join(f'<tr data-node="{html.escape(node)}" data-rank="{rank}"><td>{html.escape(node)}</td>'
                        f"<td>{rank}</td><td>{samples[(node, rank)]:g}</td></tr>" for node, rank in report.ranks())
    return (f'<details{" open" if len(report.nodes()) > 1 else ""}><summary>Ranks by node</summary>'
            f'<table id="ranks"><tr><th>node</th><th>rank</th><th>samples</th></tr>{rank_rows}</table></details>')


def _sections_part(report: JobReport, charts: _Charts) -> str:
    split = _sections(report)
    if split is None:
        return ""
    return ("<h2>Sections</h2><p>Each bar: one rank's window, split by the time spent in each section; "
            "hatched: wait sections (waiting for other ranks, never scored).</p>" + charts.div(SECTION_GROUP, split))


def _stat_parts(report: JobReport, threshold: float, charts: _Charts) -> list[str]:
    """Per stat its charts, the ``gpu`` group's under a heading of their own after the others."""
    parts: list[str] = []
    ordered = sorted(report.stats.values(), key=lambda s: (s.group == GPU_GROUP, s.group, s.name))
    current = None
    for s in ordered:
        heading = "GPU" if s.group == GPU_GROUP else "Stats"
        if heading != current:
            parts.append(f"<h2>{heading}</h2>")
            current = heading
        window = report.window_s.get((s.group, s.name))
        about = f"{len(s.windows())} windows" + (f" of {window:g} s" if window else "") + f", {len(s.ranks)} ranks"
        parts.append(f'<section class="stat" data-stat="{html.escape(s.key)}"><h3>{html.escape(s.key)}</h3>'
                     f"<p>{about}</p>" + charts.div(s.key, _over_time(s)) + charts.div(s.key, _percentiles(s))
                     + charts.div(s.key, _heatmap(report, s, threshold)) + "</section>")
    return parts


def _puts_part(report: JobReport, charts: _Charts) -> str:
    if not report.puts:
        return ""
    return "<h2>Put metrics</h2>" + "".join(
        f'<section class="put" data-stat="{html.escape(f"{g}/{n}")}"><h3>{html.escape(f"{g}/{n}")}</h3>'
        f"<p>{sum(len(p) for p in report.puts[(g, n)].values())} points</p>"
        + charts.div(f"{g}/{n}", _put_chart(report, (g, n), report.puts[(g, n)])) + "</section>"
        for g, n in sorted(report.puts))


def _events_part(report: JobReport, charts: _Charts) -> str:
    timeline = _timeline(report)
    if timeline is None:
        return ""
    listed = report.events[:_MAX_EVENT_ROWS]
    rows_html = "".join(
        f"<tr><td>{utc_text(float(e.get('timestamp') or 0.0))}</td><td>{html.escape(str(e['name']))}</td>"
        f"<td>{'' if e.get('rank') is None else html.escape(str(e.get('rank')))}</td>"
        f"<td>{html.escape(_event_text(e))}</td></tr>" for e in listed)
    more = (f"<p>{len(report.events) - len(listed)} more events on the timeline only</p>"
            if len(report.events) > len(listed) else "")
    return ("<h2>Events</h2>" + charts.div("events", timeline)
            + f"<details><summary>{len(report.events)} events, {len(report.gaps)} gaps</summary>"
            '<table id="events"><tr><th>time (UTC)</th><th>event</th><th>rank</th><th>data</th></tr>'
            f"{rows_html}</table>{more}</details>")


def _document(job: str, js: str, body: str, figures: list[dict[str, Any]]) -> str:
    """The HTML document: plotly.js, the body, the figures' JSON and the script that draws them."""
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>shmstat report: {html.escape(job)}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}"
        "th,td{padding:2px 10px;text-align:left;border-bottom:1px solid #ddd}td{font-variant-numeric:tabular-nums}"
        ".chart{margin:0.5em 0 1.5em 0}section.stat{border-top:1px solid #ccc;margin-top:1em}</style>"
        f"<script>{js}</script></head><body>"
        f"<h1>shmstat report</h1><p>generated {generated} by shmstat report</p>"
        + body
        + f'<script id="figures" type="application/json">{_json_for_script(figures)}</script>'
        "<script>(function(){var figs=JSON.parse(document.getElementById('figures').textContent);"
        "figs.forEach(function(f){Plotly.newPlot(f.id,f.data,f.layout,{displaylogo:false,responsive:true});});"
        "document.body.setAttribute('data-charts-drawn',String(figs.length));})();</script>"
        "</body></html>\n"
    )
