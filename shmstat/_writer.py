"""The one writer of a slot in this process: the C ``SlotWriter`` or its pure-Python twin, and what both share.

Every Stat of one key in a process, and every ``add`` a user kept bound after the Stat was gone, writes through
one :class:`SlotBinding`, so their samples land in one window (re-created or closed Stats lose nothing).
Threads: the C add runs without giving up the GIL (Python callbacks such as the window report run after the
bank is consistent), the Python add under a lock, so concurrent adds to one Stat reconcile exactly. Forks: a
binding taken before a fork re-binds, in the child, to a slot of the child's own writer entry on its first
add (a fork generation checked per add), so a child never writes its parent's slot.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _state
from . import layout as L
from .aggregation import Aggregation, aggregate
from .histogram import MAX_SCALE, Histogram, index_at_max_scale

if TYPE_CHECKING:  # pragma: no cover
    from .rank import RankAttachment, StatKey

__all__ = ["SlotBinding", "Summary", "coerce_value"]

Clock = Callable[[], int]

_generation = [0]  # bumped in the child of every fork
_all: weakref.WeakSet[SlotBinding] = weakref.WeakSet()
_inherited: dict[tuple[str, int, StatKey], SlotBinding] = {}  # in a forked child: the parent's bindings


class Summary:
    """Values of one closed window, as torch.monitor reports them (zeros for an empty window), and its
    histogram for a stat with percentiles."""

    __slots__ = ("count", "hist", "last", "max", "min", "sum")

    def __init__(self, count: int = 0, total: float = 0.0, lo: float = 0.0, hi: float = 0.0, last: float = 0.0,
                 hist: Histogram | None = None):
        self.count, self.sum, self.min, self.max, self.last, self.hist = count, total, lo, hi, last, hist

    def value(self, agg: Aggregation) -> float:
        """The figure of one aggregation."""
        return aggregate(agg, self.count, self.sum, self.min, self.max, self.last, self.hist)


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


class SlotBinding:
    """This process's writer of one stat key's slot: ``add``, the last closed window, the Stats it reports to."""

    def __init__(self, att: RankAttachment, key: StatKey, window_ns: int, want_last: bool, clock: Clock,
                 flags: int = 0) -> None:
        self.key = key
        self.window_ns = window_ns
        self.want_last = want_last
        self.clock = clock
        self.last = Summary()
        self.stats: weakref.WeakSet[Any] = weakref.WeakSet()
        """Live Stats of this key: a closed window is logged to local handlers once, through one of them."""
        self.job = att.segment.job
        self.owner = att.owner_local_rank
        self.att = att
        self.index = att.allocate_stat(*key, flags=flags)
        self.flags = flags
        self.hist0 = att.hist_offset(self.index)
        self._gen = _generation[0]
        self.add: Callable[[float], None]
        self.count: Callable[[], int]
        self._c: Any = None
        fast = None
        if os.environ.get("SHMSTAT_PURE_PYTHON") != "1":
            try:
                from . import _fastpath as fast  # optional C hot path, built at install time
            except ImportError:
                fast = None
        if fast is not None:
            slot0, nan_w, disc_w, beat_w = self._slot_words(att)
            self._c = fast.SlotWriter(
                att.segment.buf, slot0 * 8, att.segment.geometry.banks, window_ns, att.incarnation, key[3],
                want_last, nan_w * 8, disc_w * 8, beat_w * 8, self.on_roll,
                None if clock is time.time_ns else clock, self.rebind, self.hist0,
            )
            self.add = self._c.add
            self.count = lambda: self._c.count
        else:
            self.add, self.count, self._repoint = _python_writer(self, att)
        _all.add(self)
        att.writers[key] = self

    def _slot_words(self, att: RankAttachment) -> tuple[int, int, int, int]:
        """(first word of the slot, nan word, discarded word, heartbeat word) of this binding in ``att``."""
        slot0 = att.segment.geometry.slot_offset(att.local_rank, self.index) // 8
        return slot0, att.word(L.R_NAN), att.word(L.R_DISCARDED), att.word(L.R_HEARTBEAT)

    def on_roll(self, n: int, total: float, lo: float, hi: float, lastv: float, t: int) -> None:
        """A window closed in this process (called after the bank is consistent): remember it, log it locally."""
        hist = self._closed_hist(t, n >= self.key[3]) if n and self.hist0 >= 0 else None
        self.last = Summary(n, total, lo, hi, lastv, hist) if n else Summary()
        if n and _state.STATE.handler_tuple:
            for stat in list(self.stats):
                stat._log_window(self.last, t)
                break

    def _closed_hist(self, t: int, full: bool = False) -> Histogram | None:
        """The histogram of the window that just closed: in the bank of the newest window before ``t``'s, or of
        ``t``'s own when it closed by filling up (this process is the slot's one writer, so nothing changes it
        meanwhile)."""
        seg = self.att.segment
        geo = seg.geometry
        slot0 = geo.slot_offset(self.att.local_rank, self.index)
        open_wid = t // self.window_ns + (1 if full else 0)
        best = None
        for b in range(geo.banks):
            wid = seg.i64[(slot0 + b * L.BANK_SIZE) // 8 + L.B_WID]
            if wid < open_wid and (best is None or wid > best[0]):
                best = (wid, b)
        return None if best is None else L.read_hist(seg.buf, self.hist0 + best[1] * L.HIST_SIZE)

    def rebind(self) -> None:
        """In a forked child, on the first add: write a slot of the child's own writer entry from now on."""
        from .attach import ensure_init  # late: attach imports the publisher

        att = ensure_init()
        if att is None or att.segment.job != self.job:
            raise RuntimeError("a Stat bound before fork() has no job to write to in the child")
        adopt(self, att)


def adopt(binding: SlotBinding, att: RankAttachment) -> None:
    """Make ``binding`` (inherited from the parent) the writer of its key in ``att``, a fresh slot of the child."""
    _inherited.pop((binding.job, binding.owner, binding.key), None)
    binding.att = att
    binding.index = att.allocate_stat(*binding.key, flags=binding.flags)
    binding.hist0 = att.hist_offset(binding.index)
    binding._gen = _generation[0]
    binding.last = Summary()
    slot0, nan_w, disc_w, beat_w = binding._slot_words(att)
    if binding._c is not None:
        binding._c.rebind(slot0 * 8, att.incarnation, nan_w * 8, disc_w * 8, beat_w * 8, binding.hist0)
    else:
        binding._repoint(att, slot0, nan_w, disc_w, beat_w)
    att.writers[binding.key] = binding


def binding_for(att: RankAttachment, key: StatKey, window_ns: int, want_last: bool, clock: Clock,
                flags: int = 0) -> SlotBinding:
    """The writer of ``key`` in ``att``: the existing one, one inherited across a fork, or a new one."""
    found = att.writers.get(key)
    if found is not None and found._gen == _generation[0]:
        return found
    inherited = _inherited.get((att.segment.job, att.owner_local_rank, key))
    if inherited is not None:
        adopt(inherited, att)
        return inherited
    return SlotBinding(att, key, window_ns, want_last, clock, flags)


def _python_writer(binding: SlotBinding, att: RankAttachment) -> tuple[Any, Any, Any]:
    """The pure-Python ``add``/``count`` of a binding, and its ``repoint`` (used after a fork)."""
    clock, wns, want_last = binding.clock, binding.window_ns, binding.want_last
    max2 = 2.0 * binding.key[3]
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
    gen = [_generation[0]]

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
        while True:
            wid = t // wns
            end = (wid + 1) * wns
            b = slot0 + (wid % nbanks) * L.BANK_WORDS
            if hist0 >= 0:
                hist = hist0 + (wid % nbanks) * L.HIST_SIZE
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
        if gen[0] != _generation[0]:
            binding.rebind()
        if type(v) is not float:
            v = coerce_value(v)
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
        nonlocal hist0, hist, full_reported
        full_reported = False
        f, q, u = new_att.segment.f64, new_att.segment.i64, new_att.segment.u32
        hist0, hist = binding.hist0, -1
        slot0, nan_word, disc_word, beat_word = new_slot0, new_nan, new_disc, new_beat
        inc = new_att.incarnation
        seq = sm = mn = mx = lastv = 0.0
        wend = 0
        base = slot0
        lock = threading.Lock()
        gen[0] = _generation[0]

    return add, count, repoint


_M = L.HIST_BUCKETS


def hist_reset(q: memoryview, u: memoryview, off: int) -> None:
    """An empty histogram at byte offset ``off`` (the bank's seq is odd): the pure-Python twin of the C
    ``hist_reset``; zeroes only the counts the previous window used."""
    w = off // 8
    for side in (0, 1):
        lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
        c0 = (off + L.HIST_COUNTS) // 4 + _M * side
        if lo <= hi:
            for i in (range(lo, hi + 1) if hi - lo < _M else range(_M)):
                u[c0 + i % _M] = 0
        q[w + 2 + 2 * side] = (1 << 63) - 1
        q[w + 3 + 2 * side] = -(1 << 63)
    q[w] = MAX_SCALE
    q[w + 1] = 0


def _shift_side(q: memoryview, u: memoryview, off: int, side: int, by: int) -> None:
    w = off // 8
    lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
    if lo > hi:
        return
    c0 = (off + L.HIST_COUNTS) // 4 + _M * side
    merged: dict[int, int] = {}
    for i in range(lo, hi + 1):
        merged[i >> by] = merged.get(i >> by, 0) + u[c0 + i % _M]
        u[c0 + i % _M] = 0
    for j, n in merged.items():
        u[c0 + j % _M] = min(n, 0xFFFFFFFF)
    q[w + 2 + 2 * side], q[w + 3 + 2 * side] = lo >> by, hi >> by


def hist_add(q: memoryview, u: memoryview, off: int, v: float) -> None:
    """Count ``v`` (not NaN) in the histogram at byte offset ``off``: the pure-Python twin of the C
    ``hist_add`` (same index function, same scale lowering, the same bytes)."""
    w = off // 8
    if v == 0.0:
        q[w + 1] += 1
        return
    i8 = index_at_max_scale(abs(v))
    side = 0 if v > 0 else 1
    scale = q[w]
    i = i8 >> (MAX_SCALE - scale)
    lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
    if lo > hi:
        lo = hi = i
    elif i < lo or i > hi:
        nlo, nhi = min(i, lo), max(i, hi)
        by = 0
        while (nhi >> by) - (nlo >> by) >= _M:
            by += 1
        if by:
            _shift_side(q, u, off, 0, by)
            _shift_side(q, u, off, 1, by)
            scale -= by
            q[w] = scale
            i = i8 >> (MAX_SCALE - scale)
            lo, hi = q[w + 2 + 2 * side], q[w + 3 + 2 * side]
            if lo > hi:
                lo = hi = i
        lo, hi = min(lo, i), max(hi, i)
    q[w + 2 + 2 * side], q[w + 3 + 2 * side] = lo, hi
    c = (off + L.HIST_COUNTS) // 4 + _M * side + i % _M
    if u[c] != 0xFFFFFFFF:
        u[c] += 1


def _after_fork_in_child() -> None:
    _generation[0] += 1
    _inherited.clear()
    for binding in list(_all):
        _inherited[(binding.job, binding.owner, binding.key)] = binding


os.register_at_fork(after_in_child=_after_fork_in_child)
