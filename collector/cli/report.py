"""``shmstat report``: a finished job's jsonl output (and its ``--events`` file) as one self-contained HTML file;
one node's files or several nodes' (``shmstat report n1.jsonl n2.jsonl --events e1.jsonl --events e2.jsonl``).

Reading and drawing are two steps, so each can be tested on its own: :func:`load_report` reads the jsonl rows of
the windows handler (:class:`collector.handlers.jsonl.JsonlMetricHandler`'s format) and the events sink's lines
(:class:`collector.sinks.events.JsonlEventHandler`'s) into a :class:`JobReport`; :func:`render_html` draws it
with plotly.js (the ``plotly`` package's own copy, from the optional extra ``shmstat[report]``), inlined in the
page with every figure's data, so nothing is fetched when the page is opened (no network, no CDN).

The page holds: the job summary (ranks, windows, samples, drops, restarts, events and gaps, the job's put
metrics: never the collector's own points) and each rank that scored under the threshold, in words; per stat its
merged figure over time with the spread across ranks (the lowest and highest rank's figure of each window), its
percentiles over time (stats that keep them), and a rank x window heatmap of the straggler figure (the window's
p50 when the stat keeps percentiles, else its mean: the collector's rule, :mod:`collector.daemon.straggler`),
coloured by figure / the window's median on a fixed scale (:data:`RELATIVE_RANGE`), with the windows where a rank
scored under the threshold marked; the ``gpu`` group's stats in a section of their own; each put metric per rank
over time; the events and gaps on a timeline, each hang (``shmstat.hang`` to its ``shmstat.hang.resolved``) a band
on it and a line in words; the sections (group ``section``) as a stacked breakdown per window and rank, wait
sections hatched. Every chart shows its legend. Scores are the collector's own when the jsonl holds them (the
``shmstat`` group was configured) and the job has one node, otherwise they are computed from the rows with the
same rule.

Across nodes: a rank is ``(node, rank)`` (:data:`RankKey`), the node from each row's ``node`` (a file with rows that
name none: its file name when several files are read), so ranks of different nodes with the same number stay
apart; every rank is scored against the job-wide median of its window (the collector's scores, each against its
own node's median, are left aside), and the heatmaps have a row per node/rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from shmstat.errors import ConfigError

from ..daemon.straggler import DEFAULT_THRESHOLD
from .report_job import (
    AGGREGATIONS,
    GPU_GROUP,
    HANG_EVENT,
    RESOLVED_EVENT,
    Hang,
    JobReport,
    RankKey,
    StatSeries,
    Straggler,
    load_report,
)
from .report_page import RELATIVE_RANGE, plotly_js, render_html, window_label

__all__ = ["AGGREGATIONS", "GPU_GROUP", "HANG_EVENT", "RELATIVE_RANGE", "RESOLVED_EVENT", "Hang", "JobReport",
           "RankKey", "StatSeries", "Straggler", "load_report", "plotly_js", "render_html", "window_label",
           "write_report"]


def write_report(jsonl: str | Sequence[str], out: str | None = None, *, events: str | Sequence[str] | None = None,
                 job: str | None = None, threshold: float = DEFAULT_THRESHOLD) -> str:
    """Read ``jsonl`` (one file or each node's) and ``events``, write the report page to ``out`` (default: the
    first jsonl file with the suffix ``.html``) and return its path. Raises :class:`ConfigError` with one sentence
    for a bad argument."""
    report = load_report(jsonl, events, job=job)
    page = render_html(report, threshold=threshold)
    out = out or (os.path.splitext(jsonl if isinstance(jsonl, str) else jsonl[0])[0] + ".html")
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        raise ConfigError(f"cannot write the report {out!r}: {exc.strerror}") from None
    return out
