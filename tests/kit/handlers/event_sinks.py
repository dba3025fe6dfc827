"""Users' own events sinks, loaded by the collector from ``--events pkg.module:Class`` specs in tests."""

from __future__ import annotations

import threading
import time


class Stuck:
    """Blocks forever in its first ``emit_events`` (a sink waiting on a dead network peer)."""

    def emit_events(self, batch) -> None:
        threading.Event().wait()


class Counting:
    """Counts what it receives; ``every`` is only there to take an argument."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.records = 0

    def emit_events(self, batch) -> None:
        self.records += len(batch)


class NotASink:
    """Has no ``emit_events``."""

    def emit(self, metric_data) -> None:
        pass


class Exploding:
    """Its constructor raises."""

    def __init__(self) -> None:
        raise RuntimeError("no sink today\nsecond line")

    def emit_events(self, batch) -> None:
        pass


class Slow:
    """Takes ``seconds`` over every batch (a sink writing to a slow disk or a far peer): it is always about that
    far behind what events arrive, and a collector that stops finds it still holding some."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds

    def emit_events(self, batch) -> None:
        time.sleep(self.seconds)
