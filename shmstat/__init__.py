"""shmstat: multiprocess shared-memory telemetry, a drop-in for ``torch.monitor``.

``from shmstat import Stat, Aggregation, Event, log_event, register_event_handler`` works like
``torch.monitor``; in a job (``shmstat.init(...)`` or ``SHMSTAT_JOB`` / torchrun's variables) stats go to the
node's shared-memory segment and events to the node's collector.
"""

from __future__ import annotations

from .aggregation import COUNT, MAX, MEAN, MIN, SUM, VALUE, Aggregation  # torch.monitor.COUNT etc. too
from .errors import (
    CapacityError,
    CollectorError,
    ConfigError,
    EventTooLargeError,
    LayoutMismatchError,
    SegmentError,
    ShmstatError,
    WireError,
)
from .job.attach import init, shutdown
from .job.counters import stats
from .publish.events import (
    STAT_EVENT,
    Event,
    EventHandlerHandle,
    data_value_t,
    log_event,
    register_event_handler,
    unregister_event_handler,
)
from .publish.tensorboard import TensorboardEventHandler
from .writer.sections import advance_step, section
from .writer.stat import Stat

__all__ = [  # noqa: RUF022 (in the order the API reference shows: what a rank uses first, aliases, errors)
    "Stat",
    "section",
    "advance_step",
    "Aggregation",
    "Event",
    "log_event",
    "register_event_handler",
    "unregister_event_handler",
    "EventHandlerHandle",
    "TensorboardEventHandler",
    "data_value_t",
    "init",
    "shutdown",
    "stats",
    "STAT_EVENT",
    "COUNT",
    "MAX",
    "MEAN",
    "MIN",
    "SUM",
    "VALUE",
    "ShmstatError",
    "ConfigError",
    "CapacityError",
    "CollectorError",
    "EventTooLargeError",
    "LayoutMismatchError",
    "SegmentError",
    "WireError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``shmstat.torch`` (:mod:`shmstat.torch`) on first use: importing shmstat does not import torch's helpers."""
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
