"""``Stat``: windowed summary statistics, in-process (as torch.monitor) or in the job's shared memory.

Two cores share one face:

- in-process (no job attached): windows close lazily, on the first ``add`` after the window ended and when
  the Stat is closed or garbage-collected, and are logged to the local handlers as ``torch.monitor.Stat``
  events with torch.monitor's data keys (``<name>.<aggregation>``), exactly as torch.monitor does;
- attached (a job is configured): ``add`` writes into this rank's slot of the segment (see
  :mod:`shmstat.layout`) without a lock, allocation or system call beyond the clock, and the node's collector
  closes windows on time, even for idle ranks. Local handlers still see each window when it rolls over.

Windows are aligned to the wall clock (``window id = time_ns // window_ns``) so ranks and nodes line up.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from . import _state
from . import layout as L
from .aggregation import Aggregation, aggregate, aggregation_key, from_mask, to_mask
from .errors import ConfigError

__all__ = ["DEFAULT_GROUP", "Stat"]

DEFAULT_GROUP = "default"
STAT_EVENT_NAME = "torch.monitor.Stat"
_UNLIMITED = 9223372036854775807
_KEY_ORDER = (Aggregation.COUNT, Aggregation.SUM, Aggregation.MEAN, Aggregation.MAX, Aggregation.MIN,
              Aggregation.VALUE)
_live_attached: weakref.WeakSet[Stat] = weakref.WeakSet()

Clock = Callable[[], int]


def _window_ns(window_size: Any) -> int:
    """The window in ns (``timedelta`` or float seconds, truncated to ms); refuses one outside 1 ms..1 h."""
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
            f"window_size {window_size!r} is over the longest window of {L.MAX_WINDOW_MS // 1000} s; "
            "use a shorter window (log rarer values as events)"
        )
    return ms * 1_000_000


class _Summary:
    """Values of one closed window, as torch.monitor reports them (zeros for an empty window)."""

    __slots__ = ("count", "last", "max", "min", "sum")

    def __init__(self, count: int = 0, total: float = 0.0, lo: float = 0.0, hi: float = 0.0, last: float = 0.0):
        self.count, self.sum, self.min, self.max, self.last = count, total, lo, hi, last

    def value(self, agg: Aggregation) -> float:
        return aggregate(agg, self.count, self.sum, self.min, self.max, self.last)


class Stat:
    """Summary statistics of values added over fixed windows (``torch.monitor.Stat`` compatible).

    ``Stat(name, aggregations, window_size, max_samples=2**63-1)``; ``window_size`` is a ``timedelta`` or
    seconds, truncated to milliseconds (at least 1 ms). Keyword-only extras: ``group`` (the metric group the
    collector dispatches windows to) and ``clock`` (a ``() -> int`` wall-clock in ns, for tests).

    ``add(v)`` adds a value to the open window; it is a per-instance function (the fastest call CPython has),
    not a method. Promises: a closed window is logged once; ``get()`` returns the last closed window as
    ``{Aggregation: float}`` (zeros before any and after an empty window); ``count`` is the number of samples
    in the open window; NaN samples are ignored and counted, infinities are kept; ``Aggregation.VALUE`` yields
    the last value added (key ``<name>.value``), where torch.monitor yields nothing.
    """

    __slots__ = ("__weakref__", "_aggs", "_attached", "_core", "_group", "_max_samples", "_name",
                 "_window_ns", "add")

    def __init__(
        self,
        name: str,
        aggregations: Iterable[Aggregation],
        window_size: _dt.timedelta | float,
        max_samples: int = _UNLIMITED,
        *,
        group: str = DEFAULT_GROUP,
        clock: Clock = time.time_ns,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Stat name must be a str, not {type(name).__name__}")
        if not name:
            raise ConfigError("Stat name must not be empty")
        if isinstance(max_samples, bool) or not isinstance(max_samples, int):
            raise TypeError(f"max_samples must be an int, not {type(max_samples).__name__}")
        if max_samples < 1:
            raise ConfigError(f"max_samples is {max_samples}; it must be at least 1")
        self._name = name
        self._aggs = from_mask(to_mask(aggregations))
        self._window_ns = _window_ns(window_size)
        self._max_samples = max_samples
        self._group = group
        from .attach import ensure_init  # late: attach imports the publisher

        attachment = ensure_init()
        self._attached = attachment is not None
        if attachment is not None:
            self._core: _LocalCore | _SharedCore = _SharedCore(self, attachment, clock)
            _live_attached.add(self)
        else:
            self._core = _LocalCore(self, clock)
        self.add: Callable[[float], None] = self._core.add

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
            self._core = _ClosedCore()
            self.add = _closed_add
            core.close()
            self._core.last = core.last

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"Stat(name={self._name!r}, window_ms={self._window_ns // 1_000_000}, group={self._group!r})"

    # -- shared by both cores ----------------------------------------------------------------------------
    def _log_window(self, summary: _Summary, now_ns: int) -> None:
        from .events import Event, _dispatch_local

        data: dict[str, float] = {}
        for agg in _KEY_ORDER:
            if agg in self._aggs:
                data[f"{self._name}.{aggregation_key(agg)}"] = summary.value(agg)
        _dispatch_local(Event._from_ns(STAT_EVENT_NAME, now_ns, data))

    def _detach_after_fork(self) -> None:
        """In a forked child: stop writing to the parent's slot; continue in-process."""
        core = _LocalCore(self, time.time_ns)
        self._core = core
        self._attached = False
        self.add = core.add


def _closed_add(v: float) -> None:
    """``add`` on a closed Stat: ignored, as on a destroyed torch.monitor Stat."""


class _ClosedCore:
    def __init__(self) -> None:
        self.last = _Summary()

    def add(self, v: float) -> None:
        pass

    def count(self) -> int:
        return 0

    def close(self) -> None:
        pass


class _LocalCore:
    """In-process windows with torch.monitor's lazy closing."""

    def __init__(self, stat: Stat, clock: Clock) -> None:
        self.last = _Summary()
        self.nan_count = 0
        stat_ref = weakref.ref(stat)
        wns, max_samples = stat._window_ns, stat._max_samples
        n = 0
        total = lo = hi = last = 0.0
        wend = 0
        full = False
        core = self

        def log(now: int) -> None:
            nonlocal n, full
            core.last = _Summary(n, total, lo, hi, last)
            n = 0
            s = stat_ref()
            if s is not None:
                s._log_window(core.last, now)

        def add(v: float) -> None:
            nonlocal n, total, lo, hi, last, wend, full
            t = clock()
            if t >= wend:
                wend = (t // wns + 1) * wns
                if n:
                    log(t)
                elif wend:
                    core.last = _Summary()
                full = False
            if full:
                return
            if v != v:
                core.nan_count += 1
                return
            if n:
                total += v
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            else:
                total = lo = hi = v + 0.0  # raises on a non-number
            last = v
            n += 1
            if n >= max_samples:
                full = True
                log(t)

        def count() -> int:
            return n

        def close() -> None:
            if n:
                log(clock())

        self.add, self.count, self.close = add, count, close


class _SharedCore:
    """Writes samples into this rank's slot of the job segment; the seqlock protocol is in ``layout``."""

    def __init__(self, stat: Stat, attachment: Any, clock: Clock) -> None:
        from .segment import RankAttachment

        att: RankAttachment = attachment
        seg, geo = att.segment, att.segment.geometry
        mask = to_mask(stat._aggs)
        window_ms = stat._window_ns // 1_000_000
        shortest = L.min_window_ms(geo.banks)
        if window_ms < shortest:
            raise ConfigError(
                f"window_size of {window_ms} ms is too short for job {att.segment.job!r}: with {geo.banks} banks "
                f"per slot the collector cannot read windows under {shortest} ms before they are overwritten; "
                "use a longer window or a segment with more banks"
            )
        self.index = att.allocate_stat(stat._name, stat._group, window_ms, stat._max_samples, mask)
        self.last = _Summary()
        self.attachment = att
        stat_ref = weakref.ref(stat)
        f, q = seg.f64, seg.i64
        wns, nbanks, inc = stat._window_ns, geo.banks, att.incarnation
        slot0 = geo.slot_offset(att.local_rank, self.index) // 8
        nan_word, disc_word, beat_word = att.word(L.R_NAN), att.word(L.R_DISCARDED), att.word(L.R_HEARTBEAT)
        max2 = 2.0 * stat._max_samples
        want_last = Aggregation.VALUE in stat._aggs
        seq = sm = mn = mx = lastv = 0.0
        wend = 0
        base = slot0
        core = self

        def roll(v: float, t: int) -> None:
            # Slow path, once per window: close the previous window locally, start the window of ``t``. The
            # new bank is marked before the clock is read again (the C roll() says why); if the window ended
            # meanwhile, its bank stays empty and the sample goes to the window of the later reading.
            nonlocal seq, sm, mn, mx, lastv, wend, base
            v = float(v)  # raises on a non-number before the bank is touched
            if v != v:
                q[nan_word] += 1
                return
            if seq:
                core.last = _Summary(int(seq) >> 1, sm, mn, mx, lastv)
                s = stat_ref()
                if s is not None and _state.STATE.handler_tuple:
                    s._log_window(core.last, t)
            elif wend:
                core.last = _Summary()
            while True:
                wid = t // wns
                end = (wid + 1) * wns
                b = slot0 + (wid % nbanks) * L.BANK_WORDS
                f[b] = 1.0
                q[b + L.B_WID] = wid
                q[b + L.B_INC] = inc
                t2 = clock()
                if t2 < end:
                    break
                f[b + L.B_SUM] = f[b + L.B_MIN] = f[b + L.B_MAX] = f[b + L.B_LAST] = 0.0
                q[b + L.B_TS] = 0
                f[b] = 0.0
                t = t2
            wend, base = end, b
            f[b + L.B_SUM] = f[b + L.B_MIN] = f[b + L.B_MAX] = f[b + L.B_LAST] = v
            q[b + L.B_TS] = t
            sm = mn = mx = lastv = v
            seq = 2.0
            f[b] = 2.0
            q[beat_word] = t

        # add(): the open window's bank is marked (odd seq) before the clock is read, so that a collector
        # closing the window after that reading sees the write in progress and waits for it (see _fastpath.c).
        def add(v: float) -> None:
            nonlocal seq, sm, mn, mx, lastv
            total = sm + v  # raises on a non-number before the bank is touched
            b = base
            if wend:
                f[b] = seq + 1.0
            t = clock()
            if t >= wend or v != v or seq >= max2:
                if wend:
                    f[b] = seq
                if t >= wend:
                    return roll(v, t)
                q[nan_word if v != v else disc_word] += 1
                return
            sm = total
            f[b + 2] = total
            if v < mn:
                mn = v
                f[b + 3] = v
            elif v > mx:
                mx = v
                f[b + 4] = v
            if want_last:
                lastv = v
                f[b + 5] = v
                q[b + 6] = t
            seq += 2.0
            f[b] = seq

        def count() -> int:
            return int(seq) >> 1 if clock() < wend else 0

        def close() -> None:
            att.release_stat(core.index)

        self.add, self.count, self.close = add, count, close
        self.writer = None
        try:
            from . import _fastpath  # optional C hot path, built at install time
        except ImportError:
            return
        if os.environ.get("SHMSTAT_PURE_PYTHON") == "1":
            return

        def on_roll(n: int, total: float, lo: float, hi: float, lastv: float, t: int) -> None:
            # What roll() does before resetting the bank; n == 0 is its ``elif wend`` case.
            if n:
                core.last = _Summary(n, total, lo, hi, lastv)
                s = stat_ref()
                if s is not None and _state.STATE.handler_tuple:
                    s._log_window(core.last, t)
            else:
                core.last = _Summary()

        writer = _fastpath.SlotWriter(
            seg.buf, slot0 * 8, nbanks, wns, inc, stat._max_samples, want_last, nan_word * 8, disc_word * 8,
            beat_word * 8, on_roll, None if clock is time.time_ns else clock,
        )
        self.writer = writer
        self.add = writer.add
        self.count = lambda: writer.count


def _after_fork_in_child() -> None:
    for stat in list(_live_attached):
        with contextlib.suppress(Exception):
            stat._detach_after_fork()
    _live_attached.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
