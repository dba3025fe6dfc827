"""What one pass of :class:`collector.read.scanner.Scanner` produced (:class:`ScanResult`), the watermarks it
leaves to write into the segment (:class:`DurableMarks`), and the count of distinct rows its counters are computed
with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .columns import Columns
from .merge import WindowRow

if TYPE_CHECKING:
    from shmstat.shm.segment import Segment

__all__ = ["DurableMarks", "ScanResult", "distinct"]


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


class DurableMarks(NamedTuple):
    """Watermarks of one pass still to be written into the segment: ``emitted_wid`` words and their values."""

    words: np.ndarray
    """Indices of the descriptors' ``emitted_wid`` words, counted in 8-byte words from the segment's start."""
    wids: np.ndarray

    def then(self, later: DurableMarks) -> DurableMarks:
        """These watermarks followed by ``later``'s: one set, the later value of each word kept (watermarks only
        move forward, so that is the larger one)."""
        words, wids = np.concatenate([self.words, later.words]), np.concatenate([self.wids, later.wids])
        order = np.lexsort((wids, words))
        words, wids = words[order], wids[order]
        last = np.ones(len(words), bool)
        last[:-1] = words[1:] != words[:-1]
        return DurableMarks(words[last], wids[last])

    def write(self, segment: Segment) -> None:
        """Write the watermarks into ``segment`` (a restarted collector resumes after them)."""
        if not len(self.words):
            return
        buf = segment.buf
        words = np.frombuffer(buf, np.int64, len(buf) // 8)
        try:
            words[self.words] = self.wids
        finally:
            del words
