"""Merging windows across ranks (and, with the same code, node results into job results).

COUNT and SUM add up, MEAN = SUM / COUNT, MIN and MAX are the extremes of the parts, VALUE is the value with
the latest timestamp. :func:`merge` is associative and commutative, so any grouping of parts gives the same
result (a job-level collector merges node rows exactly as a node merges rank rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from shmstat.aggregation import Aggregation, aggregate, aggregation_key, from_mask

__all__ = ["Summary", "WindowRow", "merge", "merge_all"]


@dataclass(frozen=True)
class Summary:
    """Count, sum, extremes and latest value of a set of samples."""

    count: int
    sum: float
    min: float
    max: float
    last: float
    last_ts: int
    torn: bool = False

    @property
    def mean(self) -> float:
        """SUM / COUNT (0 for an empty summary, as torch.monitor reports)."""
        return self.sum / self.count if self.count else 0.0

    def value(self, agg: Aggregation) -> float:
        """The figure for one aggregation, as a float."""
        return aggregate(agg, self.count, self.sum, self.min, self.max, self.last)


def merge(a: Summary, b: Summary) -> Summary:
    """Combine two summaries; empty ones are the identity (an empty torn one only passes its flag on)."""
    if a.count == 0:
        return b if not a.torn or b.torn else replace(b, torn=True)
    if b.count == 0:
        return a if not b.torn or a.torn else replace(a, torn=True)
    later = b if b.last_ts > a.last_ts else a
    return Summary(
        a.count + b.count, a.sum + b.sum, min(a.min, b.min), max(a.max, b.max), later.last, later.last_ts,
        a.torn or b.torn,
    )


def merge_all(parts: Iterable[Summary]) -> Summary:
    """Merge any number of summaries (empty input gives the empty summary)."""
    out = Summary(0, 0.0, 0.0, 0.0, 0.0, 0)
    for p in parts:
        out = merge(out, p)
    return out


@dataclass(frozen=True)
class WindowRow:
    """One emitted row: a stat's window, merged (``rank`` None) or of one rank."""

    group: str
    name: str
    wid: int
    window_ms: int
    agg_mask: int
    rank: int | None
    summary: Summary
    ranks: int = 1
    """How many ranks contributed (1 for a per-rank row)."""

    @property
    def start_ns(self) -> int:
        """Window start, wall-clock ns."""
        return self.wid * self.window_ms * 1_000_000

    @property
    def end_ns(self) -> int:
        """Window end (exclusive), wall-clock ns."""
        return (self.wid + 1) * self.window_ms * 1_000_000

    def values(self) -> dict[str, float]:
        """``{"<name>.<aggregation>": value}`` for the aggregations the stat asked for, torch.monitor's order."""
        keys = _keys_cache.get((self.name, self.agg_mask))
        if keys is None:
            if len(_keys_cache) > 1 << 17:
                _keys_cache.clear()
            keys = _keys_cache[(self.name, self.agg_mask)] = tuple(
                (f"{self.name}.{aggregation_key(a)}", a) for a in _ordered(self.agg_mask)
            )
        s = self.summary
        n, total, lo, hi, last = s.count, s.sum, s.min, s.max, s.last
        return {key: aggregate(a, n, total, lo, hi, last) for key, a in keys}

    def to_wire(self) -> dict[str, object]:
        """The map published on ``stat/<group>/<name>`` (every figure, whatever the stat asked for)."""
        s = self.summary
        return {
            "group": self.group, "name": self.name, "rank": self.rank, "ranks": self.ranks, "wid": self.wid,
            "window_ms": self.window_ms, "start_ns": self.start_ns, "end_ns": self.end_ns, "count": s.count,
            "sum": s.sum, "mean": s.mean, "min": s.min if s.count else 0.0, "max": s.max if s.count else 0.0,
            "value": s.last, "last_ts": s.last_ts, "torn": s.torn,
        }


_ORDER = (Aggregation.COUNT, Aggregation.SUM, Aggregation.MEAN, Aggregation.MAX, Aggregation.MIN, Aggregation.VALUE)
_ordered_cache: dict[int, tuple[Aggregation, ...]] = {}
_keys_cache: dict[tuple[str, int], tuple[tuple[str, Aggregation], ...]] = {}  # (name, mask) -> data keys


def _ordered(mask: int) -> tuple[Aggregation, ...]:
    got = _ordered_cache.get(mask)
    if got is None:
        present = set(from_mask(mask))
        got = tuple(a for a in _ORDER if a in present)
        _ordered_cache[mask] = got
    return got
