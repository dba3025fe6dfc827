"""Columnar handlers (``emit_columns``) the collector loads from ``pkg.module:Class,key=value`` specs in tests."""

from __future__ import annotations

import json
import threading

from collector.handlers.jsonl import JsonlMetricHandler
from collector.handlers.tensorboard_sink import TensorboardMetricHandler
from elastic.metrics import MetricHandler, StatMetricData


class Recorder(MetricHandler):
    """Writes every pass it receives to ``path`` as one JSON line of columns (count, rank, wid, stat, p50, p99)."""

    def __init__(self, path: str) -> None:
        self._out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open until close()

    def emit(self, metric_data) -> None:
        pass

    def emit_columns(self, columns) -> None:
        self._out.write(json.dumps({
            "job": columns.job, "group": columns.group.tolist(), "stat": columns.stat.tolist(),
            "rank": columns.rank.tolist(), "ranks": columns.ranks.tolist(), "wid": columns.wid.tolist(),
            "count": columns.count.tolist(), "p50": columns.p50.tolist(), "p99": columns.p99.tolist(),
            "agg_mask": columns.agg_mask.tolist(),
        }) + "\n")
        self._out.flush()

    def close(self) -> None:
        self._out.close()


class StuckColumns(MetricHandler):
    """Blocks forever in its first ``emit_columns``."""

    def emit(self, metric_data) -> None:
        pass

    def emit_columns(self, columns) -> None:
        threading.Event().wait()


class RaisingColumns(MetricHandler):
    """Raises in every ``emit_columns``."""

    def emit(self, metric_data) -> None:
        pass

    def emit_columns(self, columns) -> None:
        raise ValueError("this columnar handler always fails")


def rows_the_old_way(columns) -> list[StatMetricData]:
    """The MetricData the per-row path built before columns existed: WindowRow.values() per row."""
    out = []
    for row in columns.to_rows():
        start, end = row.start_ns / 1e9, row.end_ns / 1e9
        out += [StatMetricData(end, row.group, key, value, rank=row.rank, window_start=start, window_end=end,
                               torn=row.summary.torn, job=columns.job) for key, value in row.values().items()]
    return out


class Both(MetricHandler):
    """Writes each pass twice: through the jsonl and tensorboard sinks' ``emit_columns`` (into ``cols_jsonl``,
    ``cols_tb``) and, row by row, through their ``emit`` (into ``rows_jsonl``, ``rows_tb``)."""

    def __init__(self, cols_jsonl: str, rows_jsonl: str, cols_tb: str, rows_tb: str) -> None:
        self.sinks = (JsonlMetricHandler(cols_jsonl), JsonlMetricHandler(rows_jsonl),
                      TensorboardMetricHandler(cols_tb), TensorboardMetricHandler(rows_tb))

    def emit(self, metric_data) -> None:
        for sink in self.sinks:
            sink.emit(metric_data)

    def emit_columns(self, columns) -> None:
        cols_jsonl, rows_jsonl, cols_tb, rows_tb = self.sinks
        cols_jsonl.emit_columns(columns)
        cols_tb.emit_columns(columns)
        rows_tb.start_job(columns.job, columns.job_start_ns)  # what rows do not carry: when the job started
        for metric in rows_the_old_way(columns):
            rows_jsonl.emit(metric)
            rows_tb.emit(metric)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
