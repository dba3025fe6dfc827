"""Sections: named code ranges of a rank, timed into a Stat each, and the rank's phase word.

``with shmstat.section("forward"):`` (or ``@shmstat.section("forward")`` on a function) times the range into a
Stat of group :data:`SECTION_GROUP` named after the section (milliseconds; count, sum, mean, p50, p99, max over
windows of ``section_window_s``, 5 s unless ``shmstat.init(section_window_s=...)`` or
``SHMSTAT_SECTION_WINDOW_S`` says otherwise), merged and per rank on every sink like any Stat. ``wait=True``
declares a range where the rank waits for others (a collective, a barrier): its Stat carries the wait flag
(:data:`shmstat.shm.layout.FLAG_WAIT`) to the collector, which never scores it as a straggler.

Entering and leaving a section also writes the process's phase word in its entry of the segment (the innermost
open section, the depth, since when, the step counter: :mod:`shmstat.shm.phase`), so a collector sees what each
rank is doing even while it is stuck. Sections nest, per thread: each thread keeps its own stack of open
sections, and the phase word shows the section a thread last entered or returned to. A forked or spawned worker
writes its sections' samples for its rank (as every Stat does) and its phase word in its own writer entry.
Outside a job, sections are in-process Stats like any other (local windows, local handlers).

``cuda=True`` also records a CUDA event at enter and exit and resolves the pair later, without synchronising
(``Event.query()`` before ``elapsed_time``), into a ``<name>.gpu`` Stat; it is refused when CUDA is unavailable.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..aggregation import Aggregation
from ..errors import ConfigError
from ..job import _state
from ..job._state import check_window_s
from ..names import MAX_STAT_NAME_BYTES, check_name

__all__ = ["DEFAULT_SECTION_WINDOW_S", "SECTION_GROUP", "advance_step", "section", "section_window_s"]

SECTION_GROUP = "section"
"""The group of every section's Stat."""
DEFAULT_SECTION_WINDOW_S = 5.0
WINDOW_VARIABLE = "SHMSTAT_SECTION_WINDOW_S"
GPU_SUFFIX = ".gpu"
_AGGS = (Aggregation.COUNT, Aggregation.SUM, Aggregation.MEAN, Aggregation.P50, Aggregation.P99, Aggregation.MAX)
_PENDING_GPU = 4096  # CUDA event pairs kept unresolved at most (then the oldest is waited for: a slow GPU)

F = TypeVar("F", bound=Callable[..., Any])

_epoch = _state.SECTION_EPOCH
"""Bumped by init/shutdown/reset (:func:`shmstat.job._state.rebind_sections`) and in a forked child: each section
binds again to the process's current attachment (its Stat, its phase writer) on its next enter."""
_records: dict[tuple[str, bool], _Record] = {}
_records_lock = threading.Lock()


def section_window_s() -> float:
    """The window of section Stats: ``init(section_window_s=)``, else ``SHMSTAT_SECTION_WINDOW_S``, else 5 s."""
    chosen = _state.STATE.section_window_s
    if chosen is not None:
        return chosen
    env = os.environ.get(WINDOW_VARIABLE)
    return DEFAULT_SECTION_WINDOW_S if env is None else check_window_s(env, WINDOW_VARIABLE)


os.register_at_fork(after_in_child=_state.rebind_sections)
atexit.register(_records.clear)  # the section Stats close while the interpreter still runs


class _Record:
    """What one section name writes through in this process and epoch: its Stat and the phase word's id."""

    __slots__ = ("add", "cuda", "epoch", "gpu", "ident", "name", "phase", "stat", "wait")

    def __init__(self, name: str, wait: bool, cuda: bool) -> None:
        from .stat import Stat

        self.epoch = _epoch[0]
        self.name, self.wait, self.cuda = name, wait, cuda
        window = section_window_s()
        self.stat = Stat(name, _AGGS, window, group=SECTION_GROUP, wait=wait)
        self.add = self.stat.add
        index = getattr(self.stat._core, "index", -1)
        self.ident = index + 1 if index >= 0 else 0
        """The phase word's section id: 1 + the Stat's descriptor index in this process's entry (0: unnamed)."""
        self.phase = _phase_writer()
        self.gpu: _GpuTimer | None = _GpuTimer(name + GPU_SUFFIX, wait, window) if cuda else None


def _current(rec: _Record) -> _Record:
    """``rec`` if it is of this process and epoch, else this epoch's record of its section (a section left in a
    forked child, or after init/shutdown, writes the child's own phase word and slot)."""
    return rec if rec.epoch == _epoch[0] else _record(rec.name, rec.wait, rec.cuda)


def _record(name: str, wait: bool, cuda: bool) -> _Record:
    with _records_lock:
        rec = _records.get((name, wait))
        if rec is None or rec.epoch != _epoch[0] or (cuda and rec.gpu is None):
            rec = _records[(name, wait)] = _Record(name, wait, cuda or (rec is not None and rec.gpu is not None))
        return rec


class _Stack(threading.local):
    def __init__(self) -> None:
        self.open: list[tuple[_Record, int]] = []
        """This thread's open sections, innermost last: (record, monotonic ns at enter)."""


_stack = _Stack()
_mono = time.monotonic_ns


class section:
    """A named, timed code range: ``with section("forward"):`` or ``@section("forward")`` on a function.

    ``wait=True`` marks a range where the rank waits for others (a collective, a barrier): never scored as a
    straggler. ``cuda=True`` also times the range on the current CUDA stream into ``<name>.gpu`` (events resolved
    later, never synchronising); :class:`ConfigError` when CUDA is not available. ``name`` follows the name rule
    (:mod:`shmstat.names`); one object may be entered by several threads and recursively.
    """

    __slots__ = ("_cuda", "_name", "_rec", "_wait")

    def __init__(self, name: str, *, wait: bool = False, cuda: bool = False) -> None:
        limit = MAX_STAT_NAME_BYTES - len(GPU_SUFFIX) if cuda else MAX_STAT_NAME_BYTES
        self._name = check_name(name, "section name", limit)
        self._wait = bool(wait)
        self._cuda = bool(cuda)
        if cuda:
            _check_cuda(self._name)
        self._rec: _Record | None = None

    @property
    def name(self) -> str:
        """The section's name (its Stat's)."""
        return self._name

    @property
    def wait(self) -> bool:
        """Whether this is a wait section."""
        return self._wait

    def __repr__(self) -> str:
        return f"section({self._name!r}, wait={self._wait}, cuda={self._cuda})"

    def __enter__(self) -> section:
        rec = self._rec
        if rec is None or rec.epoch != _epoch[0]:
            rec = self._rec = _record(self._name, self._wait, self._cuda)
        opened = _stack.open
        t = _mono()
        opened.append((rec, t))
        rec.phase.enter(rec.ident, len(opened), t)
        if rec.gpu is not None:
            rec.gpu.start()
        return self

    def __exit__(self, *exc: object) -> None:
        t = _mono()
        opened = _stack.open
        if not opened:
            return  # entered in another process (a fork inside the section): nothing of it is ours
        rec, t0 = opened.pop()
        if rec.epoch != _epoch[0]:
            rec = _current(rec)
        rec.add((t - t0) / 1e6)
        if opened:
            parent, since = opened[-1]
            rec.phase.enter(_current(parent).ident, len(opened), since)
        else:
            rec.phase.enter(0, 0, t)
        if rec.gpu is not None:
            rec.gpu.stop()

    def _open(self) -> tuple[list[tuple[_Record, int]], tuple[_Record, int]]:
        """Enter without a ``with``: for hooks whose exit may come in another thread or out of order (the token
        goes to :meth:`_close`)."""
        rec = self._rec
        if rec is None or rec.epoch != _epoch[0]:
            rec = self._rec = _record(self._name, self._wait, self._cuda)
        opened = _stack.open
        entry = (rec, _mono())
        opened.append(entry)
        rec.phase.enter(rec.ident, len(opened), entry[1])
        return opened, entry

    def _close(self, token: tuple[list[tuple[_Record, int]], tuple[_Record, int]], count: bool = True) -> None:
        """Leave what :meth:`_open` entered (from any thread): its duration is added (unless ``count`` is false),
        and the phase word goes back to what is open on top of the thread that entered it."""
        t = _mono()
        opened, (rec, t0) = token
        for i in range(len(opened) - 1, -1, -1):
            if opened[i] is token[1]:
                del opened[i]
                break
        else:
            return  # closed already
        rec = _current(rec)
        if count:
            rec.add((t - t0) / 1e6)
        if opened:
            parent, since = opened[-1]
            rec.phase.enter(_current(parent).ident, len(opened), since)
        else:
            rec.phase.enter(0, 0, t)

    def __call__(self, fn: F) -> F:
        """Decorate a function: each call runs inside this section."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return cast(F, timed)


def advance_step() -> None:
    """Count one training step in this process's phase word (``shmstat.torch.instrument`` calls it after each
    optimizer step); a collector tells a rank that makes progress from a stuck one by it."""
    _phase_writer().step()


def _phase_writer() -> Any:
    """This process's phase writer (a no-op one when it holds no entry of a job)."""
    from ..job.attach import ensure_init
    from ..shm.phase import phase_writer

    att = ensure_init()
    if att is None or not att.has_entry:
        return phase_writer(None, None)
    return phase_writer(att.segment, att.local_rank)


def _check_cuda(name: str) -> None:
    try:
        import torch
    except ImportError:
        raise ConfigError(f"section {name!r} asks for cuda=True but torch is not installed") from None
    if not torch.cuda.is_available():
        raise ConfigError(f"section {name!r} asks for cuda=True but CUDA is not available")


class _GpuTimer:
    """CUDA events around a section, resolved without synchronising: each exit adds the pairs whose end event
    has completed (``query()``) to the ``<name>.gpu`` Stat; the rest wait for a later exit."""

    def __init__(self, name: str, wait: bool, window_s: float) -> None:
        import torch

        from .stat import Stat

        self._torch = torch
        self._stat = Stat(name, _AGGS, window_s, group=SECTION_GROUP, wait=wait)
        self._open: list[Any] = []
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Record the start event on the current stream."""
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        with self._lock:
            self._open.append(ev)

    def stop(self) -> None:
        """Record the end event, then resolve the pairs that completed."""
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        with self._lock:
            if not self._open:
                return
            self._pending.append((self._open.pop(), ev))
            if len(self._pending) > _PENDING_GPU:
                start, end = self._pending.popleft()
                end.synchronize()
                self._stat.add(start.elapsed_time(end))
            while self._pending and self._pending[0][1].query():
                start, end = self._pending.popleft()
                self._stat.add(start.elapsed_time(end))
