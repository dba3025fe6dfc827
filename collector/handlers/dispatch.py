"""Which handler serves each group (:class:`Dispatcher`, the routing table), and handlers off the scanning loop
(:class:`ThreadedDispatcher`): each handler runs in a thread of its own, fed through a bounded queue.

Every handler here is a :class:`collector.handlers.protocol.ColumnsHandler` (anything else was wrapped when it
was built): a pass reaches it as columns (``emit_columns``), a metric outside windows through ``emit``, and
nothing is looked up per call. A slow or stuck handler delays only the groups it serves: the loop never waits
for a handler. Each pass ends with a flush marker; :meth:`ThreadedDispatcher.flush` returns a :class:`PassTaken`
ticket that says when every handler has reached it, which is when the collector commits the pass's watermark
(:mod:`collector.daemon.commits`). A handler's queue holds at most ``handler_queue`` rows (default 100,000:
a row, one window of one stat merged or of one rank, is ~200 bytes as columns; a metric outside windows counts
as one row). A pass counts as its number of rows and is cut at the bound: its first rows are queued, the rest
dropped, counted (``dropped``, and per group) and warned about once.

The dispatcher is a consumer of every collector pass (:class:`collector.read.passes.PassConsumer`, on the loop:
taking a pass only queues it): :meth:`ThreadedDispatcher.take` queues the pass's windows, its put metrics, the
collector's own points and its straggler lines (after the windows, on the same handler's thread) for the
handlers of their groups.

Closing gives every handler a bounded time to finish (``close_budget_s`` in all); a handler still stuck then
is left behind (its thread is a daemon), so SIGTERM always ends the collector within a few seconds.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from elastic.metrics import MetricData, MetricHandler
from shmstat.names import COLLECTOR_GROUP

from .console import CompactWindowHandler
from .protocol import ColumnsHandler, RowsFailed, as_columns_handler
from .specs import build_handler

if TYPE_CHECKING:
    from ..read.columns import Columns
    from ..read.passes import Flag, Pass, Wanted

__all__ = ["DEFAULT_HANDLER_QUEUE", "Dispatcher", "PassTaken", "ThreadedDispatcher", "plan_pass"]

_log = logging.getLogger("shmstat.collector")

DEFAULT_HANDLER_QUEUE = 100_000
"""Rows queued per handler at most before new ones are dropped (and counted)."""

_FLUSH, _BARRIER, _STOP = object(), object(), object()


class Dispatcher:
    """Which handler serves each group (or the default): the routing table. Each handler is held as the collector
    calls it, a :class:`~collector.handlers.protocol.ColumnsHandler` (a torchelastic handler given here is wrapped
    once, :func:`~collector.handlers.protocol.as_columns_handler`; one object serving several groups is wrapped
    once for all). Handlers are called only by :class:`ThreadedDispatcher`, each in a
    thread of its own."""

    def __init__(self, handlers: Mapping[str, MetricHandler], default: MetricHandler | None = None) -> None:
        self._wrapped: dict[int, ColumnsHandler] = {}
        self.handlers: dict[str, ColumnsHandler] = {}
        self.default: ColumnsHandler = CompactWindowHandler()
        given = dict(handlers)
        star = given.pop("*", None)
        chosen = default if default is not None else star
        if chosen is not None:
            self.bind("*", chosen)
        for group, handler in given.items():
            self.bind(group, handler)

    @classmethod
    def from_specs(cls, specs: dict[str, str]) -> Dispatcher:
        """Build every handler named in ``{group: spec}`` (``*`` = default)."""
        built = {group: build_handler(spec) for group, spec in specs.items()}
        default = built.pop("*", None)
        return cls(built, default)

    def bind(self, group: str, handler: MetricHandler) -> ColumnsHandler:
        """Serve ``group`` (``*``: the default) with ``handler``; returns it as the collector calls it."""
        wrapped = self._wrapped.get(id(handler))
        if wrapped is None:
            wrapped = self._wrapped[id(handler)] = as_columns_handler(handler)
            self._wrapped[id(wrapped)] = wrapped
        if group == "*":
            self.default = wrapped
        else:
            self.handlers[group] = wrapped
        return wrapped

    def handler_for(self, group: str) -> ColumnsHandler:
        """The handler that receives metrics of ``group``."""
        return self.handlers.get(group, self.default)

    def discards(self, group: str) -> bool:
        """Whether ``group``'s handler throws everything away (a null handler: its ``discards``): the collector
        then builds no metric for it."""
        return self.handlers.get(group, self.default).discards

    def discards_points(self, group: str) -> bool:
        """Whether ``group``'s handler has no use for metrics that belong to no window (put by ranks, ``@prof``):
        it :meth:`discards` everything, or says so with ``takes_points = False`` (the compact handler)."""
        handler = self.handlers.get(group, self.default)
        return handler.discards or not handler.takes_points

    def all_handlers(self) -> list[ColumnsHandler]:
        """Every distinct handler, default included."""
        seen: dict[int, ColumnsHandler] = {id(self.default): self.default}
        for h in self.handlers.values():
            seen.setdefault(id(h), h)
        return list(seen.values())


class _Pass(NamedTuple):
    """A pass queued whole for a handler's ``emit_columns``."""

    columns: Columns


class _Say(NamedTuple):
    """A straggler line queued for a handler's ``say_straggler``."""

    flag: Flag


def plan_pass(handler_for: Callable[[str], ColumnsHandler], columns: Columns) -> list[tuple[ColumnsHandler, Columns]]:
    """How one pass reaches its handlers: ``(handler, its rows)`` per handler serving a group present; groups
    whose handler :attr:`~collector.handlers.protocol.ColumnsHandler.discards` everything get nothing."""
    groups = columns.groups() if len(columns) else []
    served: dict[int, tuple[ColumnsHandler, list[str]]] = {}
    for group in groups:
        handler = handler_for(group)
        if not handler.discards:
            served.setdefault(id(handler), (handler, []))[1].append(group)
    return [(handler, columns if len(mine) == len(groups) else columns.of_groups(set(mine)))
            for handler, mine in served.values()]


class PassTaken:
    """Whether every handler has taken what was queued for it up to one :meth:`ThreadedDispatcher.flush`: its
    ``emit_columns``/``emit`` returned (or raised: counted in ``errors``) and its ``flush`` ran. Rows dropped for a
    handler whose queue was full (counted in ``dropped``) are taken as far as this ticket is concerned."""

    def __init__(self, waits: list[tuple[ColumnsHandler, threading.Event]]) -> None:
        self._waits = waits

    @property
    def done(self) -> bool:
        """Every handler took the pass."""
        return all(event.is_set() for _, event in self._waits)

    def waiting(self) -> list[ColumnsHandler]:
        """The handlers that have not taken it yet."""
        return [handler for handler, event in self._waits if not event.is_set()]

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every handler to take the pass; whether they all did."""
        deadline = time.monotonic() + timeout_s
        return all(event.wait(max(0.0, deadline - time.monotonic())) for _, event in self._waits)


class _Worker:
    """One handler's thread and queue."""

    def __init__(self, handler: ColumnsHandler, limit: int, owner: ThreadedDispatcher) -> None:
        self.handler = handler
        self.limit = limit
        self.owner = owner
        self.queue: collections.deque[Any] = collections.deque()
        self.rows = 0  # rows in the queue
        self.cond = threading.Condition()
        self.emitted = 0
        self.errors = 0
        self.busy_since = 0.0  # monotonic time the current emit started (0: idle)
        self._warned: set[type] = set()
        self.thread = threading.Thread(target=self._run, name=f"shmstat-handler-{type(handler).__name__}",
                                       daemon=True)
        self.thread.start()

    def put(self, group: str, rows: Sequence[Any]) -> int:
        """Queue ``rows`` of ``group``; returns how many did not fit (dropped)."""
        with self.cond:
            room = self.limit - self.rows
            take = rows if len(rows) <= room else rows[: max(0, room)]
            if take:
                self.queue.append((group, take, len(take)))
                self.rows += len(take)
                self.cond.notify()
        return len(rows) - len(take)

    def put_columns(self, columns: Columns) -> Columns | None:
        """Queue a pass; returns the rows that did not fit (dropped), or None."""
        n = len(columns)
        with self.cond:
            room = max(0, self.limit - self.rows)
            take = n if n <= room else room
            if take:
                self.queue.append((columns.job, _Pass(columns if take == n else columns.take(slice(0, take))), take))
                self.rows += take
                self.cond.notify()
        return columns.take(slice(take, n)) if take < n else None

    def say(self, job: str, flag: Flag) -> None:
        """Queue a straggler line (after what was queued before: the rows of the pass that found it)."""
        with self.cond:
            self.queue.append((job, _Say(flag), 0))
            self.cond.notify()

    def control(self, marker: Any) -> threading.Event:
        """Queue a control marker (flush, barrier, stop); the event is set once the worker reached it."""
        done = threading.Event()
        with self.cond:
            self.queue.append((marker, done, 0))
            self.cond.notify()
        return done

    def _run(self) -> None:
        handler = self.handler
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                first, second, rows = self.queue.popleft()
                self.rows -= rows
            if first is _FLUSH or first is _BARRIER or first is _STOP:
                if first is _FLUSH:
                    self._call(handler.flush, "flush")
                second.set()
                if first is _STOP:
                    return
                continue
            self.busy_since = time.monotonic()
            if type(second) is _Pass:
                if self._call(handler.emit_columns, f"(pass of job {first})", second.columns):
                    self.emitted += rows
            elif type(second) is _Say:
                self._call(handler.say_straggler, f"(straggler line of job {first})", second.flag.name, first,
                           second.flag.data)
            else:
                for metric in second:
                    if self._call(handler.emit, first, metric):
                        self.emitted += 1
            self.busy_since = 0.0

    def _call(self, fn: Callable[..., object], group: str, *args: Any) -> bool:
        """Call ``fn``; whether what it was given counts as taken (not when it raised, except
        :class:`RowsFailed`, whose rows were all offered and whose failures are counted one by one)."""
        try:
            fn(*args)
            return True
        except RowsFailed as failed:  # a wrapped torchelastic handler: every row was offered, some raised
            self._count_error(failed.failures, failed.first, group)
            return True
        except Exception as exc:  # a user's handler may raise anything; the others must still run
            self._count_error(1, exc, group)
            return False

    def _count_error(self, n: int, exc: Exception, group: str) -> None:
        self.errors += n
        if type(exc) not in self._warned:
            self._warned.add(type(exc))
            _log.error("handler %r for group %r raised %r (counted; further ones not logged)",
                       self.handler, group, exc)


class ThreadedDispatcher:
    """Routes metrics to their group's handler (as :class:`Dispatcher`), each handler in a thread of its own; a
    consumer of every collector pass (:meth:`take`)."""

    on_loop = True
    """Taking a pass only queues it (:class:`collector.read.passes.PassConsumer`)."""
    own_group = COLLECTOR_GROUP
    """The group the collector's own points (its usage figures, the straggler scores) are dispatched to."""

    def __init__(self, inner: Dispatcher, *, handler_queue: int = DEFAULT_HANDLER_QUEUE,
                 close_budget_s: float = 2.0) -> None:
        self.inner = inner
        self.handler_queue = handler_queue
        self.close_budget_s = close_budget_s
        self.dropped = 0
        self.dropped_by_group: dict[str, int] = collections.defaultdict(int)
        self._workers: dict[int, _Worker] = {}
        self._warned_full: set[int] = set()
        self._closed = False

    def _worker(self, handler: ColumnsHandler) -> _Worker:
        worker = self._workers.get(id(handler))
        if worker is None:
            worker = self._workers[id(handler)] = _Worker(handler, self.handler_queue, self)
        return worker

    @property
    def errors(self) -> int:
        """Exceptions raised by handlers (counted, logged once per handler and type)."""
        return sum(w.errors for w in self._workers.values())

    @property
    def emitted(self) -> int:
        """Rows (of passes) and metrics (outside windows) handlers took without raising."""
        return sum(w.emitted for w in self._workers.values())

    def discards(self, group: str) -> bool:
        """Whether ``group``'s handler throws everything away (see :meth:`Dispatcher.discards`)."""
        return self.inner.discards(group)

    def discards_points(self, group: str) -> bool:
        """Whether ``group``'s handler has no use for metrics outside windows (:meth:`Dispatcher.discards_points`)."""
        return self.inner.discards_points(group)

    def handler_for(self, group: str) -> ColumnsHandler:
        """The handler that receives metrics of ``group``."""
        return self.inner.handler_for(group)

    def wants(self, group: str, what: Wanted) -> bool:
        """Whether ``group``'s handler has a use for its windows (:meth:`discards`) or its points, put or the
        collector's (:meth:`discards_points`)."""
        return not (self.discards(group) if what == "windows" else self.discards_points(group))

    def says_stragglers(self) -> bool:
        """Whether a handler prints straggler lines (then every pass is scored for it)."""
        return any(h.says_stragglers for h in self.inner.all_handlers())

    def take(self, pass_: Pass) -> None:
        """Queue one pass for the handlers: its windows (:meth:`emit_columns`), its put metrics and the
        collector's own points (:meth:`emit_points`, each group's to its handler unless it has no use for them),
        then its straggler lines, each to the handler of the flagged stat's group if it says them, after the
        pass's windows on that handler's thread."""
        if pass_.columns is not None:
            self.emit_columns(pass_.columns)
        for put in pass_.puts:
            group = put.metric.group_name
            if not self.discards_points(group):
                self.emit_points(group, [put.metric])
        own = self.own_group
        if pass_.usage:
            self.emit_points(own, pass_.usage)
        if pass_.scores and not self.discards(own):
            self.emit_points(own, [s.metric(own, pass_.job) for s in pass_.scores])
        for flag in pass_.flags:
            handler = self.inner.handler_for(str(flag.data["group"]))
            if handler.says_stragglers and not self._closed:
                self._worker(handler).say(pass_.job, flag)

    def emit_points(self, group: str, metrics: Sequence[MetricData]) -> None:
        """Queue metrics of one ``group`` that belong to no window (put by ranks, the collector's own figures)
        for its handler's ``emit`` (never blocks; past the bound they are dropped and counted)."""
        if metrics and not self._closed:
            self._queue(group, self.inner.handler_for(group), metrics)

    def emit_columns(self, columns: Columns) -> None:
        """Queue one pass for the handlers of its groups, each its own selection of the rows, for its
        ``emit_columns`` (never blocks; past a handler's bound rows are dropped and counted per group)."""
        if self._closed:
            return
        for handler, part in plan_pass(self.inner.handler_for, columns):
            lost = self._worker(handler).put_columns(part)
            if lost is not None:
                groups, counts = np.unique(lost.group.astype(str), return_counts=True)
                for group, n in zip(groups.tolist(), counts.tolist(), strict=True):
                    self._count_lost(handler, group, n)

    def _queue(self, group: str, handler: ColumnsHandler, rows: Sequence[Any]) -> None:
        lost = self._worker(handler).put(group, rows)
        if lost:
            self._count_lost(handler, group, lost)

    def _count_lost(self, handler: ColumnsHandler, group: str, lost: int) -> None:
        if lost:
            self.dropped += lost
            self.dropped_by_group[group] += lost
            if id(handler) not in self._warned_full:
                self._warned_full.add(id(handler))
                _log.warning("handler %r (group %r) does not keep up: its queue of %d rows is full; rows for it "
                             "are dropped and counted in collector.handler_dropped", handler, group,
                             self.handler_queue)

    def flush(self) -> PassTaken:
        """Ask every handler to flush once it has taken what was queued before (does not wait); the ticket
        returned says when each has (what the collector waits for before it commits a pass's watermark)."""
        if self._closed:  # the handlers' threads stopped: nothing more reaches them
            return PassTaken([])
        return PassTaken([(w.handler, w.control(_FLUSH)) for w in list(self._workers.values())])

    def wait(self, timeout_s: float = 10.0) -> bool:
        """Wait until every handler has taken what was queued before this call; False on timeout."""
        deadline = time.monotonic() + timeout_s
        events = [w.control(_BARRIER) for w in list(self._workers.values())]
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def stuck(self, after_s: float) -> list[ColumnsHandler]:
        """Handlers busy in one call for longer than ``after_s`` seconds."""
        now = time.monotonic()
        return [w.handler for w in self._workers.values() if w.busy_since and now - w.busy_since > after_s]

    def close(self) -> None:
        """Flush, let every handler finish what is queued within the close budget, then close the handlers
        that finished; a handler still busy after the budget is left behind (counted as stuck, logged)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.close_budget_s
        stops = [(w, w.control(_FLUSH), w.control(_STOP)) for w in list(self._workers.values())]
        for worker, _flushed, stopped in stops:
            if not stopped.wait(max(0.0, deadline - time.monotonic())):
                _log.warning("handler %r did not finish within %.1f s of shutdown; leaving it behind",
                             worker.handler, self.close_budget_s)
                continue
            worker._call(worker.handler.close, "close")
        for handler in self.inner.all_handlers():  # handlers that never got a row: close them too
            if id(handler) not in self._workers:
                with contextlib.suppress(Exception):  # same policy as emit
                    handler.close()
