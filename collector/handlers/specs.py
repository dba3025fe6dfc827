"""The SPECs that name handlers, and the objects they build, a user's own classes included.

``--handler GROUP=SPEC`` (:func:`parse_handler_args`, :func:`build_handler`), as torchelastic's
``configure(handler, group)``: a SPEC names a handler: ``compact`` (:mod:`collector.handlers.console`: one line
per merged window), ``console``, ``null``, ``jsonl:PATH`` (:mod:`collector.handlers.jsonl`), ``tensorboard:DIR``
(see :mod:`collector.handlers.tensorboard_sink`), ``otlp:ENDPOINT`` (:mod:`collector.handlers.otlp`), or
``pkg.module:Class`` for a user's own ``MetricHandler`` subclass, with keyword arguments after commas:
``pkg.module:Class,key=value,key2=value2`` builds ``Class(key=value, key2=value2)`` (see
:func:`parse_spec_kwargs` for how values are read; :func:`load_user_class` imports and builds the class).
``GROUP=SPEC`` binds it to a group; the group ``*`` is the default for groups nobody configured (``compact``
unless given: merged windows only, so a job's put metrics and ``@prof`` calls are printed only for groups bound to
``console``).

Whatever a SPEC names, the collector calls it one way (:mod:`collector.handlers.protocol`): each pass as columns
(``emit_columns(columns)``), each metric that belongs to no window (put by ranks, the collector's own figures)
through ``emit``. :func:`build_handler` decides once how: the built-in sinks subclass
:class:`~collector.handlers.protocol.ColumnsHandler`; ``console``, ``null`` and a user's class with only
``emit`` are wrapped in a :class:`~collector.handlers.protocol.RowsAdapter` (one ``MetricData`` per aggregation
and row); a user's class that defines ``emit_columns`` gets the passes as columns.

``--events SPEC`` is read by :func:`collector.sinks.specs.build_event_handler`, with this module's reading of keyword
arguments (:func:`parse_spec_kwargs`) and of a user's class (:func:`load_user_class`).

The OpenTelemetry and TensorBoard sinks are imported only when a SPEC names them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from collections.abc import Callable, Iterable
from typing import Any

from elastic.metrics import ConsoleMetricHandler, MetricHandler, NullMetricHandler
from shmstat.errors import ConfigError
from shmstat.names import COLLECTOR_GROUP, RULE_REFERENCE, group_problem

from .console import CompactWindowHandler
from .jsonl import JsonlMetricHandler
from .protocol import ColumnsHandler, RowsAdapter, as_columns_handler

__all__ = ["build_handler", "is_user_class_spec", "load_user_class", "parse_handler_args", "parse_spec_kwargs"]

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
        from .tensorboard_sink import TensorboardMetricHandler

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
