"""``Stat``: windowed summary statistics, in-process (as torch.monitor) or in the job's shared memory.

Two cores share one face:

- in-process (no job attached): windows close lazily, on the first ``add`` after the window ended and when
  the Stat is closed or garbage-collected, and are logged to the local handlers as ``torch.monitor.Stat``
  events with torch.monitor's data keys (``<name>.<aggregation>``), exactly as torch.monitor does;
- attached (a job is configured): ``add`` writes into this rank's slot of the segment (see
  :mod:`shmstat.shm.layout`) without a lock, allocation or system call beyond the clock, and the node's collector
  closes windows on time, even for idle ranks. Local handlers still see each window when it rolls over (or
  fills up).

Windows are aligned to the wall clock (``window id = time_ns // window_ns``, int64) so ranks and nodes line up.
Any window from 1 ms to 2**62 ns (~146 years) is accepted. In a job, a window longer than an hour is also closed,
for this process, by ``max_samples`` (as torch.monitor logs it at once) and by this process's end, so the collector
emits it then rather than at its wall-clock end (see :mod:`shmstat.shm.layout`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import mmap
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._backend import backend
from ..aggregation import PERCENTILES, Aggregation, aggregation_key, from_mask, to_mask
from ..errors import ConfigError
from ..names import MAX_STAT_NAME_BYTES, check_group, check_name
from ..shm import layout as L
from ..shm import layout_codec as codec
from ..shm.layout_records import WindowFigures
from ._pywriter import PySlotWriter
from ._writer import binding_for

if TYPE_CHECKING:  # pragma: no cover
    from ..histogram import Histogram
    from ..publish.events import data_value_t

__all__ = ["DEFAULT_GROUP", "Stat"]

DEFAULT_GROUP = "default"
_UNLIMITED = 9223372036854775807
_KEY_ORDER = (Aggregation.COUNT, Aggregation.SUM, Aggregation.MEAN, Aggregation.MAX, Aggregation.MIN,
              Aggregation.VALUE, Aggregation.P50, Aggregation.P90, Aggregation.P99, Aggregation.P999)

Clock = Callable[[], int]


def _window_ns(window_size: Any) -> int:
    """The window in ns (``timedelta`` or float seconds, truncated to ms); refuses one under 1 ms or over
    :data:`shmstat.shm.layout.MAX_WINDOW_MS` (2**62 ns, ~146 years: the longest that int64 window ends hold)."""
    if isinstance(window_size, _dt.timedelta):
        ms = window_size // _dt.timedelta(milliseconds=1)
    elif isinstance(window_size, (int, float)) and not isinstance(window_size, bool):
        if not math.isfinite(window_size):
            raise ConfigError(f"window_size {window_size!r} is not a finite number of seconds")
        ms = int(window_size * 1000) if abs(window_size) < 1e15 else int(math.copysign(1e18, window_size))
    else:
        raise TypeError(
            f"window_size must be a datetime.timedelta or seconds as a float, not {type(window_size).__name__}"
        )
    if ms < 1:
        raise ConfigError(f"window_size {window_size!r} is under 1 ms; use a window of at least 1 ms")
    if ms > L.MAX_WINDOW_MS:
        raise ConfigError(
            f"window_size {window_size!r} is over the longest window of {L.MAX_WINDOW_MS} ms (about 146 years); "
            "use a shorter window"
        )
    return ms * 1_000_000


def _checked_max_samples(max_samples: Any) -> int:
    """``max_samples`` if it is an int of at least 1: :class:`TypeError` for another type, :class:`ConfigError`
    under 1."""
    if isinstance(max_samples, bool) or not isinstance(max_samples, int):
        raise TypeError(f"max_samples must be an int, not {type(max_samples).__name__}")
    if max_samples < 1:
        raise ConfigError(f"max_samples is {max_samples}; it must be at least 1")
    return max_samples


class Stat:
    """Summary statistics of values added over fixed windows (``torch.monitor.Stat`` compatible).

    ``Stat(name, aggregations, window_size, max_samples=2**63-1)``; ``window_size`` is a ``timedelta`` or
    seconds, truncated to milliseconds (1 ms to 2**62 ns, about 146 years, in a job too: a window under
    :func:`shmstat.shm.layout.min_window_ms`, which the ring cannot hold at the collector's pace, never overwrites
    one the collector has not emitted; a sample that finds the ring so full is dropped and counted in its rank's
    ``dropped``). The add that brings a window to ``max_samples`` logs it at once and
    the window's later adds are discarded, as in torch.monitor. Keyword-only extras: ``group`` (the metric group the
    collector dispatches windows to), ``higher_is_better`` (a rate such as tokens/s: the straggler report then
    flags ranks whose figure is low) and ``clock`` (a ``() -> int`` wall-clock in ns, for tests). ``name`` and
    ``group`` follow the name rule of :mod:`shmstat.names` (in a job or not): :class:`ConfigError` otherwise.
    ``Aggregation.P50``/``P90``/``P99``/``P999`` keep an exponential histogram per window (same figures
    in process and in a job; error bound in :mod:`shmstat.histogram`).

    ``add(v)`` adds a value to the open window; it is a per-instance function (the fastest call CPython has),
    not a method. Promises: a closed window is logged once; ``get()`` returns the last closed window as
    ``{Aggregation: float}`` (zeros before any and after an empty window); ``count`` is the number of samples
    in the open window; NaN samples are ignored and counted, infinities are kept; ``Aggregation.VALUE`` yields
    the last value added (key ``<name>.value``), where torch.monitor yields nothing.
    """

    __slots__ = ("__weakref__", "_aggs", "_core", "_flags", "_group", "_max_samples", "_name",
                 "_window_ns", "add")

    def __init__(
        self,
        name: str,
        aggregations: Iterable[Aggregation],
        window_size: _dt.timedelta | float,
        max_samples: int = _UNLIMITED,
        *,
        group: str = DEFAULT_GROUP,
        higher_is_better: bool = False,
        wait: bool = False,
        clock: Clock = time.time_ns,
    ) -> None:
        self._name = check_name(name, "Stat name", MAX_STAT_NAME_BYTES)  # the name rule (shmstat.names)
        self._group = check_group(group, "Stat group")
        self._max_samples = _checked_max_samples(max_samples)
        self._aggs = from_mask(to_mask(aggregations))
        self._window_ns = _window_ns(window_size)
        self._flags = (L.FLAG_HIGHER_IS_BETTER if higher_is_better else 0) | (L.FLAG_WAIT if wait else 0)
        self._core: _PrivateCore | _SharedCore | _ClosedCore = self._open_core(clock)
        self.add: Callable[[float], None] = self._core.add

    def _open_core(self, clock: Clock) -> _PrivateCore | _SharedCore:
        """The core this Stat writes through: the job's shared memory when the process is (or now becomes)
        attached, else in-process windows (:class:`_PrivateCore`)."""
        from ..job.attach import ensure_init  # late: attach imports the publisher

        attachment = ensure_init()
        if attachment is not None:
            return _SharedCore(self, attachment, clock)
        return _PrivateCore(self, clock)

    @property
    def name(self) -> str:
        """The name given at creation."""
        return self._name

    @property
    def group(self) -> str:
        """The metric group the collector dispatches this stat's windows to."""
        return self._group

    @property
    def count(self) -> int:
        """Number of samples in the open window (0 right after a window was logged)."""
        return self._core.count()

    def get(self) -> dict[Aggregation, float]:
        """The last closed window as ``{Aggregation: float}`` for each requested aggregation."""
        summary = self._core.last
        return {agg: summary.value(agg) for agg in self._aggs}

    def close(self) -> None:
        """Log what the open window holds (in-process) and release this Stat's slot; idempotent."""
        core = self._core
        if core is not None:
            self._core = closed = _ClosedCore()
            self.add = _closed_add
            core.close()
            closed.last = core.last

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"Stat(name={self._name!r}, window_ms={self._window_ns // 1_000_000}, group={self._group!r})"

    # -- shared by both cores ----------------------------------------------------------------------------
    def _log_window(self, summary: WindowFigures, now_ns: int) -> None:
        from ..publish.events import STAT_EVENT, Event, _dispatch_local

        data: dict[str, data_value_t] = {}
        for agg in _KEY_ORDER:
            if agg in self._aggs:
                data[f"{self._name}.{aggregation_key(agg)}"] = summary.value(agg)
        _dispatch_local(Event._from_ns(STAT_EVENT, now_ns, data))


def _closed_add(v: float) -> None:
    """``add`` on a closed Stat: ignored, as on a destroyed torch.monitor Stat."""


class _ClosedCore:
    def __init__(self) -> None:
        self.last = WindowFigures()

    def add(self, v: float) -> None:
        pass

    def count(self) -> int:
        return 0

    def close(self) -> None:
        pass


class _PrivateCore:
    """In-process windows: the slot writer (C, or its pure-Python twin :class:`PySlotWriter`) on a buffer private to
    this process, laid out like a slot with one bank, so a window is written by the same code in process and in a
    job. On top of it, torch.monitor's lazy closing: the window is reported by the first add after it ended (and
    logged if it held samples), by ``max_samples`` at once, or by :meth:`close`. Thread-safe: the C add runs
    without giving up the GIL, the Python one takes its turn (one thread at a time). A stat with percentiles has
    the writer keep each reported window's histogram (``keep_closed_hist``) before the one bank is reused."""

    # the bank, then nan_count, discarded, heartbeat; then the bank's histogram (a stat with percentiles)
    _NAN, _DISCARDED, _BEAT, _HIST = L.BANK_SIZE, L.BANK_SIZE + 8, L.BANK_SIZE + 16, L.BANK_SIZE + 24

    def __init__(self, stat: Stat, clock: Clock) -> None:
        self.last = WindowFigures()
        self._stat_ref = weakref.ref(stat)
        self._clock = clock
        self._max_seq = 2.0 * stat._max_samples  # seq of a full window (reported when it filled)
        self._keeps_hist = keeps_hist = any(agg in PERCENTILES for agg in stat._aggs)
        self._buf = mmap.mmap(-1, self._HIST + (L.HIST_SIZE if keeps_hist else 0))  # anonymous: this process's
        writer_class = backend().SlotWriter or PySlotWriter
        self._writer: Any = writer_class(
            self._buf, 0, 1, stat._window_ns, 0, stat._max_samples, Aggregation.VALUE in stat._aggs, self._NAN,
            self._DISCARDED, self._BEAT, self._on_roll, None if clock is time.time_ns else clock, None,
            self._HIST if keeps_hist else -1, keep_closed_hist=keeps_hist,
        )
        self.add = self._writer.add

    def _on_roll(self, count: int, total: float, minimum: float, maximum: float, last_value: float, at: int) -> None:
        hist = None
        if count and self._keeps_hist:
            hist = codec.decode_hist(memoryview(self._writer.closed_hist), 0)
        self._closed(count, total, minimum, maximum, last_value, at, hist)

    def _closed(self, count: int, total: float, minimum: float, maximum: float, last_value: float, at: int,
                hist: Histogram | None) -> None:
        # a window closed: it becomes get()'s, and is logged if it held samples
        self.last = WindowFigures(count, total, minimum, maximum, last_value, hist=hist) if count else WindowFigures()
        stat = self._stat_ref()
        if count and stat is not None:
            stat._log_window(self.last, at)

    @property
    def nan_count(self) -> int:
        """NaN samples ignored so far."""
        return int.from_bytes(self._buf[self._NAN : self._NAN + 8], "little")

    def count(self) -> int:
        """Samples in the open window (torch's lazy count: until the next add, the window that ended; 0 once it was
        logged full)."""
        seq = self._writer.state()[0]
        return int(seq) >> 1 if seq < self._max_seq else 0

    def close(self) -> None:
        """Log what the open window holds (unless it was logged full)."""
        seq, total, minimum, maximum, last_value = self._writer.state()
        if seq and seq < self._max_seq:
            hist = codec.decode_hist(memoryview(self._buf), self._HIST) if self._keeps_hist else None
            self._closed(int(seq) >> 1, total, minimum, maximum, last_value, self._clock(), hist)


class _SharedCore:
    """Writes through this process's one writer of the stat's slot (:class:`shmstat.writer._writer.SlotBinding`)."""

    def __init__(self, stat: Stat, attachment: Any, clock: Clock) -> None:
        from ..job.rank import RankAttachment, SlotKey

        att: RankAttachment = attachment
        key = SlotKey(stat._name, stat._group, stat._window_ns // 1_000_000, stat._max_samples, to_mask(stat._aggs))
        binding = binding_for(att, key, stat._window_ns, Aggregation.VALUE in stat._aggs, clock, stat._flags)
        binding.stats.add(stat)
        self.binding = binding
        self.index = binding.index
        self.add = binding.add
        self.count = binding.count

    @property
    def last(self) -> WindowFigures:
        """The last window this process closed on the slot (whichever Stat of the key added to it)."""
        return self.binding.last

    def close(self) -> None:
        """Nothing to release: the slot stays this process's (a kept bound ``add`` may still write it)."""
