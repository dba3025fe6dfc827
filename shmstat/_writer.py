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

if TYPE_CHECKING:  # pragma: no cover
    from .rank import RankAttachment, StatKey

__all__ = ["SlotBinding", "Summary", "coerce_value"]

Clock = Callable[[], int]

_generation = [0]  # bumped in the child of every fork
_all: weakref.WeakSet[SlotBinding] = weakref.WeakSet()
_inherited: dict[tuple[str, int, StatKey], SlotBinding] = {}  # in a forked child: the parent's bindings


class Summary:
    """Values of one closed window, as torch.monitor reports them (zeros for an empty window)."""

    __slots__ = ("count", "last", "max", "min", "sum")

    def __init__(self, count: int = 0, total: float = 0.0, lo: float = 0.0, hi: float = 0.0, last: float = 0.0):
        self.count, self.sum, self.min, self.max, self.last = count, total, lo, hi, last

    def value(self, agg: Aggregation) -> float:
        """The figure of one aggregation."""
        return aggregate(agg, self.count, self.sum, self.min, self.max, self.last)


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

    def __init__(self, att: RankAttachment, key: StatKey, window_ns: int, want_last: bool, clock: Clock) -> None:
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
        self.index = att.allocate_stat(*key)
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
                None if clock is time.time_ns else clock, self.rebind,
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
        self.last = Summary(n, total, lo, hi, lastv) if n else Summary()
        if n and _state.STATE.handler_tuple:
            for stat in list(self.stats):
                stat._log_window(self.last, t)
                break

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
    binding.index = att.allocate_stat(*binding.key)
    binding._gen = _generation[0]
    binding.last = Summary()
    slot0, nan_w, disc_w, beat_w = binding._slot_words(att)
    if binding._c is not None:
        binding._c.rebind(slot0 * 8, att.incarnation, nan_w * 8, disc_w * 8, beat_w * 8)
    else:
        binding._repoint(att, slot0, nan_w, disc_w, beat_w)
    att.writers[binding.key] = binding


def binding_for(att: RankAttachment, key: StatKey, window_ns: int, want_last: bool, clock: Clock) -> SlotBinding:
    """The writer of ``key`` in ``att``: the existing one, one inherited across a fork, or a new one."""
    found = att.writers.get(key)
    if found is not None and found._gen == _generation[0]:
        return found
    inherited = _inherited.get((att.segment.job, att.owner_local_rank, key))
    if inherited is not None:
        adopt(inherited, att)
        return inherited
    return SlotBinding(att, key, window_ns, want_last, clock)


def _python_writer(binding: SlotBinding, att: RankAttachment) -> tuple[Any, Any, Any]:
    """The pure-Python ``add``/``count`` of a binding, and its ``repoint`` (used after a fork)."""
    clock, wns, want_last = binding.clock, binding.window_ns, binding.want_last
    max2 = 2.0 * binding.key[3]
    nbanks = att.segment.geometry.banks
    f, q = att.segment.f64, att.segment.i64
    slot0, nan_word, disc_word, beat_word = binding._slot_words(att)
    inc = att.incarnation
    seq = sm = mn = mx = lastv = 0.0
    wend = 0
    base = slot0
    lock = threading.Lock()
    gen = [_generation[0]]

    def roll(v: float, t: int) -> tuple[int, float, float, float, float, int] | None:
        # Slow path, once per window: start the window of ``t``. The new bank is marked before the clock is read
        # again (the C roll() says why); if the window ended meanwhile, its bank stays empty and the sample goes
        # to the window of the later reading. Returns what the caller reports once the bank is consistent.
        nonlocal seq, sm, mn, mx, lastv, wend, base
        if v != v:
            q[nan_word] += 1
            return None
        report = (int(seq) >> 1, sm, mn, mx, lastv, t) if seq else ((0, 0.0, 0.0, 0.0, 0.0, t) if wend else None)
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
        return report

    def add(v: float) -> None:
        # The open window's bank is marked (odd seq) before the clock is read, so that a collector closing the
        # window after that reading sees the write in progress and waits for it (see _fastpath.c).
        nonlocal seq, sm, mn, mx, lastv
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
                seq += 2.0
                f[b] = seq
                return
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
        return int(seq) >> 1 if clock() < wend else 0

    def repoint(new_att: RankAttachment, new_slot0: int, new_nan: int, new_disc: int, new_beat: int) -> None:
        nonlocal f, q, slot0, nan_word, disc_word, beat_word, inc, seq, sm, mn, mx, lastv, wend, base, lock
        f, q = new_att.segment.f64, new_att.segment.i64
        slot0, nan_word, disc_word, beat_word = new_slot0, new_nan, new_disc, new_beat
        inc = new_att.incarnation
        seq = sm = mn = mx = lastv = 0.0
        wend = 0
        base = slot0
        lock = threading.Lock()
        gen[0] = _generation[0]

    return add, count, repoint


def _after_fork_in_child() -> None:
    _generation[0] += 1
    _inherited.clear()
    for binding in list(_all):
        _inherited[(binding.job, binding.owner, binding.key)] = binding


os.register_at_fork(after_in_child=_after_fork_in_child)
