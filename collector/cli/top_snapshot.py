"""The data of a ``shmstat top`` frame: :func:`snapshot` reads a job's segment (the newest closed window of every
stat, merged across ranks, each rank's figure and straggler score in that window) into small frozen dataclasses
(:class:`TopSnapshot` and what it holds), which :func:`collector.cli.top.render` draws.

The windows are merged by the collector's own merge (:func:`collector.read.columns.merge_parts`, the one every
collector pass uses, so the figures are the collector's to the last bit; only ranks that declare one stat with
different aggregations are one row here and several there): a stat's merged figure combines the windows of every
rank, and a rank's extra writers (forked children, spawned workers: entries with ``writer_of != 0``) count in that
rank's figure. A rank's *figure* and *score* are the collector's straggler rule
(:mod:`collector.daemon.straggler`): the window's p50 when the stat keeps a histogram, else its mean; ``median /
figure`` (or ``figure / median`` for a stat where higher is better); a straggler scores under the threshold in the
window shown. The collector's GPU figures (:mod:`collector.gpu.figures`) are shown but not scored, and give
each rank its GPU summary (:class:`RankGpu`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shmstat.shm.layout_records import BankSnapshot, WindowFigures
from shmstat.shm.reader import SegmentReader
from shmstat.shm.segment import Segment, pid_alive

from ..daemon.straggler import COUNT_ONLY_MASK, DEFAULT_THRESHOLD, figure, score_ranks
from ..gpu.figures import figure_of
from ..read.columns import Parts, StatTable, merge_parts
from ..read.hist_batch import HistBatch
from ..read.rows import WindowRow

__all__ = ["JobView", "RankFigure", "RankGpu", "StatView", "TopSnapshot", "snapshot"]


@dataclass(frozen=True)
class RankFigure:
    """One rank's part of a stat's window: its (writers-summed) summary, figure and straggler score."""

    rank: int
    summary: WindowFigures
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
    merged: WindowFigures
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
class RankGpu:
    """One rank's GPUs in their newest closed window: which, utilisation and memory (None: not sampled)."""

    rank: int
    gpus: tuple[int, ...]
    util: float | None
    """Mean GPU utilisation, %, over the rank's GPUs."""
    memory_mib: float | None
    """Memory the rank's processes hold on its GPUs (where NVML lists them), else its GPUs' memory used, MiB."""


@dataclass(frozen=True)
class JobView:
    """One job's segment: its ranks and stats, or why it could not be read."""

    job: str
    stats: tuple[StatView, ...] = ()
    ranks_alive: int = 0
    ranks_total: int = 0
    error: str | None = None
    gpus: tuple[RankGpu, ...] = ()
    """Per rank, its GPUs (when the collector samples GPUs)."""

    def gpu_of(self, rank: int) -> RankGpu | None:
        """Rank ``rank``'s GPU summary, if any."""
        return next((g for g in self.gpus if g.rank == rank), None)


@dataclass(frozen=True)
class TopSnapshot:
    """What one frame shows: every job read at ``now_ns``."""

    now_ns: int
    jobs: tuple[JobView, ...]
    threshold: float = DEFAULT_THRESHOLD


def snapshot(source: Segment | SegmentReader | list[Segment | SegmentReader], now_ns: int, *,
             threshold: float = DEFAULT_THRESHOLD, alive: dict[int, bool] | None = None) -> TopSnapshot:
    """Read the newest closed window of every stat of one segment (or several) at ``now_ns``.

    Each stat is scored in its own direction, the one its descriptor declares (``Stat(..., higher_is_better=True)``
    for a rate), as the collector scores it; ``alive`` caches pid liveness across segments of one frame (filled as
    pids are looked up).
    """
    sources = source if isinstance(source, list) else [source]
    alive = {} if alive is None else alive
    jobs = []
    for src in sources:
        reader = src if isinstance(src, SegmentReader) else SegmentReader(src)
        jobs.append(_job_view(reader, now_ns, threshold, alive))
    return TopSnapshot(now_ns, tuple(jobs), threshold)


def _job_view(reader: SegmentReader, now_ns: int, threshold: float, alive: dict[int, bool]) -> JobView:
    infos = reader.ranks()
    by_local = {i.local_rank: i for i in infos}
    # every closed window still in the ring, as (stat, owner rank, window); a rank's own slot and its writers'
    found: list[tuple[tuple[str, str, int], int, BankSnapshot]] = []
    # (group, name, window_ms) -> (agg_mask, higher_is_better, keeps a histogram) of its first descriptor
    stat_of: dict[tuple[str, str, int], tuple[int, bool, bool]] = {}
    owners: dict[int, tuple[str, int]] = {}
    waits: set[tuple[str, str, int]] = set()  # wait sections: shown, never scored
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
                if desc.wait:
                    waits.add(key)
                found.extend((key, owner.rank, w) for w in read.windows)
    stats = []
    for merged, per_rank in _newest_windows(reader.segment.job, found, stat_of):
        parts = {rank: s for rank, s in per_rank.items() if s.count or s.torn}
        figures = {rank: figure(s) for rank, s in parts.items()}
        median, scores = score_ranks(figures, merged.higher_is_better)
        if (figure_of(merged.group, merged.name) is not None or not merged.agg_mask & ~COUNT_ONLY_MASK
                or (merged.group, merged.name, merged.window_ms) in waits):
            scores = {}  # a GPU figure, a COUNT alone or a wait: shown, not scored (the collector's rule)
        ranks = tuple(
            RankFigure(rank, s, figures[rank], scores.get(rank), rank in scores and scores[rank] < threshold,
                       *owners.get(rank, ("", 0)))
            for rank, s in parts.items()
        )
        if not scores:  # one rank: it is the median
            median = next(iter(figures.values()), 0.0)
        stats.append(StatView(merged.group, merged.name, merged.wid, merged.window_ms * 1_000_000, merged.summary,
                              ranks, median, merged.higher_is_better))
    stats.sort(key=lambda s: (s.key, s.window_ns))
    roots = [i for i in infos if not i.is_writer]
    return JobView(reader.segment.job, tuple(stats), n_alive, len(roots), gpus=_rank_gpus(stats))


def _rank_gpus(stats: list[StatView]) -> tuple[RankGpu, ...]:
    """Each rank's GPU summary from the GPU figures among ``stats``."""
    seen: dict[int, dict[str, dict[int, float]]] = {}  # rank -> figure -> gpu -> mean
    for s in stats:
        found = figure_of(s.group, s.name)
        if found is None or found[1].name not in ("util", "fb_used", "proc_fb_used"):
            continue
        for r in s.ranks:
            if r.summary.count:
                seen.setdefault(r.rank, {}).setdefault(found[1].name, {})[found[0]] = r.summary.mean
    out = []
    for rank in sorted(seen):
        figs = seen[rank]
        gpus = tuple(sorted({g for by_gpu in figs.values() for g in by_gpu}))
        util = figs.get("util")
        memory = figs.get("proc_fb_used") or figs.get("fb_used")
        out.append(RankGpu(rank, gpus, sum(util.values()) / len(util) if util else None,
                           sum(memory.values()) if memory else None))
    return tuple(out)


def _newest_windows(job: str, found: list[tuple[tuple[str, str, int], int, BankSnapshot]],
                    stat_of: dict[tuple[str, str, int], tuple[int, bool, bool]],
                    ) -> list[tuple[WindowRow, dict[int, WindowFigures]]]:
    """The newest window of every stat in ``found``, merged by the collector's merge
    (:func:`collector.read.columns.merge_parts`): per stat its merged row and each rank's summary (by rank)."""
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
