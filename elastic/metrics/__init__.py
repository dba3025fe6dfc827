"""``elastic.metrics``: torchelastic's metrics API (``torch.distributed.elastic.metrics``), shmstat-backed.

Change ``import torch.distributed.elastic.metrics as metrics`` to ``import elastic.metrics as metrics`` and
the code runs unchanged: ``configure(handler, group)``, ``put_metric(name, value, group)``, ``@prof``,
``getStream(group).add_value(name, value)``, the handlers and :data:`MetricData` behave as in torchelastic.

In a process attached to a job (``shmstat.init(...)``, ``SHMSTAT_JOB`` or torchrun's variables), metrics of
groups without an in-process handler go to the node's collector, which dispatches them per group; outside a
job they go nowhere, exactly like torchelastic's default. :class:`StatMetricData` is our addition: the
MetricData rows the collector makes from shared-memory stat windows (per rank or merged).

The package exports exactly what ``torch.distributed.elastic.metrics`` exports, plus :class:`StatMetricData`
and :class:`CollectorMetricHandler`; ``MetricStream`` (what :func:`getStream` returns) lives in
:mod:`elastic.metrics.emitting`, which is also ``elastic.metrics.api``, as in torchelastic.
"""

from __future__ import annotations

from . import api as api  # torchelastic's metrics.api, an attribute of the package as there
from .emitting import (
    CollectorMetricHandler,
    ConsoleMetricHandler,
    MetricData,
    MetricHandler,
    MetricsConfig,
    NullMetricHandler,
    StatMetricData,
    configure,
    get_elapsed_time_ms,
    getStream,
    initialize_metrics,
    prof,
    profile,
    publish_metric,
    put_metric,
)

__all__ = [
    "CollectorMetricHandler",
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "MetricsConfig",
    "NullMetricHandler",
    "StatMetricData",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]
