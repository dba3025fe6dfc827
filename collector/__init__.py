"""The node side of shmstat: the collector daemon, its handlers, the launcher and the ``shmstat`` CLI."""

from __future__ import annotations

from .daemon.collector import PLATFORM_GROUP, Collector, CollectorConfig
from .handlers.api import AgentMetricData, Dispatcher, JsonlMetricHandler, build_handler
from .handlers.compact import CompactWindowHandler
from .handlers.events import EventHandler, EventRecord, GapRecord, build_event_handler
from .handlers.protocol import ColumnsHandler, RowsAdapter
from .read.columns import Columns
from .read.merge import Summary, WindowRow

__all__ = [
    "PLATFORM_GROUP",
    "AgentMetricData",
    "Collector",
    "CollectorConfig",
    "Columns",
    "ColumnsHandler",
    "CompactWindowHandler",
    "Dispatcher",
    "EventHandler",
    "EventRecord",
    "GapRecord",
    "JsonlMetricHandler",
    "RowsAdapter",
    "Summary",
    "WindowRow",
    "build_event_handler",
    "build_handler",
]
