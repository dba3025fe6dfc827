"""What a jsonl file already holds when a collector opens it, so that the windows a restarted collector emits
again are not written twice (:func:`resume_jsonl`, used by :class:`collector.handlers.api.JsonlMetricHandler`).

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
import os
import stat
import sys
from typing import NamedTuple

__all__ = ["DEFAULT_TAIL_BYTES", "WindowKey", "resume_jsonl"]

_log = logging.getLogger("shmstat.collector")

DEFAULT_TAIL_BYTES = 16 << 20
"""Bytes at the end of a jsonl file read back on open for the windows already written."""

WindowKey = tuple[str | None, str, str, int | None, float, object]
"""(job, group, name, rank or None for the merged row, window start in unix seconds, value as written): one row of
one window. The value is part of it so that a second row a window may legitimately get (a merged row split by a
stalled rank, see README's Guarantees) is not taken for one written already."""


class Resumed(NamedTuple):
    """What :func:`resume_jsonl` found: the windows' rows already in the file, and bytes of a cut line removed."""

    written: set[WindowKey]
    repaired: int


def resume_jsonl(fd: int, path: str, tail_bytes: int = DEFAULT_TAIL_BYTES) -> Resumed:
    """Repair a cut last line of the file open (for writing) on ``fd`` and read the window rows of its last
    ``tail_bytes``; a file that is not a regular file, or that cannot be read, is left as it is."""
    try:
        st = os.fstat(fd)
    except OSError:
        return Resumed(set(), 0)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return Resumed(set(), 0)
    size = st.st_size
    start = max(0, size - tail_bytes)
    try:
        rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # written through a path we may not read back: nothing to resume from
        return Resumed(set(), 0)
    try:
        if os.fstat(rfd).st_ino != st.st_ino:  # the path names another file now
            return Resumed(set(), 0)
        data = os.pread(rfd, size - start, start)
    finally:
        os.close(rfd)
    repaired = 0
    if not data.endswith(b"\n"):
        cut = data.rfind(b"\n")
        if cut < 0 and start > 0:  # one line longer than the tail: not ours to judge
            return Resumed(set(), 0)
        keep = start + cut + 1
        with contextlib.suppress(OSError):
            os.ftruncate(fd, keep)
            repaired = size - keep
            data = data[: cut + 1]
            _log.warning("jsonl output %r ended in a cut line (a collector was killed while writing it): %d bytes "
                         "removed; the rows are written again whole", path, repaired)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first may be the end of a line that began before the tail
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
