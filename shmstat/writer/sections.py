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

The C path (``shmstat._fastpath``: ``SectionCore``, the base of :class:`section`, and ``PhaseWriter``) enters and
leaves a section without running Python code: it reads the clock, keeps the thread's stack, writes the phase word
(the bytes :class:`shmstat.shm.phase.PhaseWriter` writes; the GIL serialises the threads, so no lock) and adds the
duration through the Stat's C ``SlotWriter``; a decorated function is a C ``SectionFunction`` that runs the same
enter and exit around each call. What it does not take (``cuda=True``, a section bound in an earlier
epoch, a Stat on the Python writer) runs in ``_enter_py``/``_exit_py``, the pure-Python twin, which is all that runs
on the pure-Python backend (:mod:`shmstat._backend`).

``cuda=True`` also records a CUDA event at enter and exit and resolves the pair later, without synchronising
(``Event.query()`` before ``elapsed_time``), into a ``<name>.gpu`` Stat; it is refused when CUDA is unavailable.
"""

from __future__ import annotations

import atexit
import collections
import functools
import inspect
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar, cast

from .._backend import backend
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

_fast: Any = backend() if backend().SectionCore is not None else None
"""The C backend when it has the section types (the C path runs), else None."""
_RecordBase: Any = object if _fast is None else _fast.RecordCore
_SectionBase: Any = object if _fast is None else _fast.SectionCore

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
if _fast is not None:
    _fast.section_epoch(_epoch)
atexit.register(_records.clear)  # the section Stats close while the interpreter still runs


class _Record(_RecordBase):
    """What one section name writes through in this process and epoch: its Stat and the phase word's id (on the C
    path, also bound into its C base: the Stat's C writer, the C phase writer)."""

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
        if _fast is not None:
            writer = getattr(self.add, "__self__", None)  # the bound add of the Stat's writer
            c_writer = writer if type(writer) is _fast.SlotWriter and self.gpu is None else None
            c_phase = self.phase if type(self.phase) is _fast.PhaseWriter else None
            self._bind_c(c_writer, c_phase, self.ident, self.epoch)


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


class _PyStack:
    """A thread's open sections, innermost last: (record, monotonic ns at enter), each with an id (the pure-Python
    twin of ``shmstat._fastpath.Stack``)."""

    __slots__ = ("_ids", "_open")

    def __init__(self) -> None:
        self._open: list[tuple[_Record, int, int]] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._open)

    def push(self, rec: _Record, mono_ns: int) -> int:
        """Open an entry; its id."""
        ident = next(self._ids)
        self._open.append((rec, mono_ns, ident))
        return ident

    def remove(self, ident: int) -> tuple[_Record, int] | None:
        """Remove the entry ``ident``: (record, mono_ns), or None when it is not open (closed already)."""
        opened = self._open
        for i in range(len(opened) - 1, -1, -1):
            if opened[i][2] == ident:
                rec, t0, _ = opened.pop(i)
                return rec, t0
        return None

    def pop(self) -> tuple[_Record, int] | None:
        """Remove the innermost entry: (record, mono_ns), or None when none is open."""
        if not self._open:
            return None
        rec, t0, _ = self._open.pop()
        return rec, t0

    def top(self) -> tuple[_Record, int] | None:
        """The innermost entry, or None."""
        if not self._open:
            return None
        rec, t0, _ = self._open[-1]
        return rec, t0


class _PyStacks(threading.local):
    def __init__(self) -> None:
        self.stack = _PyStack()


_py_stacks = _PyStacks()


def _py_thread_stack() -> _PyStack:
    return _py_stacks.stack


_thread_stack: Callable[[], Any] = _py_thread_stack if _fast is None else _fast.thread_stack
"""This thread's stack of open sections (the C one on the C path: the C enter and exit keep it)."""
_mono = time.monotonic_ns


class section(_SectionBase):
    """A named, timed code range: ``with section("forward"):`` or ``@section("forward")`` on a function.

    ``wait=True`` marks a range where the rank waits for others (a collective, a barrier): never scored as a
    straggler. ``cuda=True`` also times the range on the current CUDA stream into ``<name>.gpu`` (events resolved
    later, never synchronising); :class:`ConfigError` when CUDA is not available. ``name`` follows the name rule
    (:mod:`shmstat.names`); one object may be entered by several threads and recursively.
    """

    # on the C path, _rec is the C base's
    __slots__ = ("_cuda", "_name", "_wait") if _fast is not None else ("_cuda", "_name", "_rec", "_wait")

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

    def _bound(self) -> _Record:
        rec = self._rec
        if rec is None or rec.epoch != _epoch[0]:
            rec = self._rec = _record(self._name, self._wait, self._cuda)
        return rec

    def _enter_py(self) -> section:
        """``__enter__`` in Python: all of it on the pure-Python path, what the C one hands over on the C path."""
        rec = self._bound()
        opened = _thread_stack()
        t = _mono()
        opened.push(rec, t)
        rec.phase.enter(rec.ident, len(opened), t)
        if rec.gpu is not None:
            rec.gpu.start()
        return self

    def _exit_py(self, *exc: object) -> None:
        """``__exit__`` in Python (see :meth:`_enter_py`)."""
        t = _mono()
        opened = _thread_stack()
        entry = opened.pop()
        if entry is None:
            return  # entered in another process (a fork inside the section): nothing of it is ours
        self._left(opened, entry, t, True)
        rec = entry[0]
        if rec.gpu is not None:
            rec.gpu.stop()

    if _fast is None:
        __enter__ = _enter_py
        __exit__ = _exit_py

    @staticmethod
    def _left(opened: Any, entry: tuple[_Record, int], t: int, count: bool) -> None:
        """After ``entry`` left ``opened``: its duration added (when ``count``), the phase word back to what is
        open on top of ``opened``."""
        rec, t0 = entry
        rec = _current(rec)
        if count:
            rec.add((t - t0) / 1e6)
        top = opened.top()
        if top is not None:
            parent, since = top
            rec.phase.enter(_current(parent).ident, len(opened), since)
        else:
            rec.phase.enter(0, 0, t)

    def _open(self) -> tuple[Any, int]:
        """Enter without a ``with``: for hooks whose exit may come in another thread or out of order (the token
        goes to :meth:`_close`)."""
        rec = self._bound()
        opened = _thread_stack()
        t = _mono()
        ident = opened.push(rec, t)
        rec.phase.enter(rec.ident, len(opened), t)
        return opened, ident

    def _close(self, token: tuple[Any, int], count: bool = True) -> None:
        """Leave what :meth:`_open` entered (from any thread): its duration is added (unless ``count`` is false),
        and the phase word goes back to what is open on top of the thread that entered it."""
        t = _mono()
        opened, ident = token
        entry = opened.remove(ident)
        if entry is None:
            return  # closed already
        self._left(opened, entry, t, count)

    def __call__(self, fn: F) -> F:
        """Decorate a function: each call runs inside this section; a generator function's generator runs each of
        its steps inside it (each item it yields is one sample: a data loader's batch; its end is none), a
        coroutine function's coroutine from its start to its result (the awaits included: left by token, as other
        coroutines of the thread enter and leave sections meanwhile)."""
        if inspect.isgeneratorfunction(fn):
            return cast(F, self._generator(fn))
        if inspect.iscoroutinefunction(fn):
            return cast(F, self._coroutine(fn))
        if _fast is not None:  # the C wrapper: enter, the call, exit, no frame or ``with`` of its own
            return cast(F, functools.update_wrapper(_fast.SectionFunction(self, fn), fn))

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return cast(F, timed)

    def _generator(self, fn: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Generator[Any, Any, Any]]:
        """``fn``'s generators, each step (to its next item, or its end) inside this section."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            inner = fn(*args, **kwargs)
            sent: Any = None
            thrown: BaseException | None = None
            while True:
                token = self._open()
                try:
                    item = inner.throw(thrown) if thrown is not None else inner.send(sent)
                except StopIteration as end:  # its end is no item: not a sample
                    self._close(token, count=False)
                    return end.value
                except BaseException:
                    self._close(token)
                    raise
                self._close(token)
                sent, thrown = None, None
                try:
                    sent = yield item
                except GeneratorExit:
                    inner.close()
                    raise
                except BaseException as error:  # thrown in by the caller: passed on to the inner generator
                    thrown = error

        return timed

    def _coroutine(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
        """``fn``'s coroutines, from their start to their result, inside this section."""

        @functools.wraps(fn)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            token = self._open()
            try:
                return await fn(*args, **kwargs)
            finally:
                self._close(token)

        return timed


def advance_step() -> None:
    """Count one training step in this process's phase word (``shmstat.torch.instrument`` calls it after each
    optimizer step); a collector tells a rank that makes progress from a stuck one by it."""
    _phase_writer().step()


_c_phase: list[Any] = []  # [the C phase writer of this process's entry] (the C path)
_c_phase_lock = threading.Lock()


def _phase_writer() -> Any:
    """This process's phase writer (a no-op one when it holds no entry of a job): on the C path the C twin of
    :class:`shmstat.shm.phase.PhaseWriter` (one writer per entry and process: the two are never mixed)."""
    from ..job.attach import ensure_init
    from ..shm.phase import phase_writer

    att = ensure_init()
    if att is None or not att.has_entry:
        return phase_writer(None, None)
    if _fast is None:
        return phase_writer(att.segment, att.local_rank)
    segment, local_rank = att.segment, att.local_rank
    with _c_phase_lock:
        if _c_phase:
            writer, seg, lr = _c_phase[0]
            if writer.pid == os.getpid() and seg is segment and lr == local_rank:
                return writer
        writer = _fast.PhaseWriter(segment.buf, segment.geometry.rank_offset(local_rank))
        _c_phase[:] = [(writer, segment, local_rank)]
        return writer


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
