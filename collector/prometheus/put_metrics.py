"""Put metrics on ``/metrics``: every ``put_metric`` value (``@prof``'s ``.success``, ``.failure`` and
``.duration.ms`` included) folded into its series, one per (job, group, name, rank), bounded per job.

A series keeps the newest value, how many values were put (an int: exact at any count) and their sum (an int
while every value is an int, so ``@prof``'s counts add up exactly; a NaN or an infinity is counted but left
out of the sum, where it would stay forever). A job's series hold at most :data:`MAX_SERIES_BYTES` (each
costs its group and name in UTF-8 bytes plus :data:`SERIES_OVERHEAD_BYTES`); a value of a new series past
that bound, or a value that is not a real number, is dropped and counted per job (:attr:`PutMetrics.dropped`,
``shmstat_metric_dropped_total``). Series already kept keep counting.

:class:`PutMetrics` is not thread-safe: :class:`collector.prometheus.exporter.PrometheusExporter` calls it under
its lock.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SERIES_BYTES", "SERIES_OVERHEAD_BYTES", "PutMetrics", "PutSeries", "put_families"]

MAX_SERIES_BYTES = 4 << 20
"""What one job's put-metric series may hold (about 10,000 series of short names)."""
SERIES_OVERHEAD_BYTES = 384
"""What a series costs beyond its group and name bytes: the key, the record, the dict entry and the strings'
headers (measured with tracemalloc: ~320 bytes)."""

Key = tuple[str, str, str, int | None]
"""(job, group, name, rank); rank None for a metric the agent (``shmstat run``) put."""


@dataclass
class PutSeries:
    """One put metric's series: the newest value, how many values were put, and their sum."""

    value: float
    count: int
    total: int | float


class PutMetrics:
    """The put-metric series of every job, bounded per job in bytes (see the module docstring)."""

    def __init__(self, max_series_bytes: int = MAX_SERIES_BYTES) -> None:
        self.max_series_bytes = max_series_bytes
        self.series: dict[Key, PutSeries] = {}
        self.bytes_by_job: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        """Per job, the values not exported (their series did not fit, or they were not real numbers)."""

    def add(self, job: str, group: str, name: str, rank: int | None, value: Any) -> bool:
        """Fold one put value into its series; False when it was dropped (and counted)."""
        if not isinstance(value, numbers.Real):
            self._drop(job)
            return False
        key = (job, group, name, rank)
        cur = self.series.get(key)
        if cur is None:
            cost = len(group.encode("utf-8", "replace")) + len(name.encode("utf-8", "replace")) + SERIES_OVERHEAD_BYTES
            held = self.bytes_by_job.get(job, 0)
            if held + cost > self.max_series_bytes:
                self._drop(job)
                return False
            self.bytes_by_job[job] = held + cost
            self.dropped.setdefault(job, 0)
            cur = self.series[key] = PutSeries(0.0, 0, 0)
        number: int | float = int(value) if isinstance(value, numbers.Integral) else float(value)
        cur.value = float(number)
        cur.count += 1
        if isinstance(number, int) or math.isfinite(number):
            cur.total += number
        return True

    def _drop(self, job: str) -> None:
        self.dropped[job] = self.dropped.get(job, 0) + 1

    def forget(self, jobs: set[str]) -> None:
        """Drop every series of ``jobs`` (retired) and their counts."""
        for key in [k for k in self.series if k[0] in jobs]:
            del self.series[key]
        for job in jobs:
            self.bytes_by_job.pop(job, None)
            self.dropped.pop(job, None)

    def snapshot(self) -> tuple[list[tuple[Key, float, int, int | float]], list[tuple[str, int]]]:
        """Copies for a rendering made outside the lock: the series, and the drop counts per job."""
        return ([(k, s.value, s.count, s.total) for k, s in self.series.items()], list(self.dropped.items()))


def put_families(snapshot: tuple[list[tuple[Key, float, int, int | float]], list[tuple[str, int]]],
                 node: str) -> list[Any]:
    """The metric families of a :meth:`PutMetrics.snapshot`: ``shmstat_metric`` (gauge, newest value),
    ``shmstat_metric_count_total`` and ``shmstat_metric_sum_total`` (counters), ``shmstat_metric_dropped_total``
    (counter, per job)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.samples import Sample

    series, dropped = snapshot
    newest = GaugeMetricFamily("shmstat_metric", "Newest value of each put metric")
    count = CounterMetricFamily("shmstat_metric_count", "Values put to each put metric, running total")
    total = CounterMetricFamily("shmstat_metric_sum", "Sum of the finite values put to each put metric, "
                                "running total")
    for (job, group, name, rank), value, n, sm in series:
        labels = {"job": job, "node": node, "group": group, "name": name}
        if rank is not None:
            labels["rank"] = str(rank)
        newest.samples.append(Sample("shmstat_metric", labels, value))
        count.samples.append(Sample("shmstat_metric_count_total", labels, n))
        total.samples.append(Sample("shmstat_metric_sum_total", labels, sm))
    lost = CounterMetricFamily("shmstat_metric_dropped", "Put values not exported: their series did not fit the "
                               "job's bound, or they were not numbers")
    for job, n in dropped:
        lost.samples.append(Sample("shmstat_metric_dropped_total", {"job": job, "node": node}, n))
    return [newest, count, total, lost]
