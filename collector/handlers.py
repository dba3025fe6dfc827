"""Per-group metric handlers in the collector, as torchelastic's ``configure(handler, group)``.

A SPEC names a handler: ``console``, ``null``, ``jsonl:PATH``, ``otlp:ENDPOINT`` (:mod:`collector.sink_otlp`),
or ``pkg.module:Class`` for a user's own ``MetricHandler`` subclass (constructed with no arguments).
``GROUP=SPEC`` binds it to a group; the group ``*`` is the default for groups nobody configured (``console``
unless given).

A handler that defines ``emit_window(row: WindowRow, job: str)`` (:func:`takes_windows`) receives each closed
window whole, histogram included, instead of one ``MetricData`` per aggregation; metrics that belong to no
window still reach its ``emit``.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

from elastic.metrics import ConsoleMetricHandler, MetricData, MetricHandler, NullMetricHandler
from shmstat.errors import ConfigError

if TYPE_CHECKING:
    from .merge import WindowRow

__all__ = ["Dispatcher", "JsonlMetricHandler", "build_handler", "parse_handler_args", "takes_windows"]

_log = logging.getLogger("shmstat.collector")


class JsonlMetricHandler(MetricHandler):
    """Appends one JSON object per metric to a file: timestamp, group, name, value, rank, window start/end, job.

    ``rank`` is null for rows merged across ranks and for metrics put by ranks; ``window_start`` and
    ``window_end`` (unix seconds) are null for put metrics. Non-finite floats are written as the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so every line is strict JSON. The file is opened 0600 in
    append mode, and flushed after every collector pass.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open jsonl output {path!r}: {exc.strerror}") from None
        self._out: IO[str] = os.fdopen(fd, "a", encoding="utf-8", buffering=1 << 16)

    def emit(self, metric_data: MetricData) -> None:
        """Write one line for ``metric_data``."""
        row = {
            "timestamp": metric_data.timestamp,
            "group": metric_data.group_name,
            "name": metric_data.name,
            "value": _json_number(metric_data.value),
            "rank": getattr(metric_data, "rank", None),
            "window_start": getattr(metric_data, "window_start", None),
            "window_end": getattr(metric_data, "window_end", None),
        }
        if getattr(metric_data, "torn", False):
            row["torn"] = True
        job = getattr(metric_data, "job", None)
        if job is not None:
            row["job"] = job
        source_rank = getattr(metric_data, "source_rank", None)
        if source_rank is not None:
            row["source_rank"] = source_rank
        self._out.write(json.dumps(row, allow_nan=False) + "\n")

    def flush(self) -> None:
        """Push buffered lines to the file."""
        self._out.flush()

    def close(self) -> None:
        """Flush and close the file."""
        if not self._out.closed:
            self._out.close()


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value


def build_handler(spec: str) -> MetricHandler:
    """The handler a SPEC names; raises :class:`ConfigError` with one sentence for a bad SPEC."""
    kind, _, arg = spec.partition(":")
    if spec == "console":
        return ConsoleMetricHandler()
    if spec == "null":
        return NullMetricHandler()
    if kind == "jsonl":
        if not arg:
            raise ConfigError("handler spec 'jsonl:' needs a path, e.g. jsonl:/tmp/metrics.jsonl")
        return JsonlMetricHandler(arg)
    if kind == "otlp":
        from .sink_otlp import build_otlp_handler  # imports OpenTelemetry only when asked for

        return build_otlp_handler(arg)
    if arg.isidentifier() and kind and all(part.isidentifier() for part in kind.split(".")):
        return _load_user_handler(kind, arg)
    raise ConfigError(
        f"unknown handler spec {spec!r}; use console, null, jsonl:PATH, otlp:ENDPOINT or pkg.module:Class"
    )


def takes_windows(handler: MetricHandler) -> bool:
    """Whether ``handler`` takes whole window rows (it defines ``emit_window(row, job)``)."""
    return callable(getattr(handler, "emit_window", None))


def _load_user_handler(module_name: str, class_name: str) -> MetricHandler:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} for a handler: {exc}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, MetricHandler):
        raise ConfigError(f"{module_name}:{class_name} is not a MetricHandler subclass")
    try:
        return cls()
    except Exception as exc:  # a user's constructor can raise anything
        raise ConfigError(f"{module_name}:{class_name}() failed: {exc}") from None


def parse_handler_args(args: Iterable[str]) -> dict[str, str]:
    """``["GROUP=SPEC", ...]`` to ``{group: spec}``; raises :class:`ConfigError` on a malformed entry."""
    out: dict[str, str] = {}
    for arg in args:
        group, sep, spec = arg.partition("=")
        if not sep or not group or not spec:
            raise ConfigError(f"--handler {arg!r} is not GROUP=SPEC (e.g. train=jsonl:/tmp/m.jsonl or *=console)")
        out[group] = spec
    return out


class Dispatcher:
    """Routes each metric to the handler of its group (or the default); a raising handler is counted."""

    def __init__(self, handlers: dict[str, MetricHandler], default: MetricHandler | None = None) -> None:
        self.handlers = dict(handlers)
        self.default = default if default is not None else self.handlers.pop("*", None) or ConsoleMetricHandler()
        self.errors = 0
        self.emitted = 0
        self._warned: set[tuple[int, type]] = set()

    @classmethod
    def from_specs(cls, specs: dict[str, str]) -> Dispatcher:
        """Build every handler named in ``{group: spec}`` (``*`` = default)."""
        built = {group: build_handler(spec) for group, spec in specs.items()}
        default = built.pop("*", None)
        return cls(built, default)

    def handler_for(self, group: str) -> MetricHandler:
        """The handler that receives metrics of ``group``."""
        return self.handlers.get(group, self.default)

    def discards(self, group: str) -> bool:
        """Whether ``group``'s handler is a plain null handler (its ``emit`` is NullMetricHandler's, which does
        nothing): the collector then builds no metric for it."""
        return type(self.handlers.get(group, self.default)).emit is NullMetricHandler.emit

    def emit(self, metric: MetricData) -> None:
        """Hand one metric to its group's handler; exceptions are logged once per handler and type, counted."""
        self.emit_all(metric.group_name, (metric,))

    def emit_all(self, group: str, metrics: Iterable[MetricData]) -> None:
        """:meth:`emit` for several metrics of one ``group`` (its handler is looked up once)."""
        handler = self.handlers.get(group, self.default)
        emit = handler.emit
        for metric in metrics:
            self._call(handler, group, emit, metric)

    def emit_window(self, row: WindowRow, job: str) -> bool:
        """Hand a whole window row to its group's handler if that handler takes windows (:func:`takes_windows`);
        False (nothing done) otherwise: the caller then emits one metric per aggregation."""
        handler = self.handlers.get(row.group, self.default)
        if not takes_windows(handler):
            return False
        self._call(handler, row.group, handler.emit_window, row, job)  # type: ignore[attr-defined]
        return True

    def _call(self, handler: MetricHandler, group: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
            self.emitted += 1
        except Exception as exc:  # a user's handler may raise anything; the others must still run
            self.errors += 1
            key = (id(handler), type(exc))
            if key not in self._warned:
                self._warned.add(key)
                _log.error("handler %r for group %r raised %r (counted; further ones not logged)",
                           handler, group, exc)

    def all_handlers(self) -> list[MetricHandler]:
        """Every distinct handler, default included."""
        seen: dict[int, MetricHandler] = {id(self.default): self.default}
        for h in self.handlers.values():
            seen.setdefault(id(h), h)
        return list(seen.values())

    def flush(self) -> None:
        """Flush every handler that can be flushed (errors are counted)."""
        for h in self.all_handlers():
            flush = getattr(h, "flush", None)
            if callable(flush):
                try:
                    flush()
                except Exception:  # same policy as emit
                    self.errors += 1

    def close(self) -> None:
        """Flush and close every handler that has ``close``."""
        self.flush()
        for h in self.all_handlers():
            close = getattr(h, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    self.errors += 1
