"""One collector pass of one job as columns: :class:`Columns`, what every handler's ``emit_columns`` receives.

Every figure is a NumPy array with one entry per row; a row is one window of one stat, merged across ranks or of
one rank, in the collector's row order (windows by window id then stat; each window's merged row
first, then one row per rank by rank). The arrays are built straight from the scanner's vectorised read
(:func:`merge_parts`, the one merge, below): no Python object is made per row.

Conventions:

- ``rank`` is ``-1`` for a row merged across ranks (torchelastic handlers see ``rank=None`` there), else the rank;
  ``ranks`` is how many ranks a merged row combines (1 on a per-rank row);
- ``count`` is an int64 array; ``sum``, ``min``, ``max``, ``value`` (the latest sample) and ``mean`` are float64;
  for an empty window (possible only on a window flagged ``torn``) ``mean`` is 0.0, as torch.monitor reports;
- ``p50``, ``p90``, ``p99``, ``p999`` are float64: NaN where the stat keeps no percentiles, otherwise exactly what
  a torchelastic handler gets for ``<stat>.p50``.. (0.0 for an empty window or a histogram lost to an overwrite), for
  all four, whichever of them the stat asked for; ``hists`` holds every row's histogram as arrays
  (:class:`collector.read.hist_batch.HistBatch`, no object per row) and ``hist`` the same as
  :class:`shmstat.histogram.Histogram` objects (None where there is none, built on first use), for handlers
  that export whole histograms;
- ``agg_mask`` says which aggregations each row's stat asked for (bit ``1 << int(Aggregation)``; see
  :meth:`Columns.aggregations`); ``wid`` and ``window_ms`` give the window (``start_ns``, ``end_ns``,
  ``window_start``, ``window_end`` derive from them).

The arrays belong to the handler that received them (each handler gets its own selection): it may keep them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np

from elastic.metrics import StatMetricData
from shmstat.aggregation import PERCENTILES, Aggregation, aggregation_key
from shmstat.shm.layout_records import WindowFigures

from ..gpu.figures import GPU_GROUP, is_gpu_stat
from .hist_batch import HistBatch
from .rows import WindowRow, ordered_aggregations

__all__ = ["COUNT_ONLY_MASK", "PERCENTILE_COLUMNS", "Columns", "Parts", "StatTable", "merge_parts"]

PERCENTILE_COLUMNS: dict[Aggregation, str] = {Aggregation.P50: "p50", Aggregation.P90: "p90",
                                              Aggregation.P99: "p99", Aggregation.P999: "p999"}
"""The column holding each percentile aggregation."""

COUNT_ONLY_MASK = 1 << int(Aggregation.COUNT)
"""The aggregation mask of a stat that counts and asks for no figure of its values: never scored for stragglers
(its mean is no figure the user asked for, so a score of it means nothing)."""

_COLUMN_OF = {Aggregation.COUNT: 0, Aggregation.SUM: 1, Aggregation.MEAN: 2, Aggregation.MAX: 3,
              Aggregation.MIN: 4, Aggregation.VALUE: 5, Aggregation.P50: 6, Aggregation.P90: 7,
              Aggregation.P99: 8, Aggregation.P999: 9}
_plan_cache: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}  # (stat, mask) -> ((data key, column), ..)


@dataclass(frozen=True, eq=False)
class Columns:
    """The rows of one pass of one job, one array per figure (see the module docstring for the conventions)."""

    job: str
    group: np.ndarray
    """Each row's group (object array of str)."""
    stat: np.ndarray
    """Each row's stat name (object array of str)."""
    rank: np.ndarray
    """Each row's rank, ``-1`` for a row merged across ranks (int64)."""
    ranks: np.ndarray
    """Ranks a row combines (int64; 1 on a per-rank row)."""
    wid: np.ndarray
    """Window index: the window is ``[wid * window_ms, (wid + 1) * window_ms)`` ms of Unix time (int64)."""
    window_ms: np.ndarray
    """Window length in ms (int64)."""
    agg_mask: np.ndarray
    """The aggregations the row's stat asked for, as a mask (int64)."""
    count: np.ndarray
    sum: np.ndarray
    min: np.ndarray
    max: np.ndarray
    value: np.ndarray
    """The latest sample of the window (float64)."""
    last_ts: np.ndarray
    """When the latest sample was added, Unix ns (int64)."""
    mean: np.ndarray
    p50: np.ndarray
    p90: np.ndarray
    p99: np.ndarray
    p999: np.ndarray
    torn: np.ndarray
    """True where the window may be incomplete (a writer died in the middle of an ``add``)."""
    higher_is_better: np.ndarray
    """What each row's stat declared (bool)."""
    hists: HistBatch
    """Each row's histogram as arrays (none where the stat keeps none or it could not be read)."""
    job_start_ns: int = 0
    """When the job's segment was created on this node (Unix ns; 0 if unknown): the same for every pass of the
    job, across collector restarts (what ``tensorboard:DIR`` counts its steps from)."""
    wait: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    """Whether each row's stat times a wait for other ranks (a wait section; bool): never scored. Left out, no
    row is one."""

    def __post_init__(self) -> None:
        if len(self.wait) != len(self.wid):
            object.__setattr__(self, "wait", np.zeros(len(self.wid), bool))

    @classmethod
    def empty(cls, job: str) -> Columns:
        """A pass with no rows."""
        arrays: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in ("job", "hists", "job_start_ns"):
                arrays[f.name] = np.empty(0, _DTYPES.get(f.name, np.float64))
        return cls(job, hists=HistBatch.empty(0), **arrays)

    @classmethod
    def from_rows(cls, job: str, rows: Sequence[WindowRow], *, job_start_ns: int = 0) -> Columns:
        """``rows`` as the columns of a pass of ``job``, in the given order and as they are (nothing merged or
        added): the inverse of :meth:`to_rows`, to feed a handler's ``emit_columns`` rows made by hand (a test
        of one's own handler)."""
        if not rows:
            return cls.empty(job)
        s = [r.summary for r in rows]

        def quantile(q: float) -> np.ndarray:
            return np.array([math.nan if x.hist is None else x.quantile(q) for x in s], np.float64)

        return cls(
            job, group=np.array([r.group for r in rows], object), stat=np.array([r.name for r in rows], object),
            rank=np.array([-1 if r.rank is None else r.rank for r in rows], np.int64),
            ranks=np.array([r.ranks for r in rows], np.int64), wid=np.array([r.wid for r in rows], np.int64),
            window_ms=np.array([r.window_ms for r in rows], np.int64),
            agg_mask=np.array([r.agg_mask for r in rows], np.int64), count=np.array([x.count for x in s], np.int64),
            sum=np.array([x.sum for x in s], np.float64), min=np.array([x.min for x in s], np.float64),
            max=np.array([x.max for x in s], np.float64), value=np.array([x.last for x in s], np.float64),
            last_ts=np.array([x.last_ts for x in s], np.int64), mean=np.array([x.mean for x in s], np.float64),
            p50=quantile(0.5), p90=quantile(0.9), p99=quantile(0.99), p999=quantile(0.999),
            torn=np.array([x.torn for x in s], bool),
            higher_is_better=np.array([r.higher_is_better for r in rows], bool),
            hists=HistBatch.from_histograms([x.hist for x in s]), job_start_ns=job_start_ns,
            wait=np.array([r.wait for r in rows], bool))

    @cached_property
    def hist(self) -> np.ndarray:
        """Each row's :class:`shmstat.histogram.Histogram` (object array; None where there is none), built from
        :attr:`hists` on first use."""
        return self.hists.histograms()

    def __len__(self) -> int:
        """Number of rows."""
        return len(self.wid)

    @property
    def start_ns(self) -> np.ndarray:
        """Window starts, Unix ns (int64)."""
        return self.wid * self.window_ms * 1_000_000

    @property
    def end_ns(self) -> np.ndarray:
        """Window ends (exclusive), Unix ns (int64)."""
        return (self.wid + 1) * self.window_ms * 1_000_000

    @property
    def window_start(self) -> np.ndarray:
        """Window starts, Unix seconds (float64, as torchelastic handlers get them)."""
        return self.start_ns / 1e9

    @property
    def window_end(self) -> np.ndarray:
        """Window ends, Unix seconds (float64)."""
        return self.end_ns / 1e9

    def take(self, index: Any) -> Columns:
        """The rows selected by ``index`` (a boolean mask, an index array or a slice), as new Columns."""
        arrays = {f.name: getattr(self, f.name)[index] for f in fields(self) if f.name not in ("job", "job_start_ns")}
        return Columns(self.job, **arrays, job_start_ns=self.job_start_ns)

    def merged(self) -> Columns:
        """Only the rows merged across ranks."""
        return self.take(self.rank < 0)

    def per_rank(self) -> Columns:
        """Only the per-rank rows."""
        return self.take(self.rank >= 0)

    def of_groups(self, groups: set[str] | frozenset[str]) -> Columns:
        """Only the rows of ``groups``."""
        return self.take(np.isin(self.group, list(groups)))

    def scored_stats(self) -> np.ndarray:
        """Per row, whether its stat is one the straggler rule scores (:mod:`collector.daemon.straggler`): it asked
        for a figure of its values (not COUNT alone), is not a wait (:data:`shmstat.shm.layout.FLAG_WAIT`) and is not
        one of the collector's GPU figures."""
        scored = ((self.agg_mask & ~COUNT_ONLY_MASK) != 0) & ~self.wait  # a wait section: the healthy wait longest
        gpu = np.flatnonzero(self.group == GPU_GROUP)
        if len(gpu):  # a rank's GPU is not slower for being busier
            scored[gpu] &= [not is_gpu_stat(GPU_GROUP, self.stat[i]) for i in gpu.tolist()]
        return scored

    def groups(self) -> list[str]:
        """The distinct groups present, sorted."""
        return sorted(set(self.group.tolist()))

    def aggregations(self, i: int) -> tuple[Aggregation, ...]:
        """The aggregations row ``i``'s stat asked for, in torch.monitor's order (COUNT, SUM, MEAN, ..)."""
        return ordered_aggregations(int(self.agg_mask[i]))

    def row(self, i: int) -> WindowRow:
        """Row ``i`` as a :class:`WindowRow`."""
        rank = int(self.rank[i])
        return WindowRow(
            self.group[i], self.stat[i], int(self.wid[i]), int(self.window_ms[i]), int(self.agg_mask[i]),
            None if rank < 0 else rank,
            WindowFigures(int(self.count[i]), float(self.sum[i]), float(self.min[i]), float(self.max[i]),
                    float(self.value[i]), int(self.last_ts[i]), bool(self.torn[i]), self.hist[i]),
            ranks=int(self.ranks[i]), higher_is_better=bool(self.higher_is_better[i]), wait=bool(self.wait[i]),
        )

    def to_rows(self) -> list[WindowRow]:
        """Every row as a :class:`WindowRow`, in order (one Python object per row: for convenience, not speed)."""
        cols = zip(self.group.tolist(), self.stat.tolist(), self.wid.tolist(), self.window_ms.tolist(),
                   self.agg_mask.tolist(), self.rank.tolist(), self.count.tolist(), self.sum.tolist(),
                   self.min.tolist(), self.max.tolist(), self.value.tolist(), self.last_ts.tolist(),
                   self.torn.tolist(), self.hist.tolist(), self.ranks.tolist(), self.higher_is_better.tolist(),
                   self.wait.tolist(), strict=True)
        return [WindowRow(g, s, w, ms, m, None if r < 0 else r, WindowFigures(n, t, lo, hi, v, ts, torn, h),
                          ranks=k, higher_is_better=hib, wait=wt)
                for g, s, w, ms, m, r, n, t, lo, hi, v, ts, torn, h, k, hib, wt in cols]

    def __iter__(self) -> Iterator[WindowRow]:
        """The rows as :class:`WindowRow` (see :meth:`to_rows`)."""
        return iter(self.to_rows())

    def to_metrics(self) -> list[StatMetricData]:
        """What torchelastic handlers receive for these rows (through
        :class:`collector.handlers.protocol.RowsAdapter`): one :class:`StatMetricData` per aggregation each stat
        asked for, named ``<stat>.<aggregation>``, timestamp = window end, in row order."""
        return StatMetricData._from_figures(self.flat(), self.job)

    def flat(self) -> Iterator[tuple[float, str, str, float, int | None, float, bool]]:
        """The figures of :meth:`to_metrics` as plain tuples ``(window_end, group, "<stat>.<aggregation>", value,
        rank or None, window_start, torn)``, in the same order (what sinks that write one line per figure use); a
        ``<stat>.count`` value is an int, every other a float."""
        end_s, start_s = self.window_end.tolist(), self.window_start.tolist()
        count = self.count.tolist()  # ints: a count is written as an int everywhere (jsonl, subscribers, ...)
        figures = (count, self.sum.tolist(), self.mean.tolist(),
                   self.max.tolist(), self.min.tolist(), self.value.tolist(), self.p50.tolist(),
                   self.p90.tolist(), self.p99.tolist(), self.p999.tolist())
        torn_col = self.torn.tolist()
        for i, (group, stat, mask, rank) in enumerate(zip(self.group.tolist(), self.stat.tolist(),
                                                          self.agg_mask.tolist(), self.rank.tolist(),
                                                          strict=True)):
            plan = _plan_cache.get((stat, mask))
            if plan is None:
                plan = _plan(stat, mask)
            end, start, torn, r = end_s[i], start_s[i], torn_col[i], None if rank < 0 else rank
            empty = count[i] == 0
            for key, column in plan:
                yield end, group, key, 0.0 if empty and column else figures[column][i], r, start, torn

def _plan(stat: str, mask: int) -> tuple[tuple[str, int], ...]:
    if len(_plan_cache) > 1 << 17:
        _plan_cache.clear()
    plan = _plan_cache[(stat, mask)] = tuple((f"{stat}.{aggregation_key(a)}", _COLUMN_OF[a])
                                             for a in ordered_aggregations(mask))
    return plan


_DTYPES: dict[str, Any] = {"group": object, "stat": object, "rank": np.int64, "ranks": np.int64,
                           "wid": np.int64, "window_ms": np.int64, "agg_mask": np.int64, "count": np.int64,
                           "last_ts": np.int64, "torn": bool, "higher_is_better": bool, "wait": bool}


# ---- The merge ----
# Merging the windows one pass found into :class:`collector.read.columns.Columns`, on arrays. The collector's one
# merge. The scanner hands over its found windows as :class:`Parts` (one entry per slot window: a rank's own slot or
# one of its writers'), and the stats they belong to as :class:`StatTable`. :func:`merge_parts` sorts them into row
# order (by window, then stat; each window's merged row, then one row per rank) and folds them in that order,
# exactly: counts and sums added in order (so float sums are bit-identical to a fold), MEAN = SUM / COUNT, min/max
# over non-empty parts, the value of the part with the latest timestamp (the first such part on a tie), torn if any
# part is, histograms merged on arrays (:meth:`collector.read.hist_batch.HistBatch.merge_groups`, exactly
# :func:`shmstat.histogram.merge_histograms`) and the percentiles read from them. A rank's writers give that rank
# one row; all parts of a window give its merged row. No Python object is made per row. The collector's passes (so
# every handler, the Prometheus exporter and the straggler detector, which all take a pass as columns) and ``shmstat
# top`` (:mod:`collector.cli.top_snapshot`) merge windows with it; the per-object fold it is checked against is in
# ``tests/kit/merge_reference.py``.


_I64_MIN = np.iinfo(np.int64).min


@dataclass(frozen=True)
class StatTable:
    """The stats of a pass (the ones that merge across ranks), indexed by a stat id."""

    group: np.ndarray
    """Object array of str."""
    name: np.ndarray
    """Object array of str."""
    window_ms: np.ndarray
    agg_mask: np.ndarray
    higher_is_better: np.ndarray
    keeps_hist: np.ndarray
    """Whether the stat keeps percentiles (bool)."""
    order: np.ndarray
    """Each stat's position when the stats are sorted by (group, name, window_ms, agg_mask)."""
    wait: np.ndarray | None = None
    """Whether the stat times a wait for other ranks (bool; None: none does)."""


@dataclass(frozen=True)
class Parts:
    """Found slot windows, one entry each (equal-length arrays)."""

    key: np.ndarray
    """Stat id (into :class:`StatTable`)."""
    rank: np.ndarray
    slot: np.ndarray
    """The slot's position in the scanner's table (orders a rank's writers)."""
    wid: np.ndarray
    count: np.ndarray
    sum: np.ndarray
    min: np.ndarray
    max: np.ndarray
    last: np.ndarray
    last_ts: np.ndarray
    torn: np.ndarray
    hist: HistBatch
    """Each entry's histogram, if its stat keeps percentiles and it could be read."""

    @staticmethod
    def concat(parts: list[Parts]) -> Parts:
        """One Parts holding all of ``parts`` in order."""
        if len(parts) == 1:
            return parts[0]
        names = [n for n in Parts.__dataclass_fields__ if n != "hist"]
        return Parts(**{n: np.concatenate([getattr(p, n) for p in parts]) for n in names},
                     hist=HistBatch.concat([p.hist for p in parts]))

    def take(self, index: np.ndarray) -> Parts:
        """The entries selected by ``index``."""
        return Parts(**{n: getattr(self, n)[index] for n in Parts.__dataclass_fields__})


def merge_parts(job: str, parts: Parts, stats: StatTable, job_start_ns: int = 0) -> Columns:
    """The rows of ``parts``: per (window, stat) a merged row, then a row per rank (see the module docstring);
    ``job_start_ns`` is passed on (:attr:`Columns.job_start_ns`)."""
    n = len(parts.wid)
    if not n:
        return Columns.empty(job)
    p = parts.take(np.lexsort((parts.slot, parts.rank, stats.order[parts.key], parts.wid)))
    change_win = (p.wid[1:] != p.wid[:-1]) | (p.key[1:] != p.key[:-1])
    new_win = np.concatenate(([True], change_win))
    new_rank = np.concatenate(([True], change_win | (p.rank[1:] != p.rank[:-1])))
    win_start, rank_start = np.flatnonzero(new_win), np.flatnonzero(new_rank)
    merged = _reduce(p, win_start, single_raw=False)
    ranked = _reduce(p, rank_start, single_raw=True)
    nwin, nrank = len(win_start), len(rank_start)
    win_of_rank = np.cumsum(new_win)[rank_start] - 1
    ranks_per_win = np.bincount(win_of_rank, minlength=nwin)
    first_rank = np.cumsum(ranks_per_win) - ranks_per_win
    merged_pos = first_rank + np.arange(nwin)
    rank_pos = np.arange(nrank) + win_of_rank + 1
    total = nwin + nrank
    key = np.empty(total, np.int64)
    key[merged_pos], key[rank_pos] = p.key[win_start], p.key[rank_start]
    out: dict[str, np.ndarray] = {}
    for name in ("count", "sum", "min", "max", "last", "last_ts", "torn"):
        col = np.empty(total, merged[name].dtype)
        col[merged_pos], col[rank_pos] = merged[name], ranked[name]
        out[name] = col
    hist = HistBatch.assemble(total, [(merged_pos, merged["hist"]), (rank_pos, ranked["hist"])])
    wid = np.empty(total, np.int64)
    wid[merged_pos], wid[rank_pos] = p.wid[win_start], p.wid[rank_start]
    rank = np.empty(total, np.int64)
    rank[merged_pos], rank[rank_pos] = -1, p.rank[rank_start]
    ranks = np.ones(total, np.int64)
    ranks[merged_pos] = ranks_per_win
    count = out["count"]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, out["sum"] / np.maximum(count, 1), 0.0)
    pct = _percentiles(count, out["min"], out["max"], hist, stats.keeps_hist[key])
    return Columns(
        job, stats.group[key], stats.name[key], rank, ranks, wid, stats.window_ms[key], stats.agg_mask[key],
        count, out["sum"], out["min"], out["max"], out["last"], out["last_ts"], mean,
        pct[Aggregation.P50], pct[Aggregation.P90], pct[Aggregation.P99], pct[Aggregation.P999], out["torn"],
        stats.higher_is_better[key], hist, job_start_ns,
        np.zeros(total, bool) if stats.wait is None else stats.wait[key],
    )


def _reduce(p: Parts, start: np.ndarray, *, single_raw: bool) -> dict[str, Any]:
    """Merge the runs of ``p`` beginning at ``start`` (sorted; each run one row), folding each run in order; with
    ``single_raw`` a run of one part is that part as it is (the per-rank row of a rank with one writer)."""
    n, groups = len(p.wid), len(start)
    size = np.diff(np.append(start, n))
    gid = np.repeat(np.arange(groups), size)
    nonempty = p.count > 0
    count = np.add.reduceat(p.count, start)
    total = np.zeros(groups)
    for d in range(int(size.max())):  # in part order, one depth at a time: the float sums of a fold, bit for bit
        g = np.flatnonzero(size > d)
        total[g] += np.where(nonempty[start[g] + d], p.sum[start[g] + d], 0.0)
    lo, hi = np.zeros(groups), np.zeros(groups)
    started = np.zeros(groups, bool)
    for d in range(int(size.max())):  # min()/max() folded in part order (NaN included)
        g = np.flatnonzero(size > d)
        j = start[g] + d
        ne, first = nonempty[j], ~started[g]
        a, b = p.min[j], p.max[j]
        lo[g] = np.where(ne & (first | (a < lo[g])), a, lo[g])
        hi[g] = np.where(ne & (first | (b > hi[g])), b, hi[g])
        started[g] |= ne
    ts_masked = np.where(nonempty, p.last_ts, _I64_MIN)
    latest = np.maximum.reduceat(ts_masked, start)
    hit = np.flatnonzero(nonempty & (ts_masked == latest[gid]))
    which, first = np.unique(gid[hit], return_index=True)
    last = np.zeros(groups)
    last_ts = np.zeros(groups, np.int64)
    last[which], last_ts[which] = p.last[hit[first]], p.last_ts[hit[first]]
    torn = np.logical_or.reduceat(p.torn, start)
    one = size == 1 if single_raw else np.zeros(groups, bool)
    # the non-empty parts' histograms merged; a run of one part keeps its own (single_raw)
    hist = p.hist.merge_groups(gid, groups, nonempty | one[gid])
    if one.any():
        s = start[one]
        total[one], lo[one], hi[one] = p.sum[s], p.min[s], p.max[s]
        last[one], last_ts[one], torn[one], count[one] = p.last[s], p.last_ts[s], p.torn[s], p.count[s]
    return {"count": count, "sum": total, "min": lo, "max": hi, "last": last, "last_ts": last_ts, "torn": torn,
            "hist": hist}


def _percentiles(count: np.ndarray, lo: np.ndarray, hi: np.ndarray, hist: HistBatch,
                 keeps: np.ndarray) -> dict[Aggregation, np.ndarray]:
    """Each percentile column: NaN for stats that keep none; else what ``aggregate`` gives (0.0 for an empty
    window or a missing histogram)."""
    out = {a: np.where(keeps, 0.0, np.nan) for a in PERCENTILE_COLUMNS}
    rows = np.flatnonzero(keeps & (count > 0) & hist.present)
    if len(rows):
        table = hist[rows].quantiles(tuple(PERCENTILES.values()), lo[rows], hi[rows])
        for j, a in enumerate(PERCENTILES):
            out[a][rows] = table[:, j]
    return out
