"""The decoded records of a job's segment: what :mod:`shmstat.shm.layout_codec` reads out of the bytes that
:mod:`shmstat.shm.layout` draws (the header, a rank entry, a stat descriptor, a bank), as plain values, and the one
record of a window's figures that the writer, the reader and the collector share.

- :class:`WindowFigures`: a window's figures (count, sum, extremes, latest value, histogram), whoever holds them: a
  Stat's last closed window (``Stat.last``, the writer), a bank read out of the segment, and the figures of one
  collector row (:class:`collector.read.rows.WindowRow` carries them with the row's labels), merged or per rank;
- :class:`BankSnapshot`: a window as its bank holds it, the figures plus which window (``wid``) and which
  incarnation wrote it: what :func:`~shmstat.shm.layout_codec.read_bank` copies and what
  :meth:`shmstat.shm.reader.SegmentReader.read_slot` returns for a slot;
- :class:`Header`, :class:`RankInfo`, :class:`StatDescriptor`: the other records.

The fields' meanings, offsets and formats are those of :mod:`shmstat.shm.layout`; this module defines no offset or
constant of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..aggregation import Aggregation, aggregate
from .layout import DEFAULT_HIST_SLOTS, FLAG_HIGHER_IS_BETTER, FLAG_WAIT, LONG_WINDOW_MS, Geometry, RankState

if TYPE_CHECKING:  # pragma: no cover
    from ..histogram import Histogram

__all__ = ["BankSnapshot", "Header", "RankInfo", "StatDescriptor", "WindowFigures"]


@dataclass(frozen=True, slots=True)
class WindowFigures:
    """Count, sum, extremes and latest value of a window's samples (and their histogram, for stats that keep
    percentiles); all zeros for an empty window, as torch.monitor reports one."""

    count: int = 0
    sum: float = 0.0
    min: float = 0.0
    max: float = 0.0
    last: float = 0.0
    last_ts: int = 0
    """Wall-clock ns of the latest sample (0 where not known: the writer's own ``Stat.last``)."""
    torn: bool = False
    """The writer died in the middle of an add: the figures may miss (part of) that one sample."""
    hist: Histogram | None = None

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile from the histogram (clamped to the exact min/max); None if none is kept."""
        if self.hist is None:
            return None
        return self.hist.quantile(q, self.min, self.max) if self.count else 0.0

    @property
    def mean(self) -> float:
        """SUM / COUNT (0 for an empty window, as torch.monitor reports)."""
        return self.sum / self.count if self.count else 0.0

    def value(self, agg: Aggregation) -> float:
        """The figure for one aggregation, as a float."""
        return aggregate(agg, self.count, self.sum, self.min, self.max, self.last, self.hist)


@dataclass(frozen=True)
class Header:
    """The decoded segment header."""

    magic: bytes
    version: int
    max_ranks: int
    max_stats: int
    banks: int
    total_size: int
    created_ns: int
    collector_pid: int
    collector_beat_ns: int
    hist_slots: int = DEFAULT_HIST_SLOTS
    dropped: int = 0
    """Samples dropped by processes that got no entry of the job."""
    ranks_refused: int = 0
    """Rank processes that got no entry of the job."""

    @property
    def geometry(self) -> Geometry:
        """The capacities recorded in the header."""
        return Geometry(self.max_ranks, self.max_stats, self.banks, self.hist_slots)


@dataclass(frozen=True)
class RankInfo:
    """One decoded rank-table entry."""

    local_rank: int
    state: int
    pid: int
    incarnation: int
    rank: int
    world_size: int
    start_ns: int
    heartbeat_ns: int
    nstats: int
    nan_count: int
    discarded: int
    writer_of: int = 0
    """0 for a rank; ``1 + local rank`` of the rank this writer entry writes for."""
    dropped: int = 0
    """Samples of this rank that no slot holds (see the rank entry in :mod:`shmstat.shm.layout`)."""
    stats_refused: int = 0
    """Stats of this rank that got no slot."""
    writers_refused: int = 0
    """Writer processes of this rank that got no entry."""
    events_end: int = 0
    """0, or the sequence number after the last item its process numbered, recorded as it exited with items no
    collector acknowledged (see the rank entry in :mod:`shmstat.shm.layout`)."""
    events_incarnation: int = 0
    """The incarnation that process published under (with :attr:`events_end`)."""

    @property
    def is_writer(self) -> bool:
        """Whether this entry is an extra writer (forked child, spawned worker) of another rank's samples."""
        return self.writer_of != 0

    @property
    def state_name(self) -> str:
        """``free``, ``active``, ``exited`` or ``died``."""
        return RankState.NAMES.get(self.state, "unknown")


@dataclass(frozen=True)
class StatDescriptor:
    """One decoded stat descriptor: what a rank declared about one of its stats."""

    local_rank: int
    index: int
    name: str
    group: str
    window_ms: int
    max_samples: int
    agg_mask: int
    emitted_wid: int
    incarnation: int
    flags: int = 0
    hist: int = -1
    """Index of the stat's histogram in its rank's table, -1 for none."""

    @property
    def higher_is_better(self) -> bool:
        """Whether the stat declared that a high figure is good (a rate)."""
        return bool(self.flags & FLAG_HIGHER_IS_BETTER)

    @property
    def wait(self) -> bool:
        """Whether the stat times a wait for other ranks (a wait section): never scored as a straggler."""
        return bool(self.flags & FLAG_WAIT)

    @property
    def window_ns(self) -> int:
        """Window length in nanoseconds."""
        return self.window_ms * 1_000_000

    @property
    def is_long(self) -> bool:
        """Whether the window is longer than :data:`~shmstat.shm.layout.LONG_WINDOW_MS`: each writer's window also
        closes by count or by the writer's end, not only on the wall clock."""
        return self.window_ms > LONG_WINDOW_MS


@dataclass(frozen=True, slots=True, kw_only=True)
class BankSnapshot(WindowFigures):
    """A window as its bank holds it: a consistent copy of the bank (or, if ``torn``, the last inconsistent copy
    seen), its figures and which window and incarnation they are of."""

    wid: int
    """The window id (wall-clock ns // window ns)."""
    incarnation: int
    """The incarnation of the rank entry that wrote the window."""
