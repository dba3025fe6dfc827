"""What ``shmstat run`` and ``shmstat collect`` print when no ``--handler`` says otherwise: one line per merged stat
window and one per straggler flagged or recovered (:class:`CompactWindowHandler`, handler spec ``compact``), and a
periodic one-line status (:func:`status_line`).

Per-rank rows, metrics put by ranks and ``@prof`` calls are not printed by the compact handler: they are one line
per call, which floods a terminal (ask for them with ``--handler GROUP=console``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING

from elastic.metrics import MetricData
from shmstat.aggregation import Aggregation, aggregation_key

from .protocol import ColumnsHandler, StragglerLines

if TYPE_CHECKING:
    from ..read.columns import Columns

__all__ = ["SHORT_JOB_LEN", "CompactWindowHandler", "StragglerLines", "short_job_ids", "status_line",
           "stopping_line", "straggler_line"]

SHORT_JOB_LEN = 8
"""How many characters of a job id a console line shows at least (more when two jobs share them)."""
_SHORT_JOBS_KEPT = 4096  # job ids remembered for their short form; past it the memory starts over


def short_job_ids(jobs: set[str] | frozenset[str]) -> dict[str, str]:
    """Each job's shortest prefix of at least :data:`SHORT_JOB_LEN` characters that no other job of ``jobs``
    starts with (the whole id when none is shorter)."""
    out = {}
    for job in jobs:
        n = min(SHORT_JOB_LEN, len(job))
        while n < len(job) and any(other != job and other.startswith(job[:n]) for other in jobs):
            n += 1
        out[job] = job[:n]
    return out


def straggler_line(name: str, data: dict[str, str | int | float | bool], job: str = "") -> str:
    """The console line of a straggler event, e.g. ``[12:00:05] straggler: rank 1 on train/step_ms scores 0.62
    (its 16.2 against a median of 10.1) for 3 windows``; ``job`` (a short id) goes after the time."""
    if name.startswith("shmstat.hang"):  # the hang detector's line (collector.daemon.hangs), stamped now
        return f"[{_stamp(time.time_ns() // 1_000_000_000 * 1000)}] {job + ' ' if job else ''}{data.get('line', name)}"
    start_ns = int(data.get("window_start_ns", 0))
    where = f"rank {data.get('rank')} on {data.get('group')}/{data.get('stat')}"
    head = f"[{_stamp(start_ns // 1_000_000)}] {job + ' ' if job else ''}"
    score = float(data.get("score", 0.0))
    if name.endswith(".recovered"):
        why = "scores as the others again" if data.get("reason") == "recovered" else "is no longer scored"
        return f"{head}straggler recovered: {where} {why} (score {score:.2f})"
    figure, median = float(data.get("figure", 0.0)), float(data.get("median", 0.0))
    return (f"{head}straggler: {where} scores {score:.2f} (its {figure:.4g} against a median of {median:.4g}) for "
            f"{data.get('windows')} windows")

_FIGURE = {Aggregation.SUM: "sum", Aggregation.MEAN: "mean", Aggregation.MAX: "max", Aggregation.MIN: "min",
           Aggregation.VALUE: "value", Aggregation.P50: "p50", Aggregation.P90: "p90", Aggregation.P99: "p99",
           Aggregation.P999: "p999"}


class CompactWindowHandler(StragglerLines, ColumnsHandler):
    """Prints one line per window merged across ranks, e.g.
    ``[12:00:05] train/step_ms  count=128 mean=12.4 p99=15 (4 ranks)``: the window's local start time, the stat,
    its exact sample count, then every other aggregation the stat asked for (torch.monitor's order), how many ranks
    the window merges, and ``torn`` when a writer died in the middle of an ``add``; and a line per straggler
    flagged or recovered (:func:`straggler_line`). ``show_job`` puts the job after the time (a node collector
    serves several), shortened (:meth:`shown`). Metrics that belong to no window (put by ranks, ``@prof``,
    the collector's own) are not printed: :attr:`takes_points` is False, so the collector does not even decode
    them for it."""

    takes_points = False
    """Metrics that belong to no window are of no use to this handler (see :meth:`Dispatcher.discards_points`)."""

    def __init__(self, out: IO[str] | None = None, *, show_job: bool = False) -> None:
        self.out = out
        self.show_job = show_job
        self.lines = 0
        self._lock = threading.Lock()  # a node collector's jobs share one handler
        self._short: dict[str, str] = {}

    def shown(self, job: str) -> str:
        """How the lines show ``job``: its shortest prefix of at least :data:`SHORT_JOB_LEN` characters unique
        among the jobs known so far (:meth:`know`)."""
        if job not in self._short:
            self.know([job])
        return self._short[job]

    def know(self, jobs: Iterable[str]) -> dict[str, str]:
        """Take ``jobs`` into account for the short forms (a node collector names the jobs on its node); returns
        the jobs known before whose short form changed, with the new one."""
        with self._lock:
            new = set(jobs) - set(self._short)
            if not new:
                return {}
            before = self._short if len(self._short) + len(new) <= _SHORT_JOBS_KEPT else {}
            self._short = short_job_ids(frozenset(set(before) | new))
            return {job: self._short[job] for job, was in before.items() if self._short[job] != was}

    def say_straggler(self, name: str, job: str, data: dict[str, str | int | float | bool]) -> None:
        """Print the line of a straggler flagged or recovered (:func:`straggler_line`)."""
        line = straggler_line(name, data, self.shown(job) if self.show_job and job else "")
        out = self.out if self.out is not None else sys.stdout
        with self._lock:
            out.write(line + "\n")
            out.flush()
            self.lines += 1

    def emit(self, metric_data: MetricData) -> None:
        """Ignore a metric that belongs to no window; windows arrive whole through :meth:`emit_columns`."""

    def emit_columns(self, columns: Columns) -> None:
        """Print one line per merged row of a pass."""
        merged = columns.merged()
        if not len(merged):
            return
        job = f"{self.shown(columns.job)} " if self.show_job and columns.job else ""
        figures = {a: getattr(merged, _FIGURE[a]).tolist() for a in _FIGURE}
        lines = []
        for i, (group, stat, count, ranks, wid, window_ms, torn) in enumerate(zip(
                merged.group.tolist(), merged.stat.tolist(), merged.count.tolist(), merged.ranks.tolist(),
                merged.wid.tolist(), merged.window_ms.tolist(), merged.torn.tolist(), strict=True)):
            shown = " ".join(f"{aggregation_key(a)}={_number(figures[a][i] if count else 0.0)}"
                             for a in merged.aggregations(i) if a in _FIGURE)
            lines.append(f"[{_stamp(wid * window_ms)}] {job}{group}/{stat}  count={count}{' ' if shown else ''}{shown} "
                         f"({ranks} rank{'' if ranks == 1 else 's'}){' torn' if torn else ''}")
        out = self.out if self.out is not None else sys.stdout
        with self._lock:
            out.write("\n".join(lines) + "\n")
            out.flush()
            self.lines += len(lines)


def _stamp(start_ms: int) -> str:
    """A window's local start time: ``12:00:05``, with milliseconds when it does not start on a second."""
    text = time.strftime("%H:%M:%S", time.localtime(start_ms // 1000))
    return text if start_ms % 1000 == 0 else f"{text}.{start_ms % 1000:03d}"


def _number(value: float) -> str:
    return f"{value:.6g}"


def status_line(counters: dict[str, int], *, ranks_alive: int, job: str | None = None, jobs: int | None = None,
                now: float | None = None, final: bool = False) -> str:
    """The one-line status: which job (or how many jobs served now), ranks alive, windows emitted, events relayed,
    and what was lost (``dropped``: handler rows dropped, sequence gaps, windows overwritten before they were read,
    events an events sink lost), with samples the ranks dropped for want of room, rejected frames and handler errors
    when there are any. ``final``: the collector's last line, ``stopped:``, the jobs it served in all and the
    ranks still running as it stops (``ranks_alive``: their processes live)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    who = f"job {job}" if job is not None else f"{jobs} job{'' if jobs == 1 else 's'}"
    dropped = (counters["handler_dropped"] + counters["seq_gaps"] + counters["windows_overwritten"]
               + counters.get("events_dropped", 0))
    ranks = f"{ranks_alive} rank{'' if ranks_alive == 1 else 's'}"
    if final:
        start = f"[{stamp}] shmstat: stopped: {who} served, {ranks} still running, "
    else:
        start = f"[{stamp}] shmstat: {who}, {ranks} alive, "
    line = (start +
            f"{counters['windows_emitted']} windows emitted, {counters['events_relayed']} events relayed, "
            f"{dropped} dropped")
    for key, label in (("samples_dropped", "samples dropped by ranks (no room: see shmstat ls)"),
                       ("frames_rejected", "frames rejected"), ("handler_errors", "handler errors"),
                       ("subscriber_items_lost", "items slow subscribers reported lost"),
                       ("handshakes_refused", "subscriber keys refused"),
                       ("handshakes_failed", "subscriber handshakes failed"),
                       ("subscription_resets", "publish sockets bound anew (too many subscription topics)")):
        if counters.get(key):
            line += f", {counters[key]} {label}"
    return line


def stopping_line(running: dict[str, int], slack_s: float, banks: int) -> str | None:
    """What a collector stopping while ranks still run says (None when none does): how many ranks of which jobs
    (``running``: job -> ranks), and within how long a successor must start (``slack_s``: the ring's ``banks``
    minus 2 windows of the shortest window) before their windows are overwritten, counted."""
    if not any(running.values()):
        return None
    total = sum(running.values())
    jobs = ", ".join(f"{job}: {n}" for job, n in sorted(running.items()) if n)
    ranks = "1 rank still runs" if total == 1 else f"{total} ranks still run"
    return (f"shmstat collector: stopping while {ranks} ({jobs}); start a "
            f"collector within {slack_s:g} s ({banks - 2} of the ring's {banks} windows) or their windows past that "
            f"are overwritten (counted as windows_overwritten); their events wait in the ranks")

