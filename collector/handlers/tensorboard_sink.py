"""The ``tensorboard:DIR`` handler: collector rows as TensorBoard scalars, written with TensorBoard's own writer.

Each row becomes one scalar written with :class:`tensorboard.summary.Writer` (the ``tensorboard`` package's
framework-free summary writer; install it with ``pip install 'shmstat[tensorboard]'``):

- tag ``<group>/<stat>.<agg>`` for a row merged across ranks, ``rank<N>/<group>/<stat>.<agg>`` for rank N's row
  (one tag per row, never shared: a group holds no ``/`` and is never ``rank<N>``, by the name rule of
  :mod:`shmstat.names`);
- step = windows since the job started: the row's window index minus the index of the window (of the same
  length) holding the job's origin. The origin is the job's start, the moment its segment was created on this
  node (:attr:`collector.read.columns.Columns.job_start_ns`), kept in ``DIR/<job>/shmstat-origin.json``
  the first time the job is written: step 0 is the job's first window, step N reads as N window lengths into
  the job, and a restarted collector (even one that finds the job's segment made anew) goes on with the
  origin it finds there, so a tag's steps never go back (TensorBoard would drop the points past a step that
  went back). A job first seen through window rows given to :meth:`~TensorboardMetricHandler.emit` (a user's
  rows: they carry no job start) has the start of its first window as origin, unless
  :meth:`~TensorboardMetricHandler.start_job` said when it started. Wall time = the window's end;
- a row with no window (a metric a rank put, a usage sample) gets step = a per-tag counter (its n-th value
  since this collector started) and its own timestamp as wall time; a job's rows with no window go to a run of
  their own, ``DIR/<job>/metrics/``, so a put metric never shares a tag with a stat's figure (a put
  ``x.count`` next to the stat ``x``);
- a value that is not a real number, or not finite as a float32 (NaN, infinities, beyond 3.4e38), is skipped
  and counted (:attr:`TensorboardMetricHandler.skipped_nonfinite`, ``skipped_not_numeric``);
- whole passes come as columns (``emit_columns``), written as the same scalars in the same order;
- rows of a job go to ``DIR/<job>/`` (the node collector serves several jobs), one writer and one event file
  per job (and its ``metrics/`` run for rows with no window);
  the metrics of the agent of ``shmstat run`` (:class:`collector.handlers.protocol.AgentMetricData`) go to
  a run of their own, ``DIR/<job>/agent/``; rows naming no job go to ``DIR`` itself. ``DIR`` and the
  directories under it are created mode 0700.

A window that may be incomplete (``torn``) is written like any other: TensorBoard has no place for the flag
(the ``jsonl:PATH`` handler keeps it).

TensorBoard's writer writes in a thread of its own; when a write fails there (a full disk), that thread ends by
raising, and Python would print its traceback. Its failure is raised again by the writer's next call, where the
collector logs it in one line and counts it (``collector.handler_errors``): the threads of our writers end
quietly (:func:`_quiet_writer_threads`) and are counted in :attr:`TensorboardMetricHandler.writer_failures`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from elastic.metrics import MetricData
from shmstat.errors import ConfigError
from shmstat.names import rank_segment
from shmstat.shm.runtime import validate_job

from .protocol import AgentMetricData, ColumnsHandler

if TYPE_CHECKING:
    from ..read.columns import Columns

__all__ = ["AGENT_RUN", "ORIGIN_FILE", "TensorboardMetricHandler"]

_log = logging.getLogger("shmstat.collector")

_FLOAT32_MAX = 3.4028234663852886e38
"""TensorBoard stores a scalar as a float32: a finite float64 beyond this would be written as an infinity."""
AGENT_RUN = "agent"
"""The run (directory under ``DIR/<job>/``) of the agent's metrics."""
PUT_RUN = "metrics"
"""The run (directory under ``DIR/<job>/``) of the metrics the job's ranks put: a tag of its own namespace, so a
put metric ``x.count`` of rank 0 in group ``g`` is never the stat ``x``'s ``rank0/g/x.count``."""
ORIGIN_FILE = "shmstat-origin.json"
"""Where, in ``DIR/<job>/``, the origin of the job's steps is kept (``{"job": ..., "origin_ns": ...}``)."""


_writer_threads: weakref.WeakKeyDictionary[threading.Thread, TensorboardMetricHandler] = weakref.WeakKeyDictionary()
"""The threads TensorBoard's writers started for our handlers, and whose they are."""
_hook_lock = threading.Lock()
_failures_lock = threading.Lock()
_previous_hook: Callable[[threading.ExceptHookArgs], Any] | None = None
_opening: TensorboardMetricHandler | None = None
"""The handler whose writer is being made (with ``_hook_lock`` held): its thread may fail before it is known."""


def _quiet_writer_threads(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: a writer thread of ours that failed is counted, not printed (its writer raises the
    error again at its next call, which the collector logs in one line and counts); any other thread's exception
    goes to the hook there was before."""
    handler = _writer_threads.get(args.thread) if args.thread is not None else None
    if handler is None and type(args.thread).__module__.startswith("tensorboard."):
        handler = _opening  # a writer's first write failed before _open could know its thread
    if handler is not None and isinstance(args.exc_value, Exception):
        with _failures_lock:  # not the handler's lock: a thread holding that may be waiting on this one
            handler.writer_failures += 1
        return
    (_previous_hook or threading.__excepthook__)(args)


def _install_quiet_hook() -> None:
    global _previous_hook  # one hook per process, chained to the one before
    with _hook_lock:
        if threading.excepthook is not _quiet_writer_threads:
            _previous_hook = threading.excepthook
            threading.excepthook = _quiet_writer_threads


def _writer_class() -> Any:
    """:class:`tensorboard.summary.Writer`, imported only when a ``tensorboard:DIR`` handler is built."""
    try:
        from tensorboard.summary import Writer
    except ImportError:
        raise ConfigError("the tensorboard:DIR handler needs the tensorboard package: "
                          "pip install 'shmstat[tensorboard]'") from None
    return Writer


def _window_step(start: float | None, end: float | None, origin_ns: int) -> int | None:
    """The step of the window ``[start, end)`` (Unix seconds): its index (``start / length``) minus the index of
    the window of that length holding ``origin_ns``; None for no window.

    ``end - start`` in float seconds is only good to ~0.5 µs today (the ulp of a Unix time is 0.24 µs), far
    too coarse to divide a Unix time by; so the length is taken to the whole microsecond (a job's windows are
    whole milliseconds) and the start in microseconds is divided by it and rounded (a start is on a boundary).
    """
    if start is None or end is None:
        return None
    length_us = round((end - start) * 1e6)
    if length_us <= 0:
        return None
    return round(start * 1e6 / length_us) - origin_ns // (length_us * 1000)


def _keep_origin(path: str, job: str, proposed_ns: int) -> int:
    """The origin kept at ``path``, or ``proposed_ns`` written there (owner-only, whole) when there is none; a
    file that cannot be read as one is replaced, one that cannot be written is logged once: the origin then
    holds for this collector only."""
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f).get("origin_ns")
        if isinstance(kept, int) and not isinstance(kept, bool) and kept >= 0:
            return kept
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError) as exc:
        _log.warning("%s cannot be read as the origin of job %s's TensorBoard steps (%s); writing it anew",
                     path, job, exc)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"job": job, "origin_ns": proposed_ns}, f)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _log.warning("cannot keep the origin of job %s's TensorBoard steps in %s (%s): a restarted collector "
                     "will count them from the job's start again", job, path, exc.strerror)
    return proposed_ns


class TensorboardMetricHandler(ColumnsHandler):
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
        self.writer_failures = 0
        """TensorBoard writer threads that ended on an error (a full disk): their writer raises it again at its
        next call, and each such call is counted by the collector (``collector.handler_errors``)."""
        self._writers: dict[tuple[str | None, str], Any] = {}  # (job, run: "" or AGENT_RUN) -> writer
        self._counters: dict[tuple[str | None, str, str], int] = {}
        self._origins: dict[str | None, int] = {}  # job -> Unix ns its steps count from
        self._starts: dict[str | None, int] = {}  # job -> its start, when known (the origin of a new job)
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
        job = getattr(metric_data, "job", None)
        if isinstance(metric_data, AgentMetricData):
            run = AGENT_RUN
        elif job is not None and getattr(metric_data, "window_start", None) is None:
            run = PUT_RUN
        else:
            run = ""
        self._write(job, run,
                    ((float(metric_data.timestamp), metric_data.group_name, metric_data.name, float(value),
                      getattr(metric_data, "rank", None), getattr(metric_data, "window_start", None),
                      getattr(metric_data, "window_end", None)),))

    def emit_columns(self, columns: Columns) -> None:
        """Write a whole pass: one scalar per figure, in the order of :meth:`collector.read.columns.Columns.flat`."""
        if columns.job_start_ns:
            self.start_job(columns.job, columns.job_start_ns)
        self._write(columns.job, "", ((end, group, name, value, rank, start, end)
                                      for end, group, name, value, rank, start, _torn in columns.flat()))

    def start_job(self, job: str | None, start_ns: int) -> None:
        """Say when ``job`` started (Unix ns): the origin of its steps unless one is kept already (see the module
        docstring). Columns carry it; call this before giving window rows of a job to :meth:`emit`."""
        with self._lock:
            self._starts[job] = int(start_ns)

    def _origin(self, job: str | None, first_start_ns: int) -> int:
        """The origin of ``job``'s steps (called with the lock held, once the job's directory exists): the one
        in use, else the one kept in its directory, else its start (or ``first_start_ns``), kept there now."""
        got = self._origins.get(job)
        if got is not None:
            return got
        origin = self._starts.get(job, first_start_ns)
        if job is not None:
            origin = _keep_origin(os.path.join(self.logdir, validate_job(job), ORIGIN_FILE), job, origin)
        self._origins[job] = origin
        return origin

    def _write(self, job: str | None, run: str, rows: Iterable[tuple[float, str, str, float, int | None,
                                                                     float | None, float | None]]) -> None:
        """The one writing path: ``(timestamp, group, name, value, rank, window start, window end)`` rows as
        scalars of ``job``'s ``run`` (step = windows since the job's start, wall time = window end; without a
        window, a per-tag counter and the timestamp); non-finite values skipped and counted."""
        steps: dict[tuple[Any, Any], int | None] = {}
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            writer = self._writers.get((job, run))
            if writer is None:
                writer = self._open(job, run)
            add = writer.add_scalar
            origin = self._origins.get(job)
            for timestamp, group, name, value, rank, start, end in rows:
                if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                    self.skipped_nonfinite += 1
                    continue
                tag = f"{group}/{name}" if rank is None else f"{rank_segment(rank)}/{group}/{name}"
                step = steps.get((start, end), -1)
                if step == -1:
                    if origin is None and start is not None and end is not None:
                        origin = self._origin(job, round(start * 1e9))
                    step = steps[(start, end)] = _window_step(start, end, origin or 0)
                if step is not None:
                    wall_time = float(end)  # type: ignore[arg-type]  # a window index means end is a number
                else:
                    key = (job, run, tag)
                    step = self._counters.get(key, 0)
                    self._counters[key] = step + 1
                    wall_time = timestamp
                add(tag, value, step, wall_time=wall_time)
                self.written += 1
                self._dirty = True

    def _open(self, job: str | None, run: str) -> Any:
        """The writer of ``job``'s directory (its ``run`` subdirectory, if any), made now (with the lock held)."""
        path = self.logdir
        for part in ([] if job is None else [validate_job(job)]) + ([run] if run else []):
            path = os.path.join(path, part)
            os.makedirs(path, mode=0o700, exist_ok=True)  # each level 0700 (makedirs gives the leaf its mode only)
        _install_quiet_hook()
        global _opening
        with _hook_lock:  # the threads the writer starts are told from others by being new and TensorBoard's
            before = set(threading.enumerate())
            _opening = self
            try:
                writer = self._writers[(job, run)] = self._writer_cls(path)
            finally:
                for thread in threading.enumerate():
                    if thread not in before and type(thread).__module__.startswith("tensorboard."):
                        _writer_threads[thread] = self
                _opening = None  # only once its threads are known
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
