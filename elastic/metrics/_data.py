"""The records handlers receive: :data:`MetricData` (torchelastic's namedtuple) and :class:`StatMetricData`."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable
from typing import Any

__all__ = ["MetricData", "StatMetricData"]

MetricData = namedtuple("MetricData", ["timestamp", "group_name", "name", "value"])
MetricData.__doc__ = """One metric data point: ``(timestamp, group_name, name, value)``.

Exactly torchelastic's namedtuple: ``timestamp`` is Unix time in seconds (a float from :func:`time.time`),
``group_name`` and ``name`` identify the metric, ``value`` is what was passed to ``put_metric``.
"""

_EXTRAS = ("rank", "window_start", "window_end", "torn", "job")


class StatMetricData(MetricData):
    """A :data:`MetricData` the collector made from a closed stat window, with where and when it came from.

    It is still a 4-tuple ``(timestamp, group_name, name, value)`` (unpacking, indexing, ``len`` and
    ``isinstance(row, MetricData)`` behave as for a plain MetricData), so any torchelastic handler accepts it.
    The extra attributes, passed by keyword only:

    - ``rank``: the rank the window belongs to, or ``None`` for a row merged across ranks;
    - ``window_start`` / ``window_end``: the window's bounds in Unix seconds;
    - ``torn``: True when the window may be incomplete (its writer died in the middle of an ``add``);
    - ``job``: the job the row belongs to (a node collector serves several), or ``None``.

    Two StatMetricData are equal when both the tuple and the extras are equal; compared with a plain
    MetricData only the tuple counts. :meth:`_asdict` includes the extras; pickling and :mod:`copy` keep them.
    """

    rank: int | None
    window_start: float
    window_end: float
    torn: bool
    job: str | None

    def __new__(
        cls,
        timestamp: float,
        group_name: str,
        name: str,
        value: Any,
        *,
        rank: int | None,
        window_start: float,
        window_end: float,
        torn: bool = False,
        job: str | None = None,
    ) -> StatMetricData:
        """Build the row; the four MetricData fields positionally or by name, the extras by keyword."""
        self = tuple.__new__(cls, (timestamp, group_name, name, value))
        self.rank = rank
        self.window_start = window_start
        self.window_end = window_end
        self.torn = torn
        self.job = job
        return self

    @classmethod
    def _from_figures(cls, figures: Iterable[tuple[float, str, str, Any, int | None, float, bool]],
                      job: str | None) -> list[StatMetricData]:
        """Rows from ``(window_end, group_name, name, value, rank, window_start, torn)`` tuples, the timestamp
        being the window's end (what the collector builds for a whole pass: the same rows as ``__new__``, without
        its keyword handling per row)."""
        new = tuple.__new__
        out: list[StatMetricData] = []
        append = out.append
        for end, group, name, value, rank, start, torn in figures:
            row = new(cls, (end, group, name, value))
            row.__dict__ = {"rank": rank, "window_start": start, "window_end": end, "torn": torn, "job": job}
            append(row)
        return out

    @classmethod
    def _make(  # type: ignore[override]
        cls,
        iterable: Iterable[Any],
        *,
        rank: int | None,
        window_start: float,
        window_end: float,
        torn: bool = False,
        job: str | None = None,
    ) -> StatMetricData:
        """Build a row from a 4-item iterable plus the extras (by keyword)."""
        values = tuple(iterable)
        if len(values) != 4:
            raise TypeError(f"Expected 4 arguments, got {len(values)}")
        return cls(*values, rank=rank, window_start=window_start, window_end=window_end, torn=torn, job=job)

    def _replace(self, **changes: Any) -> StatMetricData:
        """A copy with some fields or extras replaced; unknown names raise :class:`ValueError` (as namedtuple)."""
        values = [changes.pop(field, value) for field, value in zip(self._fields, self, strict=True)]
        extras = {key: changes.pop(key, getattr(self, key)) for key in _EXTRAS}
        if changes:
            raise ValueError(f"Got unexpected field names: {list(changes)!r}")
        return type(self)(*values, **extras)

    def _asdict(self) -> dict[str, Any]:
        """The four fields then the extras, as a new dict (for JSON and other flat formats)."""
        out = dict(zip(self._fields, self, strict=True))
        for key in _EXTRAS:
            out[key] = getattr(self, key)
        return out

    def _extras(self) -> tuple[Any, ...]:
        return (self.rank, self.window_start, self.window_end, self.torn, self.job)

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Pickle and copy support: rebuild through ``__new__`` with the extras as keywords."""
        return tuple(self), dict(zip(_EXTRAS, self._extras(), strict=True))

    def __eq__(self, other: object) -> bool:
        """Tuple equality, plus equal extras when ``other`` is a StatMetricData too."""
        if not isinstance(other, tuple):
            return NotImplemented
        if not tuple.__eq__(self, other):
            return False
        if isinstance(other, StatMetricData):
            return self._extras() == other._extras()
        return True

    def __ne__(self, other: object) -> bool:
        """The negation of :meth:`__eq__`."""
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = MetricData.__hash__

    def __repr__(self) -> str:
        """``StatMetricData(timestamp=..., group_name=..., name=..., value=..., rank=..., ...)``."""
        items = ", ".join(f"{key}={value!r}" for key, value in self._asdict().items())
        return f"{type(self).__name__}({items})"
