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


def _resumable(f: Any, q: Any, b: int, wid: int, wns: int) -> float:
    """2 * the samples an earlier writer of the slot left in window ``wid``'s bank (word ``b``), which a new
    writer continues (the C ``resumable()``: not for windows over an hour, a torn bank keeps its complete ones)."""
    if wns > L.LONG_WINDOW_MS * 1_000_000 or q[b + L.B_WID] != wid:
        return 0.0
    seq = float(f[b])
    if not 2.0 <= seq < 2.0**62:
        return 0.0
    return 2.0 * (seq // 2.0)


def python_writer(binding: Binding, att: RankAttachment, generation: list[int]) -> tuple[Any, Any, Any]:
    """The pure-Python ``add``/``count`` of a binding, and its ``repoint`` (used after a fork); ``generation``
    is the writer module's fork generation (bumped in the child of every fork: ``add`` then re-binds)."""
    clock, wns, want_last = binding.clock, binding.window_ns, binding.want_last
    max2 = 2.0 * binding.key.max_samples
    nbanks = att.segment.geometry.banks
    f, q, u = att.segment.f64, att.segment.i64, att.segment.u32
    slot0, nan_word, disc_word, beat_word = binding._slot_words(att)
    hist0 = binding.hist0
    hist = -1  # byte offset of the open window's histogram
    inc = att.incarnation
    seq = sm = mn = mx = lastv = 0.0
    wend = 0
    full_reported = False  # the open window filled up and was reported then (as the C writer's)
    base = slot0
    lock = threading.Lock()
    gen = [generation[0]]
    seg = att.segment
    drop_at = att.drop_offset if binding.index < 0 else -1  # drop mode: the counter's byte offset

    def roll(v: float, t: int) -> tuple[int, float, float, float, float, int] | None:
        # Slow path, once per window: start the window of ``t``. The new bank is marked before the clock is read
        # again (the C roll() says why); if the window ended meanwhile, its bank stays empty and the sample goes
        # to the window of the later reading. Returns what the caller reports once the bank is consistent.
        nonlocal seq, sm, mn, mx, lastv, wend, base, hist, full_reported
        if v != v:
            q[nan_word] += 1
            return None
        report = ((int(seq) >> 1, sm, mn, mx, lastv, t) if seq and not full_reported
                  else ((0, 0.0, 0.0, 0.0, 0.0, t) if wend else None))
        full_reported = False
        first = not wend  # this binding's first window: the bank may hold an earlier writer's samples
        while True:
            wid = t // wns
            end = (wid + 1) * wns
            b = slot0 + (wid % nbanks) * L.BANK_WORDS
            if hist0 >= 0:
                hist = hist0 + (wid % nbanks) * L.HIST_SIZE
            kept = _resumable(f, q, b, wid, wns) if first else 0.0
            f[b] = kept + 1.0
            q[b + L.B_WID] = wid
            q[b + L.B_INC] = inc
            t2 = clock()
            if t2 < end:
                break
            if kept:  # the window ended meanwhile: the earlier writer's samples stay as they were
                f[b] = kept
                t = t2
                continue
            f[b + L.B_SUM] = f[b + L.B_MIN] = f[b + L.B_MAX] = f[b + L.B_LAST] = 0.0
            q[b + L.B_TS] = 0
            f[b] = 0.0
            t = t2
        wend, base = end, b
        if kept:  # continue the earlier writer's window (the C resume())
            seq, sm, mn, mx, lastv = kept, f[b + L.B_SUM], f[b + L.B_MIN], f[b + L.B_MAX], f[b + L.B_LAST]
            if kept >= max2:
                f[b] = kept
                full_reported = True
                q[disc_word] += 1
                return report
            sm += v
            f[b + L.B_SUM] = sm
            if v < mn:
                mn = f[b + L.B_MIN] = v
            if v > mx:
                mx = f[b + L.B_MAX] = v
            if want_last:
                lastv = f[b + L.B_LAST] = v
                q[b + L.B_TS] = t
            if hist >= 0:
                hist_add(q, u, hist, v)
            seq = kept + 2.0
            f[b] = seq
            q[beat_word] = t
            if seq >= max2:
                full_reported = True
                return (int(seq) >> 1, sm, mn, mx, lastv, t)
            return report
        if hist >= 0:
            hist_reset(q, u, hist)
            hist_add(q, u, hist, v)
        f[b + L.B_SUM] = f[b + L.B_MIN] = f[b + L.B_MAX] = f[b + L.B_LAST] = v
        q[b + L.B_TS] = t
        sm = mn = mx = lastv = v
        seq = 2.0
        f[b] = 2.0
        q[beat_word] = t
        if seq >= max2:  # max_samples 1: full at once (the previous window was reported when it filled)
            full_reported = True
            return (1, v, v, v, v, t)
        return report

    def add(v: float) -> None:
        # The open window's bank is marked (odd seq) before the clock is read, so that a collector closing the
        # window after that reading sees the write in progress and waits for it (see _fastpath.c).
        nonlocal seq, sm, mn, mx, lastv, full_reported
        if gen[0] != generation[0]:
            binding.rebind()
        if type(v) is not float:
            v = coerce_value(v)
        if drop_at >= 0:
            add_counter(seg, drop_at)
            return
        with lock:
            b = base
            if wend:
                f[b] = seq + 1.0
            t = clock()
            if t < wend and v == v and seq < max2:
                sm += v
                f[b + 2] = sm
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
                if hist >= 0:
                    hist_add(q, u, hist, v)
                seq += 2.0
                f[b] = seq
                if seq < max2:
                    return
                full_reported = True  # torch.monitor logs a full window at once
                report: tuple[int, float, float, float, float, int] | None = (int(seq) >> 1, sm, mn, mx, lastv, t)
            else:
                if wend:
                    f[b] = seq
                if t >= wend:
                    report = roll(v, t)
                else:
                    q[nan_word if v != v else disc_word] += 1
                    return
        if report is not None:
            binding.on_roll(*report)

    def count() -> int:
        return int(seq) >> 1 if clock() < wend and not full_reported else 0

    def repoint(new_att: RankAttachment, new_slot0: int, new_nan: int, new_disc: int, new_beat: int) -> None:
        nonlocal f, q, u, slot0, nan_word, disc_word, beat_word, inc, seq, sm, mn, mx, lastv, wend, base, lock
        nonlocal hist0, hist, seg, drop_at, full_reported
        full_reported = False
        f, q, u = new_att.segment.f64, new_att.segment.i64, new_att.segment.u32
        seg = new_att.segment
        drop_at = new_att.drop_offset if binding.index < 0 else -1
        hist0, hist = binding.hist0, -1
        slot0, nan_word, disc_word, beat_word = new_slot0, new_nan, new_disc, new_beat
        inc = new_att.incarnation
        seq = sm = mn = mx = lastv = 0.0
        wend = 0
        base = slot0
        lock = threading.Lock()
        gen[0] = generation[0]

    return add, count, repoint
