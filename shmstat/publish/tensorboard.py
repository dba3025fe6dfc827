"""An event handler that writes Stat windows to a TensorBoard ``SummaryWriter``.

Mirrors ``torch.monitor.TensorboardEventHandler``: only events named ``torch.monitor.Stat`` are written, one
scalar per data item, with the event's time as ``walltime``. Where we are better: torch passes no step (so
TensorBoard puts every point at step 0 unless plotted by wall time); we pass the window index as step.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from .events import STAT_EVENT, Event

__all__ = ["TensorboardEventHandler"]


class _ScalarWriter(Protocol):
    """What the handler needs from a writer: ``torch.utils.tensorboard.SummaryWriter.add_scalar``."""

    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int | None = None, walltime: float | None = None
    ) -> Any: ...


class TensorboardEventHandler:
    """An event handler that writes known events (``torch.monitor.Stat`` windows) to the provided writer.

    Register it with :func:`~shmstat.publish.events.register_event_handler`. For each ``torch.monitor.Stat`` event it
    calls ``writer.add_scalar(key, value, global_step=step, walltime=<event time as Unix seconds>)`` once per
    data item whose value is an int or float (a bool is written as ``0.0``/``1.0``; str values are skipped).
    Other events are ignored.

    The step is the window index: the int in the data key :attr:`WINDOW_INDEX_KEY` if the event carries one
    (that key is then not written as a scalar), otherwise a per-key counter that starts at 0 and counts the
    windows this handler has written for that key.
    """

    WINDOW_INDEX_KEY = "window_index"
    """Data key that, when present with an int value, gives the step of every scalar of the event."""

    def __init__(self, writer: _ScalarWriter) -> None:
        """Construct the handler around ``writer`` (any object with a SummaryWriter-style ``add_scalar``)."""
        self._writer = writer
        self._steps: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        """Write the numeric data of a ``torch.monitor.Stat`` event as scalars; ignore any other event."""
        if event.name != STAT_EVENT:
            return
        data = event.data
        timestamp_ns = getattr(event, "_timestamp_ns", None)  # torch's own Events lack it
        walltime = timestamp_ns() / 1_000_000_000 if timestamp_ns is not None else event.timestamp.timestamp()
        index_key = self.WINDOW_INDEX_KEY
        index = data.get(index_key)
        if type(index) is not int:
            index = None
        scalars: list[tuple[str, float | int, int]] = []
        with self._lock:
            steps = self._steps
            for key, value in data.items():
                if index is not None and key == index_key:
                    continue
                if isinstance(value, bool):
                    value = float(value)
                elif not isinstance(value, (int, float)):
                    continue
                if index is None:
                    step = steps.get(key, 0)
                    steps[key] = step + 1
                else:
                    step = index
                scalars.append((key, value, step))
        add_scalar = self._writer.add_scalar
        for key, value, step in scalars:
            add_scalar(key, value, global_step=step, walltime=walltime)

    def __repr__(self) -> str:
        """``TensorboardEventHandler(<writer>)``."""
        return f"TensorboardEventHandler({self._writer!r})"
