"""What one pass of :class:`collector.read.scanner.Scanner` produced (:class:`ScanResult`), and the count of
distinct rows its counters are computed with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .columns import Columns
from .merge import WindowRow

__all__ = ["ScanResult", "distinct"]


@dataclass
class ScanResult:
    """What one pass produced: its rows as :class:`Columns` (window order, merged row first, then one per rank)
    and counters; :attr:`rows` gives the same rows as :class:`WindowRow` objects (built on first use).

    ``skipped_windows`` / ``skipped_rows``: merged windows / rows (merged and per rank) of groups the caller's
    ``want`` declined; they were read, counted and are committed like the others, but never built.
    """

    columns: Columns = field(default_factory=lambda: Columns.empty(""))
    windows_read: int = 0
    overwritten: int = 0
    torn: int = 0
    skipped_windows: int = 0
    skipped_rows: int = 0
    _rows: list[WindowRow] | None = field(default=None, repr=False)

    @property
    def rows(self) -> list[WindowRow]:
        """The rows as :class:`WindowRow` objects (built from :attr:`columns` once, on first use)."""
        if self._rows is None:
            self._rows = self.columns.to_rows()
        return self._rows


def distinct(*columns: np.ndarray) -> int:
    """Number of distinct rows of equally long integer columns."""
    if not len(columns[0]):
        return 0
    order = np.lexsort(columns[::-1])
    change = np.zeros(len(order) - 1, bool)
    for col in columns:
        c = col[order]
        change |= c[1:] != c[:-1]
    return 1 + int(change.sum())
