"""User MetricHandlers built by the collector from ``pkg.module:Class,key=value`` specs in tests."""

from __future__ import annotations

import json

from collector import ColumnsHandler
from elastic.metrics import MetricHandler


class Configured(MetricHandler):
    """Records its keyword arguments (with their JSON types) in ``path`` when built, then each row it gets,
    scaled by ``scale``, and ``closed`` when closed."""

    def __init__(self, path: str, every: int = 1, scale: float = 1.0, enabled: bool = True,
                 label: str | None = None, tags: list | None = None, note: object = "unset") -> None:
        self.path = path
        self.scale = scale
        self._out = open(path, "w", encoding="utf-8")  # noqa: SIM115 - kept open until close()
        args = {"path": path, "every": every, "scale": scale, "enabled": enabled, "label": label, "tags": tags,
                "note": note}
        self._write({"args": args, "types": {k: type(v).__name__ for k, v in args.items()}})

    def _write(self, obj: dict) -> None:
        self._out.write(json.dumps(obj) + "\n")
        self._out.flush()

    def emit(self, metric_data) -> None:
        self._write({"name": metric_data.name, "rank": metric_data.rank, "value": metric_data.value * self.scale})

    def close(self) -> None:
        self._write({"closed": True})
        self._out.close()


class Refuses(MetricHandler):
    """A constructor that raises, with a message over two lines."""

    def __init__(self, limit: int = 0) -> None:
        raise ValueError(f"limit {limit} is too low\nraise it")

    def emit(self, metric_data) -> None:
        pass


class NotAHandler:
    """Has an ``emit`` but is no MetricHandler."""

    def emit(self, metric_data) -> None:
        pass


class NoEmit(MetricHandler):
    """A MetricHandler subclass that defines neither ``emit`` nor ``emit_columns`` (still abstract)."""


class NoColumns(ColumnsHandler):
    """A ColumnsHandler subclass that forgot ``emit_columns``."""

    def emit(self, metric_data) -> None:
        pass
