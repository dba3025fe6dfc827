"""The SPEC that names an events sink (``--events SPEC``), and the sink it builds (:func:`build_event_handler`).

A SPEC is ``jsonl:PATH``, ``console`` (the sinks of :mod:`collector.sinks.events`), ``otlp:ENDPOINT``
(:mod:`collector.sinks.otlp_logs`) or ``pkg.module:Class[,key=value...]`` (keyword arguments read as for
``--handler``: :func:`collector.handlers.specs.parse_spec_kwargs`; the class loaded by
:func:`collector.handlers.specs.load_user_class`). The OpenTelemetry sink is imported only when a SPEC names it.
"""

from __future__ import annotations

from typing import Any

from shmstat.errors import ConfigError

from ..handlers.specs import is_user_class_spec, load_user_class, parse_spec_kwargs
from .events import ConsoleEventHandler, EventSink, JsonlEventHandler

__all__ = ["build_event_handler"]


def build_event_handler(spec: str) -> EventSink:
    """The events sink a SPEC names (``--events SPEC``, see the module docstring); :class:`ConfigError` with one
    sentence for a bad SPEC, before anything is started."""
    kind, _, arg = spec.partition(":")
    if spec == "console":
        return ConsoleEventHandler()
    if kind == "jsonl":
        if not arg:
            raise ConfigError("events spec 'jsonl:' needs a path, e.g. --events jsonl:/tmp/events.jsonl")
        return JsonlEventHandler(arg)
    if kind == "otlp":
        from .otlp_logs import build_otlp_event_handler  # imports OpenTelemetry only when asked for

        return build_otlp_event_handler(arg)
    class_name, comma, arguments = arg.partition(",")
    if is_user_class_spec(kind, class_name):
        kwargs = parse_spec_kwargs(spec, arguments) if comma else {}

        def refusal(cls: Any) -> str | None:
            if isinstance(cls, type) and issubclass(cls, EventSink):
                return None
            return f"{kind}:{class_name} is not an events sink: it has no emit_events(batch) method"

        return load_user_class(kind, class_name, kwargs, what="an events sink", refusal=refusal)
    shown = repr(spec) if len(spec) <= 40 else repr(spec[:37]) + "..."
    either = f" (no module {kind!r} either)" if kind.isidentifier() and class_name.isidentifier() else ""
    raise ConfigError(f"unknown events sink kind {kind!r} in {shown}{either}; use console, jsonl:PATH, "
                      "otlp:ENDPOINT or pkg.module:Class")
