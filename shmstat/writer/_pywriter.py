"""The pure-Python twin of the C ``SlotWriter`` (``shmstat._fastpath``), used when the C extension is not
available or does not apply: :class:`PySlotWriter`, with the C writer's constructor and methods, writing the bank,
the seqlock and the histogram exactly as the C writer does; and :func:`coerce_value`, the C path's rules for
turning a sample into a float."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..job._degrade import add_counter
from ..shm import layout as L
from ._pyhist import hist_add, hist_reset

__all__ = ["PySlotWriter", "coerce_value"]


def coerce_value(v: Any) -> float:
    """A sample as a float, by the C path's rules (``PyFloat_AsDouble``): int and bool, then ``__float__``,
    then ``__index__``; anything else (str, None, complex) is a ``TypeError`` and changes nothing."""
    if type(v) is float:
        return v
    if isinstance(v, int):
        return float(v)  # OverflowError past a double's range, as in C
    as_float = getattr(type(v), "__float__", None)
    if as_float is not None:
        result = as_float(v)
        if not isinstance(result, float):
            raise TypeError(f"{type(v).__name__}.__float__ returned {type(result).__name__}, not float")
        return float(result)
    as_index = getattr(type(v), "__index__", None)
    if as_index is not None:
        return float(as_index(v))
    raise TypeError(f"must be real number, not {type(v).__name__}")


class _Views:
    """A writable buffer as the views a writer writes through (index = byte offset // 8, or // 4 for ``u32``), and
    as what :func:`shmstat.job._degrade.add_counter` reads of a segment (``buf``, ``i64``)."""

    __slots__ = ("buf", "f64", "i64", "u32")

    def __init__(self, buf: Any) -> None:
        self.buf = memoryview(buf)
        self.f64, self.i64, self.u32 = self.buf.cast("d"), self.buf.cast("q"), self.buf.cast("I")


def _wait_turn(turn: list[None]) -> None:
    """Take the turn token from ``turn`` once the thread holding it (inside an add: preempted, or in an injected
    clock) puts it back; the GIL is given up between tries, as the C writer's ``busy`` wait does."""
    while True:
        os.sched_yield()
        try:
            turn.pop()
            return
        except IndexError:
            pass


_fork_generation = [0]
"""Bumped in the child of every fork (the C writer's ``fork_generation``): a writer bound before it calls its
``on_fork`` on the next add."""


def _after_fork_in_child() -> None:
    _fork_generation[0] += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _resumable(f64: Any, i64: Any, bank: int, window_id: int, window_ns: int) -> float:
    """2 * the samples an earlier writer of the slot left in window ``window_id``'s bank (word ``bank``), which a
    new writer continues (the C ``resumable()``: not for windows over an hour, a torn bank keeps its complete
    ones)."""
    if window_ns > L.LONG_WINDOW_MS * 1_000_000 or i64[bank + L.B_WID] != window_id:
        return 0.0
    seq = float(f64[bank])
    if not 2.0 <= seq < 2.0**62:
        return 0.0
    return 2.0 * (seq // 2.0)


Report = tuple[int, float, float, float, float, int]
"""What a closed window reports to ``on_roll``: (count, total, minimum, maximum, last value, time)."""

OnRoll = Callable[[int, float, float, float, float, int], Any]

# the bank's words after seq (shmstat/shm/layout.py), as plain names; add writes the ones it writes on every call
# as literal offsets instead (a name costs it about 1%), which must be these:
_WID, _SUM, _MIN, _MAX, _LAST, _TS, _INC = L.B_WID, L.B_SUM, L.B_MIN, L.B_MAX, L.B_LAST, L.B_TS, L.B_INC
assert (_SUM, _MIN, _MAX, _LAST, _TS) == (2, 3, 4, 5, 6), "the bank layout moved: update add's offsets"


class PySlotWriter:
    """The pure-Python ``SlotWriter``: ``PySlotWriter(buf, slot0, nbanks, window_ns, incarnation, max_samples,
    want_last, nan_off, discarded_off, heartbeat_off, on_roll, clock=None, on_fork=None, hist0=-1)``, offsets in
    bytes of ``buf`` (a writable buffer, held for this object's life) as the C constructor takes them; ``add``,
    ``count``, ``state()``, ``rebind``, ``drop`` and ``guard`` as the C writer's.

    The open window's figures live in this object (``_seq``, ``_total``, ``_min``, ``_max``, ``_last``) and are
    mirrored into its bank word by word; ``_seq`` is the bank's seqlock word, 2 * the samples, odd while a write is
    in progress (see :mod:`shmstat.shm.layout`). The methods mirror the C writer's functions: ``add`` is
    ``add_locked()``, ``_roll`` (with ``_mark_bank``, ``_start_window`` and ``_resume``) its ``roll()``. Adds from
    several threads take turns (one at a time, see ``_reset``); ``on_roll`` runs after the turn.

    ``keep_closed_hist`` (keyword-only, as the C writer's): each report with samples of a stat with percentiles
    keeps the reported window's histogram bytes in :attr:`closed_hist` before the bank is reused, for a buffer whose
    ring is too short to still hold it (the in-process Stat's one bank).
    """

    __slots__ = (
        "_bank",
        "_beat_word",
        "_blocked",
        "_clock",
        "_discarded_word",
        "_drop_at",
        "_f64",
        "_full_reported",
        "_full_seq",
        "_gen",
        "_guard_drop_at",
        "_guard_word",
        "_hist_at",
        "_hist_base",
        "_i64",
        "_incarnation",
        "_last",
        "_max",
        "_min",
        "_nan_word",
        "_nbanks",
        "_on_fork",
        "_on_roll",
        "_seq",
        "_slot0",
        "_total",
        "_turn",
        "_u32",
        "_want_last",
        "_window_end",
        "_window_ns",
        "_words",
        "closed_hist",
        "keep_closed_hist",
    )

    def __init__(self, buf: Any, slot0: int, nbanks: int, window_ns: int, incarnation: int, max_samples: int,
                 want_last: bool, nan_off: int, discarded_off: int, heartbeat_off: int, on_roll: OnRoll | None,
                 clock: Callable[[], int] | None = None, on_fork: Callable[[], None] | None = None,
                 hist0: int = -1, *, keep_closed_hist: bool = False) -> None:
        self._words = words = _Views(buf)
        self._f64, self._i64, self._u32 = words.f64, words.i64, words.u32
        self._nbanks = nbanks
        self._window_ns = window_ns
        self._full_seq = 2.0 * max_samples  # seq of a full window
        self._want_last = want_last
        self._on_roll = on_roll
        self._clock = time.time_ns if clock is None else clock
        self._on_fork = on_fork
        self.keep_closed_hist = keep_closed_hist
        self.closed_hist: bytes | None = None
        """With ``keep_closed_hist``: the histogram bytes of the window last reported with samples."""
        self.rebind(slot0, incarnation, nan_off, discarded_off, heartbeat_off, hist0)

    def rebind(self, slot0: int, incarnation: int, nan_off: int, discarded_off: int, heartbeat_off: int,
               hist0: int = -1) -> None:
        """Write the slot at byte ``slot0`` from now on (no drop mode, no guard), starting from an empty window."""
        self._slot0 = self._bank = slot0 // 8  # first word of the slot; of the open window's bank
        self._incarnation = incarnation
        self._nan_word, self._discarded_word, self._beat_word = nan_off // 8, discarded_off // 8, heartbeat_off // 8
        self._hist_base, self._hist_at = hist0, -1  # byte offsets of the slot's first histogram, of the open one
        self._guard_word = self._guard_drop_at = -1
        self._drop_at = -1
        self._reset()

    def drop(self, counter_off: int) -> None:
        """Drop mode (no slot): every add only adds 1 to the u64 at byte ``counter_off``, atomically."""
        self._drop_at = counter_off
        self._reset()

    def guard(self, emitted_off: int, dropped_off: int) -> None:
        """A window under the ring's shortest: a bank holding a later window than the i64 at ``emitted_off`` (the
        slot's emitted_wid) is not overwritten; a sample that finds its bank so held is added to the u64 at
        ``dropped_off``. Until a :meth:`rebind`."""
        self._guard_word, self._guard_drop_at = emitted_off // 8, dropped_off

    def _reset(self) -> None:
        self._seq = self._total = self._min = self._max = self._last = 0.0
        self._window_end = 0  # end of the open window, ns (0: none yet)
        self._full_reported = False  # the open window filled up and was reported then (as the C writer's)
        self._blocked = False  # the open window found its bank held (the C writer's ``blocked``)
        # Adds from several threads take turns: the one that pops the single token from ``_turn`` writes, another
        # finds the list empty and yields until the token is back (the C writer's ``busy``). A list's pop and
        # append are atomic under the GIL and cost ~25 ns where a threading.Lock's `with` costs ~150 (CPython 3.11).
        self._turn: list[None] = [None]
        self._gen = _fork_generation[0]

    def state(self) -> tuple[float, float, float, float, float]:
        """(seq, sum, min, max, last): this writer's copy of the open window."""
        return self._seq, self._total, self._min, self._max, self._last

    @property
    def count(self) -> int:
        """Samples in the open window: 0 once it ended, or was reported when it filled."""
        return int(self._seq) >> 1 if self._clock() < self._window_end and not self._full_reported else 0

    def add(self, v: float) -> None:
        """Add a sample. The open window's bank is marked (odd seq) before the clock is read, so that a collector
        closing the window after that reading sees the write in progress and waits for it (see _fastpath.c)."""
        if self._gen != _fork_generation[0]:
            self._forked()
        if type(v) is not float:
            v = coerce_value(v)
        if self._drop_at >= 0:
            self._add_shared(self._drop_at)
            return
        turn = self._turn
        try:
            turn.pop()  # this add's turn (see _reset)
        except IndexError:
            _wait_turn(turn)
        try:
            if self._blocked:
                report: Report | None = self._blocked_add(v)
            else:
                f64 = self._f64
                bank = self._bank
                seq = self._seq
                end = self._window_end
                if end:
                    f64[bank] = seq + 1.0
                now = self._clock()
                if now < end and v == v and seq < self._full_seq:
                    self._total = total = self._total + v
                    f64[bank + 2] = total  # the bank's words: 2 sum, 3 min, 4 max, 5 last, 6 last_ts
                    if v < self._min:
                        self._min = f64[bank + 3] = v
                    elif v > self._max:
                        self._max = f64[bank + 4] = v
                    if self._want_last:
                        self._last = f64[bank + 5] = v
                        self._i64[bank + 6] = now
                    if self._hist_at >= 0:
                        hist_add(self._i64, self._u32, self._hist_at, v)
                    seq += 2.0
                    self._seq = f64[bank] = seq
                    if seq < self._full_seq:
                        return
                    self._full_reported = True  # torch.monitor logs a full window at once
                    report = self._report(now)
                else:
                    if end:
                        f64[bank] = seq
                    if now >= end:
                        report = self._roll(v, now)
                    else:  # a NaN, or a sample into a full window
                        self._i64[self._nan_word if v != v else self._discarded_word] += 1
                        return
        finally:
            turn.append(None)
        if report is not None and self._on_roll is not None:
            self._on_roll(*report)

    def _forked(self) -> None:
        # a forked child: bind to a slot of its own before writing anything (the C add's fork check)
        if self._on_fork is None:
            self._gen = _fork_generation[0]
            self._turn = [None]  # a thread of the parent may have held the turn at the fork
            return
        self._on_fork()
        if self._gen != _fork_generation[0]:
            raise RuntimeError("on_fork did not rebind the writer")

    def _add_shared(self, offset: int) -> None:
        # a counter several processes add to (drop mode, the guard's drops): only ever set on a job's segment
        add_counter(self._words, offset)  # type: ignore[arg-type]  # it reads only buf and i64 of a Segment

    def _report(self, now: int) -> Report:
        # the open window's figures, reported (its histogram kept first, where asked)
        if self.keep_closed_hist and self._hist_at >= 0:
            self.closed_hist = bytes(self._words.buf[self._hist_at:self._hist_at + L.HIST_SIZE])
        return (int(self._seq) >> 1, self._total, self._min, self._max, self._last, now)

    def _held_unread(self, marked: int, window_id: int) -> bool:
        # the C held_unread(): the bank holds an earlier window, with samples, that no collector has emitted yet
        i64 = self._i64
        old, s = i64[marked + _WID], self._f64[marked]
        return bool(old < window_id and 1.0 <= s < 2.0**62 and old > i64[self._guard_word])

    def _closing_report(self, now: int) -> Report | None:
        # what the window being left reports: its figures unless they were reported when it filled, zeros for an
        # empty one, nothing before this writer's first window
        if self._seq and not self._full_reported:
            return self._report(now)
        return (0, 0.0, 0.0, 0.0, 0.0, now) if self._window_end else None

    def _mark_bank(self, now: int, first: bool) -> tuple[int, int, float, int]:
        # The bank of the window of ``now`` is marked (odd seq) before the clock is read again (the C roll() says
        # why); if the window ended meanwhile, its bank stays empty (or as an earlier writer left it) and the same
        # is done for the window of the later reading. Returns (bank, window end, kept, now): ``kept`` is 2 * the
        # samples an earlier writer left there (only looked for in this writer's ``first`` window).
        f64, i64, window_ns = self._f64, self._i64, self._window_ns
        while True:
            window_id = now // window_ns
            end = (window_id + 1) * window_ns
            k = window_id % self._nbanks
            marked = self._slot0 + k * L.BANK_WORDS
            if self._hist_base >= 0:
                self._hist_at = self._hist_base + k * L.HIST_SIZE
            kept = _resumable(f64, i64, marked, window_id, window_ns) if first else 0.0
            if not kept and self._guard_word >= 0 and self._held_unread(marked, window_id):
                return marked, end, -1.0, now  # held: not marked (roll drops and counts)
            f64[marked] = kept + 1.0
            i64[marked + _WID] = window_id
            i64[marked + _INC] = self._incarnation
            later = self._clock()
            if later < end:
                return marked, end, kept, now
            if kept:  # the window ended meanwhile: the earlier writer's samples stay as they were
                f64[marked] = kept
                now = later
                continue
            f64[marked + _SUM] = f64[marked + _MIN] = f64[marked + _MAX] = f64[marked + _LAST] = 0.0
            i64[marked + _TS] = 0
            f64[marked] = 0.0
            now = later

    def _resume(self, v: float, now: int, kept: float, report: Report | None) -> Report | None:
        # the first sample into a window an earlier writer left ``kept`` in (the C resume()): the window's figures
        # come from the bank, then ``v`` is added as add does
        f64, bank = self._f64, self._bank
        self._seq, self._total, self._min, self._max, self._last = (kept, f64[bank + _SUM], f64[bank + _MIN],
                                                                    f64[bank + _MAX], f64[bank + _LAST])
        if kept >= self._full_seq:
            f64[bank] = kept
            self._full_reported = True
            self._i64[self._discarded_word] += 1
            return report
        self._total += v
        f64[bank + _SUM] = self._total
        if v < self._min:
            self._min = f64[bank + _MIN] = v
        if v > self._max:
            self._max = f64[bank + _MAX] = v
        if self._want_last:
            self._last = f64[bank + _LAST] = v
            self._i64[bank + _TS] = now
        if self._hist_at >= 0:
            hist_add(self._i64, self._u32, self._hist_at, v)
        self._seq = kept + 2.0
        f64[bank] = self._seq
        self._i64[self._beat_word] = now
        if self._seq >= self._full_seq:
            self._full_reported = True
            return self._report(now)
        return report

    def _start_window(self, v: float, now: int, report: Report | None) -> Report | None:
        # ``v`` as the first sample of the open window's bank (marked by _mark_bank)
        f64, i64, bank = self._f64, self._i64, self._bank
        if self._hist_at >= 0:
            hist_reset(i64, self._u32, self._hist_at)
            hist_add(i64, self._u32, self._hist_at, v)
        f64[bank + _SUM] = f64[bank + _MIN] = f64[bank + _MAX] = f64[bank + _LAST] = v
        i64[bank + _TS] = now
        self._total = self._min = self._max = self._last = v
        self._seq = 2.0
        f64[bank] = 2.0
        i64[self._beat_word] = now
        if self._seq >= self._full_seq:  # max_samples 1: full at once (the previous window was reported when it filled)
            self._full_reported = True
            return self._report(now)
        return report

    def _roll(self, v: float, now: int) -> Report | None:
        # Slow path, once per window: start the window of ``now`` with ``v``. Returns what the caller reports
        # (to on_roll) once the bank is consistent: the window left, or a window that is full at once.
        if v != v:
            self._i64[self._nan_word] += 1
            return None
        report = self._closing_report(now)
        self._full_reported = False
        first = not self._window_end  # this writer's first window: the bank may hold an earlier writer's samples
        self._bank, self._window_end, kept, now = self._mark_bank(now, first)
        if kept < 0:  # the ring cannot hold this window at the collector's pace: dropped and counted
            self._add_shared(self._guard_drop_at)
            self._seq = 0.0
            self._blocked = True
            return report
        if kept:
            return self._resume(v, now, kept, report)
        return self._start_window(v, now, report)

    def _blocked_add(self, v: float) -> Report | None:
        # the C add_blocked(): dropped and counted while the bank is still held; once the collector emitted what
        # it holds, the window starts there (as a first window); once it ended, the usual roll
        now = self._clock()
        if now < self._window_end:
            if v != v:
                self._i64[self._nan_word] += 1
                return None
            if self._held_unread(self._bank, now // self._window_ns):
                self._add_shared(self._guard_drop_at)
                return None
            self._window_end = 0
        self._blocked = False
        return self._roll(v, now)
