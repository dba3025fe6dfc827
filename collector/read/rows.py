"""A collector row: a stat's window with its labels (:class:`WindowRow`), whose figures are the one record of a
window's figures, :class:`shmstat.shm.layout_records.WindowFigures` (the same the writer's ``Stat.last`` and a bank
read out of the segment are).

Rows are what a pass's columns become when one is wanted as an object (:meth:`collector.read.columns.Columns.row`,
``to_rows``: ``stat/`` subscribers, the OTLP sink, ``shmstat top``). Merging is not done here: the one merge is
:func:`collector.read.columns.merge_parts`, on arrays (COUNT and SUM add up, MEAN = SUM / COUNT, MIN and MAX
are the extremes of the parts, VALUE is the value with the latest timestamp, the percentiles come from the parts'
histograms merged exactly); the per-object fold it is checked against is in ``tests/kit/merge_reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmstat.aggregation import PERCENTILES, Aggregation, aggregate, aggregation_key, from_mask
from shmstat.shm.layout_records import WindowFigures

__all__ = ["WindowRow", "WindowSpan", "ordered_aggregations"]


class WindowSpan:
    """Start and end of window ``wid`` of ``window_ms`` ms, for records that carry both."""

    wid: int
    window_ms: int

    @property
    def start_ns(self) -> int:
        """Window start, wall-clock ns."""
        return self.wid * self.window_ms * 1_000_000

    @property
    def end_ns(self) -> int:
        """Window end (exclusive), wall-clock ns."""
        return (self.wid + 1) * self.window_ms * 1_000_000


@dataclass(frozen=True)
class WindowRow(WindowSpan):
    """One emitted row: a stat's window, merged (``rank`` None) or of one rank, with its labels and figures."""

    group: str
    name: str
    wid: int
    window_ms: int
    agg_mask: int
    rank: int | None
    summary: WindowFigures
    """The window's figures (merged over the ranks for a merged row)."""
    ranks: int = 1
    """How many ranks contributed (1 for a per-rank row)."""
    higher_is_better: bool = False
    """What the stat declared (``Stat(..., higher_is_better=True)``, e.g. tokens/s): a straggler is a rank whose
    figure is low, not high."""
    wait: bool = False
    """The stat times a wait for other ranks (``shmstat.section(..., wait=True)``): never scored as a straggler."""

    def values(self) -> dict[str, float]:
        """``{"<name>.<aggregation>": value}`` for the aggregations the stat asked for, torch.monitor's order; the
        count is an int, every other figure a float."""
        keys = _keys_cache.get((self.name, self.agg_mask))
        if keys is None:
            if len(_keys_cache) > 1 << 17:
                _keys_cache.clear()
            keys = _keys_cache[(self.name, self.agg_mask)] = tuple(
                (f"{self.name}.{aggregation_key(a)}", a) for a in ordered_aggregations(self.agg_mask)
            )
        s = self.summary
        n, total, lo, hi, last, hist = s.count, s.sum, s.min, s.max, s.last, s.hist
        return {key: n if a is Aggregation.COUNT else aggregate(a, n, total, lo, hi, last, hist) for key, a in keys}

    def to_wire(self) -> dict[str, object]:
        """The map published on ``stat/<group>/<name>`` (every figure, whatever the stat asked for)."""
        s = self.summary
        return {
            "group": self.group, "name": self.name, "rank": self.rank, "ranks": self.ranks, "wid": self.wid,
            "window_ms": self.window_ms, "start_ns": self.start_ns, "end_ns": self.end_ns, "count": s.count,
            "sum": s.sum, "mean": s.mean, "min": s.min if s.count else 0.0, "max": s.max if s.count else 0.0,
            "value": s.last, "last_ts": s.last_ts, "torn": s.torn, "higher_is_better": self.higher_is_better,
            "wait": self.wait,
            **self._percentiles(),
        }

    def _percentiles(self) -> dict[str, object]:
        """``p50``.. and the histogram itself (``hist``) for stats that keep one: what subscribers merge."""
        s = self.summary
        if s.hist is None:
            return {}
        out: dict[str, object] = {aggregation_key(a): s.value(a) for a in PERCENTILES}
        out["hist"] = s.hist.to_wire()
        return out


_ORDER = (Aggregation.COUNT, Aggregation.SUM, Aggregation.MEAN, Aggregation.MAX, Aggregation.MIN, Aggregation.VALUE,
          Aggregation.P50, Aggregation.P90, Aggregation.P99, Aggregation.P999)
_ordered_cache: dict[int, tuple[Aggregation, ...]] = {}
_keys_cache: dict[tuple[str, int], tuple[tuple[str, Aggregation], ...]] = {}  # (name, mask) -> data keys


def ordered_aggregations(mask: int) -> tuple[Aggregation, ...]:
    """The aggregations of ``mask`` in the order rows and columns list them: count, sum, mean, max, min, value,
    p50, p90, p99, p999."""
    got = _ordered_cache.get(mask)
    if got is None:
        present = set(from_mask(mask))
        got = tuple(a for a in _ORDER if a in present)
        _ordered_cache[mask] = got
    return got
