"""The ``jsonl:PATH`` handler (:class:`JsonlMetricHandler`): one JSON object per metric, appended to a file, exactly
once across collector restarts.

What a jsonl file already holds when a collector opens it, so that the windows a restarted collector emits
again are not written twice (:func:`resume_jsonl`, used by :class:`JsonlMetricHandler`).

A collector commits a pass's watermark only once every handler took it (:mod:`collector.daemon.commits`), so a
collector killed between the jsonl handler's write and that commit leaves rows in the file that the next
collector emits again. On open, the handler repairs the last line if a kill cut it (the file is truncated after
the last complete line: those rows are emitted again whole), then reads the file's last ``tail_bytes`` (16 MiB by
default: bounded work at start, about 90,000 rows) for the window rows already written, keyed by (job, group,
name, rank, window start, value); a row emitted again with the same key is skipped. Rows of windows written
further back than the tail are written again only if a handler held the watermark back that long
(``commit_wait_s``), which a restart then shows as a repeated row. Files that are not regular files (a pipe,
``/dev/stdout``) are written as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import numpy as np

from elastic.metrics import MetricData
from shmstat.errors import ConfigError

from .protocol import ColumnsHandler

if TYPE_CHECKING:
    from ..read.columns import Columns

__all__ = ["DEFAULT_TAIL_BYTES", "REPAIR_BYTES", "JsonlMetricHandler", "WindowKey", "read_tail", "resume_jsonl"]

_log = logging.getLogger("shmstat.collector")

DEFAULT_TAIL_BYTES = 16 << 20
"""Bytes at the end of a jsonl file read back (before the first write) for the windows already written."""
REPAIR_BYTES = 1 << 16
"""Bytes read at open to repair a cut last line before anything else happens (the rest is read later)."""

WindowKey = tuple[str | None, str, str, int | None, float, object]
"""(job, group, name, rank or None for the merged row, window start in unix seconds, value as written): one row of
one window. The value is part of it so that a second row a window may legitimately get (a merged row split by a
stalled rank, see README's Guarantees) is not taken for one written already."""


class Resumed(NamedTuple):
    """What :func:`resume_jsonl` found: the windows' rows already in the file, and bytes of a cut line removed."""

    written: set[WindowKey]
    repaired: int


def read_tail(fd: int, path: str, tail_bytes: int) -> tuple[list[bytes], int]:
    """The whole lines of the last ``tail_bytes`` of the file open (for writing) on ``fd``, after cutting off a last
    line a kill left unfinished; and how many bytes were cut. A file that is not a regular file, or that cannot be
    read back through ``path``, is left as it is (no lines)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return [], 0
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return [], 0
    size = st.st_size
    start = max(0, size - tail_bytes)
    try:
        rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # written through a path we may not read back: nothing to resume from
        return [], 0
    try:
        if os.fstat(rfd).st_ino != st.st_ino:  # the path names another file now
            return [], 0
        data = os.pread(rfd, size - start, start)
    finally:
        os.close(rfd)
    repaired = 0
    if not data.endswith(b"\n"):
        cut = data.rfind(b"\n")
        if cut < 0 and start > 0:  # one line longer than the tail: not ours to judge
            return [], 0
        keep = start + cut + 1
        with contextlib.suppress(OSError):
            os.ftruncate(fd, keep)
            repaired = size - keep
            data = data[: cut + 1]
            _log.warning("jsonl output %r ended in a cut line (a collector was killed while writing it): %d bytes "
                         "removed; what they held is written again whole", path, repaired)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first may be the end of a line that began before the tail
    return lines, repaired


def resume_jsonl(fd: int, path: str, tail_bytes: int = DEFAULT_TAIL_BYTES) -> Resumed:
    """Repair a cut last line of the file open (for writing) on ``fd`` and read the window rows of its last
    ``tail_bytes`` (:func:`read_tail`)."""
    lines, repaired = read_tail(fd, path, tail_bytes)
    written: set[WindowKey] = set()
    for line in lines:
        if b'"window_start": null' in line or not line:
            continue
        try:
            row = json.loads(line)
            job = row.get("job")
            key = (None if job is None else sys.intern(job), sys.intern(row["group"]), sys.intern(row["name"]),
                   row["rank"], float(row["window_start"]), row["value"])  # (interned: one copy of each name)
        except (ValueError, KeyError, TypeError, AttributeError):  # not a row of ours: not a window written
            continue
        written.add(key)
    return Resumed(written, repaired)


class JsonlMetricHandler(ColumnsHandler):
    """Appends one JSON object per metric to a file: timestamp, group, name, value, rank, window start/end, job.

    ``rank`` is null for rows merged across ranks and for metrics put by ranks; ``window_start`` and
    ``window_end`` (unix seconds) are null for put metrics. Non-finite floats are written as the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so every line is strict JSON. The file is opened 0600 in
    append mode, and flushed after every collector pass.

    Exactly once across collector crashes: on open, a last line cut by a kill is removed and the rows of the
    windows in the file's last ``tail_bytes`` are not written again (:func:`resume_jsonl`).
    """

    def __init__(self, path: str, tail_bytes: int = DEFAULT_TAIL_BYTES) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open jsonl output {path!r}: {exc.strerror}") from None
        read_tail(fd, path, REPAIR_BYTES)  # a cut last line repaired at once (a small read, nothing parsed)
        self._tail_bytes = tail_bytes
        self._resumed = False  # the tail is read by the first emit, in the handler's thread: not on the start's path
        self._written: set[WindowKey] = set()
        """Rows of windows the file's tail held when opened (skipped if emitted again)."""
        self.skipped = 0
        """Rows not written because the file already held them (windows emitted again by a restarted collector)."""
        self._out: IO[str] = os.fdopen(fd, "a", encoding="utf-8", buffering=1 << 16)

    def _resume(self) -> None:
        """Read the windows the file's tail holds (once, before the first write; a collector starting with a
        large file serves at once and its handler's thread reads it meanwhile)."""
        self._resumed = True
        try:
            fd = self._out.fileno()
        except (OSError, ValueError):  # not a file underneath: nothing to resume from
            return
        self._written = resume_jsonl(fd, self.path, self._tail_bytes).written

    def emit(self, metric_data: MetricData) -> None:
        """Write one line for ``metric_data`` (a metric put by a rank, the collector's own figures, or a user's
        row: whatever it carries of rank, window, job)."""
        if not self._resumed:
            self._resume()
        start = getattr(metric_data, "window_start", None)
        if self._written and start is not None and (
                getattr(metric_data, "job", None), metric_data.group_name, metric_data.name,
                getattr(metric_data, "rank", None), float(start), _json_number(metric_data.value)) in self._written:
            self.skipped += 1
            return
        self._out.write(_line(metric_data.timestamp, metric_data.group_name, metric_data.name, metric_data.value,
                              getattr(metric_data, "rank", None), getattr(metric_data, "window_start", None),
                              getattr(metric_data, "window_end", None), getattr(metric_data, "torn", False),
                              getattr(metric_data, "job", None), getattr(metric_data, "source_rank", None)) + "\n")

    def emit_columns(self, columns: Columns) -> None:
        """Write one line per figure of a pass, in the order of :meth:`collector.read.columns.Columns.flat`."""
        if not self._resumed:
            self._resume()
        job = columns.job
        rows: Iterable[tuple[float, str, str, float, int | None, float, bool]] = columns.flat()
        if self._written:  # a restarted collector may emit again windows the file holds: those rows are skipped
            every, written = list(rows), self._written
            rows = [row for row in every
                    if (job, row[1], row[2], row[4], row[5], _json_number(row[3])) not in written]
            self.skipped += len(every) - len(rows)
        # the stats that declared higher_is_better (rates): their rows say so, so a reader scores them as the
        # collector does (collector.cli.report); a row's name is "<stat>.<aggregation>"
        rates = {(columns.group[i], columns.stat[i]) for i in np.flatnonzero(columns.higher_is_better).tolist()}
        waits = {(columns.group[i], columns.stat[i]) for i in np.flatnonzero(columns.wait).tolist()}
        lines = [_line(end, group, name, value, rank, start, end, torn, job, None,
                       bool(rates) and (group, name.rpartition(".")[0]) in rates,
                       bool(waits) and (group, name.rpartition(".")[0]) in waits)
                 for end, group, name, value, rank, start, torn in rows]
        if lines:
            lines.append("")
            self._out.write("\n".join(lines))

    def flush(self) -> None:
        """Push buffered lines to the file."""
        self._out.flush()

    def close(self) -> None:
        """Flush and close the file."""
        if not self._out.closed:
            self._out.close()


def _line(timestamp: float, group: str, name: str, value: Any, rank: int | None, start: float | None,
          end: float | None, torn: bool, job: str | None, source_rank: int | None,
          higher_is_better: bool = False, wait: bool = False) -> str:
    """The one JSON line of a figure (the only place the jsonl format is written)."""
    row = {"timestamp": timestamp, "group": group, "name": name, "value": _json_number(value), "rank": rank,
           "window_start": start, "window_end": end}
    if torn:
        row["torn"] = True
    if higher_is_better:
        row["higher_is_better"] = True
    if wait:
        row["wait"] = True
    if job is not None:
        row["job"] = job
    if source_rank is not None:
        row["source_rank"] = source_rank
    return json.dumps(row, allow_nan=False)


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value
