"""``shmstat top``: what a job's segment holds right now, as a person on the node wants to see it.

Two steps, so that a frame can be tested without a terminal: :func:`snapshot` reads the segment (the newest
closed window of every stat, merged across ranks, each rank's figure and straggler score in that window) into
small frozen dataclasses, and :func:`render` turns a :class:`TopSnapshot` into a ``rich`` renderable (a pure
function of the snapshot). The live loop and ``--once`` are in :mod:`collector.cli.top_live`.

The windows are merged by the collector's own merge (:func:`collector.read.column_merge.merge_parts`, the one every
collector pass uses, so the figures are the collector's to the last bit; only ranks that declare one stat with
different aggregations are one row here and several there): a stat's merged figure combines the windows of every
rank, and a rank's extra writers (forked children, spawned workers: entries with ``writer_of != 0``) count in that
rank's figure. A rank's *figure* and *score* are the collector's straggler rule
(:mod:`collector.daemon.straggler`): the window's p50 when the stat keeps a histogram, else its mean; ``median /
figure`` (or ``figure / median`` for a stat where higher is better); a straggler scores under the threshold in the
window shown.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from shmstat.shm.reader import SegmentReader, WindowRead
from shmstat.shm.segment import Segment, pid_alive

from ..daemon.straggler import DEFAULT_THRESHOLD, figure, score_ranks
from ..read.column_merge import Parts, StatTable, merge_parts
from ..read.hist_batch import HistBatch
from ..read.merge import Summary, WindowRow

__all__ = [
    "SORTS", "VIEWS", "JobView", "RankFigure", "StatView", "TopSnapshot", "abbreviate", "render", "snapshot",
    "window_label",
]

SORTS = ("name", "count", "mean", "p99", "spread")
"""Sort keys of ``--sort``: ``name`` ascending, the numbers descending (unknown values last)."""
VIEWS = ("stats", "ranks")
"""``stats``: one row per stat of each job; ``ranks``: one row per rank of one stat."""


@dataclass(frozen=True)
class RankFigure:
    """One rank's part of a stat's window: its (writers-summed) summary, figure and straggler score."""

    rank: int
    summary: Summary
    figure: float
    score: float | None
    """``None`` when the stat has fewer than two ranks in the window (nothing to compare with)."""
    straggler: bool
    state: str = ""
    pid: int = 0


@dataclass(frozen=True)
class StatView:
    """One stat's newest closed window: merged across ranks, and per rank."""

    group: str
    name: str
    wid: int
    window_ns: int
    merged: Summary
    ranks: tuple[RankFigure, ...]
    """Ranks with samples in this window, by rank."""
    median: float
    higher_is_better: bool = False

    @property
    def key(self) -> str:
        """``group/name``, as ``--stat`` takes it."""
        return f"{self.group}/{self.name}"

    @property
    def start_ns(self) -> int:
        """Start of the window shown, wall-clock ns."""
        return self.wid * self.window_ns

    @property
    def low(self) -> RankFigure | None:
        """The rank with the lowest figure (the lowest rank number among equals)."""
        return min(self.ranks, key=lambda r: (r.figure, r.rank)) if self.ranks else None

    @property
    def high(self) -> RankFigure | None:
        """The rank with the highest figure (the lowest rank number among equals)."""
        return max(self.ranks, key=lambda r: (r.figure, -r.rank)) if self.ranks else None

    @property
    def stragglers(self) -> tuple[int, ...]:
        """Ranks scoring under the threshold in this window."""
        return tuple(r.rank for r in self.ranks if r.straggler)

    @property
    def spread(self) -> float:
        """(highest - lowest figure) / |median|: how far apart the ranks are (0 with one rank)."""
        lo, hi = self.low, self.high
        if lo is None or hi is None or hi.figure == lo.figure:
            return 0.0
        return (hi.figure - lo.figure) / abs(self.median) if self.median else math.inf


@dataclass(frozen=True)
class JobView:
    """One job's segment: its ranks and stats, or why it could not be read."""

    job: str
    stats: tuple[StatView, ...] = ()
    ranks_alive: int = 0
    ranks_total: int = 0
    error: str | None = None


@dataclass(frozen=True)
class TopSnapshot:
    """What one frame shows: every job read at ``now_ns``."""

    now_ns: int
    jobs: tuple[JobView, ...]
    threshold: float = DEFAULT_THRESHOLD


def snapshot(source: Segment | SegmentReader | list[Segment | SegmentReader], now_ns: int, *,
             threshold: float = DEFAULT_THRESHOLD, higher_is_better: bool = False,
             alive: dict[int, bool] | None = None) -> TopSnapshot:
    """Read the newest closed window of every stat of one segment (or several) at ``now_ns``.

    ``higher_is_better`` is the direction straggler scores use (a time: False); ``alive`` caches pid liveness
    across segments of one frame (filled as pids are looked up).
    """
    sources = source if isinstance(source, list) else [source]
    alive = {} if alive is None else alive
    jobs = []
    for src in sources:
        reader = src if isinstance(src, SegmentReader) else SegmentReader(src)
        jobs.append(_job_view(reader, now_ns, threshold, higher_is_better, alive))
    return TopSnapshot(now_ns, tuple(jobs), threshold)


def _job_view(reader: SegmentReader, now_ns: int, threshold: float, higher_is_better: bool,
              alive: dict[int, bool]) -> JobView:
    infos = reader.ranks()
    by_local = {i.local_rank: i for i in infos}
    # every closed window still in the ring, as (stat, owner rank, window); a rank's own slot and its writers'
    found: list[tuple[tuple[str, str, int], int, WindowRead]] = []
    # (group, name, window_ms) -> (agg_mask, higher_is_better, keeps a histogram) of its first descriptor
    stat_of: dict[tuple[str, str, int], tuple[int, bool, bool]] = {}
    owners: dict[int, tuple[str, int]] = {}
    n_alive = 0
    for info in infos:
        owner = by_local.get(info.writer_of - 1, info) if info.is_writer else info
        if not info.is_writer:
            is_alive = alive.setdefault(info.pid, pid_alive(info.pid))
            n_alive += info.state_name == "active" and is_alive
            owners[owner.rank] = (info.state_name, info.pid)
        for desc in reader.descriptors(info.local_rank):
            read = reader.read_slot(info, desc, now_ns, 0, -1)
            if read.windows:
                key = (desc.group, desc.name, desc.window_ms)
                stat_of.setdefault(key, (desc.agg_mask, desc.higher_is_better, desc.hist >= 0))
                found.extend((key, owner.rank, w) for w in read.windows)
    stats = []
    for merged, per_rank in _newest_windows(reader.segment.job, found, stat_of):
        parts = {rank: s for rank, s in per_rank.items() if s.count or s.torn}
        figures = {rank: figure(s) for rank, s in parts.items()}
        median, scores = score_ranks(figures, higher_is_better)
        ranks = tuple(
            RankFigure(rank, s, figures[rank], scores.get(rank), rank in scores and scores[rank] < threshold,
                       *owners.get(rank, ("", 0)))
            for rank, s in parts.items()
        )
        if not scores:  # one rank: it is the median
            median = next(iter(figures.values()), 0.0)
        stats.append(StatView(merged.group, merged.name, merged.wid, merged.window_ms * 1_000_000, merged.summary,
                              ranks, median, higher_is_better))
    stats.sort(key=lambda s: (s.key, s.window_ns))
    roots = [i for i in infos if not i.is_writer]
    return JobView(reader.segment.job, tuple(stats), n_alive, len(roots))


def _newest_windows(job: str, found: list[tuple[tuple[str, str, int], int, WindowRead]],
                    stat_of: dict[tuple[str, str, int], tuple[int, bool, bool]],
                    ) -> list[tuple[WindowRow, dict[int, Summary]]]:
    """The newest window of every stat in ``found``, merged by the collector's merge
    (:func:`collector.read.column_merge.merge_parts`): per stat its merged row and each rank's summary (by rank)."""
    if not found:
        return []
    keys = {key: k for k, key in enumerate(stat_of)}
    newest: dict[tuple[str, str, int], int] = {}
    for key, _rank, w in found:
        newest[key] = max(newest.get(key, w.wid), w.wid)
    chosen = [(keys[key], rank, w) for key, rank, w in found if w.wid == newest[key]]
    order = np.empty(len(keys), np.int64)
    order[[keys[k] for k in sorted(keys)]] = np.arange(len(keys))
    table = StatTable(
        np.array([k[0] for k in keys] + [None], object)[:-1], np.array([k[1] for k in keys] + [None], object)[:-1],
        np.array([k[2] for k in keys], np.int64), np.array([m[0] for m in stat_of.values()], np.int64),
        np.array([m[1] for m in stat_of.values()], bool), np.array([m[2] for m in stat_of.values()], bool), order,
    )
    n = len(chosen)
    ws = [w for _, _, w in chosen]
    parts = Parts(
        np.array([k for k, _, _ in chosen], np.int64), np.array([r for _, r, _ in chosen], np.int64),
        np.arange(n, dtype=np.int64),  # the order read: a rank's own slot and writers merge in that order
        np.array([w.wid for w in ws], np.int64), np.array([w.count for w in ws], np.int64),
        np.array([w.sum for w in ws], np.float64), np.array([w.min for w in ws], np.float64),
        np.array([w.max for w in ws], np.float64), np.array([w.last for w in ws], np.float64),
        np.array([w.last_ts for w in ws], np.int64), np.array([w.torn for w in ws], bool),
        HistBatch.from_histograms([w.hist for w in ws]),
    )
    cols = merge_parts(job, parts, table)
    rows, rank = cols.to_rows(), cols.rank.tolist()
    out = []
    for i in np.flatnonzero(cols.rank < 0).tolist():  # each window's merged row, then one row per rank
        out.append((rows[i], {rank[j]: rows[j].summary for j in range(i + 1, i + 1 + rows[i].ranks)}))
    return out


# -- rendering ----------------------------------------------------------------------------------------------------

_NUMBER_WIDTH = 6


def abbreviate(value: float | None) -> str:
    """A number in at most 6 characters: ``12.5``, ``0.125``, ``1.23k``, ``-4.5M``, ``1.2e-5``; ``-`` for None."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    text = ""
    for digits in (3, 2, 1):
        text = _short(float(value), digits)
        if len(text) <= _NUMBER_WIDTH:
            break
    return text


def _short(value: float, digits: int) -> str:
    a = abs(value)
    if a < 0.01 or a >= 999.5e15:
        mantissa, exp = f"{value:.{digits - 1}e}".split("e")
        if "." in mantissa:
            mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exp)}"
    if a < 999.5:
        return str(int(value)) if value == int(value) else f"{value:.{digits}g}"
    for unit in ("k", "M", "G", "T", "P"):
        value /= 1000.0
        if abs(value) < 999.5:
            return f"{value:.{digits}g}{unit}"
    raise AssertionError(value)  # pragma: no cover (caught above)


def window_label(start_ns: int, window_ns: int) -> str:
    """``HH:MM:SS.mmm +LEN``: a window's local start time and its length (``100ms``, ``1s``, ``1m``)."""
    start_s = start_ns / 1e9
    ms = (start_ns // 1_000_000) % 1000
    length_ms = window_ns / 1e6
    if length_ms < 1000:
        length = f"{length_ms:g}ms"
    elif length_ms < 60_000 or length_ms % 60_000:
        length = f"{length_ms / 1000:g}s"
    else:
        length = f"{length_ms / 60_000:g}m"
    return f"{time.strftime('%H:%M:%S', time.localtime(start_s))}.{ms:03d} +{length}"


def _sorted(stats: tuple[StatView, ...], sort: str) -> list[StatView]:
    if sort == "name":
        return sorted(stats, key=lambda s: (s.key, s.window_ns))
    pick = {
        "count": lambda s: s.merged.count,
        "mean": lambda s: s.merged.mean,
        "p99": lambda s: s.merged.quantile(0.99),
        "spread": lambda s: s.spread,
    }[sort]
    return sorted(stats, key=lambda s: (pick(s) is None, -(pick(s) or 0.0), s.key))


def _sorted_ranks(ranks: tuple[RankFigure, ...], sort: str) -> list[RankFigure]:
    if sort == "name":
        return sorted(ranks, key=lambda r: r.rank)
    if sort == "spread":  # the worst score first
        return sorted(ranks, key=lambda r: (r.score is None, r.score if r.score is not None else 0.0, r.rank))
    pick = {
        "count": lambda r: r.summary.count,
        "mean": lambda r: r.summary.mean,
        "p99": lambda r: r.summary.quantile(0.99),
    }[sort]
    return sorted(ranks, key=lambda r: (pick(r) is None, -(pick(r) or 0.0), r.rank))


def _table(width: int) -> Table:
    return Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
                 header_style="bold", width=min(width, 120), expand=True)


def _num_columns(t: Table, *names: str) -> None:
    for n in names:
        t.add_column(n, justify="right", no_wrap=True, min_width=_NUMBER_WIDTH, max_width=_NUMBER_WIDTH + 1)


def _at(r: RankFigure | None) -> str:
    return "-" if r is None else f"{abbreviate(r.figure)} r{r.rank}"


def _ranks_list(ranks: tuple[int, ...], room: int = 6) -> str:
    text = ",".join(str(r) for r in ranks)
    return text if len(text) <= room else text[: room - 1].rsplit(",", 1)[0] + "…"


def _windows_label(stats: list[StatView], now_ns: int) -> str:
    """The windows shown (the most common first; rows of a stat with another window length or a later or
    earlier newest window differ) and how long ago the first one ended."""
    labels: dict[str, int] = {}
    ends: dict[str, int] = {}
    for s in stats:
        label = window_label(s.start_ns, s.window_ns)
        labels[label] = labels.get(label, 0) + 1
        ends[label] = s.start_ns + s.window_ns
    if not labels:
        return "no closed window yet"
    ordered = sorted(labels, key=lambda k: -labels[k])
    shown = ", ".join(ordered[:2])
    more = f" (+{len(ordered) - 2} more)" if len(ordered) > 2 else ""
    return f"window {shown}{more}, ended {_age(now_ns - ends[ordered[0]])} ago"


def _age(ns: int) -> str:
    s = max(ns, 0) / 1e9
    for limit, unit, div in ((60, "s", 1), (3600, "m", 60), (86400, "h", 3600)):
        if s < limit:
            return f"{s / div:.1f}{unit}" if unit == "s" else f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def _header(job: JobView, snap: TopSnapshot, windows: str) -> Text:
    clock = time.strftime("%H:%M:%S", time.localtime(snap.now_ns / 1e9))
    head = Text.assemble(("job ", "dim"), (job.job, "bold cyan"), f"  {clock}  ",
                         (f"ranks {job.ranks_alive}/{job.ranks_total} alive", "dim"))
    head.append(f"\n{windows}", style="dim")
    return head


def _stats_table(job: JobView, sort: str, width: int, max_rows: int | None) -> Table:
    t = _table(width)
    t.add_column("STAT", overflow="ellipsis", no_wrap=True, min_width=8, ratio=1)
    _num_columns(t, "COUNT", "MEAN", "P50", "P99", "MAX")
    t.add_column("LOW@RANK", justify="right", no_wrap=True, overflow="ellipsis", max_width=12)
    t.add_column("HIGH@RANK", justify="right", no_wrap=True, overflow="ellipsis", max_width=12)
    t.add_column("SLOW", no_wrap=True, overflow="ellipsis", max_width=6)
    rows = _sorted(job.stats, sort)
    for s in rows[:max_rows]:
        m = s.merged
        slow = s.stragglers
        name = ("! " if slow else "") + s.key
        t.add_row(name, abbreviate(m.count), abbreviate(m.mean), abbreviate(m.quantile(0.5)),
                  abbreviate(m.quantile(0.99)), abbreviate(m.max if m.count else None), _at(s.low), _at(s.high),
                  _ranks_list(slow), style="bold red" if slow else None)
    if max_rows is not None and len(rows) > max_rows:
        t.add_row(Text(f"… {len(rows) - max_rows} more stats", style="dim"))
    return t


def _ranks_table(stat: StatView, sort: str, width: int, max_rows: int | None) -> Table:
    t = _table(width)
    t.add_column("RANK", justify="right", no_wrap=True)
    t.add_column("STATE", no_wrap=True, overflow="ellipsis", max_width=7)
    t.add_column("PID", justify="right", no_wrap=True, max_width=8)
    _num_columns(t, "COUNT", "MEAN", "P50", "P99", "MIN", "MAX")
    t.add_column("SCORE", justify="right", no_wrap=True, max_width=6)
    t.add_column("", no_wrap=True, max_width=4)
    rows = _sorted_ranks(stat.ranks, sort)
    for r in rows[:max_rows]:
        s = r.summary
        score = "-" if r.score is None else f"{r.score:.2f}" if r.score < 100 else abbreviate(r.score)
        t.add_row(str(r.rank), r.state, str(r.pid or "-"), abbreviate(s.count), abbreviate(s.mean),
                  abbreviate(s.quantile(0.5)), abbreviate(s.quantile(0.99)), abbreviate(s.min if s.count else None),
                  abbreviate(s.max if s.count else None), score, "SLOW" if r.straggler else "",
                  style="bold red" if r.straggler else None)
    if max_rows is not None and len(rows) > max_rows:
        t.add_row(Text(f"… {len(rows) - max_rows} more ranks", style="dim"))
    return t


def render(snap: TopSnapshot, *, view: str = "stats", stat: str | None = None, sort: str = "name", width: int = 80,
           height: int | None = None) -> RenderableType:
    """One frame of ``shmstat top`` for ``snap``: per job, a header (job, clock, ranks alive, the window shown:
    local start and length) and a table; ``view="ranks"`` shows one row per rank of ``stat`` (``group/name``).

    ``sort`` is one of :data:`SORTS`; ``width`` the columns to fit (80 over ssh); ``height``, if given, bounds
    the rows so the frame fits a screen. Straggler rows are bold red and marked (``!`` / ``SLOW``), so the
    mark survives a terminal without colour.
    """
    if view not in VIEWS or sort not in SORTS or (view == "ranks" and not stat):
        raise ValueError(f"render(view={view!r}, stat={stat!r}, sort={sort!r}): view is one of {VIEWS} (ranks "
                         f"needs a stat), sort one of {SORTS}")
    parts: list[RenderableType] = []
    if not snap.jobs:
        return Text("no shmstat segments of this user on this node (start a job, or see 'shmstat ls')")
    budget = None if height is None else max(3, (height - 1) // len(snap.jobs) - 4)
    for job in snap.jobs:
        if parts:
            parts.append(Text(""))
        if job.error is not None:
            parts.append(Text.assemble(("job ", "dim"), (job.job, "bold cyan"), "  ", (job.error, "yellow")))
            continue
        if view == "ranks":
            chosen = [s for s in job.stats if s.key == stat]
            if not chosen:
                names = ", ".join(s.key for s in job.stats[:5]) or "none yet"
                parts.append(_header(job, snap, "no closed window yet"))
                parts.append(Text(f"no stat {stat} with a closed window in this job (stats: {names})", "yellow"))
                continue
            s = max(chosen, key=lambda c: c.start_ns)
            where = f"{_windows_label([s], snap.now_ns)}  stat {s.key}  median {abbreviate(s.median)}"
            parts.append(_header(job, snap, where))
            parts.append(_ranks_table(s, sort, width, budget))
            continue
        parts.append(_header(job, snap, _windows_label(list(job.stats), snap.now_ns)))
        parts.append(_stats_table(job, sort, width, budget) if job.stats else Text("no closed window yet", "dim"))
    return Group(*parts)
