"""The ``tensorboard:DIR`` handler: collector rows as TensorBoard scalars, written with TensorBoard's own writer.

Each row becomes one scalar written with :class:`tensorboard.summary.Writer` (the ``tensorboard`` package's
framework-free summary writer; install it with ``pip install 'shmstat[tensorboard]'``):

- tag ``<group>/<stat>.<agg>`` for a row merged across ranks, ``rank<N>/<group>/<stat>.<agg>`` for rank N's row
  (one tag per row, never shared: a group holds no ``/`` and is never ``rank<N>``, by the name rule of
  :mod:`shmstat.names`);
- step = the window index (``window_start / window length``, the same index on every rank and node, since
  windows are aligned to the wall clock), wall time = the window's end;
- a row with no window (a metric a rank put, a usage sample) gets step = a per-tag counter and its own
  timestamp as wall time;
- a value that is not a real number, or not finite as a float32 (NaN, infinities, beyond 3.4e38), is skipped
  and counted (:attr:`TensorboardMetricHandler.skipped_nonfinite`, ``skipped_not_numeric``);
- whole passes come as columns (``emit_columns``), written as the same scalars in the same order;
- rows of a job go to ``DIR/<job>/`` (the node collector serves several jobs), one writer and one event file
  per job; rows naming no job go to ``DIR`` itself. ``DIR`` and the job directories are created mode 0700.

A window that may be incomplete (``torn``) is written like any other: TensorBoard has no place for the flag
(the ``jsonl:PATH`` handler keeps it).
"""

from __future__ import annotations

import math
import numbers
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from elastic.metrics import MetricData, MetricHandler
from shmstat.errors import ConfigError
from shmstat.names import rank_segment
from shmstat.shm.runtime import validate_job

if TYPE_CHECKING:
    from ..read.columns import Columns

__all__ = ["TensorboardMetricHandler"]

_FLOAT32_MAX = 3.4028234663852886e38
"""TensorBoard stores a scalar as a float32: a finite float64 beyond this would be written as an infinity."""


def _writer_class() -> Any:
    """:class:`tensorboard.summary.Writer`, imported only when a ``tensorboard:DIR`` handler is built."""
    try:
        from tensorboard.summary import Writer
    except ImportError:
        raise ConfigError("the tensorboard:DIR handler needs the tensorboard package: "
                          "pip install 'shmstat[tensorboard]'") from None
    return Writer


def _window_index(start: float | None, end: float | None) -> int | None:
    """The index of the window ``[start, end)`` (Unix seconds): ``start / length``, or None for no window.

    ``end - start`` in float seconds is only good to ~0.5 µs today (the ulp of a Unix time is 0.24 µs), far
    too coarse to divide a Unix time by; so the length is taken to the whole microsecond (a job's windows are
    whole milliseconds) and the start in microseconds is divided by it and rounded (a start is on a boundary).
    """
    if start is None or end is None:
        return None
    length_us = round((end - start) * 1e6)
    if length_us <= 0:
        return None
    return round(start * 1e6 / length_us)


class TensorboardMetricHandler(MetricHandler):
    """Writes every row it receives as a TensorBoard scalar under ``logdir`` (see the module docstring).

    Rows are buffered by TensorBoard's writer; :meth:`flush` (after every collector pass) pushes them to the
    event files and :meth:`close` closes them. Safe to call from several threads.
    """

    def __init__(self, logdir: str) -> None:
        """Check ``logdir`` and create it (mode 0700) if needed; raises :class:`ConfigError` in one sentence."""
        if not logdir:
            raise ConfigError("handler spec 'tensorboard:' needs a directory, e.g. tensorboard:/tmp/tb")
        self._writer_cls = _writer_class()
        try:
            os.makedirs(logdir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the tensorboard directory {logdir!r}: {exc.strerror}") from None
        if not os.path.isdir(logdir) or not os.access(logdir, os.W_OK | os.X_OK):
            raise ConfigError(f"the tensorboard directory {logdir!r} is not a directory you can write to")
        self.logdir = logdir
        self.written = 0
        """Scalars written."""
        self.skipped_nonfinite = 0
        """Rows skipped because their value is NaN, infinite, or beyond float32's range."""
        self.skipped_not_numeric = 0
        """Rows skipped because their value is not a real number (a string, None...)."""
        self._writers: dict[str | None, Any] = {}
        self._counters: dict[tuple[str | None, str], int] = {}
        self._dirty = False
        self._closed = False
        self._lock = threading.Lock()

    def emit(self, metric_data: MetricData) -> None:
        """Write ``metric_data`` as one scalar (or skip and count it); see the module docstring for tag and step."""
        value = metric_data.value
        if not isinstance(value, numbers.Real):
            with self._lock:
                self.skipped_not_numeric += 1
            return
        self._write(getattr(metric_data, "job", None),
                    ((float(metric_data.timestamp), metric_data.group_name, metric_data.name, float(value),
                      getattr(metric_data, "rank", None), getattr(metric_data, "window_start", None),
                      getattr(metric_data, "window_end", None)),))

    def emit_columns(self, columns: Columns) -> None:
        """Write a whole pass: one scalar per figure, in the order of :meth:`collector.read.columns.Columns.flat`."""
        self._write(columns.job, ((end, group, name, value, rank, start, end)
                                  for end, group, name, value, rank, start, _torn in columns.flat()))

    def _write(self, job: str | None, rows: Iterable[tuple[float, str, str, float, int | None, float | None,
                                                            float | None]]) -> None:
        """The one writing path: ``(timestamp, group, name, value, rank, window start, window end)`` rows as
        scalars (step = window index, wall time = window end; without a window, a per-tag counter and the
        timestamp); non-finite values skipped and counted."""
        steps: dict[tuple[Any, Any], int | None] = {}
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            writer = self._writers.get(job)
            if writer is None:
                writer = self._open(job)
            add = writer.add_scalar
            for timestamp, group, name, value, rank, start, end in rows:
                if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                    self.skipped_nonfinite += 1
                    continue
                tag = f"{group}/{name}" if rank is None else f"{rank_segment(rank)}/{group}/{name}"
                step = steps.get((start, end), -1)
                if step == -1:
                    step = steps[(start, end)] = _window_index(start, end)
                if step is not None:
                    wall_time = float(end)  # type: ignore[arg-type]  # a window index means end is a number
                else:
                    key = (job, tag)
                    step = self._counters.get(key, 0)
                    self._counters[key] = step + 1
                    wall_time = timestamp
                add(tag, value, step, wall_time=wall_time)
                self.written += 1
                self._dirty = True

    def _open(self, job: str | None) -> Any:
        """The writer of ``job``'s directory, made now (called with the lock held)."""
        path = self.logdir if job is None else os.path.join(self.logdir, validate_job(job))
        os.makedirs(path, mode=0o700, exist_ok=True)
        writer = self._writers[job] = self._writer_cls(path)
        return writer

    def flush(self) -> None:
        """Push what was written since the last flush to the event files."""
        with self._lock:
            if self._closed or not self._dirty:
                return
            self._dirty = False
            for writer in self._writers.values():
                writer.flush()

    def close(self) -> None:
        """Flush and close every event file; later rows raise (the dispatcher counts them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            writer.close()

    def __repr__(self) -> str:
        """``TensorboardMetricHandler('<logdir>')``."""
        return f"TensorboardMetricHandler({self.logdir!r})"
