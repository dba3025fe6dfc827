"""What other threads of the collector's process hand to its loop (the launcher's agent: its own metrics and
the workers' status events): queued without a lock (a deque's appends and pops are atomic) and taken by the loop
each round (:meth:`Submitted.drain`). Used by :class:`collector.daemon.collector.Collector`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic.metrics import MetricData
from shmstat import wire

if TYPE_CHECKING:
    from ..handlers.dispatch import ThreadedDispatcher
    from ..prometheus.exporter import PrometheusExporter
    from ..wire.relay import Relay

__all__ = ["Submitted"]

_EventItem = tuple[str, int, dict[str, str | int | float | bool]]  # (name, ts_ns, data)


class Submitted:
    """Metrics and events made in this process, in the order submitted; any thread may add, one loop takes."""

    def __init__(self) -> None:
        self._items: deque[MetricData | _EventItem] = deque()

    def metric(self, metric: MetricData) -> None:
        """Queue a metric (thread-safe)."""
        self._items.append(metric)

    def event(self, name: str, data: dict[str, str | int | float | bool]) -> None:
        """Queue an event stamped now (thread-safe); ``data`` is copied."""
        self._items.append((name, time.time_ns(), dict(data)))

    def drain(self, job: str, dispatcher: ThreadedDispatcher, exporter: PrometheusExporter | None, relay: Relay,
              publish_event: Callable[[str, int, dict[str, str | int | float | bool]], None]) -> None:
        """On the loop's thread: dispatch every queued metric to its group's handlers, export it with no rank
        label and publish it; hand every queued event to ``publish_event``."""
        while self._items:
            item = self._items.popleft()
            if isinstance(item, MetricData):
                if not dispatcher.discards_points(item.group_name):
                    dispatcher.emit_points(item.group_name, [item])
                if exporter is not None:
                    exporter.observe_metric(job, item, None)
                topic = wire.metric_topic(item.group_name, item.name)
                relay.publish(topic, "metric", [[item.group_name, item.name, item.value, item.timestamp]])
            elif isinstance(item, tuple):
                publish_event(*item)
