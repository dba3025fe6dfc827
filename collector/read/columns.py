"""One collector pass of one job as columns: :class:`Columns`, what every handler's ``emit_columns`` receives.

Every figure is a NumPy array with one entry per row; a row is one window of one stat, merged across ranks or of
one rank, in the collector's row order (windows by window id then stat; each window's merged row
first, then one row per rank by rank). The arrays are built straight from the scanner's vectorised read
(:func:`collector.read.column_merge.merge_parts`): no Python object is made per row.

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
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np

from elastic.metrics import StatMetricData
from shmstat.aggregation import Aggregation, aggregation_key

from .hist_batch import HistBatch
from .merge import Summary, WindowRow, _ordered

__all__ = ["PERCENTILE_COLUMNS", "Columns"]

PERCENTILE_COLUMNS: dict[Aggregation, str] = {Aggregation.P50: "p50", Aggregation.P90: "p90",
                                              Aggregation.P99: "p99", Aggregation.P999: "p999"}
"""The column holding each percentile aggregation."""

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
            hists=HistBatch.from_histograms([x.hist for x in s]), job_start_ns=job_start_ns)

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

    def groups(self) -> list[str]:
        """The distinct groups present, sorted."""
        return sorted(set(self.group.tolist()))

    def aggregations(self, i: int) -> tuple[Aggregation, ...]:
        """The aggregations row ``i``'s stat asked for, in torch.monitor's order (COUNT, SUM, MEAN, ..)."""
        return _ordered(int(self.agg_mask[i]))

    def row(self, i: int) -> WindowRow:
        """Row ``i`` as a :class:`WindowRow`."""
        rank = int(self.rank[i])
        return WindowRow(
            self.group[i], self.stat[i], int(self.wid[i]), int(self.window_ms[i]), int(self.agg_mask[i]),
            None if rank < 0 else rank,
            Summary(int(self.count[i]), float(self.sum[i]), float(self.min[i]), float(self.max[i]),
                    float(self.value[i]), int(self.last_ts[i]), bool(self.torn[i]), self.hist[i]),
            ranks=int(self.ranks[i]), higher_is_better=bool(self.higher_is_better[i]),
        )

    def to_rows(self) -> list[WindowRow]:
        """Every row as a :class:`WindowRow`, in order (one Python object per row: for convenience, not speed)."""
        cols = zip(self.group.tolist(), self.stat.tolist(), self.wid.tolist(), self.window_ms.tolist(),
                   self.agg_mask.tolist(), self.rank.tolist(), self.count.tolist(), self.sum.tolist(),
                   self.min.tolist(), self.max.tolist(), self.value.tolist(), self.last_ts.tolist(),
                   self.torn.tolist(), self.hist.tolist(), self.ranks.tolist(), self.higher_is_better.tolist(),
                   strict=True)
        return [WindowRow(g, s, w, ms, m, None if r < 0 else r, Summary(n, t, lo, hi, v, ts, torn, h), ranks=k,
                          higher_is_better=hib)
                for g, s, w, ms, m, r, n, t, lo, hi, v, ts, torn, h, k, hib in cols]

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
                                             for a in _ordered(mask))
    return plan


_DTYPES: dict[str, Any] = {"group": object, "stat": object, "rank": np.int64, "ranks": np.int64,
                           "wid": np.int64, "window_ms": np.int64, "agg_mask": np.int64, "count": np.int64,
                           "last_ts": np.int64, "torn": bool, "higher_is_better": bool}

