"""``shmstat top --nodes ENDPOINT...``: the job across its nodes' collectors, live.

The nodes' streams are followed by :class:`collector.jobwide.watch.NodeStreams` and scored by
:class:`collector.jobwide.watch.JobWatch`
(each rank and each node against the job-wide median, the one straggler rule); :func:`render_nodes` turns its
:meth:`~collector.jobwide.watch.JobWatch.views` into a frame (a pure function of them, testable without a terminal): per
job a header (job, clock, nodes heard), the hang line while the job hangs (the rank holding it, its node and
section; the nodes that wait), then per stat its newest scored window: each node (its figure, the median of its
ranks', and its score) followed by its ranks, a slow node marked ``SLOW NODE`` and a slow rank ``SLOW`` (bold red,
the mark kept without colour), and last each node gone silent (no message, no heartbeat: the host down or its
collector killed), marked ``SILENT 12 s`` with how long since it was last heard, without figures. The frame's
footer counts what the watcher did not fold in: rows that came after their window was scored, items the nodes'
heartbeats showed lost, messages that did not decode. Frames are refreshed as ``shmstat top``'s are
(:mod:`collector.cli.top_live`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from shmstat.errors import ConfigError

from ..daemon.straggler import DEFAULT_THRESHOLD, DEFAULT_WINDOWS
from ..jobwide.watch import DEFAULT_SILENT_AFTER_S, JobView, JobWatch, NodeStreams, StatScores
from .top import abbreviate, window_label
from .top_live import live_frames

__all__ = ["render_nodes", "run_top_nodes"]


def _score(value: float) -> str:
    return f"{value:.2f}" if value < 100 else abbreviate(value)


def _stat_table(s: StatScores, silent: tuple[tuple[str, float], ...], width: int, max_rows: int | None) -> Table:
    t = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
              header_style="bold", width=None if width >= 60 else width)
    t.add_column("NODE", no_wrap=True, overflow="ellipsis", min_width=6, max_width=max(12, min(width, 120) - 40))
    t.add_column("RANK", justify="right", no_wrap=True)
    t.add_column("P50|MEAN", justify="right", no_wrap=True, min_width=7)
    t.add_column("SCORE", justify="right", no_wrap=True, min_width=5)
    t.add_column("", no_wrap=True, min_width=9)
    rows = 0
    for n in s.nodes:
        if max_rows is not None and rows >= max_rows:
            t.add_row(Text(f"… {len(s.nodes)} nodes in all", style="dim"))
            break
        t.add_row(Text(n.node), Text(f"{n.ranks} ranks"), Text(abbreviate(n.figure)), Text(_score(n.score)),
                  Text("SLOW NODE" if n.slow else ""), style="bold red" if n.slow else "bold")
        rows += 1
        for r in (r for r in s.ranks if r.node == n.node):
            if max_rows is not None and rows >= max_rows:
                break
            t.add_row(Text(""), Text(str(r.rank)), Text(abbreviate(r.figure)), Text(_score(r.score)),
                      Text("SLOW" if r.slow else ""), style="bold red" if r.slow else None)
            rows += 1
    for node, silent_s in silent:  # no figure: its last window is not the job's now
        t.add_row(Text(node), Text("-"), Text("-"), Text("-"), Text(f"SILENT {silent_s:.0f} s"), style="bold yellow")
    return t


def _footer(jw: JobWatch) -> Text:
    return Text(f"from the nodes: {jw.late} late rows, {jw.lost} items lost, {jw.undecodable} undecodable messages",
                style="bold yellow" if jw.lost or jw.undecodable else "dim")


def render_nodes(views: Sequence[JobView], now_ns: int, *, stat: str | None = None, width: int = 80,
                 height: int | None = None, counts: JobWatch | None = None) -> RenderableType:
    """One frame of ``shmstat top --nodes`` for ``views`` (:meth:`collector.jobwide.watch.JobWatch.views`): per job, a
    header, the hang line if the job hangs, then per stat (only ``stat``, ``GROUP/NAME``, if given) its newest
    window scored across the nodes, node rows (``NODE``, ``N ranks``, figure, score) each followed by its ranks'
    rows, slow nodes and ranks bold red and marked ``SLOW NODE`` / ``SLOW``, silent nodes last, marked ``SILENT N s``.
    ``height`` bounds the rows. ``counts``: the watcher whose counts (late, lost, undecodable) end the frame."""
    if not views:
        empty = Text("nothing received from the nodes yet (are their collectors publishing there?)")
        return empty if counts is None else Group(empty, _footer(counts))
    parts: list[RenderableType] = []
    clock = time.strftime("%H:%M:%S", time.localtime(now_ns / 1e9))
    for job in views:
        if parts:
            parts.append(Text(""))
        parts.append(Text.assemble(("job ", "dim"), (job.job or "(per-job endpoint)", "bold cyan"), f"  {clock}  ",
                                   (f"nodes {len(job.nodes)}: {', '.join(sorted(job.nodes))}", "dim")))
        if job.hang is not None:
            parts.append(Text(job.hang.line, style="bold red"))
        stats = [s for s in job.stats if stat is None or s.key == stat]
        if not stats:
            parts.append(Text(f"no window of {stat} scored yet" if stat else "no window scored yet", style="dim"))
            parts.extend(Text(f"{node} SILENT {silent_s:.0f} s", style="bold yellow") for node, silent_s in job.silent)
            continue
        budget = None if height is None else max(3, (height - 3) // (len(stats) * len(views)) - 2)
        for s in stats:
            ns = s.window_ms * 1_000_000
            parts.append(Text(f"{s.key}  window {window_label(s.wid * ns, ns)}  job median {abbreviate(s.median)}",
                              style="dim"))
            parts.append(_stat_table(s, job.silent, width, budget))
    if counts is not None:
        parts.append(_footer(counts))
    return Group(*parts)


def run_top_nodes(endpoints: Sequence[str], *, curve: str | None = None, curve_client: str | None = None,
                  stat: str | None = None, interval_s: float = 1.0, once: bool = False,
                  iterations: int | None = None, threshold: float = DEFAULT_THRESHOLD, windows: int = DEFAULT_WINDOWS,
                  silent_after_s: float = DEFAULT_SILENT_AFTER_S, console: Console | None = None,
                  clock: Callable[[], int] = time.time_ns) -> int:
    """Show the job across ``endpoints`` (one per node: ``tcp://HOST:PORT`` or ``NODE=tcp://HOST:PORT``, CURVE
    as ``shmstat subscribe --curve DIR [--curve-client NAME]``) until Ctrl-C (exit status 0), for ``iterations``
    frames, or one frame (``once``: after ``interval_s`` of listening). ``threshold``/``windows``: the straggler
    rule's; ``silent_after_s``: how long a node may send nothing, heartbeats included, before it is shown silent
    (``--silent-after``). Frames are redrawn in place on a terminal, printed one after the other otherwise. Raises
    :class:`ConfigError` for a bad option, endpoint or key directory."""
    if not 0 < interval_s <= 3600:
        raise ConfigError(f"--interval must be more than 0 and at most 3600 seconds, got {interval_s:g}")
    if iterations is not None and iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {iterations}")
    if stat is not None and ("/" not in stat or stat.startswith("/") or stat.endswith("/")):
        raise ConfigError(f"--stat takes GROUP/NAME (as the table shows it), got {stat!r}")
    if not 0 < silent_after_s <= 3600:  # the flag's name in the sentence, not JobWatch's parameter
        raise ConfigError(f"--silent-after must be more than 0 and at most 3600 seconds, got {silent_after_s:g}")
    jw = JobWatch(threshold=threshold, windows=windows, settle_s=max(2.0, 2 * interval_s),
                  silent_after_s=silent_after_s)
    streams = NodeStreams(endpoints, jw, curve=curve, curve_client=curve_client)
    console = console or Console()

    def listen() -> None:
        until = time.monotonic() + interval_s
        while (left := until - time.monotonic()) > 0:
            streams.poll(min(left, 0.1))

    def frame(height: int | None) -> RenderableType:
        return render_nodes(jw.views(), clock(), stat=stat, width=console.width, height=height, counts=jw)

    try:
        if once or not console.is_terminal:
            n = 0
            while True:
                listen()
                console.print(frame(None))
                n += 1
                if once or (iterations is not None and n >= iterations):
                    return 0
                console.print()
        return live_frames(console, frame, iterations, listen)
    except KeyboardInterrupt:
        return 0
    finally:
        streams.close()
