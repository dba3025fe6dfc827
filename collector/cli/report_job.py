"""The job's figures as ``shmstat report`` reads them from files: :func:`load_report` reads the jsonl rows of
the windows handler (:class:`collector.handlers.jsonl.JsonlMetricHandler`'s format, one node's file or each node's)
and the events sink's lines (:class:`collector.sinks.events.JsonlEventHandler`'s) into a :class:`JobReport`: per
stat its :class:`StatSeries`, the job's put metrics, events, gaps and the collector's counters, with the
:class:`Straggler` and :class:`Hang` records the page says in words. Nothing here draws:
:mod:`collector.cli.report_page` does.
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shmstat.errors import ConfigError
from shmstat.names import COLLECTOR_GROUP
from shmstat.writer.sections import SECTION_GROUP

from ..daemon.cause import SectionTimes, attribute
from ..daemon.hangs import HANG_EVENT, RESOLVED_EVENT
from ..daemon.scoring import score_ranks
from ..daemon.straggler import DEFAULT_THRESHOLD, SCORE_METRIC_PREFIX

__all__ = ["AGGREGATIONS", "GPU_GROUP", "HANG_EVENT", "PERCENTILES", "RESOLVED_EVENT", "Figures", "Hang",
           "JobReport", "RankKey", "StatSeries", "Straggler", "load_report", "rank_label", "utc_text"]

AGGREGATIONS = ("count", "sum", "mean", "max", "min", "value", "p50", "p90", "p99", "p999")
"""The ``<stat>.<aggregation>`` suffixes a window row can carry."""
PERCENTILES = ("p50", "p90", "p99", "p999")
"""The aggregations that are percentiles (merged within one node only)."""
GPU_GROUP = "gpu"
"""The group whose stats (GPU figures, one series per rank) get a section of their own."""
_COUNTERS_PREFIX = "collector."

Figures = dict[str, float | None]
RankKey = tuple[str, int]
"""A rank of the job: (node, rank number). The node is ``""`` in a one-file report whose rows name none."""


@dataclass
class StatSeries:
    """One stat's windows: merged figures and each rank's, by window start (unix seconds)."""

    group: str
    name: str
    merged: dict[float, Figures] = field(default_factory=dict)
    """Merged figures by window start: the node's merged rows; with several nodes, what adds up exactly across
    them (count, sum, min, max, and the mean as sum / count), no percentile (those merge exactly in Prometheus)."""
    node_merged: dict[str, dict[float, Figures]] = field(default_factory=dict)
    """Each node's merged rows as written, by node and window start."""
    ranks: dict[RankKey, dict[float, Figures]] = field(default_factory=dict)
    scores: dict[tuple[RankKey, float], float] = field(default_factory=dict)
    """The collector's straggler scores, by (rank, window start), when the jsonl holds them (one node only)."""
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
        """Whether the stat keeps percentiles: its rows carry them (a rank's, or a node's merged rows)."""
        return any(p in figures for per in (*self.node_merged.values(), *self.ranks.values())
                   for figures in per.values() for p in PERCENTILES)

    def figure(self, figures: Figures) -> float | None:
        """A rank's straggler figure in one window: its p50 when the stat keeps percentiles, else its mean
        (:func:`collector.daemon.scoring.figure`); None for a window with no sample."""
        if not figures.get("count", 1):
            return None
        value = figures.get("p50") if "p50" in figures else figures.get("mean")
        return value if value is not None and math.isfinite(value) else None

    def score_grid(self) -> dict[tuple[RankKey, float], float]:
        """Every (rank, window start) score: the collector's where the jsonl has one, else the collector's rule
        applied to the rows in the stat's direction (:func:`collector.daemon.scoring.score_ranks`, the
        collector's own code)."""
        out = dict(self.scores)
        if self.wait:  # the healthy ranks wait longest: a wait is no rank's fault (collector.read.columns)
            return out
        keys = sorted(self.ranks)
        for start in self.windows():
            figures = {i: f for i, key in enumerate(keys)
                       if start in (per := self.ranks[key]) and (f := self.figure(per[start])) is not None}
            _, scores = score_ranks(figures, self.higher_is_better)
            for i, score in scores.items():
                out.setdefault((keys[i], start), score)
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
    node: str = ""
    """The rank's node (``""``: a one-file report whose rows name none)."""
    cause: str | None = None
    """What carries its excess, when its sections tell (:func:`collector.daemon.cause.attribute`, the collector's
    own rule, against the ranks of its node, over the section windows within its slow windows)."""

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
        shown = ", ".join(utc_text(a) if a == b else f"{utc_text(a)} to {utc_text(b)}" for a, b in runs[:most_runs])
        if len(runs) > most_runs:
            shown += f" and {len(runs) - most_runs} more runs"
        worst, middle = min(self.scores), statistics.median(self.scores)
        return (f"rank {self.rank} was slow on {self.stat} in {len(self.windows)} of the {self.scored} windows that "
                f"scored it ({shown} UTC): score {middle:.3g} (median of those windows; lowest {worst:.3g}; "
                f"under {threshold:g} is slow, 1 is the median rank)" + (f" \u2014 {self.cause}" if self.cause else ""))


@dataclass
class Hang:
    """One hang episode of one node: its ``shmstat.hang`` event and when its ``shmstat.hang.resolved`` came."""

    node: str
    start: float
    """When the node's collector named it (the event's time, unix seconds)."""
    end: float | None
    """When it resolved (unix seconds); None: the files hold no resolution."""
    data: dict[str, Any]
    """The hang event's data (:mod:`collector.daemon.hangs`: ranks, suspects, each suspect's section and state)."""
    reason: str = ""
    """The resolution's reason (``progress``, ``ended``), if it resolved."""

    @property
    def line(self) -> str:
        """The collector's console line of the hang (the event's ``line``)."""
        line = self.data.get("line")
        return line if isinstance(line, str) else f"hang: ranks {self.data.get('ranks')}"


@dataclass
class JobReport:
    """What a report shows of one job: its stats, the collector's counters, events and gaps."""

    job: str
    stats: dict[tuple[str, str], StatSeries] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    """The collector's own counters (``shmstat`` group, ``collector.<name>``), newest value of each."""
    window_s: dict[tuple[str, str], float] = field(default_factory=dict)
    puts: dict[tuple[str, str], dict[tuple[str, int | None], list[tuple[float, float]]]] = field(
        default_factory=dict)
    """The job's put metrics (rows with no window, of any group but the collector's own), by (group, name) and
    (node, rank) (rank None: put by no rank, e.g. ``shmstat run``'s agent), as (timestamp, value) in file
    order."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Events in time order, each with its ``node`` (as its file names it, else as its rows' file does)."""
    gaps: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0
    """Lines of either file that were not a JSON object of the expected shape (skipped, counted)."""

    def ranks(self) -> list[RankKey]:
        """Every (node, rank) with a per-rank window row."""
        return sorted({r for s in self.stats.values() for r in s.ranks})

    def nodes(self) -> list[str]:
        """Every node of a window row or an event."""
        nodes = {node for node, _ in self.ranks()} | {str(e.get("node") or "") for e in self.events}
        nodes |= {node for s in self.stats.values() for node in s.node_merged}
        return sorted(nodes)

    def hangs(self) -> list[Hang]:
        """Each node's hang episodes, in time order: a ``shmstat.hang`` event to the node's next
        ``shmstat.hang.resolved`` (a resolution with no hang before it, one the collector never published, is
        left out)."""
        out: list[Hang] = []
        open_: dict[str, Hang] = {}
        for e in self.events:
            node, data = str(e.get("node") or ""), e.get("data")
            if e.get("name") == HANG_EVENT and isinstance(data, dict):
                open_[node] = hang = Hang(node, float(e.get("timestamp") or 0.0), None, data)
                out.append(hang)
            elif e.get("name") == RESOLVED_EVENT and node in open_:
                hang = open_.pop(node)
                hang.end = float(e.get("timestamp") or 0.0)
                reason = data.get("reason") if isinstance(data, dict) else None
                hang.reason = reason if isinstance(reason, str) else ""
        return out

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
            by_rank: dict[RankKey, list[tuple[float, float]]] = defaultdict(list)
            for (key, start), score in s.score_grid().items():
                by_rank[key].append((start, score))
            for (node, rank), scored in by_rank.items():
                slow = sorted((start, score) for start, score in scored if score < threshold)
                if slow:
                    length = self.window_s.get((s.group, s.name))
                    end = slow[-1][0] + length if length else math.nextafter(slow[-1][0], math.inf)
                    out.append(Straggler(s.key, rank, [w for w, _ in slow], [sc for _, sc in slow], len(scored),
                                         s.windows(), node, self.cause((node, rank), slow[0][0], end)))
        return sorted(out, key=lambda g: (-len(g.windows), g.stat, g.node, g.rank))

    def cause(self, key: RankKey, start: float, end: float) -> str | None:
        """What carries the excess of the rank ``key`` names against the ranks of its node in the section windows
        that start from ``start`` to before ``end`` (unix s), summed (:func:`collector.daemon.cause.attribute`, the
        collector's rule), in words; None when its sections do not tell."""
        node, rank = key
        ranks: dict[int, dict[str, SectionTimes]] = defaultdict(dict)
        for s in self.stats.values():
            if s.group != SECTION_GROUP:
                continue
            for (rank_node, r), per in s.ranks.items():
                if rank_node != node:
                    continue
                picked = [f for w, f in per.items() if start <= w < end and f.get("sum") is not None]
                if picked:
                    ranks[r][s.name] = SectionTimes(sum(f["sum"] or 0.0 for f in picked),
                                                    int(sum(f.get("count") or 0 for f in picked)), s.wait)
        found = attribute(ranks, rank)
        return None if found is None else found.sentence()

    def restarts(self) -> int:
        """Rank starts after each rank's first: per rank, the incarnations its ``rank/joined`` events name, less
        one (the events file tells; without it, 0)."""
        seen: dict[Any, set[Any]] = defaultdict(set)
        for e in self.events:
            data = e.get("data")
            if e.get("name") == "rank/joined" and isinstance(data, dict) and _int(data.get("rank")) \
                    and _int(data.get("incarnation")):
                seen[(e.get("node"), data["rank"])].add(data["incarnation"])
        return sum(len(incarnations) - 1 for incarnations in seen.values())

    def summary(self) -> dict[str, int]:
        """The job's figures at a glance (what the page's summary table shows, by the same names)."""
        return {
            "nodes": len(self.nodes()),
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
    job_ok = (r.get("job") is None or _text(r.get("job"))) and (r.get("node") is None or _text(r.get("node")))
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
    if not ((e.get("job") is None or _text(e.get("job"))) and (e.get("node") is None or _text(e.get("node")))
            and _time(e.get("timestamp"))
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


def load_report(jsonl: str | Sequence[str], events: str | Sequence[str] | None = None, *,
                job: str | None = None) -> JobReport:
    """Read a job's jsonl windows (one file, or several: one per node) and ``events`` (its events jsonl files)
    into a :class:`JobReport`.

    Files holding several jobs (a node collector's) need ``job``; rows of other jobs are left out. Each row's node
    is its ``node``; a row that names none takes its file's name (without the suffix) when several files are read,
    else ``""``; an event that names none, the node of the windows file given at its position when there are as
    many of each. Lines that are not a row (not UTF-8, not a JSON object, a field of the wrong type or out of
    range: see :func:`_is_row`) are skipped and counted (:attr:`JobReport.bad_lines`). Raises
    :class:`ConfigError` with one sentence for a file that cannot be read, a ``job`` no file holds, or several
    jobs and no ``job``.
    """
    paths = [jsonl] if isinstance(jsonl, str) else list(jsonl)
    event_paths = [] if events is None else [events] if isinstance(events, str) else list(events)
    where, holds = (paths[0], "holds") if len(paths) == 1 else (f"the {len(paths)} jsonl files", "hold")
    files = [[r if r is not None and _is_row(r) else None for r in _objects(path, "jsonl")] for path in paths]
    jobs = {r.get("job") for rows in files for r in rows if r is not None and r.get("job") is not None}
    if job is None and len(jobs) > 1:
        raise ConfigError(f"{where} {holds} {len(jobs)} jobs ({', '.join(sorted(map(str, jobs))[:5])}); "
                          "choose one with --job")
    if job is not None and job not in jobs:
        # the collector prints a job's id shortened to a prefix: take a prefix that names one job of the file
        matches = sorted(str(j) for j in jobs if str(j).startswith(job))
        if len(matches) > 1:
            raise ConfigError(f"--job {job!r} is the start of {len(matches)} jobs of {where} "
                              f"({', '.join(matches[:5])}{', ...' if len(matches) > 5 else ''}); give more of it")
        if not matches:
            raise ConfigError(f"{where} {holds} no row of job {job!r} "
                              f"(jobs: {', '.join(sorted(map(str, jobs))) or 'none'})")
        job = matches[0]
    chosen = job if job is not None else next(iter(jobs), "")
    report = JobReport(chosen or os.path.basename(paths[0]))
    file_nodes = [os.path.splitext(os.path.basename(path))[0] if len(paths) > 1 else "" for path in paths]
    for rows, file_node in zip(files, file_nodes, strict=True):
        for r in rows:
            if r is None:
                report.bad_lines += 1
                continue
            if r.get("job") not in (None, chosen):
                continue
            _take_row(report, r, r.get("node") or file_node)
    for series in report.stats.values():
        series.merged = _across_nodes(series.node_merged)
    if len(report.nodes()) > 1:  # each node's collector scored its ranks against its node: the job's median here
        for series in report.stats.values():
            series.scores.clear()
    for i, path in enumerate(event_paths):
        file_node = file_nodes[i] if len(event_paths) == len(paths) else ""
        for e in _objects(path, "events file"):
            if e is None or not _is_event(e):
                report.bad_lines += 1
            elif e.get("job") not in (None, chosen):
                continue
            elif "gap" in e:
                report.gaps.append(e)
            else:
                report.events.append({**e, "node": e.get("node") or file_node})
    report.events.sort(key=lambda e: e.get("timestamp") or 0.0)
    return report


_ADDS = ("count", "sum")


def _across_nodes(per_node: dict[str, dict[float, Figures]]) -> dict[float, Figures]:
    """One merged row per window from each node's: a node's own as written; across nodes what adds up exactly."""
    if len(per_node) <= 1:
        return next(iter(per_node.values()), {})
    out: dict[float, Figures] = {}
    for start in sorted({w for per in per_node.values() for w in per}):
        rows = [per[start] for per in per_node.values() if start in per]
        if len(rows) == 1:
            out[start] = {a: v for a, v in rows[0].items() if a not in PERCENTILES}
            continue
        merged: Figures = {}
        for agg in _ADDS:
            values = [r.get(agg) for r in rows if agg in r]
            if values:
                merged[agg] = None if None in values else sum(v for v in values if v is not None)
        lows = [v for r in rows if (v := r.get("min")) is not None]
        highs = [v for r in rows if (v := r.get("max")) is not None]
        if lows:
            merged["min"] = min(lows)
        if highs:
            merged["max"] = max(highs)
        count, total = merged.get("count"), merged.get("sum")
        if count and total is not None:
            merged["mean"] = total / count
        elif count and all(r.get("mean") is not None and r.get("count") is not None for r in rows):
            merged["mean"] = sum((r["mean"] or 0.0) * (r["count"] or 0.0) for r in rows) / count
        out[start] = merged
    return out


def _take_row(report: JobReport, r: dict[str, Any], node: str) -> None:
    group, name, start, rank = r["group"], r["name"], r.get("window_start"), r.get("rank")
    value = _number(r.get("value"))
    if start is None:
        if group == COLLECTOR_GROUP:  # the collector's own points (no job may put into its group): no put metric
            if name.startswith(_COUNTERS_PREFIX) and value is not None:
                report.counters[name[len(_COUNTERS_PREFIX):]] = value
        elif value is not None:
            points = report.puts.setdefault((group, name), {}).setdefault(
                (node, None if rank is None else int(rank)), [])
            points.append((float(r.get("timestamp") or 0.0), value))
        return
    start = float(start)
    if group == COLLECTOR_GROUP and name.startswith(SCORE_METRIC_PREFIX):
        stat_group, _, stat = name[len(SCORE_METRIC_PREFIX):].partition("/")
        if rank is not None and value is not None:
            series = _series(report, stat_group, stat)
            series.scores[((node, int(rank)), start)] = value
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
        figures = series.node_merged.setdefault(node, {}).setdefault(start, {})
        if agg == "count" and r.get("torn"):
            series.torn += 1
    else:
        figures = series.ranks.setdefault((node, int(rank)), {}).setdefault(start, {})
    figures[agg] = value


def _series(report: JobReport, group: str, stat: str) -> StatSeries:
    series = report.stats.get((group, stat))
    if series is None:
        series = report.stats[(group, stat)] = StatSeries(group, stat)
    return series



def utc_text(start: float) -> str:
    """``start`` (unix seconds) as UTC text to the millisecond: ``YYYY-MM-DD HH:MM:SS.mmm``."""
    ms = int(start * 1000) % 1000
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(start))}.{ms:03d}"


def rank_label(key: RankKey, several: bool) -> str | int:
    """How the page names a rank: its number, or ``node/rank`` (escaped: plotly reads labels as markup) when the
    job has ``several`` nodes."""
    return html.escape(f"{key[0]}/{key[1]}") if several else key[1]
