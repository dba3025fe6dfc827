"""The ``otlp:ENDPOINT`` handler: closed windows exported as OpenTelemetry metrics over OTLP/HTTP (protobuf).

Needs the optional extra ``shmstat[otlp]`` (``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``),
imported only when the handler is built. The windows are already aggregated, so no SDK instrument is used (it
would aggregate them again): the data objects of ``opentelemetry.sdk.metrics.export`` are built by hand and
sent with ``OTLPMetricExporter.export``, one request per collector pass (:meth:`OtlpMetricHandler.flush`).

What one window row of stat ``S`` becomes (points of a rank carry the attribute ``rank``; every point carries
``job``, ``group`` and ``stat``; the resource carries ``host.name``, and ``service.name`` ``shmstat`` unless
``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` name one):

- ``S.count`` and ``S.sum``: cumulative Sums, running totals per series (job, group, stat, rank), from the start
  of the series' first window to the end of this one. ``S.count`` is monotonic; ``S.sum`` is monotonic until a
  window of the stat holds a negative value, and from then on is exported as a non-monotonic Sum.
- the other aggregations the stat asked for (``S.mean``, ``S.min``, ``S.max``, ``S.value``, ``S.p50`` ..):
  Gauges at the window's end;
- for a stat that keeps percentiles, ``S.histogram``: an ExponentialHistogram point of the window (delta
  temporality) with the window's own scale, zero count and buckets (:mod:`shmstat.histogram` uses OTel's index
  semantics, so the buckets go over as they are). Its population is the window's finite samples: ``+inf`` and
  ``-inf`` samples have no bucket (OTLP's count must be the zero count plus the buckets'), so they are left out
  of the point, and so are the sum, min and max they make (``S.count``, ``S.min``, ``S.max`` carry them).

Metrics with no window (``put_metric`` values, the collector's own figures) are Gauges named as the metric.
Empty windows add nothing but their (unchanged) running totals.

Failures: an export that fails (receiver down, an HTTP error, past the timeout of a few seconds) makes
:meth:`~OtlpMetricHandler.flush` raise :class:`OtlpExportError`, which the collector logs once and counts in
``collector.handler_errors``; that pass's points are dropped (the cumulative Sums carry the totals on, so the
next export that gets through is right again). After a failure the handler waits 1 s, then 2, 4 .. up to 30 s
before trying again, dropping (and counting) the passes in between: a dead receiver costs the collector
nothing but that handler's thread. The exporter's own log records are kept out of the log (their reason goes
into the exception).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic.metrics import MetricData
from shmstat.errors import ConfigError
from shmstat.histogram import Histogram

from .otlp_export import (
    DEFAULT_TIMEOUT_S,
    OtlpExportError,
    catch_export_reasons,
    check_endpoint,
    collector_resource,
    export_reasons,
)
from .protocol import ColumnsHandler

if TYPE_CHECKING:
    from ..read.columns import Columns
    from ..read.rows import WindowRow

__all__ = ["DEFAULT_TIMEOUT_S", "OtlpExportError", "OtlpMetricHandler", "build_otlp_handler"]

_log = logging.getLogger("shmstat.collector")

_BACKOFF_S = (1.0, 30.0)
"""The wait after a failed export: first, and at most (doubling in between)."""
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.metric_exporter"
_INSTALL = "pip install 'shmstat[otlp]'"


@dataclass
class _Series:
    """Running totals of one (job, group, stat, rank)."""

    start_ns: int
    count: int = 0
    sum: float = 0.0


def _otel() -> Any:
    """The OpenTelemetry modules, imported on first use; :class:`ConfigError` naming the extra if missing."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import export
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    except ImportError:
        raise ConfigError(f"handler spec 'otlp:' needs OpenTelemetry: {_INSTALL}") from None
    return _Otel(export, OTLPMetricExporter, Resource, InstrumentationScope)


@dataclass(frozen=True)
class _Otel:
    export: Any
    exporter: Any
    resource: Any
    scope: Any


def build_otlp_handler(endpoint: str) -> OtlpMetricHandler:
    """The handler of spec ``otlp:ENDPOINT``; :class:`ConfigError` (one sentence) for a bad endpoint or when
    OpenTelemetry is not installed."""
    check_endpoint(endpoint, "handler", "http://127.0.0.1:4318/v1/metrics")
    return OtlpMetricHandler(endpoint)


class OtlpMetricHandler(ColumnsHandler):
    """Exports windows to an OTLP/HTTP receiver at ``endpoint`` (see the module docstring for what is sent).

    The collector hands it each pass as columns (:meth:`emit_columns`) and other metrics (:meth:`emit`) from one
    thread, then calls :meth:`flush` once per pass. ``exporter`` (anything with ``export(MetricsData)`` and
    ``shutdown()``) and ``clock`` (monotonic seconds) are for tests.
    """

    def __init__(self, endpoint: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, host: str | None = None,
                 exporter: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._otel = _otel()
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._exporter = exporter if exporter is not None else self._otel.exporter(endpoint=endpoint,
                                                                                    timeout=timeout_s)
        catch_export_reasons(_EXPORTER_LOGGER)
        self._resource = collector_resource(self._otel.resource, host)
        self._scope = self._otel.scope("shmstat.collector")
        self._clock = clock
        self._series: dict[tuple[str, str, str, int | None], _Series] = {}
        self._signed: set[tuple[str, str, str]] = set()  # stats whose sum went down once: non-monotonic
        # pending points of this pass: (kind, metric name, stat key or None) -> data points
        self._pending: dict[tuple[str, str, tuple[str, str, str] | None], list[Any]] = {}
        self._retry_at = 0.0
        self._backoff = _BACKOFF_S[0]
        self.exports = 0
        """Exports the receiver accepted."""
        self.failures = 0
        """Exports that failed, and passes dropped while waiting to try again."""
        self.points_dropped = 0

    def __repr__(self) -> str:
        return f"OtlpMetricHandler({self.endpoint!r})"

    # -- rows in ----------------------------------------------------------------------------------------
    def emit_columns(self, columns: Columns) -> None:
        """Add the points of every window of a pass (its merged rows and its per-rank rows), in row order."""
        for row in columns.to_rows():
            self._add_window(row, columns.job)

    def _add_window(self, row: WindowRow, job: str) -> None:
        """Add the points of one closed window (merged when ``row.rank`` is None, else of that rank)."""
        ex = self._otel.export
        s = row.summary
        start, end = row.start_ns, row.end_ns
        stat_key = (job, row.group, row.name)
        attrs: dict[str, str | int] = {"job": job, "group": row.group, "stat": row.name}
        if row.rank is not None:
            attrs["rank"] = row.rank
        series_key = (*stat_key, row.rank)
        series = self._series.get(series_key)
        if series is None:
            series = self._series[series_key] = _Series(start)
        series.count += s.count
        if s.count:
            series.sum += s.sum
            if s.min < 0:
                self._signed.add(stat_key)
        self._add("count", f"{row.name}.count", None, ex.NumberDataPoint(attrs, series.start_ns, end, series.count))
        self._add("sum", f"{row.name}.sum", stat_key, ex.NumberDataPoint(attrs, series.start_ns, end, series.sum))
        if not s.count:
            return
        skip = len(row.name) + 1
        for key, value in row.values().items():
            figure = key[skip:]
            if figure not in ("count", "sum"):
                self._add("gauge", key, None, ex.NumberDataPoint(attrs, start, end, float(value)))
        if s.hist is not None:
            self._add("hist", f"{row.name}.histogram", None, self._hist_point(attrs, start, end, row, s.hist))

    def _hist_point(self, attrs: dict[str, str | int], start: int, end: int, row: WindowRow, h: Histogram) -> Any:
        """The window's ExponentialHistogram point. Its population is the finite samples (OTLP's count is the
        zero count plus the buckets'): the infinities are left out, and so are the sum, min and max they make
        (the window's ``S.count``, ``S.min`` and ``S.max`` still have them)."""
        ex = self._otel.export
        s = row.summary
        return ex.ExponentialHistogramDataPoint(
            attributes=attrs, start_time_unix_nano=start, time_unix_nano=end,
            count=h.finite_count, sum=None if h.pos_inf or h.neg_inf else s.sum, scale=h.scale, zero_count=h.zero,
            positive=ex.Buckets(*_dense(h.pos)), negative=ex.Buckets(*_dense(h.neg)),
            flags=0, min=None if h.neg_inf else s.min, max=None if h.pos_inf else s.max,
        )

    def emit(self, metric_data: MetricData) -> None:
        """Add a metric that is not a window row (a put metric, a collector figure) as a Gauge point; a value
        that is not a number is skipped."""
        value = metric_data.value
        if isinstance(value, bool):
            value = int(value)
        elif not isinstance(value, int | float):
            return
        attrs: dict[str, str | int] = {"group": metric_data.group_name}
        job = getattr(metric_data, "job", None)
        if job is not None:
            attrs["job"] = job
        rank = getattr(metric_data, "rank", None)
        if rank is not None:
            attrs["rank"] = rank
        end = getattr(metric_data, "window_end", None)
        ts = int((end if end is not None else metric_data.timestamp) * 1e9)
        self._add("gauge", metric_data.name, None, self._otel.export.NumberDataPoint(attrs, 0, ts, value))

    def _add(self, kind: str, name: str, stat_key: tuple[str, str, str] | None, point: Any) -> None:
        points = self._pending.get((kind, name, stat_key))
        if points is None:
            points = self._pending[(kind, name, stat_key)] = []
        points.append(point)

    # -- out --------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send this pass's points in one export; raises :class:`OtlpExportError` if they did not get through
        (or were dropped while waiting to try again after a failure)."""
        if not self._pending:
            return
        data = self._metrics_data()
        points = sum(len(v) for v in self._pending.values())
        self._pending.clear()
        now = self._clock()
        if now < self._retry_at:
            self.failures += 1
            self.points_dropped += points
            raise OtlpExportError(f"OTLP export to {self.endpoint} failed recently; {points} points dropped "
                                  f"until the next attempt in {self._retry_at - now:.1f} s")
        reason = ""
        export_reasons.last.pop(threading.get_ident(), None)
        try:
            ok = self._exporter.export(data) == self._otel.export.MetricExportResult.SUCCESS
        except Exception as exc:  # an exporter's bug must not end the handler's thread
            ok, reason = False, repr(exc)
        if ok:
            if self.failures and self._backoff > _BACKOFF_S[0]:
                _log.info("OTLP export to %s works again", self.endpoint)
            self.exports += 1
            self._backoff = _BACKOFF_S[0]
            self._retry_at = 0.0
            return
        reason = reason or export_reasons.last.pop(threading.get_ident(), "") or "the receiver refused it"
        self.failures += 1
        self.points_dropped += points
        wait = self._backoff
        self._retry_at = self._clock() + wait
        self._backoff = min(self._backoff * 2, _BACKOFF_S[1])
        raise OtlpExportError(f"OTLP export to {self.endpoint} failed ({reason}); {points} points dropped, "
                              f"next attempt in {wait:.0f} s")

    def _metrics_data(self) -> Any:
        ex = self._otel.export
        cumulative, delta = ex.AggregationTemporality.CUMULATIVE, ex.AggregationTemporality.DELTA
        metrics = []
        for (kind, name, stat_key), points in self._pending.items():
            if kind == "count":
                data = ex.Sum(points, cumulative, True)
            elif kind == "sum":
                data = ex.Sum(points, cumulative, stat_key not in self._signed)
            elif kind == "hist":
                data = ex.ExponentialHistogram(points, delta)
            else:
                data = ex.Gauge(points)
            metrics.append(ex.Metric(name, "", "", data))
        scope = ex.ScopeMetrics(self._scope, metrics, "")
        return ex.MetricsData([ex.ResourceMetrics(self._resource, [scope], "")])

    def close(self) -> None:
        """Send what is pending, then shut the exporter down."""
        try:
            self.flush()
        finally:
            self._exporter.shutdown()


def _dense(counts: dict[int, int]) -> tuple[int, list[int]]:
    """``(offset, bucket_counts)`` of sparse ``{index: count}`` as OTLP has them (no buckets: ``(0, [])``)."""
    if not counts:
        return 0, []
    first = min(counts)
    return first, [counts.get(i, 0) for i in range(first, max(counts) + 1)]
