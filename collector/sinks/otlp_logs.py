"""The ``--events otlp:ENDPOINT`` sink: events exported as OpenTelemetry log records over OTLP/HTTP (protobuf).

Needs the optional extra ``shmstat[otlp]`` (``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``,
1.39 or later: the SDK's ``ReadableLogRecord``), imported only when the sink is built. As the metrics handler
(:mod:`collector.handlers.otlp`) does, the records are built by hand (``opentelemetry._logs.LogRecord`` wrapped in
``opentelemetry.sdk._logs.ReadableLogRecord``) and sent with ``OTLPLogExporter.export``: one request per batch.

What an :class:`~collector.sinks.events.EventRecord` becomes: a log record with ``event_name`` the event's
name, ``time_unix_nano`` its timestamp, severity INFO, the body its data (a map), and the attributes ``job``,
``rank`` (absent for the collector's own events), ``pid``, ``incarnation`` and ``seq``. A
:class:`~collector.sinks.events.GapRecord` is a record with ``event_name`` ``shmstat.events.gap``, severity
WARN, the body ``{"gap", "from_seq", "to_seq", "at"}`` and the same attributes. The resource carries
``host.name`` and ``service.name`` ``shmstat`` (unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES``
name one); the scope is ``shmstat.collector``.

Failures: an export that fails (receiver down, an HTTP error, past the timeout) raises :class:`OtlpExportError`
from ``emit_events``: the collector counts the call in ``collector.event_handler_errors`` and its events in
``collector.events_dropped``. After a failure the sink waits 1 s, then 2, 4 .. up to 30 s before trying again,
failing (and so counting) the batches in between at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shmstat.errors import ConfigError

from ..handlers.otlp_export import (
    DEFAULT_TIMEOUT_S,
    OtlpExportError,
    catch_export_reasons,
    check_endpoint,
    collector_resource,
    export_reasons,
)
from .events import EventHandler, EventRecord, GapRecord

__all__ = ["GAP_EVENT_NAME", "OtlpEventHandler", "build_otlp_event_handler"]

_log = logging.getLogger("shmstat.collector")

GAP_EVENT_NAME = "shmstat.events.gap"
"""The ``event_name`` of the log record a gap becomes."""
_BACKOFF_S = (1.0, 30.0)
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http._log_exporter"
_INSTALL = "pip install -U 'shmstat[otlp]'"


@dataclass(frozen=True)
class _Otel:
    log_record: Any
    readable: Any
    severity: Any
    exporter: Any
    result: Any
    resource: Any
    scope: Any


def _otel() -> _Otel:
    """The OpenTelemetry names, imported on first use; :class:`ConfigError` naming the extra if missing."""
    try:
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.sdk._logs.export import LogRecordExportResult
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    except ImportError:
        raise ConfigError(f"events spec 'otlp:' needs OpenTelemetry 1.39 or later: {_INSTALL}") from None
    return _Otel(LogRecord, ReadableLogRecord, SeverityNumber, OTLPLogExporter, LogRecordExportResult, Resource,
                 InstrumentationScope)


def build_otlp_event_handler(endpoint: str) -> OtlpEventHandler:
    """The sink of spec ``otlp:ENDPOINT``; :class:`ConfigError` (one sentence) for a bad endpoint or when
    OpenTelemetry is not installed."""
    check_endpoint(endpoint, "events", "http://127.0.0.1:4318/v1/logs")
    return OtlpEventHandler(endpoint)


class OtlpEventHandler(EventHandler):
    """Exports every batch of records to an OTLP/HTTP logs receiver at ``endpoint`` (see the module docstring).
    ``exporter`` (anything with ``export(batch)`` and ``shutdown()``) and ``clock`` (monotonic seconds) are for
    tests."""

    def __init__(self, endpoint: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, host: str | None = None,
                 exporter: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._otel = _otel()
        self.endpoint = endpoint
        self._exporter = exporter if exporter is not None else self._otel.exporter(endpoint=endpoint,
                                                                                    timeout=timeout_s)
        catch_export_reasons(_EXPORTER_LOGGER)
        self._resource = collector_resource(self._otel.resource, host)
        self._scope = self._otel.scope("shmstat.collector")
        self._clock = clock
        self._retry_at = 0.0
        self._backoff = _BACKOFF_S[0]
        self.exports = 0
        """Exports the receiver accepted."""
        self.failures = 0
        """Batches that failed, or were failed at once while waiting to try again."""

    def __repr__(self) -> str:
        return f"OtlpEventHandler({self.endpoint!r})"

    def emit_events(self, batch: list[EventRecord | GapRecord]) -> None:
        """Send ``batch`` in one export; raises :class:`OtlpExportError` if it did not get through."""
        if not batch:
            return
        now = self._clock()
        if now < self._retry_at:
            self.failures += 1
            raise OtlpExportError(f"OTLP export to {self.endpoint} failed recently; {len(batch)} records dropped "
                                  f"until the next attempt in {self._retry_at - now:.1f} s")
        records = [self._record(r) for r in batch]
        reason = ""
        export_reasons.last.pop(threading.get_ident(), None)
        try:
            ok = self._exporter.export(records) == self._otel.result.SUCCESS
        except Exception as exc:  # an exporter's bug must not end the sink's thread
            ok, reason = False, repr(exc)
        if ok:
            if self.failures and self._backoff > _BACKOFF_S[0]:
                _log.info("OTLP export to %s works again", self.endpoint)
            self.exports += 1
            self._backoff, self._retry_at = _BACKOFF_S[0], 0.0
            return
        reason = reason or export_reasons.last.pop(threading.get_ident(), "") or "the receiver refused it"
        self.failures += 1
        wait = self._backoff
        self._retry_at = self._clock() + wait
        self._backoff = min(self._backoff * 2, _BACKOFF_S[1])
        raise OtlpExportError(f"OTLP export to {self.endpoint} failed ({reason}); {len(batch)} records dropped, "
                              f"next attempt in {wait:.0f} s")

    def _record(self, r: EventRecord | GapRecord) -> Any:
        otel = self._otel
        attrs: dict[str, str | int] = {"job": r.job, "pid": r.pid, "incarnation": r.incarnation}
        if r.rank is not None:
            attrs["rank"] = r.rank
        if isinstance(r, GapRecord):
            name, severity, ts = GAP_EVENT_NAME, otel.severity.WARN, r.ts_ns
            body: dict[str, Any] = {"gap": r.count, "from_seq": r.from_seq, "to_seq": r.to_seq, "at": r.at}
        else:
            name, severity, ts, body = r.name, otel.severity.INFO, r.ts_ns, dict(r.data)
            attrs["seq"] = r.seq
        record = otel.log_record(timestamp=ts, observed_timestamp=time.time_ns(), severity_number=severity,
                                 severity_text=severity.name, body=body, attributes=attrs, event_name=name)
        return otel.readable(log_record=record, resource=self._resource, instrumentation_scope=self._scope)

    def close(self) -> None:
        """Shut the exporter down."""
        self._exporter.shutdown()
