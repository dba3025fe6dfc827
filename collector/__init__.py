"""The node side of shmstat: the collector daemon, its handlers, the launcher and the ``shmstat`` CLI."""

from __future__ import annotations

from shmstat.shm.layout_records import WindowFigures

from .daemon.collector import PLATFORM_GROUP, Collector, CollectorConfig
from .handlers.console import CompactWindowHandler
from .handlers.dispatch import Dispatcher
from .handlers.jsonl import JsonlMetricHandler
from .handlers.protocol import AgentMetricData, ColumnsHandler, RowsAdapter
from .handlers.specs import build_handler
from .read.columns import Columns
from .read.rows import WindowRow
from .sinks.events import EventHandler, EventRecord, GapRecord
from .sinks.specs import build_event_handler

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
    "WindowFigures",
    "WindowRow",
    "build_event_handler",
    "build_handler",
]
