"""Per-group metric handlers in the collector, as torchelastic's ``configure(handler, group)``.

A SPEC names a handler: ``compact`` (:mod:`collector.handlers.compact`: one line per merged window), ``console``,
``null``, ``jsonl:PATH``, ``tensorboard:DIR`` (see :mod:`collector.handlers.tensorboard`), ``otlp:ENDPOINT``
(:mod:`collector.handlers.otlp`), or ``pkg.module:Class`` for a user's own ``MetricHandler`` subclass, with keyword
arguments after commas: ``pkg.module:Class,key=value,key2=value2`` builds ``Class(key=value, key2=value2)``
(see :func:`parse_spec_kwargs` for how values are read). ``GROUP=SPEC`` binds it to a group; the group ``*`` is the
default for groups nobody configured (``compact`` unless given: merged windows only, so a job's put metrics and
``@prof`` calls are printed only for groups bound to ``console``).

Whatever a SPEC names, the collector calls it one way (:mod:`collector.handlers.protocol`): each pass as columns
(``emit_columns(columns)``), each metric that belongs to no window (put by ranks, the collector's own figures)
through ``emit``. :func:`build_handler` decides once how: the built-in sinks subclass
:class:`~collector.handlers.protocol.ColumnsHandler`; ``console``, ``null`` and a user's class with only
``emit`` are wrapped in a :class:`~collector.handlers.protocol.RowsAdapter` (one ``MetricData`` per aggregation
and row); a user's class that defines ``emit_columns`` gets the passes as columns.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any

from elastic.metrics import ConsoleMetricHandler, MetricData, MetricHandler, NullMetricHandler, StatMetricData
from shmstat.errors import ConfigError
from shmstat.names import COLLECTOR_GROUP, RULE_REFERENCE, group_problem

from .compact import CompactWindowHandler
from .jsonl_resume import DEFAULT_TAIL_BYTES, resume_jsonl
from .protocol import ColumnsHandler, RowsAdapter, as_columns_handler

if TYPE_CHECKING:
    from ..read.columns import Columns

__all__ = ["AgentMetricData", "Dispatcher", "JsonlMetricHandler", "build_handler", "is_user_class_spec",
           "load_user_class", "parse_handler_args", "parse_spec_kwargs"]

_log = logging.getLogger("shmstat.collector")


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


class JsonlMetricHandler(ColumnsHandler):
    """Appends one JSON object per metric to a file: timestamp, group, name, value, rank, window start/end, job.

    ``rank`` is null for rows merged across ranks and for metrics put by ranks; ``window_start`` and
    ``window_end`` (unix seconds) are null for put metrics. Non-finite floats are written as the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so every line is strict JSON. The file is opened 0600 in
    append mode, and flushed after every collector pass.

    Exactly once across collector crashes: on open, a last line cut by a kill is removed and the rows of the
    windows in the file's last ``tail_bytes`` are not written again (:mod:`collector.handlers.jsonl_resume`).
    """

    def __init__(self, path: str, tail_bytes: int = DEFAULT_TAIL_BYTES) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open jsonl output {path!r}: {exc.strerror}") from None
        resumed = resume_jsonl(fd, path, tail_bytes)
        self._written = resumed.written
        """Rows of windows the file's tail held when opened (skipped if emitted again)."""
        self.skipped = 0
        """Rows not written because the file already held them (windows emitted again by a restarted collector)."""
        self._out: IO[str] = os.fdopen(fd, "a", encoding="utf-8", buffering=1 << 16)

    def emit(self, metric_data: MetricData) -> None:
        """Write one line for ``metric_data`` (a metric put by a rank, the collector's own figures, or a user's
        row: whatever it carries of rank, window, job)."""
        start = getattr(metric_data, "window_start", None)
        if self._written and start is not None and (
                getattr(metric_data, "job", None), metric_data.group_name, metric_data.name,
                getattr(metric_data, "rank", None), float(start), _json_number(metric_data.value)) in self._written:
            self.skipped += 1
            return
        self._out.write(_line(metric_data.timestamp, metric_data.group_name, metric_data.name, metric_data.value,
                              getattr(metric_data, "rank", None), getattr(metric_data, "window_start", None),
                              getattr(metric_data, "window_end", None), getattr(metric_data, "torn", False),
                              getattr(metric_data, "job", None), getattr(metric_data, "source_rank", None)) + "\n")

    def emit_columns(self, columns: Columns) -> None:
        """Write one line per figure of a pass, in the order of :meth:`collector.read.columns.Columns.flat`."""
        job = columns.job
        rows: Iterable[tuple[float, str, str, float, int | None, float, bool]] = columns.flat()
        if self._written:  # a restarted collector may emit again windows the file holds: those rows are skipped
            every, written = list(rows), self._written
            rows = [row for row in every
                    if (job, row[1], row[2], row[4], row[5], _json_number(row[3])) not in written]
            self.skipped += len(every) - len(rows)
        lines = [_line(end, group, name, value, rank, start, end, torn, job, None)
                 for end, group, name, value, rank, start, torn in rows]
        if lines:
            lines.append("")
            self._out.write("\n".join(lines))

    def flush(self) -> None:
        """Push buffered lines to the file."""
        self._out.flush()

    def close(self) -> None:
        """Flush and close the file."""
        if not self._out.closed:
            self._out.close()


def _line(timestamp: float, group: str, name: str, value: Any, rank: int | None, start: float | None,
          end: float | None, torn: bool, job: str | None, source_rank: int | None) -> str:
    """The one JSON line of a figure (the only place the jsonl format is written)."""
    row = {"timestamp": timestamp, "group": group, "name": name, "value": _json_number(value), "rank": rank,
           "window_start": start, "window_end": end}
    if torn:
        row["torn"] = True
    if job is not None:
        row["job"] = job
    if source_rank is not None:
        row["source_rank"] = source_rank
    return json.dumps(row, allow_nan=False)


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value


def build_handler(spec: str) -> ColumnsHandler:
    """The handler a SPEC names, as the collector calls it (:func:`collector.handlers.protocol.as_columns_handler`:
    torchelastic handlers wrapped in a :class:`~collector.handlers.protocol.RowsAdapter`); raises
    :class:`ConfigError` with one sentence for a bad SPEC."""
    kind, _, arg = spec.partition(":")
    if spec == "compact":
        return CompactWindowHandler()
    if spec == "console":
        return RowsAdapter(ConsoleMetricHandler())
    if spec == "null":
        return RowsAdapter(NullMetricHandler())
    if kind == "jsonl":
        if not arg:
            raise ConfigError("handler spec 'jsonl:' needs a path, e.g. jsonl:/tmp/metrics.jsonl")
        return JsonlMetricHandler(arg)
    if kind == "tensorboard":
        from .tensorboard import TensorboardMetricHandler

        return TensorboardMetricHandler(arg)
    if kind == "otlp":
        from .otlp import build_otlp_handler  # imports OpenTelemetry only when asked for

        return build_otlp_handler(arg)
    class_name, comma, arguments = arg.partition(",")
    if is_user_class_spec(kind, class_name):
        return as_columns_handler(
            _load_user_handler(kind, class_name, parse_spec_kwargs(spec, arguments) if comma else {}))
    raise ConfigError(f"unknown handler kind {kind!r} in {_shown_spec(spec)}{_no_module(kind, class_name)}; use "
                      "compact, console, null, jsonl:PATH, tensorboard:DIR, otlp:ENDPOINT or pkg.module:Class")


def is_user_class_spec(module_name: str, class_name: str) -> bool:
    """Whether ``module_name:class_name`` reads as a user's class: a dotted module name and a class name, the
    module dotted or one Python finds (``jsnl:x`` is a mistyped kind, not a module named ``jsnl``)."""
    if not (class_name.isidentifier() and module_name and all(p.isidentifier() for p in module_name.split("."))):
        return False
    if "." in module_name:
        return True
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def _no_module(kind: str, class_name: str) -> str:
    """`` (no module named KIND either)`` when the SPEC could have meant a user's class."""
    return f" (no module {kind!r} either)" if kind.isidentifier() and class_name.isidentifier() else ""


def _shown_spec(spec: str) -> str:
    return repr(spec) if len(spec) <= 40 else repr(spec[:37]) + "..."


def parse_spec_kwargs(spec: str, arguments: str) -> dict[str, Any]:
    """The keyword arguments of a SPEC's ``key=value,key2=value2`` tail (``spec`` is only for messages).

    Items are separated by commas; each is ``key=value`` with ``key`` a Python identifier given once. A value is
    read as a JSON literal when it is one (``8``, ``0.5``, ``true``, ``null``, ``"a string"``, ``[1, 2]``),
    otherwise it is the plain string as written (``path=/tmp/x`` gives ``"/tmp/x"``). A comma or ``=`` inside
    a value must be inside a JSON string (``sep=","``); commas inside JSON arrays and objects are fine. Raises
    :class:`ConfigError` with one sentence for a malformed tail.
    """
    kwargs: dict[str, Any] = {}
    for item in _split_top_level(spec, arguments):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"handler spec {spec!r}: {item!r} is not key=value with a Python name as key")
        if key in kwargs:
            raise ConfigError(f"handler spec {spec!r} gives {key!r} twice")
        try:
            value: Any = json.loads(text)
        except ValueError:
            if "=" in text:
                raise ConfigError(f"handler spec {spec!r}: the value of {key!r} contains '=', so write it as a JSON "
                                  f"string, e.g. {key}=\"{text}\"") from None
            value = text
        kwargs[key] = value
    return kwargs


def _split_top_level(spec: str, text: str) -> list[str]:
    """``text`` split at the commas outside JSON strings, arrays and objects."""
    items: list[str] = []
    depth, in_string, escaped, begin = 0, False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[begin:i])
            begin = i + 1
    if in_string or depth:
        raise ConfigError(f"handler spec {spec!r} has an unclosed string, array or object in its arguments")
    items.append(text[begin:])
    return items


def _load_user_handler(module_name: str, class_name: str, kwargs: dict[str, Any]) -> MetricHandler:
    def refusal(cls: Any) -> str | None:
        if not (isinstance(cls, type) and issubclass(cls, MetricHandler)):
            return f"{module_name}:{class_name} is not a MetricHandler subclass"
        if inspect.isabstract(cls):  # the protocol's methods it lacks are its abstract ones
            lacking = " and ".join(sorted(getattr(cls, "__abstractmethods__", ())))
            return (f"{module_name}:{class_name} does not define {lacking}: a handler defines emit(metric_data), "
                    "and emit_columns(columns) to take passes as columns")
        return None

    handler: MetricHandler = load_user_class(module_name, class_name, kwargs, what="a handler", refusal=refusal)
    return handler


def load_user_class(module_name: str, class_name: str, kwargs: dict[str, Any], *, what: str,
                    refusal: Callable[[Any], str | None]) -> Any:
    """``module_name.class_name(**kwargs)``, the object a ``pkg.module:Class,key=value`` SPEC names. ``what`` names
    the object in messages (``"a handler"``); ``refusal(cls)`` is the sentence refusing a class that is not one
    (None accepts it). Raises :class:`ConfigError` with one sentence for a module that cannot be imported, a name
    that is not there, a refused class, arguments it does not take, or a constructor that raises."""
    target = f"{module_name}:{class_name}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} for {what}: {_one_line(exc)}") from None
    except Exception as exc:  # a user's module can raise anything while it is imported
        raise ConfigError(f"importing module {module_name!r} for {what} raised {_one_line(exc)}") from None
    if not hasattr(module, class_name):
        raise ConfigError(f"module {module_name!r} has no class {class_name!r} for {what}")
    cls = getattr(module, class_name)
    refused = refusal(cls)
    if refused is not None:
        raise ConfigError(refused)
    try:
        signature: inspect.Signature | None = inspect.signature(cls)
    except (TypeError, ValueError):  # some classes (C extensions) have no signature to check against
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{target} does not take these arguments ({exc}); it takes "
                              f"{_describe_parameters(signature)}") from None
    try:
        return cls(**kwargs)
    except Exception as exc:  # a user's constructor can raise anything
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"{target}({shown}) failed: {_one_line(exc)}") from None


def _describe_parameters(signature: inspect.Signature) -> str:
    """A constructor's parameters as a user writes them in a SPEC: ``path, every=1`` (or ``no arguments``)."""
    shown = []
    for p in signature.parameters.values():
        if p.kind is p.VAR_POSITIONAL or p.kind is p.POSITIONAL_ONLY:
            continue
        if p.kind is p.VAR_KEYWORD:
            shown.append(f"**{p.name}")
        else:
            shown.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(shown) if shown else "no arguments"


def _one_line(exc: BaseException) -> str:
    """An exception as ``Type: message`` on one line (a user's message may span several)."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def parse_handler_args(args: Iterable[str]) -> dict[str, str]:
    """``["GROUP=SPEC", ...]`` to ``{group: spec}``; raises :class:`ConfigError` on a malformed entry, or on a
    GROUP no rank can use (the name rule, :mod:`shmstat.names`; ``*`` and the collector's own group are fine)."""
    out: dict[str, str] = {}
    for arg in args:
        group, sep, spec = arg.partition("=")
        if not sep or not group or not spec:
            raise ConfigError(f"--handler {arg!r} is not GROUP=SPEC (e.g. train=jsonl:/tmp/m.jsonl or *=console)")
        problem = None if group in ("*", COLLECTOR_GROUP) else group_problem(group)
        if problem is not None:
            shown = repr(group) if len(group) <= 32 else repr(group[:29]) + "..."
            raise ConfigError(f"--handler group {shown} {problem} ({RULE_REFERENCE})")
        out[group] = spec
    return out


class Dispatcher:
    """Which handler serves each group (or the default): the routing table. Each handler is held as the collector
    calls it, a :class:`~collector.handlers.protocol.ColumnsHandler` (a torchelastic handler given here is wrapped
    once, :func:`~collector.handlers.protocol.as_columns_handler`; one object serving several groups is wrapped
    once for all). Handlers are called only by :class:`collector.handlers.dispatch.ThreadedDispatcher`, each in a
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
