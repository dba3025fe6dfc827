"""The aggregations a :class:`~shmstat.writer.stat.Stat` can compute, and their bit masks.

:class:`Aggregation` mirrors ``torch.monitor.Aggregation``: same member names, same integer values
(VALUE 0, MEAN 2, COUNT 3, SUM 4, MAX 5, MIN 6), same ``str()``. A set of aggregations is stored in the
shared-memory segment as a bit mask (bit ``int(agg)``), built with :func:`to_mask` and read back with
:func:`from_mask`.

Every function here also accepts torch's own ``torch.monitor.Aggregation`` members (matched by ``.name``), so
code that passes torch's enum keeps working after switching the import. torch is never imported.

Where we differ from torch: ``VALUE`` is implemented (the last value added, data key ``<stat>.value``); torch
accepts it but emits nothing for it. ``P50``, ``P90``, ``P99`` and ``P999`` are ours (keys ``<stat>.p50`` ...):
a stat that asks for any of them keeps an exponential histogram per window (:mod:`shmstat.histogram`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .histogram import Histogram

__all__ = [
    "AGG_BIT",
    "COUNT",
    "MAX",
    "MEAN",
    "MIN",
    "P50",
    "P90",
    "P99",
    "P999",
    "PERCENTILES",
    "PERCENTILE_MASK",
    "SUM",
    "VALUE",
    "Aggregation",
    "aggregate",
    "aggregation_key",
    "from_mask",
    "to_mask",
]


class Aggregation(enum.IntEnum):
    """These are types of aggregations that can be used to accumulate stats.

    The integer values equal torch's; iteration order is VALUE, MEAN, COUNT, SUM, MAX, MIN.
    """

    def __new__(cls, value: int, doc: str) -> Aggregation:
        """Create a member holding ``value`` with its own docstring ``doc``."""
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj.__doc__ = doc
        return obj

    VALUE = 0, "VALUE returns the last value to be added."
    MEAN = 2, "MEAN computes the arithmetic mean of all the added values."
    COUNT = 3, "COUNT returns the total number of added values."
    SUM = 4, "SUM returns the sum of the added values."
    MAX = 5, "MAX returns the max of the added values."
    MIN = 6, "MIN returns the min of the added values."
    P50 = 10, "P50 returns the median of the added values (from an exponential histogram, see shmstat.histogram)."
    P90 = 11, "P90 returns the 90th percentile of the added values."
    P99 = 12, "P99 returns the 99th percentile of the added values."
    P999 = 13, "P999 returns the 99.9th percentile of the added values."

    def __str__(self) -> str:
        """``Aggregation.MEAN``, as torch prints its members."""
        return f"Aggregation.{self.name}"

    def __format__(self, format_spec: str) -> str:
        """Format like ``str()`` (torch's members format as ``Aggregation.MEAN``)."""
        return format(str(self), format_spec)


VALUE = Aggregation.VALUE
"""Alias of :attr:`Aggregation.VALUE` (torch.monitor exports its members at module level too)."""
MEAN = Aggregation.MEAN
"""Alias of :attr:`Aggregation.MEAN`."""
COUNT = Aggregation.COUNT
"""Alias of :attr:`Aggregation.COUNT`."""
SUM = Aggregation.SUM
"""Alias of :attr:`Aggregation.SUM`."""
MAX = Aggregation.MAX
"""Alias of :attr:`Aggregation.MAX`."""
MIN = Aggregation.MIN
"""Alias of :attr:`Aggregation.MIN`."""
P50 = Aggregation.P50
"""Alias of :attr:`Aggregation.P50`."""
P90 = Aggregation.P90
"""Alias of :attr:`Aggregation.P90`."""
P99 = Aggregation.P99
"""Alias of :attr:`Aggregation.P99`."""
P999 = Aggregation.P999
"""Alias of :attr:`Aggregation.P999`."""

PERCENTILES: dict[Aggregation, float] = {P50: 0.5, P90: 0.9, P99: 0.99, P999: 0.999}
"""The quantile each percentile aggregation reports."""
PERCENTILE_MASK = (1 << 10) | (1 << 11) | (1 << 12) | (1 << 13)
"""The bits of the percentile aggregations: a stat whose mask has any keeps a histogram per window."""

AGG_BIT: dict[Aggregation, int] = {agg: 1 << int(agg) for agg in Aggregation}
"""The bit of each aggregation in a mask: ``1 << int(agg)``."""

_VALID_MASK = 0
for _bit in AGG_BIT.values():
    _VALID_MASK |= _bit
del _bit

_KEYS: dict[Aggregation, str] = {agg: agg.name.lower() for agg in Aggregation}


def _coerce(agg: Any) -> Aggregation:
    """Return our member for ``agg`` (ours, or any object whose ``.name`` is a member name, e.g. torch's)."""
    if isinstance(agg, Aggregation):
        return agg
    name = getattr(agg, "name", None)
    if isinstance(name, str):
        member = Aggregation.__members__.get(name)
        if member is None:
            raise ConfigError(
                f"aggregation {agg!r} is unknown: use one of {', '.join(Aggregation.__members__)}"
            )
        return member
    raise TypeError(
        f"{agg!r} of type {type(agg).__name__} is not an Aggregation: pass a member such as Aggregation.MEAN"
    )


def aggregation_key(agg: Any) -> str:
    """The lower-case suffix of the data key this aggregation produces (``"mean"`` for ``<stat>.mean``).

    Accepts our members and torch's; raises :class:`TypeError` for anything else.
    """
    return _KEYS[_coerce(agg)]


def to_mask(aggs: Iterable[Any]) -> int:
    """The bit mask of an iterable of aggregations (ours or torch's); duplicates merge, empty gives 0."""
    mask = 0
    for agg in aggs:
        mask |= AGG_BIT[_coerce(agg)]
    return mask


def from_mask(mask: int) -> list[Aggregation]:
    """The aggregations in ``mask``, in enum order (VALUE, MEAN, COUNT, SUM, MAX, MIN), each once.

    Raises :class:`~shmstat.errors.ConfigError` if ``mask`` is negative or has a bit no aggregation owns.
    """
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise TypeError(f"aggregation mask must be an int, not {type(mask).__name__}")
    if mask < 0 or mask & ~_VALID_MASK:
        raise ConfigError(
            f"aggregation mask {mask:#x} has bits outside {_VALID_MASK:#x}; pass a mask made by to_mask()"
        )
    return [agg for agg, bit in AGG_BIT.items() if mask & bit]


def aggregate(agg: Aggregation, count: int, total: float, lo: float, hi: float, last: float,
              hist: Histogram | None = None) -> float:
    """The figure one aggregation reports for a window's count, sum, min, max and last value (and, for the
    percentiles, its histogram), as a float.

    Every aggregation of an empty window is 0.0, as torch.monitor reports it; MEAN is ``total / count``; a
    percentile with no histogram is 0.0.
    """
    if count == 0:
        return 0.0
    q = PERCENTILES.get(agg)
    if q is not None:
        return hist.quantile(q, lo, hi) if hist is not None else 0.0
    if agg is Aggregation.COUNT:
        return float(count)
    if agg is Aggregation.SUM:
        return float(total)
    if agg is Aggregation.MEAN:
        return total / count
    if agg is Aggregation.MAX:
        return float(hi)
    if agg is Aggregation.MIN:
        return float(lo)
    return float(last)
