"""Merging the windows one pass found into :class:`collector.read.columns.Columns`, on arrays.

The collector's one merge. The scanner hands over its found windows as :class:`Parts` (one entry per slot window:
a rank's own slot or one of its writers'), and the stats they belong to as :class:`StatTable`.
:func:`merge_parts` sorts them into row order (by window, then stat; each window's merged row, then one
row per rank) and folds them in that order, exactly: counts and sums added in order (so float sums are
bit-identical to a fold), MEAN = SUM / COUNT, min/max over non-empty parts, the value of the part with the
latest timestamp (the first such part on a tie), torn if any part is, histograms merged on arrays
(:meth:`collector.read.hist_batch.HistBatch.merge_groups`, exactly :func:`shmstat.histogram.merge_histograms`)
and the percentiles read from them. A rank's writers give that rank one row; all parts of a window give its
merged row. No Python object is made per row. The collector's passes (so every handler, the Prometheus exporter
and the straggler detector, which all take a pass as columns) and ``shmstat top``
(:mod:`collector.cli.top_snapshot`) merge windows with it; the per-object fold it is checked against is in
``tests/_merge_ref.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shmstat.aggregation import PERCENTILES, Aggregation

from .columns import PERCENTILE_COLUMNS, Columns
from .hist_batch import HistBatch

__all__ = ["Parts", "StatTable", "merge_parts"]

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
