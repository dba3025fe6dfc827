"""What the two OTLP exporters share (``otlp:ENDPOINT`` as a handler, :mod:`collector.handlers.otlp`, and as an
events sink, :mod:`collector.sinks.otlp_logs`): the endpoint check, the collector's OpenTelemetry resource, the
export timeout, the error a failed export raises, and the filter that keeps the SDK exporters' own log records out
of the log while remembering their reason (the exporter does not return it).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from shmstat.errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "ExportReasons", "OtlpExportError", "catch_export_reasons", "check_endpoint",
           "collector_resource", "export_reasons"]

DEFAULT_TIMEOUT_S = 3.0
"""Seconds one export may take, retries of the exporter included."""


class OtlpExportError(RuntimeError):
    """An export did not reach the receiver (its points or records are dropped); raised by the ``flush`` of
    :class:`collector.handlers.otlp.OtlpMetricHandler` and of
    :class:`collector.sinks.otlp_logs.OtlpEventHandler`."""


class ExportReasons(logging.Filter):
    """Keeps the exporter's own records out of the log, remembering the last one per thread (the reason of a
    failure, which the exporter does not return)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[int, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        self.last[threading.get_ident()] = record.getMessage()
        return False


export_reasons = ExportReasons()
"""The one filter on the exporters' loggers: ``export_reasons.last.pop(threading.get_ident(), "")`` is the reason
the exporter logged in this thread for its last failed export."""


def catch_export_reasons(logger_name: str) -> None:
    """Have :data:`export_reasons` keep the reason an SDK exporter logs for a failed export (once per logger)."""
    logger = logging.getLogger(logger_name)
    if export_reasons not in logger.filters:
        logger.addFilter(export_reasons)


def collector_resource(resource_cls: Any, host: str | None) -> Any:
    """The OpenTelemetry resource of this collector: ``host.name`` (``host`` or this machine's name), the
    ``OTEL_*`` environment's attributes, and ``service.name`` "shmstat" unless the environment named one."""
    resource = resource_cls.create({"host.name": host or socket.gethostname()})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(resource_cls({"service.name": "shmstat"}))
    return resource


def check_endpoint(endpoint: str, spec_kind: str, example: str) -> None:
    """Refuse (:class:`ConfigError`, one sentence) an empty ``otlp:`` spec or an endpoint that is not an http(s)
    URL with a host; ``spec_kind`` ("handler", "events") and ``example`` shape the message."""
    if not endpoint:
        raise ConfigError(f"{spec_kind} spec 'otlp:' needs an endpoint, e.g. otlp:{example}")
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"otlp endpoint {endpoint!r} is not an http(s) URL, e.g. {example}")
