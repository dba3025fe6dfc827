"""``shmstat report``: a finished job's jsonl output (and its ``--events`` file) as one self-contained HTML file.

Reading and drawing are two steps, so each can be tested on its own: :func:`load_report` reads the jsonl rows of
the windows handler (:class:`collector.handlers.jsonl.JsonlMetricHandler`'s format) and the events sink's lines
(:class:`collector.sinks.events.JsonlEventHandler`'s) into a :class:`JobReport`; :func:`render_html` draws it
with plotly.js (the ``plotly`` package's own copy, from the optional extra ``shmstat[report]``), inlined in the
page with every figure's data, so nothing is fetched when the page is opened (no network, no CDN).

The page holds: the job summary (ranks, windows, samples, drops, restarts, events and gaps, the job's put
metrics: never the collector's own points) and each rank that scored under the threshold, in words; per stat its
merged figure over time with the spread across ranks (the lowest and highest rank's figure of each window), its
percentiles over time (stats that keep them), and a rank x window heatmap of the straggler figure (the window's
p50 when the stat keeps percentiles, else its mean: the collector's rule, :mod:`collector.daemon.straggler`),
coloured by figure / the window's median on a fixed scale (:data:`RELATIVE_RANGE`), with the windows where a rank
scored under the threshold marked; the ``gpu`` group's stats in a section of their own; each put metric per rank
over time; the events and gaps on a timeline. Every chart shows its legend. Scores are the collector's own when the
jsonl holds them (the ``shmstat`` group was configured), otherwise they are computed from the rows with the same
rule.
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shmstat.errors import ConfigError
from shmstat.names import COLLECTOR_GROUP

from ..daemon.straggler import DEFAULT_THRESHOLD, SCORE_METRIC_PREFIX, score_ranks

__all__ = ["AGGREGATIONS", "GPU_GROUP", "RELATIVE_RANGE", "JobReport", "StatSeries", "Straggler", "load_report",
           "plotly_js", "render_html", "write_report"]

AGGREGATIONS = ("count", "sum", "mean", "max", "min", "value", "p50", "p90", "p99", "p999")
"""The ``<stat>.<aggregation>`` suffixes a window row can carry."""
PERCENTILES = ("p50", "p90", "p99", "p999")
GPU_GROUP = "gpu"
"""The group whose stats (GPU figures, one series per rank) get a section of their own."""
_COUNTERS_PREFIX = "collector."
_MAX_EVENT_ROWS = 1000  # events listed in the page's table (the timeline has all of them)

Figures = dict[str, float | None]


@dataclass
class StatSeries:
    """One stat's windows: merged figures and each rank's, by window start (unix seconds)."""

    group: str
    name: str
    merged: dict[float, Figures] = field(default_factory=dict)
    ranks: dict[int, dict[float, Figures]] = field(default_factory=dict)
    scores: dict[tuple[int, float], float] = field(default_factory=dict)
    """The collector's straggler scores, by (rank, window start), when the jsonl holds them."""
    torn: int = 0
    """Merged windows flagged torn (a writer died in the middle of an add)."""
    higher_is_better: bool = False
    """The stat declared itself a rate (its rows say ``"higher_is_better": true``): a slow rank's figure is low."""
    wait: bool = False
    """The stat times a wait for other ranks (a wait section: its rows say ``"wait": true``): never scored."""

    @property
    def key(self) -> str:
        """``group/name``."""
        return f"{self.group}/{self.name}"

    def windows(self) -> list[float]:
        """Every window start with a merged or per-rank row, in time order."""
        starts = set(self.merged)
        for per in self.ranks.values():
            starts.update(per)
        return sorted(starts)

    def main_aggregation(self) -> str | None:
        """The aggregation drawn over time: ``mean`` when the stat has it, else ``value``, ``sum``, ``count``."""
        have = {a for figures in self.merged.values() for a in figures}
        have.update(a for per in self.ranks.values() for figures in per.values() for a in figures)
        return next((a for a in ("mean", "value", "sum", "count") if a in have), None)

    def has_percentiles(self) -> bool:
        """Whether the merged rows carry percentiles."""
        return any(p in figures for figures in self.merged.values() for p in PERCENTILES)

    def figure(self, figures: Figures) -> float | None:
        """A rank's straggler figure in one window: its p50 when the stat keeps percentiles, else its mean
        (:func:`collector.daemon.straggler.figure`); None for a window with no sample."""
        if not figures.get("count", 1):
            return None
        value = figures.get("p50") if "p50" in figures else figures.get("mean")
        return value if value is not None and math.isfinite(value) else None

    def score_grid(self) -> dict[tuple[int, float], float]:
        """Every (rank, window start) score: the collector's where the jsonl has one, else the collector's rule
        applied to the rows in the stat's direction (:func:`collector.daemon.straggler.score_ranks`, the
        collector's own code)."""
        out = dict(self.scores)
        if self.wait:  # the healthy ranks wait longest: a wait is no rank's fault (collector.read.columns)
            return out
        for start in self.windows():
            figures = {rank: f for rank, per in self.ranks.items()
                       if start in per and (f := self.figure(per[start])) is not None}
            _, scores = score_ranks(figures, self.higher_is_better)
            for rank, score in scores.items():
                out.setdefault((rank, start), score)
        return out


@dataclass
class Straggler:
    """A rank that scored under the threshold on a stat in one window or more: which windows, with what scores."""

    stat: str
    rank: int
    windows: list[float]
    """The starts of the windows it was slow in, in time order."""
    scores: list[float]
    """Its score in each of those windows."""
    scored: int
    """Windows of the stat that scored the rank."""
    stat_windows: list[float]
    """Every window of the stat, in time order (to tell runs of consecutive slow windows)."""

    def runs(self) -> list[tuple[float, float]]:
        """The slow windows as runs of consecutive windows of the stat: (first start, last start) each."""
        index = {w: i for i, w in enumerate(self.stat_windows)}
        runs: list[list[float]] = []
        for w in self.windows:
            if runs and index[w] == index[runs[-1][1]] + 1:
                runs[-1][1] = w
            else:
                runs.append([w, w])
        return [(a, b) for a, b in runs]

    def sentence(self, threshold: float, *, most_runs: int = 5) -> str:
        """The straggler in words: rank, stat, how many and which windows, its scores."""
        runs = self.runs()
        shown = ", ".join(_utc(a) if a == b else f"{_utc(a)} to {_utc(b)}" for a, b in runs[:most_runs])
        if len(runs) > most_runs:
            shown += f" and {len(runs) - most_runs} more runs"
        worst, middle = min(self.scores), statistics.median(self.scores)
        return (f"rank {self.rank} was slow on {self.stat} in {len(self.windows)} of the {self.scored} windows that "
                f"scored it ({shown} UTC): score {middle:.3g} (median of those windows; lowest {worst:.3g}; "
                f"under {threshold:g} is slow, 1 is the median rank)")


@dataclass
class JobReport:
    """What a report shows of one job: its stats, the collector's counters, events and gaps."""

    job: str
    stats: dict[tuple[str, str], StatSeries] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    """The collector's own counters (``shmstat`` group, ``collector.<name>``), newest value of each."""
    window_s: dict[tuple[str, str], float] = field(default_factory=dict)
    puts: dict[tuple[str, str], dict[int | None, list[tuple[float, float]]]] = field(default_factory=dict)
    """The job's put metrics (rows with no window, of any group but the collector's own), by (group, name) and
    rank (None: put by no rank, e.g. ``shmstat run``'s agent), as (timestamp, value) in file order."""
    events: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0
    """Lines of either file that were not a JSON object of the expected shape (skipped, counted)."""

    def ranks(self) -> list[int]:
        """Every rank with a per-rank window row."""
        return sorted({r for s in self.stats.values() for r in s.ranks})

    def windows(self) -> list[float]:
        """Every distinct window start (unix seconds) of any stat."""
        return sorted({w for s in self.stats.values() for w in s.windows()})

    def samples(self) -> int:
        """Samples counted in the merged windows of every stat (their ``count`` rows)."""
        return int(sum(f.get("count") or 0 for s in self.stats.values() for f in s.merged.values()))

    def put_metrics(self) -> int:
        """Rows of the job's put metrics (the collector's own points, group ``shmstat``, are not the job's)."""
        return sum(len(points) for per in self.puts.values() for points in per.values())

    def stragglers(self, threshold: float = DEFAULT_THRESHOLD) -> list[Straggler]:
        """Every (stat, rank) that scored under ``threshold`` in a window (:meth:`StatSeries.score_grid`: the
        collector's scores, else its rule), most slow windows first."""
        out = []
        for s in self.stats.values():
            by_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for (rank, start), score in s.score_grid().items():
                by_rank[rank].append((start, score))
            for rank, scored in by_rank.items():
                slow = sorted((start, score) for start, score in scored if score < threshold)
                if slow:
                    out.append(Straggler(s.key, rank, [w for w, _ in slow], [sc for _, sc in slow], len(scored),
                                         s.windows()))
        return sorted(out, key=lambda g: (-len(g.windows), g.stat, g.rank))

    def restarts(self) -> int:
        """Rank starts after each rank's first: per rank, the incarnations its ``rank/joined`` events name, less
        one (the events file tells; without it, 0)."""
        seen: dict[Any, set[Any]] = defaultdict(set)
        for e in self.events:
            data = e.get("data")
            if e.get("name") == "rank/joined" and isinstance(data, dict) and _int(data.get("rank")) \
                    and _int(data.get("incarnation")):
                seen[data["rank"]].add(data["incarnation"])
        return sum(len(incarnations) - 1 for incarnations in seen.values())

    def summary(self) -> dict[str, int]:
        """The job's figures at a glance (what the page's summary table shows, by the same names)."""
        return {
            "ranks": len(self.ranks()),
            "stats": len(self.stats),
            "windows": len(self.windows()),
            "samples": self.samples(),
            "samples_dropped": int(self.counters.get("samples_dropped", 0)),
            "windows_torn": sum(s.torn for s in self.stats.values()),
            "windows_overwritten": int(self.counters.get("windows_overwritten", 0)),
            "events": len(self.events),
            "events_lost": int(sum(g.get("gap") or 0 for g in self.gaps)),
            "restarts": self.restarts(),
            "put_metrics": self.put_metrics(),
        }


def _number(value: Any) -> float | None:
    """A figure as the jsonl writes it (a number; NaN and infinities as strings), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an int past a double's range: no figure written by a collector
            return None
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return None


_MAX_TIME_S = 253402300799.0
"""9999-12-31 23:59:59 UTC: the last second the page's dates (``time.gmtime``) take."""
_MAX_RANK = 1 << 31


def _int(value: Any, low: int = 0, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value < high)


def _time(value: Any) -> bool:
    """None, or seconds since the epoch the page can show."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool)
                             and 0 <= value <= _MAX_TIME_S)


def _text(value: Any) -> bool:
    """A ``str`` that is UTF-8 (no lone surrogate: the page is written in UTF-8)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_row(r: dict[str, Any]) -> bool:
    """Whether a jsonl object is a row: each field of the type and range a collector writes (see
    :func:`collector.handlers.jsonl._line`)."""
    name, value, rank = r.get("name"), r.get("value"), r.get("rank")
    job_ok = r.get("job") is None or _text(r.get("job"))
    if not isinstance(name, str) or not (_text(r.get("group")) and _text(name) and job_ok
            and _time(r.get("timestamp")) and _time(r.get("window_start")) and _time(r.get("window_end"))
            and (rank is None or _int(rank, 0, _MAX_RANK)) and isinstance(r.get("torn", False), bool)
            and isinstance(r.get("higher_is_better", False), bool) and isinstance(r.get("wait", False), bool)):
        return False
    figure = _number(value)
    if r.get("window_start") is None and r.get("group") == COLLECTOR_GROUP and name.startswith(_COUNTERS_PREFIX):
        # the collector's own figures (counters, CPU seconds): a finite number, never negative
        return not isinstance(value, str) and figure is not None and math.isfinite(figure) and figure >= 0
    if name.endswith(".count") and r.get("window_start") is not None:
        return _int(value) and figure is not None  # a count: an int, never negative, within a double's range
    return figure is not None


def _is_event(e: dict[str, Any]) -> bool:
    """Whether an events-file object is an event or a gap record of the shape the events sink writes."""
    rank = e.get("rank")
    if not ((e.get("job") is None or _text(e.get("job"))) and _time(e.get("timestamp"))
            and (rank is None or _int(rank, 0, _MAX_RANK))):
        return False
    return _int(e["gap"]) if "gap" in e else _text(e.get("name"))


def _split_name(name: str) -> tuple[str, str] | None:
    stat, dot, agg = name.rpartition(".")
    return (stat, agg) if dot and stat and agg in AGGREGATIONS else None


def _objects(path: str, what: str) -> Iterator[dict[str, Any] | None]:
    """The lines of a jsonl file as objects (None for a line that is not one: not UTF-8, not JSON, not an object)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the error must name the option)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path!r}: {exc.strerror}") from None
    with f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                yield None
                continue
            yield obj if isinstance(obj, dict) else None


def load_report(jsonl: str, events: str | None = None, *, job: str | None = None) -> JobReport:
    """Read a job's jsonl windows (and ``events``, its events jsonl) into a :class:`JobReport`.

    A file holding several jobs (a node collector's) needs ``job``; rows of other jobs are left out. Lines that
    are not a row (not UTF-8, not a JSON object, a field of the wrong type or out of range: see :func:`_is_row`) are
    skipped and counted (:attr:`JobReport.bad_lines`). Raises :class:`ConfigError` with one
    sentence for a file that cannot be read, a ``job`` it does not hold, or several jobs and no ``job``.
    """
    rows = [r if r is not None and _is_row(r) else None for r in _objects(jsonl, "jsonl")]
    jobs = {r.get("job") for r in rows if r is not None and r.get("job") is not None}
    if job is None and len(jobs) > 1:
        raise ConfigError(f"{jsonl} holds {len(jobs)} jobs ({', '.join(sorted(map(str, jobs))[:5])}); "
                          "choose one with --job")
    if job is not None and job not in jobs:
        # the collector prints a job's id shortened to a prefix: take a prefix that names one job of the file
        matches = sorted(str(j) for j in jobs if str(j).startswith(job))
        if len(matches) > 1:
            raise ConfigError(f"--job {job!r} is the start of {len(matches)} jobs of {jsonl} "
                              f"({', '.join(matches[:5])}{', ...' if len(matches) > 5 else ''}); give more of it")
        if not matches:
            raise ConfigError(f"{jsonl} holds no row of job {job!r} "
                              f"(jobs: {', '.join(sorted(map(str, jobs))) or 'none'})")
        job = matches[0]
    chosen = job if job is not None else next(iter(jobs), "")
    report = JobReport(chosen or os.path.basename(jsonl))
    for r in rows:
        if r is None:
            report.bad_lines += 1
            continue
        if r.get("job") not in (None, chosen):
            continue
        _take_row(report, r)
    if events is not None:
        for e in _objects(events, "events file"):
            if e is None or not _is_event(e):
                report.bad_lines += 1
            elif e.get("job") not in (None, chosen):
                continue
            elif "gap" in e:
                report.gaps.append(e)
            else:
                report.events.append(e)
        report.events.sort(key=lambda e: e.get("timestamp") or 0.0)
    return report


def _take_row(report: JobReport, r: dict[str, Any]) -> None:
    group, name, start, rank = r["group"], r["name"], r.get("window_start"), r.get("rank")
    value = _number(r.get("value"))
    if start is None:
        if group == COLLECTOR_GROUP:  # the collector's own points (no job may put into its group): no put metric
            if name.startswith(_COUNTERS_PREFIX) and value is not None:
                report.counters[name[len(_COUNTERS_PREFIX):]] = value
        elif value is not None:
            points = report.puts.setdefault((group, name), {}).setdefault(None if rank is None else int(rank), [])
            points.append((float(r.get("timestamp") or 0.0), value))
        return
    start = float(start)
    if group == COLLECTOR_GROUP and name.startswith(SCORE_METRIC_PREFIX):
        stat_group, _, stat = name[len(SCORE_METRIC_PREFIX):].partition("/")
        if rank is not None and value is not None:
            series = _series(report, stat_group, stat)
            series.scores[(int(rank), start)] = value
        return
    split = _split_name(name)
    if split is None:  # a window's row names an aggregation: this is no row a collector writes
        report.bad_lines += 1
        return
    stat, agg = split
    series = _series(report, group, stat)
    if r.get("higher_is_better") is True:
        series.higher_is_better = True
    if r.get("wait") is True:
        series.wait = True
    end = r.get("window_end")
    if end is not None:
        report.window_s[(group, stat)] = float(end) - start
    if rank is None:
        figures = series.merged.setdefault(start, {})
        if agg == "count" and r.get("torn"):
            series.torn += 1
    else:
        figures = series.ranks.setdefault(int(rank), {}).setdefault(start, {})
    figures[agg] = value


def _series(report: JobReport, group: str, stat: str) -> StatSeries:
    series = report.stats.get((group, stat))
    if series is None:
        series = report.stats[(group, stat)] = StatSeries(group, stat)
    return series


# -- drawing -------------------------------------------------------------------------------------------------------


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
    if not s.has_percentiles():
        return None
    windows = sorted(s.merged)
    x = [_ms(w) for w in windows]
    traces = [{"type": "scatter", "mode": "lines+markers", "name": p, "x": x,
               "y": _clean(s.merged[w].get(p) for w in windows), "meta": p}
              for p in PERCENTILES if any(p in s.merged[w] for w in windows)]
    return {"kind": "percentiles", "data": traces, "layout": _layout(f"{s.key} percentiles over time (merged)", "")}


RELATIVE_RANGE = (0.5, 1.5)
"""The heatmap's fixed colour range of figure / window median: noise around the median stays pale, whatever the
figures' own spread; a figure past either end takes that end's colour."""


def _heatmap(s: StatSeries, threshold: float) -> dict[str, Any] | None:
    if len(s.ranks) < 2:
        return None
    windows = s.windows()
    ranks = sorted(s.ranks)
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
        {"type": "heatmap", "name": figure_name, "x": x, "y": ranks, "z": z, "customdata": raw, "meta": "figure",
         "showlegend": True, "hovertemplate": hover, **colour},
        {"type": "scatter", "mode": "markers", "name": f"straggler (score < {threshold:g})",
         "x": [_ms(w) for w, _ in slow], "y": [r for _, r in slow],
         "text": [f"score {scores[(r, w)]:.3g}" for w, r in slow], "meta": "stragglers",
         "marker": {"symbol": "x", "size": 10, "color": "#222222", "line": {"width": 2, "color": "#ffffff"}}},
    ]
    scale = "figure / the window's median across ranks" if relative else figure_name
    layout = _layout(f"{s.key} {figure_name} per rank and window, coloured by {scale} (x: straggler windows)", "")
    layout["yaxis"] = {"title": {"text": "rank"}, "dtick": 1, "autorange": "reversed"}
    layout["height"] = max(260, 60 + 22 * len(ranks))
    return {"kind": "heatmap", "data": traces, "layout": layout}


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _put_chart(key: tuple[str, str], per_rank: dict[int | None, list[tuple[float, float]]]) -> dict[str, Any]:
    traces = []
    for rank in sorted(per_rank, key=lambda r: -1 if r is None else r):
        points = sorted(per_rank[rank])
        name = "no rank" if rank is None else f"rank {rank}"
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": [_ms(t) for t, _ in points],
                       "y": _clean(v for _, v in points), "meta": None if rank is None else rank})
    layout = _layout(f"{key[0]}/{key[1]} as put (each point its time), per rank", "")
    layout["xaxis"]["title"] = {"text": "time (UTC)"}
    return {"kind": "put", "data": traces, "layout": layout}


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
    layout = _layout("events", "")
    layout["height"] = max(260, 80 + 26 * len(traces))
    layout["yaxis"] = {"type": "category", "automargin": True}
    return {"kind": "events", "data": traces, "layout": layout}


def _event_text(e: dict[str, Any]) -> str:
    who = "collector" if e.get("rank") is None else f"rank {e.get('rank')}"
    return f"{who}: {json.dumps(e.get('data', {}), sort_keys=True)[:300]}"


def _layout(title: str, y_title: str) -> dict[str, Any]:
    return {"title": {"text": html.escape(title)}, "height": 320, "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
            "xaxis": {"type": "date", "title": {"text": "window start (UTC)"}},
            "yaxis": {"title": {"text": y_title}}, "legend": {"orientation": "h"},
            "showlegend": True}  # plotly hides the legend of a chart with one trace: say what even one line is


def _json_for_script(obj: Any) -> str:
    """JSON safe inside an inline ``<script>`` (no ``</script>``, no ``<!--``)."""
    return json.dumps(obj, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(report: JobReport, *, threshold: float = DEFAULT_THRESHOLD, js: str | None = None) -> str:
    """The report page of ``report``: one HTML document with plotly.js (``js``, default :func:`plotly_js`) and
    every figure's data inline. Each chart is a ``div.chart`` with ``data-stat`` (``group/name``, or ``events``) and
    ``data-kind`` (``time``, ``percentiles``, ``heatmap``, ``events``); the summary is ``table#summary``, one
    ``tr`` per figure with ``data-name`` and ``data-value``."""
    if not 0 < threshold < 1:
        raise ConfigError(f"--threshold must be between 0 and 1 (exclusive), got {threshold:g}")
    js = (plotly_js() if js is None else js).replace("</script", "<\\/script")
    charts: list[tuple[str, dict[str, Any]]] = []
    sections: list[str] = []
    summary = report.summary()
    rows = "".join(f'<tr data-name="{k}" data-value="{v}"><th>{k.replace("_", " ")}</th><td>{v}</td></tr>'
                   for k, v in summary.items())
    counters = "".join(f'<tr data-name="{html.escape(k)}" data-value="{v:g}"><th>{html.escape(k)}</th>'
                       f"<td>{v:g}</td></tr>" for k, v in sorted(report.counters.items()))
    windows = report.windows()
    span = (f"{_utc(windows[0])} to {_utc(windows[-1])} UTC" if windows else "no window")
    slow = report.stragglers(threshold)
    said = ("".join(f'<li data-stat="{html.escape(g.stat)}" data-rank="{g.rank}" data-windows="{len(g.windows)}" '
                    f'data-score="{statistics.median(g.scores)!r}">{html.escape(g.sentence(threshold))}</li>'
                    for g in slow))
    straggling = (f'<h3>Stragglers</h3><ul id="stragglers">{said}</ul>' if slow else
                  f'<h3>Stragglers</h3><p id="stragglers">no rank scored under {threshold:g} in any window</p>')
    sections.append(f"<section><h2>Job {html.escape(report.job)}</h2><p>{span}</p>"
                    f'<table id="summary">{rows}</table>{straggling}'
                    + (f'<details><summary>Collector counters (newest)</summary><table id="counters">{counters}'
                       "</table></details>" if counters else "") + "</section>")

    def chart_div(key: str, chart: dict[str, Any] | None) -> str:
        if chart is None:
            return ""
        ident = f"chart-{len(charts)}"
        charts.append((ident, chart))
        return (f'<div class="chart" id="{ident}" data-stat="{html.escape(key)}" '
                f'data-kind="{chart["kind"]}"></div>')

    ordered = sorted(report.stats.values(), key=lambda s: (s.group == GPU_GROUP, s.group, s.name))
    current = None
    for s in ordered:
        heading = "GPU" if s.group == GPU_GROUP else "Stats"
        if heading != current:
            sections.append(f"<h2>{heading}</h2>")
            current = heading
        window = report.window_s.get((s.group, s.name))
        about = f"{len(s.windows())} windows" + (f" of {window:g} s" if window else "") + f", {len(s.ranks)} ranks"
        sections.append(f'<section class="stat" data-stat="{html.escape(s.key)}"><h3>{html.escape(s.key)}</h3>'
                        f"<p>{about}</p>" + chart_div(s.key, _over_time(s)) + chart_div(s.key, _percentiles(s))
                        + chart_div(s.key, _heatmap(s, threshold)) + "</section>")
    if report.puts:
        sections.append("<h2>Put metrics</h2>" + "".join(
            f'<section class="put" data-stat="{html.escape(f"{g}/{n}")}"><h3>{html.escape(f"{g}/{n}")}</h3>'
            f"<p>{sum(len(p) for p in report.puts[(g, n)].values())} points</p>"
            + chart_div(f"{g}/{n}", _put_chart((g, n), report.puts[(g, n)])) + "</section>"
            for g, n in sorted(report.puts)))
    timeline = _timeline(report)
    if timeline is not None:
        listed = report.events[:_MAX_EVENT_ROWS]
        rows_html = "".join(
            f"<tr><td>{_utc(float(e.get('timestamp') or 0.0))}</td><td>{html.escape(str(e['name']))}</td>"
            f"<td>{'' if e.get('rank') is None else html.escape(str(e.get('rank')))}</td>"
            f"<td>{html.escape(_event_text(e))}</td></tr>" for e in listed)
        more = (f"<p>{len(report.events) - len(listed)} more events on the timeline only</p>"
                if len(report.events) > len(listed) else "")
        sections.append("<h2>Events</h2>" + chart_div("events", timeline)
                        + f"<details><summary>{len(report.events)} events, {len(report.gaps)} gaps</summary>"
                        '<table id="events"><tr><th>time (UTC)</th><th>event</th><th>rank</th><th>data</th></tr>'
                        f"{rows_html}</table>{more}</details>")
    figures = [{"id": ident, "data": chart["data"], "layout": chart["layout"]} for ident, chart in charts]
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>shmstat report: {html.escape(report.job)}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}"
        "th,td{padding:2px 10px;text-align:left;border-bottom:1px solid #ddd}td{font-variant-numeric:tabular-nums}"
        ".chart{margin:0.5em 0 1.5em 0}section.stat{border-top:1px solid #ccc;margin-top:1em}</style>"
        f"<script>{js}</script></head><body>"
        f"<h1>shmstat report</h1><p>generated {generated} by shmstat report</p>"
        + "".join(sections)
        + f'<script id="figures" type="application/json">{_json_for_script(figures)}</script>'
        "<script>(function(){var figs=JSON.parse(document.getElementById('figures').textContent);"
        "figs.forEach(function(f){Plotly.newPlot(f.id,f.data,f.layout,{displaylogo:false,responsive:true});});"
        "document.body.setAttribute('data-charts-drawn',String(figs.length));})();</script>"
        "</body></html>\n"
    )


def _utc(start: float) -> str:
    ms = int(start * 1000) % 1000
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(start))}.{ms:03d}"


def write_report(jsonl: str, out: str | None = None, *, events: str | None = None, job: str | None = None,
                 threshold: float = DEFAULT_THRESHOLD) -> str:
    """Read ``jsonl`` (and ``events``), write the report page to ``out`` (default: ``jsonl`` with the suffix
    ``.html``) and return its path. Raises :class:`ConfigError` with one sentence for a bad argument."""
    report = load_report(jsonl, events, job=job)
    page = render_html(report, threshold=threshold)
    out = out or (os.path.splitext(jsonl)[0] + ".html")
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        raise ConfigError(f"cannot write the report {out!r}: {exc.strerror}") from None
    return out
