"""torchelastic's handler classes: the :class:`MetricHandler` base, the console and the null handler."""

from __future__ import annotations

import abc

from ._data import MetricData

__all__ = ["ConsoleMetricHandler", "MetricHandler", "NullMetricHandler"]


class MetricHandler(abc.ABC):
    """Where metric data points go. Subclass it and implement :meth:`emit`."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None:
        """Handle one data point (called synchronously by ``put_metric`` / ``MetricStream.add_value``)."""


class ConsoleMetricHandler(MetricHandler):
    """Prints each data point to stdout as ``[<timestamp>][<group>]: <name>=<value>`` (torchelastic's format)."""

    def emit(self, metric_data: MetricData) -> None:
        """Print ``metric_data`` in torchelastic's console format."""
        print(f"[{metric_data.timestamp}][{metric_data.group_name}]: {metric_data.name}={metric_data.value}")


class NullMetricHandler(MetricHandler):
    """Discards every data point."""

    def emit(self, metric_data: MetricData) -> None:
        """Do nothing."""
