"""The one way the collector calls a handler: :class:`ColumnsHandler`, and :func:`as_columns_handler` for the rest.

Every handler the collector's dispatcher (:mod:`collector.handlers.dispatch`) holds is a :class:`ColumnsHandler`,
and it calls only these, each from the handler's own thread:

- ``emit_columns(columns)``: each collector pass of one job, the rows of the groups the handler serves, as one
  :class:`collector.read.columns.Columns` (arrays per figure, merged across ranks by the one merge,
  :func:`collector.read.columns.merge_parts`);
- ``emit(metric_data)``: each metric that belongs to no window (put by ranks, ``@prof``, the collector's own
  figures), torchelastic's signature;
- ``flush()``: once per pass, after its rows: the pass counts as taken when it returns (a no-op unless overridden);
- ``close()``: once, when the collector stops (a no-op unless overridden).

- ``say_straggler(name, job, data)``: a straggler flagged or recovered, after the rows of the pass that found it,
  only for a handler that :attr:`~ColumnsHandler.says_stragglers` (a console handler: :class:`StragglerLines`).

Two attributes say what the dispatcher need not build for a handler: :attr:`ColumnsHandler.takes_points` (False:
no metric outside windows) and :attr:`ColumnsHandler.discards` (True: nothing at all).

Anything else is wrapped once, when it is built (:func:`as_columns_handler`, which the spec parser and the
dispatcher's constructor call), never looked at again per call:

- a torchelastic :class:`elastic.metrics.MetricHandler` (``console``, ``null``, a user's class with only ``emit``)
  becomes a :class:`RowsAdapter`: each pass is turned into one
  :class:`elastic.metrics.StatMetricData` per aggregation (``<stat>.<aggregation>``, merged and per rank,
  :meth:`Columns.to_metrics <collector.read.columns.Columns.to_metrics>`), in the handler's thread, off the
  scan loop;
- a user's ``MetricHandler`` subclass that defines ``emit_columns`` without subclassing :class:`ColumnsHandler`
  becomes a :class:`ColumnsAdapter`, which calls its ``emit_columns`` and adds the ``flush``/``close`` it lacks.

:class:`AgentMetricData` is the one record of metrics a handler may tell apart: the agent's own metrics.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic.metrics import MetricData, MetricHandler, NullMetricHandler, StatMetricData

if TYPE_CHECKING:
    from ..read.columns import Columns

__all__ = ["AgentMetricData", "ColumnsAdapter", "ColumnsHandler", "RowsAdapter", "RowsFailed", "StragglerLines",
           "as_columns_handler"]

EventData = dict[str, str | int | float | bool]


class StragglerLines:
    """A console handler that also prints a line when the collector flags a straggler (``shmstat.straggler``) or
    sees one recover (``shmstat.straggler.recovered``): the collector scores ranks for it even when nobody asked
    for scores or subscribed to those events. Its :meth:`say_straggler` is called on the handler's own thread,
    after the rows of the pass that found the straggler."""

    says_stragglers: bool = True
    """Straggler lines are this handler's business (see :meth:`ColumnsHandler.say_straggler`)."""

    def say_straggler(self, name: str, job: str, data: EventData) -> None:
        """Print the line of straggler event ``name`` of ``job`` (its ``data`` as published)."""
        raise NotImplementedError


class ColumnsHandler(MetricHandler):
    """A collector handler: takes each pass as columns (:meth:`emit_columns`) and each metric outside windows as
    torchelastic's :meth:`emit`; :meth:`flush` and :meth:`close` are optional (no-ops here). Subclass it to
    write a handler the collector calls with no adapter in between."""

    takes_points: bool = True
    """Whether the handler wants metrics that belong to no window (put by ranks, ``@prof``, the collector's
    own); False spares the collector decoding them for it."""

    discards: bool = False
    """Whether the handler throws everything away (a null handler): the collector then builds nothing for its
    groups."""

    says_stragglers: bool = False
    """Whether the handler prints straggler lines (:meth:`say_straggler`; :class:`StragglerLines` sets it)."""

    @abc.abstractmethod
    def emit_columns(self, columns: Columns) -> None:
        """Take one pass of one job (``columns.job``): the rows of the groups this handler serves."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None:
        """Take one metric that belongs to no window."""

    def say_straggler(self, name: str, job: str, data: EventData) -> None:
        """Say straggler event ``name`` of ``job`` (called only when :attr:`says_stragglers`); does nothing here."""

    def flush(self) -> None:
        """Make what this pass gave durable (called once per pass, after its rows); does nothing here."""

    def close(self) -> None:
        """Release what the handler holds (called once, at shutdown); does nothing here."""


class RowsFailed(Exception):
    """Some rows of a pass raised in a wrapped handler's ``emit`` (the other rows of the pass were still given
    to it): ``failures`` calls raised, the first with ``first``."""

    def __init__(self, handler: MetricHandler, failures: int, first: Exception) -> None:
        super().__init__(f"{failures} of the rows raised in {handler!r}, the first {first!r}")
        self.failures = failures
        self.first = first


class _Wrapped(ColumnsHandler):
    """What both adapters share: the wrapped handler, its ``emit`` for metrics outside windows, and its own
    ``flush``/``close`` when its class defines them (looked up once, here)."""

    def __init__(self, handler: MetricHandler) -> None:
        self.handler = handler
        """The wrapped handler (the user's object)."""
        self.takes_points = getattr(handler, "takes_points", True) is not False
        self.says_stragglers = isinstance(handler, StragglerLines)
        self._flush: Callable[[], object] | None = _method(handler, "flush")
        self._close: Callable[[], object] | None = _method(handler, "close")

    def emit(self, metric_data: MetricData) -> None:
        """The wrapped handler's ``emit``."""
        self.handler.emit(metric_data)

    def say_straggler(self, name: str, job: str, data: EventData) -> None:
        """The wrapped handler's ``say_straggler`` (a :class:`StragglerLines`)."""
        if isinstance(self.handler, StragglerLines):
            self.handler.say_straggler(name, job, data)

    def flush(self) -> None:
        """The wrapped handler's ``flush``, if its class has one."""
        if self._flush is not None:
            self._flush()

    def close(self) -> None:
        """The wrapped handler's ``close``, if its class has one."""
        if self._close is not None:
            self._close()

    def __repr__(self) -> str:
        return repr(self.handler)


class RowsAdapter(_Wrapped):
    """A torchelastic :class:`~elastic.metrics.MetricHandler` as a :class:`ColumnsHandler`: each pass reaches its
    ``emit`` as one :class:`~elastic.metrics.StatMetricData` per aggregation each stat asked for, named
    ``<stat>.<aggregation>``, timestamp the window's end, merged rows (``rank`` None) and per-rank rows, in the
    pass's row order. A row whose ``emit`` raises does not stop the others: once the pass is through, the
    failures are raised together as :class:`RowsFailed` (the dispatcher counts each)."""

    def __init__(self, handler: MetricHandler) -> None:
        super().__init__(handler)
        self.discards = type(handler).emit is NullMetricHandler.emit

    def emit_columns(self, columns: Columns) -> None:
        """Give every figure of the pass to the wrapped handler's ``emit``."""
        emit = self.handler.emit
        failures, first = 0, None
        for metric in columns.to_metrics():
            try:
                emit(metric)
            except Exception as exc:  # a user's handler may raise anything; its other rows must still go
                failures += 1
                first = first or exc
        if first is not None:
            raise RowsFailed(self.handler, failures, first)


class ColumnsAdapter(_Wrapped):
    """A user's :class:`~elastic.metrics.MetricHandler` subclass that defines ``emit_columns(columns)`` but does
    not subclass :class:`ColumnsHandler`: the passes go to its ``emit_columns``, the rest as for
    :class:`RowsAdapter`."""

    def __init__(self, handler: MetricHandler) -> None:
        super().__init__(handler)
        emit_columns = _method(handler, "emit_columns")
        assert emit_columns is not None, "as_columns_handler wraps only handlers that define emit_columns"
        self._emit_columns = emit_columns

    def emit_columns(self, columns: Columns) -> None:
        """The wrapped handler's ``emit_columns``."""
        self._emit_columns(columns)


def as_columns_handler(handler: MetricHandler) -> ColumnsHandler:
    """``handler`` as the collector calls it: itself when it is a :class:`ColumnsHandler`, a :class:`ColumnsAdapter`
    when its class defines ``emit_columns``, else a :class:`RowsAdapter` (decided here, once)."""
    if isinstance(handler, ColumnsHandler):
        return handler
    if _method(handler, "emit_columns") is not None:
        return ColumnsAdapter(handler)
    return RowsAdapter(handler)


def _method(handler: object, name: str) -> Callable[..., object] | None:
    """``handler``'s bound method ``name`` if its class defines one (None otherwise)."""
    if not callable(getattr(type(handler), name, None)):
        return None
    method: Callable[..., object] = getattr(handler, name)
    return method


class AgentMetricData(StatMetricData):
    """A metric the agent of ``shmstat run`` put (its ``@prof`` calls, ``workers.<role>.*``): a
    :class:`StatMetricData` with ``rank`` None, no window, and the job the agent runs. Handlers that care tell it
    apart with ``isinstance`` (``tensorboard:DIR`` writes it to the job's own ``agent`` run); to every other
    handler it is a put metric with no rank."""

    @classmethod
    def of(cls, metric: MetricData, job: str) -> AgentMetricData:
        """``metric`` (a torchelastic MetricData the agent made) as the agent's metric of ``job``."""
        return cls(metric.timestamp, metric.group_name, metric.name, metric.value, rank=None,
                   window_start=None, window_end=None, job=job)  # type: ignore[arg-type]
