"""A user's own MetricHandler, loaded by the collector from a ``pkg.module:Class`` spec in tests."""

from __future__ import annotations

from elastic.metrics import MetricHandler


class Recording(MetricHandler):
    """Keeps what it receives."""

    def __init__(self) -> None:
        self.got: list = []

    def emit(self, metric_data) -> None:
        self.got.append(metric_data)


class Stuck(MetricHandler):
    """Blocks forever in its first ``emit`` (a handler waiting on a dead network peer), ignoring signals."""

    def emit(self, metric_data) -> None:
        import threading

        threading.Event().wait()
