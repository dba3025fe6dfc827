"""The one writer of a slot in this process: the C ``SlotWriter`` or its pure-Python twin, and what both share.

Every Stat of one key in a process, and every ``add`` a user kept bound after the Stat was gone, writes through
one :class:`SlotBinding`, so their samples land in one window (re-created or closed Stats lose nothing).
Threads: the C add runs without giving up the GIL (Python callbacks such as the window report run after the
bank is consistent), the Python add one thread at a time (a turn, see ``PySlotWriter``), so concurrent adds to one
Stat reconcile exactly. Creating a binding is idempotent under any concurrency: finding, creating and re-binding one
run under one process-wide lock (:data:`_binding_lock`), so threads creating the same Stat at once get one binding
and one slot. Forks: a binding taken before a fork re-binds, in the child, to a slot of the child's own writer
entry on its first add (a fork generation checked per add), so a child never writes its parent's slot.
No slot (the stat or percentile table is full, or the process holds no entry of the job): the writer is in *drop
mode*: ``add`` still checks the value, then only counts the sample as dropped in the segment (its rank's entry,
or the header) with an atomic add, so nothing raises and ``shmstat ls`` and a collector can show the loss.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._backend import backend
from ..errors import CapacityError, SegmentError
from ..histogram import Histogram
from ..job import _state
from ..shm import layout as L
from ..shm import layout_codec as codec
from ..shm.layout_records import WindowFigures
from ._pywriter import PySlotWriter

if TYPE_CHECKING:  # pragma: no cover
    from ..job.rank import RankAttachment, SlotKey

__all__ = ["SlotBinding"]

Clock = Callable[[], int]

_generation = [0]  # bumped in the child of every fork
_all: weakref.WeakSet[SlotBinding] = weakref.WeakSet()
_inherited: dict[tuple[str, int, SlotKey], SlotBinding] = {}  # in a forked child: the parent's bindings
_binding_lock = threading.RLock()
"""Held while a binding is found or created (:func:`binding_for`) and while an inherited one re-binds in a forked
child (:meth:`SlotBinding.rebind`): allocating a slot takes the job lock, whose ``flock`` releases the GIL, so
without it two threads creating one key could both allocate (two slots, or two writers of one slot). Never held
by ``add`` itself, except on a forked child's first add."""


class SlotBinding:
    """This process's writer of one stat key's slot: ``add``, the last closed window, the Stats it reports to."""

    def __init__(self, att: RankAttachment, key: SlotKey, window_ns: int, want_last: bool, clock: Clock,
                 flags: int = 0) -> None:
        self.key = key
        self.window_ns = window_ns
        self.want_last = want_last
        self.clock = clock
        self.last = WindowFigures()
        self.stats: weakref.WeakSet[Any] = weakref.WeakSet()
        """Live Stats of this key: a closed window is logged to local handlers once, through one of them."""
        self.job = att.segment.job
        self.owner = att.owner_local_rank
        self.att = att
        self.flags = flags
        self.index = _allocate(att, key, flags, _window_before(clock, window_ns))
        """The slot's descriptor index in ``att``'s entry; -1 in drop mode (no slot)."""
        self.hist0 = att.hist_offset(self.index) if self.index >= 0 else -1
        self._gen = _generation[0]
        slot0, nan_w, disc_w, beat_w = self._slot_words(att)
        writer_class = backend().SlotWriter or PySlotWriter  # C, or its pure-Python twin: one constructor
        self._writer: Any = writer_class(
            att.segment.buf, slot0 * 8, att.segment.geometry.banks, window_ns, att.incarnation, key.max_samples,
            want_last, nan_w * 8, disc_w * 8, beat_w * 8, self.on_roll, None if clock is time.time_ns else clock,
            self.rebind, self.hist0,
        )
        self._protect(att)
        self.add: Callable[[float], None] = self._writer.add
        self.count: Callable[[], int] = lambda: self._writer.count
        _all.add(self)
        att.writers[key] = self

    def _protect(self, att: RankAttachment) -> None:
        """Drop mode without a slot; the guard for a window the ring cannot hold at the collector's pace."""
        if self.index < 0:
            self._writer.drop(att.drop_offset)
        guard = self._guard_offsets(att)
        if guard is not None:
            self._writer.guard(*guard)

    @property
    def dropping(self) -> bool:
        """Whether this writer has no slot (every sample is dropped and counted)."""
        return self.index < 0

    def _slot_words(self, att: RankAttachment) -> tuple[int, int, int, int]:
        """(first word of the slot, nan word, discarded word, heartbeat word) of this binding in ``att``; in drop
        mode every word is the drop counter (never written as a slot)."""
        if self.index < 0:
            return 0, att.drop_offset // 8, att.drop_offset // 8, att.drop_offset // 8
        slot0 = att.segment.geometry.slot_offset(att.local_rank, self.index) // 8
        return slot0, att.word(L.R_NAN), att.word(L.R_DISCARDED), att.word(L.R_HEARTBEAT)

    def _guard_offsets(self, att: RankAttachment) -> tuple[int, int] | None:
        """For a window under the ring's shortest (:func:`shmstat.shm.layout.min_window_ms`), which the ring cannot
        hold at the collector's pace: the byte offsets of the slot's ``emitted_wid`` and of its rank's ``dropped``.
        The writer never overwrites a bank holding a window past that watermark: a sample that finds its bank so held
        is dropped and counted there, so the samples are exact or counted however late the collector reads. None
        otherwise (and in drop mode): the ring's K-2 windows of slack cover the collector's pace and grace."""
        geo = att.segment.geometry
        if self.index < 0 or self.window_ns // 1_000_000 >= L.min_window_ms(geo.banks):
            return None
        return geo.desc_offset(att.local_rank, self.index) + L.D_EMITTED, att.drop_offset

    def on_roll(self, n: int, total: float, lo: float, hi: float, lastv: float, t: int) -> None:
        """A window closed in this process (called after the bank is consistent): remember it, log it locally;
        at most once a second, check that the segment is still there (:func:`check_removed`)."""
        if time.monotonic() >= _next_check[0]:
            check_removed(self.att)
        hist = self._closed_hist(t, n >= self.key.max_samples) if n and self.hist0 >= 0 else None
        self.last = WindowFigures(n, total, lo, hi, lastv, hist=hist) if n else WindowFigures()
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
        return None if best is None else codec.decode_hist(seg.buf, self.hist0 + best[1] * L.HIST_SIZE)

    def rebind(self) -> None:
        """In a forked child, on the first add: write a slot of the child's own writer entry from now on (once,
        whichever thread of the child adds first)."""
        from ..job.attach import ensure_init  # late: attach imports the publisher

        with _binding_lock:
            if self._gen == _generation[0]:
                return  # another thread of this child re-bound it while this one waited
            try:
                att = ensure_init()
            except Exception:  # telemetry's state never raises into an add: drop and count in the parent's segment
                att = None
            if att is None or att.segment.job != self.job:
                drop_inherited(self)
                return
            adopt(self, att)


def _window_before(clock: Clock, window_ns: int) -> int:
    """The window before the one ``clock`` reads now: a new slot's first watermark (-1 if the clock fails)."""
    try:
        return max(-1, int(clock()) // window_ns - 1)
    except Exception:  # an injected clock that fails: the slot starts with no watermark
        return -1


def _allocate(att: RankAttachment, key: SlotKey, flags: int, before: int = -1) -> int:
    """The descriptor index of ``key`` in ``att``, or -1 (drop mode) when there is no room, counted and reported,
    or the segment was removed. A new slot's watermark starts at ``before`` (the window before its first)."""
    if check_removed(att):
        return -1
    try:
        return att.allocate_stat(*key, flags=flags, before=before)
    except CapacityError as exc:
        full = "percentiles" if "percentile" in str(exc) else "stats"
        att.refuse_stat(key.name, full, str(exc))
        return -1
    except (SegmentError, OSError) as exc:  # the job lock cannot be taken (its file was replaced or removed)
        att.refuse_stat(key.name, "lock", f"the job lock cannot be taken ({exc})")
        return -1


def adopt(binding: SlotBinding, att: RankAttachment) -> None:
    """Make ``binding`` (inherited from the parent) the writer of its key in ``att``, a fresh slot of the child
    (or drop mode when there is no room)."""
    _inherited.pop((binding.job, binding.owner, binding.key), None)
    binding.att = att
    binding.index = _allocate(att, binding.key, binding.flags, _window_before(binding.clock, binding.window_ns))
    binding.hist0 = att.hist_offset(binding.index) if binding.index >= 0 else -1
    binding._gen = _generation[0]
    binding.last = WindowFigures()
    slot0, nan_w, disc_w, beat_w = binding._slot_words(att)
    binding._writer.rebind(slot0 * 8, att.incarnation, nan_w * 8, disc_w * 8, beat_w * 8, binding.hist0)
    binding._protect(att)
    att.writers[binding.key] = binding


def drop_inherited(binding: SlotBinding) -> None:
    """In a forked child that could not attach at all: keep ``binding`` on the parent's mapping, in drop mode
    (counted in its rank's entry there, which ``shmstat ls`` reads if the segment still exists)."""
    _inherited.pop((binding.job, binding.owner, binding.key), None)
    _drop_mode(binding)


def _drop_mode(binding: SlotBinding) -> None:
    """Put ``binding`` in drop mode on its attachment's mapping (counted in its rank's ``dropped``)."""
    binding.index = -1
    binding.hist0 = -1
    binding._gen = _generation[0]
    binding.last = WindowFigures()
    binding._writer.drop(binding.att.drop_offset)


_next_check = [0.0]  # time.monotonic() of the next check that the segment is still in /dev/shm


def check_removed(att: RankAttachment) -> bool:
    """Whether the job's segment was removed from /dev/shm (``shmstat clean``, by hand) while this process writes
    it and no collector still reads this mapping; the first time, every writer of this process goes to drop
    mode (samples counted in the orphaned mapping, as :func:`shmstat.stats` shows) and the process warns once.
    Costs one ``stat()``; callers run it at most once a second and when a Stat is created."""
    _next_check[0] = time.monotonic() + 1.0
    if att.gone:
        return True
    seg = att.segment
    if seg.inode < 0:
        return False
    from ..shm.runtime import segment_name
    from ..shm.segment import pid_alive

    try:
        if os.stat("/dev/shm" + segment_name(seg.job)).st_ino == seg.inode:
            return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        header = seg.header()
    except ValueError:  # unmapped: detached
        return False
    if header.collector_pid and pid_alive(header.collector_pid):
        return False  # a collector mapped it before the removal and still reads it
    att.gone = True
    for binding in list(att.writers.values()):
        if binding.att is att and binding.index >= 0:
            _drop_mode(binding)
    from ..job._degrade import warn_once_in_job

    # one warning per job: the flag is in the orphaned mapping every process that noticed shares, and passed on to
    # workers started later (which then do not make the segment again: shmstat.job.attach.ensure_init)
    warn_once_in_job("removed", f"the segment of job {seg.job!r} was removed from /dev/shm while the job runs; its "
                     "samples are dropped and counted (shmstat.stats()); restart the job to collect it", seg)
    return True


def binding_for(att: RankAttachment, key: SlotKey, window_ns: int, want_last: bool, clock: Clock,
                flags: int = 0) -> SlotBinding:
    """The writer of ``key`` in ``att``: the existing one, one inherited across a fork, or a new one; one per key
    however many threads ask at once."""
    found = att.writers.get(key)
    if found is not None and found._gen == _generation[0]:
        return found
    with _binding_lock:
        found = att.writers.get(key)  # again: another thread may have created it while this one waited
        if found is not None and found._gen == _generation[0]:
            return found
        inherited = _inherited.get((att.segment.job, att.owner_local_rank, key))
        if inherited is not None:
            adopt(inherited, att)
            return inherited
        return SlotBinding(att, key, window_ns, want_last, clock, flags)


def _after_fork_in_child() -> None:
    global _binding_lock
    _binding_lock = threading.RLock()  # a thread of the parent may have held it at the fork
    _generation[0] += 1
    _inherited.clear()
    for binding in list(_all):
        _inherited[(binding.job, binding.owner, binding.key)] = binding


os.register_at_fork(after_in_child=_after_fork_in_child)
