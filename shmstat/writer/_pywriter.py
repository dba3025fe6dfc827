"""The pure-Python twin of the C ``SlotWriter`` (``shmstat._fastpath``), used when the C extension is not
available: a slot binding's ``add``, ``count`` and ``repoint`` (:func:`python_writer`), writing the bank, the
seqlock and the histogram exactly as the C writer does; and :func:`coerce_value`, the C path's rules for turning
a sample into a float (shared with ``Stat``'s in-process path)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..job._drops import add_counter
from ..shm import layout as L
from ._pyhist import hist_add, hist_reset

if TYPE_CHECKING:  # pragma: no cover
    from ..job.rank import RankAttachment, SlotKey

__all__ = ["Binding", "coerce_value", "python_writer"]


class Binding(Protocol):
    """What :func:`python_writer` uses of its :class:`shmstat.writer._writer.SlotBinding`."""

    key: SlotKey
    window_ns: int
    want_last: bool
    clock: Callable[[], int]
    hist0: int
    index: int

    def _slot_words(self, att: RankAttachment) -> tuple[int, int, int, int]: ...

    def _guard_offsets(self, att: RankAttachment) -> tuple[int, int] | None: ...

    def rebind(self) -> None: ...

    def on_roll(self, n: int, total: float, lo: float, hi: float, lastv: float, t: int) -> None: ...


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
"""What a closed window reports to :meth:`Binding.on_roll`: (count, total, minimum, maximum, last value, time)."""

# the bank's words after seq (shmstat/shm/layout.py), as plain names; add writes the ones it writes on every call
# as literal offsets instead (a name costs it about 1%), which must be these:
_WID, _SUM, _MIN, _MAX, _LAST, _TS, _INC = L.B_WID, L.B_SUM, L.B_MIN, L.B_MAX, L.B_LAST, L.B_TS, L.B_INC
assert (_SUM, _MIN, _MAX, _LAST, _TS) == (2, 3, 4, 5, 6), "the bank layout moved: update add's offsets"


def python_writer(binding: Binding, att: RankAttachment, generation: list[int]) -> tuple[Any, Any, Any]:
    """The pure-Python ``add``/``count`` of a binding, and its ``repoint`` (used after a fork); ``generation``
    is the writer module's fork generation (bumped in the child of every fork: ``add`` then re-binds).

    The open window's figures live in this closure (``seq``, ``total``, ``minimum``, ``maximum``,
    ``last_value``) and are mirrored into its bank word by word; ``seq`` is the bank's seqlock word, 2 * the
    samples, odd while a write is in progress (see :mod:`shmstat.shm.layout`). The functions mirror the C
    writer's: ``add`` is ``add_locked()``, ``roll`` (with ``mark_bank``, ``start_window`` and ``resume``) its
    ``roll()``. Closures over cell variables, not an object's attributes: they are the fastest state Python
    reads and writes, and ``add`` is the hot path.
    """
    clock, window_ns, want_last = binding.clock, binding.window_ns, binding.want_last
    full_seq = 2.0 * binding.key.max_samples  # seq of a full window
    banks = att.segment.geometry.banks
    segment = att.segment
    f64, i64, u32 = segment.f64, segment.i64, segment.u32  # the segment as 8-byte floats, ints; 4-byte counts
    slot0, nan_word, discarded_word, beat_word = binding._slot_words(att)
    hist_base = binding.hist0  # byte offset of the slot's first histogram (-1: no percentiles)
    hist_at = -1  # byte offset of the open window's histogram
    incarnation = att.incarnation
    seq = total = minimum = maximum = last_value = 0.0
    window_end = 0  # end of the open window, ns (0: none yet)
    full_reported = False  # the open window filled up and was reported then (as the C writer's)
    bank = slot0  # first word of the open window's bank
    lock = threading.Lock()
    bound_generation = [generation[0]]
    drop_at = att.drop_offset if binding.index < 0 else -1  # drop mode: the counter's byte offset
    guard = binding._guard_offsets(att)  # the C guard(): (emitted_wid byte offset, dropped byte offset) or None
    guard_word, guard_drop_at = (guard[0] // 8, guard[1]) if guard is not None else (-1, -1)
    blocked = False  # the open window found its bank held (the C writer's ``blocked``)

    def held_unread(marked: int, window_id: int) -> bool:
        # the C held_unread(): the bank holds an earlier window, with samples, that no collector has emitted yet
        old, s = i64[marked + _WID], f64[marked]
        return bool(old < window_id and 1.0 <= s < 2.0**62 and old > i64[guard_word])

    def closing_report(now: int) -> Report | None:
        # what the window being left reports: its figures unless they were reported when it filled, zeros for an
        # empty one, nothing before this binding's first window
        if seq and not full_reported:
            return (int(seq) >> 1, total, minimum, maximum, last_value, now)
        return (0, 0.0, 0.0, 0.0, 0.0, now) if window_end else None

    def mark_bank(now: int, first: bool) -> tuple[int, int, float, int]:
        # The bank of the window of ``now`` is marked (odd seq) before the clock is read again (the C roll() says
        # why); if the window ended meanwhile, its bank stays empty (or as an earlier writer left it) and the same
        # is done for the window of the later reading. Returns (bank, window end, kept, now): ``kept`` is 2 * the
        # samples an earlier writer left there (only looked for in this binding's ``first`` window).
        nonlocal hist_at
        while True:
            window_id = now // window_ns
            end = (window_id + 1) * window_ns
            marked = slot0 + (window_id % banks) * L.BANK_WORDS
            if hist_base >= 0:
                hist_at = hist_base + (window_id % banks) * L.HIST_SIZE
            kept = _resumable(f64, i64, marked, window_id, window_ns) if first else 0.0
            if not kept and guard_word >= 0 and held_unread(marked, window_id):
                return marked, end, -1.0, now  # held: not marked (roll drops and counts)
            f64[marked] = kept + 1.0
            i64[marked + _WID] = window_id
            i64[marked + _INC] = incarnation
            later = clock()
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

    def resume(v: float, now: int, kept: float, report: Report | None) -> Report | None:
        # the first sample into a window an earlier writer left ``kept`` in (the C resume()): the window's figures
        # come from the bank, then ``v`` is added as add does
        nonlocal seq, total, minimum, maximum, last_value, full_reported
        seq, total, minimum, maximum, last_value = (kept, f64[bank + _SUM], f64[bank + _MIN], f64[bank + _MAX],
                                                     f64[bank + _LAST])
        if kept >= full_seq:
            f64[bank] = kept
            full_reported = True
            i64[discarded_word] += 1
            return report
        total += v
        f64[bank + _SUM] = total
        if v < minimum:
            minimum = f64[bank + _MIN] = v
        if v > maximum:
            maximum = f64[bank + _MAX] = v
        if want_last:
            last_value = f64[bank + _LAST] = v
            i64[bank + _TS] = now
        if hist_at >= 0:
            hist_add(i64, u32, hist_at, v)
        seq = kept + 2.0
        f64[bank] = seq
        i64[beat_word] = now
        if seq >= full_seq:
            full_reported = True
            return (int(seq) >> 1, total, minimum, maximum, last_value, now)
        return report

    def start_window(v: float, now: int, report: Report | None) -> Report | None:
        # ``v`` as the first sample of the open window's bank (marked by mark_bank)
        nonlocal seq, total, minimum, maximum, last_value, full_reported
        if hist_at >= 0:
            hist_reset(i64, u32, hist_at)
            hist_add(i64, u32, hist_at, v)
        f64[bank + _SUM] = f64[bank + _MIN] = f64[bank + _MAX] = f64[bank + _LAST] = v
        i64[bank + _TS] = now
        total = minimum = maximum = last_value = v
        seq = 2.0
        f64[bank] = 2.0
        i64[beat_word] = now
        if seq >= full_seq:  # max_samples 1: full at once (the previous window was reported when it filled)
            full_reported = True
            return (1, v, v, v, v, now)
        return report

    def roll(v: float, now: int) -> Report | None:
        # Slow path, once per window: start the window of ``now`` with ``v``. Returns what the caller reports
        # (to on_roll) once the bank is consistent: the window left, or a window that is full at once.
        nonlocal window_end, bank, full_reported, seq, blocked
        if v != v:
            i64[nan_word] += 1
            return None
        report = closing_report(now)
        full_reported = False
        first = not window_end  # this binding's first window: the bank may hold an earlier writer's samples
        bank, window_end, kept, now = mark_bank(now, first)
        if kept < 0:  # the ring cannot hold this window at the collector's pace: dropped and counted
            add_counter(segment, guard_drop_at)
            seq = 0.0
            blocked = True
            return report
        if kept:
            return resume(v, now, kept, report)
        return start_window(v, now, report)

    def blocked_add(v: float) -> Report | None:
        # the C add_blocked(): dropped and counted while the bank is still held; once the collector emitted what
        # it holds, the window starts there (as a first window); once it ended, the usual roll
        nonlocal window_end, blocked
        now = clock()
        if now < window_end:
            if v != v:
                i64[nan_word] += 1
                return None
            if held_unread(bank, now // window_ns):
                add_counter(segment, guard_drop_at)
                return None
            window_end = 0
        blocked = False
        return roll(v, now)

    def add(v: float) -> None:
        # The open window's bank is marked (odd seq) before the clock is read, so that a collector closing the
        # window after that reading sees the write in progress and waits for it (see _fastpath.c).
        nonlocal seq, total, minimum, maximum, last_value, full_reported
        if bound_generation[0] != generation[0]:
            binding.rebind()
        if type(v) is not float:
            v = coerce_value(v)
        if drop_at >= 0:
            add_counter(segment, drop_at)
            return
        with lock:
            if blocked:
                report: Report | None = blocked_add(v)
            else:
                open_bank = bank
                if window_end:
                    f64[open_bank] = seq + 1.0
                now = clock()
                if now < window_end and v == v and seq < full_seq:
                    total += v
                    f64[open_bank + 2] = total  # the bank's words: 2 sum, 3 min, 4 max, 5 last, 6 last_ts
                    if v < minimum:
                        minimum = v
                        f64[open_bank + 3] = v
                    elif v > maximum:
                        maximum = v
                        f64[open_bank + 4] = v
                    if want_last:
                        last_value = v
                        f64[open_bank + 5] = v
                        i64[open_bank + 6] = now
                    if hist_at >= 0:
                        hist_add(i64, u32, hist_at, v)
                    seq += 2.0
                    f64[open_bank] = seq
                    if seq < full_seq:
                        return
                    full_reported = True  # torch.monitor logs a full window at once
                    report = (int(seq) >> 1, total, minimum, maximum, last_value, now)
                else:
                    if window_end:
                        f64[open_bank] = seq
                    if now >= window_end:
                        report = roll(v, now)
                    else:  # a NaN, or a sample into a full window
                        i64[nan_word if v != v else discarded_word] += 1
                        return
        if report is not None:
            binding.on_roll(*report)

    def count() -> int:
        return int(seq) >> 1 if clock() < window_end and not full_reported else 0

    def repoint(new_att: RankAttachment, new_slot0: int, new_nan: int, new_discarded: int, new_beat: int) -> None:
        nonlocal f64, i64, u32, segment, slot0, nan_word, discarded_word, beat_word, incarnation, drop_at
        nonlocal seq, total, minimum, maximum, last_value, window_end, bank, lock, hist_base, hist_at, full_reported
        nonlocal guard_word, guard_drop_at, blocked
        full_reported = False
        regard = binding._guard_offsets(new_att)
        guard_word, guard_drop_at = (regard[0] // 8, regard[1]) if regard is not None else (-1, -1)
        blocked = False
        segment = new_att.segment
        f64, i64, u32 = segment.f64, segment.i64, segment.u32
        drop_at = new_att.drop_offset if binding.index < 0 else -1
        hist_base, hist_at = binding.hist0, -1
        slot0, nan_word, discarded_word, beat_word = new_slot0, new_nan, new_discarded, new_beat
        incarnation = new_att.incarnation
        seq = total = minimum = maximum = last_value = 0.0
        window_end = 0
        bank = slot0
        lock = threading.Lock()
        bound_generation[0] = generation[0]

    return add, count, repoint
