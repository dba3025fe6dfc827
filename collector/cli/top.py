"""``shmstat top``: what a job's segment holds right now, as a person on the node wants to see it.

Two steps, so that a frame can be tested without a terminal: :func:`snapshot` reads the segment (the newest
closed window of every stat, merged across ranks, each rank's figure and straggler score in that window) into
small frozen dataclasses (:mod:`collector.cli.top_snapshot`, which says how the windows are merged and scored),
and :func:`render` turns a :class:`TopSnapshot` into a ``rich`` renderable (a pure function of the snapshot).
``view="sections"`` shows each rank's time split across its sections (:func:`shmstat.section`) and what it is
doing now (its phase word). The live loop and ``--once`` are in :mod:`collector.cli.top_live`; the history under
the table (sparklines of the last windows, straggler marks over time) is kept by
:class:`collector.cli.top_history.History`.
"""

from __future__ import annotations

import math
import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .top_history import History, marks, sparkline
from .top_snapshot import JobView, RankFigure, RankGpu, RankPhase, StatView, TopSnapshot, snapshot

# JobView, RankFigure, RankGpu, RankPhase, StatView, TopSnapshot and snapshot are defined in top_snapshot
__all__ = [
    "SECTION_SORTS", "SORTS", "VIEWS", "WAIT_MARK", "JobView", "RankFigure", "RankGpu", "RankPhase", "StatView",
    "TopSnapshot", "abbreviate", "gpu_cell", "render", "snapshot", "window_label",
]

SORTS = ("name", "count", "mean", "p99", "spread")
"""Sort keys of ``--sort``: ``name`` ascending, the numbers descending (unknown values last)."""
SECTION_SORTS = ("name", "spread")
"""The sort keys of the sections view: ``name`` by rank, ``spread`` the worst score first (the rank's lowest
across its compute sections). ``count``, ``mean`` and ``p99`` are a section's, and a rank has one per section."""
VIEWS = ("stats", "ranks", "sections")
"""``stats``: one row per stat of each job; ``ranks``: one row per rank of one stat; ``sections``: one row per rank,
its time split across its sections and its current section."""
SECTION_GROUP = "section"  # the group of every section's Stat (shmstat.writer.sections)
WAIT_MARK = "~"
"""Marks a wait section (a collective, a barrier): its column's header and a rank waiting in it now."""

# -- rendering ----------------------------------------------------------------------------------------------------

_NUMBER_WIDTH = 6


def abbreviate(value: float | None) -> str:
    """A number in at most 6 characters: ``12.5``, ``0.125``, ``1.23k``, ``-4.5M``, ``1.2e-5``; ``-`` for None."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    text = ""
    for digits in (3, 2, 1):
        text = _short(float(value), digits)
        if len(text) <= _NUMBER_WIDTH:
            break
    return text


def _short(value: float, digits: int) -> str:
    a = abs(value)
    if a < 0.01 or a >= 999.5e15:
        mantissa, exp = f"{value:.{digits - 1}e}".split("e")
        if "." in mantissa:
            mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exp)}"
    if a < 999.5:
        return str(int(value)) if value == int(value) else f"{value:.{digits}g}"
    for unit in ("k", "M", "G", "T", "P"):
        value /= 1000.0
        if abs(value) < 999.5:
            return f"{value:.{digits}g}{unit}"
    raise AssertionError(value)  # pragma: no cover (caught above)


def window_label(start_ns: int, window_ns: int) -> str:
    """``HH:MM:SS.mmm +LEN``: a window's local start time and its length (``100ms``, ``1s``, ``1m``)."""
    start_s = start_ns / 1e9
    ms = (start_ns // 1_000_000) % 1000
    length_ms = window_ns / 1e6
    if length_ms < 1000:
        length = f"{length_ms:g}ms"
    elif length_ms < 60_000 or length_ms % 60_000:
        length = f"{length_ms / 1000:g}s"
    else:
        length = f"{length_ms / 60_000:g}m"
    return f"{time.strftime('%H:%M:%S', time.localtime(start_s))}.{ms:03d} +{length}"


def _sorted(stats: tuple[StatView, ...], sort: str) -> list[StatView]:
    if sort == "name":
        return sorted(stats, key=lambda s: (s.key, s.window_ns))
    pick = {
        "count": lambda s: s.merged.count,
        "mean": lambda s: s.merged.mean,
        "p99": lambda s: s.merged.quantile(0.99),
        "spread": lambda s: s.spread,
    }[sort]
    return sorted(stats, key=lambda s: (pick(s) is None, -(pick(s) or 0.0), s.key))


def _sorted_ranks(ranks: tuple[RankFigure, ...], sort: str) -> list[RankFigure]:
    if sort == "name":
        return sorted(ranks, key=lambda r: r.rank)
    if sort == "spread":  # the worst score first
        return sorted(ranks, key=lambda r: (r.score is None, r.score if r.score is not None else 0.0, r.rank))
    pick = {
        "count": lambda r: r.summary.count,
        "mean": lambda r: r.summary.mean,
        "p99": lambda r: r.summary.quantile(0.99),
    }[sort]
    return sorted(ranks, key=lambda r: (pick(r) is None, -(pick(r) or 0.0), r.rank))


def _table(width: int) -> Table:
    return Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
                 header_style="bold", width=min(width, 120), expand=True)


def _add_row(t: Table, *cells: str | Text, style: str | None = None) -> None:
    """A row whose text cells are shown as written: a ``str`` given to ``rich`` is parsed as markup (``tok[/s]``
    raises, ``[b]x[/b]`` loses its brackets), and a cell may hold a name."""
    t.add_row(*(Text(c) if isinstance(c, str) else c for c in cells), style=style)


def _num_columns(t: Table, *names: str) -> None:
    for n in names:
        t.add_column(n, justify="right", no_wrap=True, min_width=_NUMBER_WIDTH, max_width=_NUMBER_WIDTH + 1)


def _at(r: RankFigure | None) -> str:
    return "-" if r is None else f"{abbreviate(r.figure)} r{r.rank}"


def _ranks_list(ranks: tuple[int, ...], room: int = 6) -> str:
    text = ",".join(str(r) for r in ranks)
    return text if len(text) <= room else text[: room - 1].rsplit(",", 1)[0] + "…"


def _windows_label(stats: list[StatView], now_ns: int) -> str:
    """The windows shown (the most common first; rows of a stat with another window length or a later or
    earlier newest window differ) and how long ago the first one ended."""
    labels: dict[str, int] = {}
    ends: dict[str, int] = {}
    for s in stats:
        label = window_label(s.start_ns, s.window_ns)
        labels[label] = labels.get(label, 0) + 1
        ends[label] = s.start_ns + s.window_ns
    if not labels:
        return "no closed window yet"
    ordered = sorted(labels, key=lambda k: -labels[k])
    shown = ", ".join(ordered[:2])
    more = f" (+{len(ordered) - 2} more)" if len(ordered) > 2 else ""
    return f"window {shown}{more}, ended {_age(now_ns - ends[ordered[0]])} ago"


def _age(ns: int) -> str:
    s = max(ns, 0) / 1e9
    for limit, unit, div in ((60, "s", 1), (3600, "m", 60), (86400, "h", 3600)):
        if s < limit:
            return f"{s / div:.1f}{unit}" if unit == "s" else f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def _header(job: JobView, snap: TopSnapshot, windows: str) -> Text:
    clock = time.strftime("%H:%M:%S", time.localtime(snap.now_ns / 1e9))
    head = Text.assemble(("job ", "dim"), (job.job, "bold cyan"), f"  {clock}  ",
                         (f"ranks {job.ranks_alive}/{job.ranks_total} alive", "dim"))
    head.append(f"\n{windows}", style="dim")
    return head


def _stats_table(job: JobView, sort: str, width: int, max_rows: int | None) -> Table:
    t = _table(width)
    t.add_column("STAT", overflow="ellipsis", no_wrap=True, min_width=8, ratio=1)
    _num_columns(t, "COUNT", "MEAN", "P50", "P99", "MAX")
    t.add_column("LOW@RANK", justify="right", no_wrap=True, overflow="ellipsis", max_width=12)
    t.add_column("HIGH@RANK", justify="right", no_wrap=True, overflow="ellipsis", max_width=12)
    t.add_column("SLOW", no_wrap=True, overflow="ellipsis", max_width=6)
    rows = _sorted(job.stats, sort)
    for s in rows[:max_rows]:
        m = s.merged
        slow = s.stragglers
        name = ("! " if slow else "") + s.key
        _add_row(t, name, abbreviate(m.count), abbreviate(m.mean), abbreviate(m.quantile(0.5)),
                  abbreviate(m.quantile(0.99)), abbreviate(m.max if m.count else None), _at(s.low), _at(s.high),
                  _ranks_list(slow), style="bold red" if slow else None)
    if max_rows is not None and len(rows) > max_rows:
        _add_row(t, Text(f"… {len(rows) - max_rows} more stats", style="dim"))
    return t


def gpu_cell(g: RankGpu | None) -> str:
    """A rank's GPU column: ``<gpus>:<utilisation>% <memory>`` (``0:87% 12.9G``); ``-`` without GPU figures."""
    if g is None:
        return "-"
    util = "-" if g.util is None else f"{g.util:.0f}%"
    memory = "" if g.memory_mib is None else " " + abbreviate(g.memory_mib * 1048576.0)
    return f"{','.join(map(str, g.gpus))}:{util}{memory}"


def _ranks_table(stat: StatView, sort: str, width: int, max_rows: int | None, job: JobView | None = None) -> Table:
    gpus = job is not None and bool(job.gpus)
    t = _table(width)
    t.add_column("RANK", justify="right", no_wrap=True)
    t.add_column("STATE", no_wrap=True, overflow="ellipsis", max_width=7)
    t.add_column("PID", justify="right", no_wrap=True, max_width=8)
    _num_columns(t, "COUNT", "MEAN", "P50", "P99", "MIN", "MAX")
    t.add_column("SCORE", justify="right", no_wrap=True, max_width=6)
    if gpus:
        t.add_column("GPU", justify="right", no_wrap=True, overflow="ellipsis", max_width=14)
    t.add_column("", no_wrap=True, max_width=4)
    rows = _sorted_ranks(stat.ranks, sort)
    for r in rows[:max_rows]:
        s = r.summary
        score = "-" if r.score is None else f"{r.score:.2f}" if r.score < 100 else abbreviate(r.score)
        gpu = [gpu_cell(job.gpu_of(r.rank))] if gpus and job is not None else []
        _add_row(t, str(r.rank), r.state, str(r.pid or "-"), abbreviate(s.count), abbreviate(s.mean),
                  abbreviate(s.quantile(0.5)), abbreviate(s.quantile(0.99)), abbreviate(s.min if s.count else None),
                  abbreviate(s.max if s.count else None), score, *gpu, "SLOW" if r.straggler else "",
                  style="bold red" if r.straggler else None)
    if max_rows is not None and len(rows) > max_rows:
        _add_row(t, Text(f"… {len(rows) - max_rows} more ranks", style="dim"))
    return t


def _strip_width(history: History, width: int) -> int:
    """Characters of a sparkline: one per kept window, as many as fit beside the name and the ranks."""
    return max(5, min(history.windows, (min(width, 120) - 22) // 2))


def _history_table(width: int, what: str, strip: int) -> Table:
    t = _table(width)
    t.add_column(what, overflow="ellipsis", no_wrap=True, min_width=8, ratio=1)
    t.add_column("P50|MEAN, LAST WINDOWS" if strip >= 21 else "LAST WINDOWS", no_wrap=True, width=strip)
    t.add_column("STRAGGLERS", no_wrap=True, width=strip)
    return t


def _stats_history(job: JobView, history: History, sort: str, width: int, max_rows: int | None) -> Table | None:
    rows = [(s, history.points(job.job, s)) for s in _sorted(job.stats, sort)]
    rows = [(s, pts) for s, pts in rows if pts]
    if not rows:
        return None
    strip = _strip_width(history, width)
    t = _history_table(width, "STAT", strip)
    t.add_column("SLOW", no_wrap=True, overflow="ellipsis", max_width=6)
    for s, pts in rows[:max_rows]:
        slow = sorted({r for p in pts for r in p.slow})
        _add_row(t, s.key, sparkline([p.merged for p in pts], strip),
                  Text(marks([bool(p.slow) for p in pts], strip), style="bold red" if slow else ""),
                  _ranks_list(tuple(slow)))
    if max_rows is not None and len(rows) > max_rows:
        _add_row(t, Text(f"… {len(rows) - max_rows} more stats", style="dim"))
    return t


def _ranks_history(job: JobView, stat: StatView, history: History, width: int, max_rows: int | None
                   ) -> Table | None:
    pts = history.points(job.job, stat)
    if not pts:
        return None
    strip = _strip_width(history, width)
    t = _history_table(width, "RANK", strip)
    _add_row(t, "merged", sparkline([p.merged for p in pts], strip), marks([bool(p.slow) for p in pts], strip))
    ranks = sorted({r for p in pts for r in p.ranks} | {r.rank for r in stat.ranks})
    for rank in ranks[:max_rows]:
        was_slow = any(rank in p.slow for p in pts)
        _add_row(t, str(rank), sparkline([p.ranks.get(rank) for p in pts], strip),
                  marks([rank in p.slow if rank in p.ranks else None for p in pts], strip),
                  style="bold red" if was_slow else None)
    if max_rows is not None and len(ranks) > max_rows:
        _add_row(t, Text(f"… {len(ranks) - max_rows} more ranks", style="dim"))
    return t


def _sections_label(sections: list[StatView], now_ns: int) -> str:
    if not sections:
        return "no section with a closed window yet"
    return f"{_windows_label(sections, now_ns)}\nper section: mean ms, % of the window; {WAIT_MARK} a wait"


def _section_columns(job: JobView, width: int) -> tuple[list[StatView], int]:
    """The sections shown (their newest window each; the compute sections by name, then the wait sections) and
    how many more did not fit ``width``."""
    newest: dict[str, StatView] = {}
    for s in job.stats:
        if s.group == SECTION_GROUP and (s.name not in newest or s.start_ns > newest[s.name].start_ns):
            newest[s.name] = s
    ordered = sorted(newest.values(), key=lambda s: (s.wait, s.name))
    room = max(1, (min(width, 120) - 36) // 10)
    if len(ordered) <= room:
        return ordered, 0
    kept = sorted(ordered, key=lambda s: -s.merged.sum)[:room]  # the sections that take the most time
    return [s for s in ordered if s in kept], len(ordered) - room


def _section_cell(stat: StatView, rank: int) -> Text:
    part = next((r for r in stat.ranks if r.rank == rank), None)
    if part is None or not part.summary.count:
        return Text("-")
    share = 100.0 * part.summary.sum / (stat.window_ns / 1e6) if stat.window_ns else math.nan
    return Text(f"{'!' if part.straggler else ''}{abbreviate(part.summary.mean)} {share:.0f}%",
                style="bold red" if part.straggler else "")


def _phase_cells(p: RankPhase | None, now_ns: int) -> tuple[Text, str]:
    if p is None or not p.since_ns:
        return Text("-" if p is None or p.state == "active" else p.state), "-"
    if p.state != "active":
        return Text(p.state), "-"
    if not p.section:
        return Text("(outside)", style="dim"), _age(now_ns - p.since_ns)
    return Text(p.section + (WAIT_MARK if p.wait else ""), style="" if p.wait else "bold"), \
        _age(now_ns - p.since_ns)


def _sorted_section_ranks(ranks: set[int], sections: list[StatView], sort: str) -> list[int]:
    if sort == "name":
        return sorted(ranks)
    worst: dict[int, float] = {}  # a wait section is never scored
    for s in sections:
        for r in s.ranks:
            if not s.wait and r.score is not None:
                worst[r.rank] = min(worst.get(r.rank, math.inf), r.score)
    return sorted(ranks, key=lambda r: (r not in worst, worst.get(r, 0.0), r))


def _sections_table(job: JobView, snap: TopSnapshot, width: int, max_rows: int | None,
                    sort: str = "name") -> tuple[Table, str]:
    sections, more = _section_columns(job, width)
    t = _table(width)
    t.expand, t.width = False, None  # columns as wide as their text: a short frame reads left to right
    t.add_column("RANK", justify="right", no_wrap=True)
    t.add_column("NOW", no_wrap=True, overflow="ellipsis", min_width=6, max_width=14)
    t.add_column("FOR", justify="right", no_wrap=True, max_width=6)
    t.add_column("STEP", justify="right", no_wrap=True, max_width=9)
    for s in sections:
        header = s.name + (WAIT_MARK if s.wait else "")
        t.add_column(Text(header), justify="right", no_wrap=True, overflow="ellipsis",
                     min_width=min(len(header), 16), max_width=16)
    phases = {p.rank: p for p in job.phases}
    ranks = _sorted_section_ranks(set(phases) | {r.rank for s in sections for r in s.ranks}, sections, sort)
    for rank in ranks[:max_rows]:
        p = phases.get(rank)
        now, age = _phase_cells(p, snap.now_ns)
        slow = any(r.rank == rank and r.straggler for s in sections for r in s.ranks)
        _add_row(t, str(rank), now, age, "-" if p is None or not p.since_ns else str(p.step),
                 *(_section_cell(s, rank) for s in sections), style="bold red" if slow else None)
    if max_rows is not None and len(ranks) > max_rows:
        _add_row(t, Text(f"… {len(ranks) - max_rows} more ranks", style="dim"))
    label = _sections_label(sections, snap.now_ns)
    return t, label + (f"; {more} more do not fit" if more else "")


def render(snap: TopSnapshot, *, view: str = "stats", stat: str | None = None, sort: str = "name", width: int = 80,
           height: int | None = None, history: History | None = None) -> RenderableType:
    """One frame of ``shmstat top`` for ``snap``: per job, a header (job, clock, ranks alive, the window shown:
    local start and length) and a table; ``view="ranks"`` shows one row per rank of ``stat`` (``group/name``).

    ``view="sections"`` shows one row per rank: its current section (``NOW``, from its phase word; wait sections
    marked :data:`WAIT_MARK`), for how long (``FOR``), its step counter (``STEP``), and per section of group
    ``section`` in its newest closed window the rank's mean duration (ms) and share of the window (its sum over
    the window's length: the split of the rank's time; nested sections count in their parent too); a cell of a
    straggler is marked ``!``.

    ``sort`` is one of :data:`SORTS` (of :data:`SECTION_SORTS` for the sections view); ``width`` the columns to
    fit (80 over ssh); ``height``, if given, bounds the rows so the frame fits a screen. Straggler rows are bold
    red and marked (``!`` / ``SLOW``), so the mark survives a terminal without colour. With ``history``
    (:class:`collector.cli.top_history.History`, which the caller feeds every snapshot) a second table follows:
    per stat (per rank, and merged, in the ranks view) a sparkline of the figure over the last windows seen and a
    strip marking the windows with a straggler (``!``).
    """
    if (view not in VIEWS or sort not in (SECTION_SORTS if view == "sections" else SORTS)
            or (view == "ranks" and not stat)):
        raise ValueError(f"render(view={view!r}, stat={stat!r}, sort={sort!r}): view is one of {VIEWS} (ranks "
                         f"needs a stat), sort one of {SORTS} ({SECTION_SORTS} for sections)")
    parts: list[RenderableType] = []
    if not snap.jobs:
        return Text("no shmstat segments of this user on this node (start a job, or see 'shmstat ls')")
    if view == "sections":
        history = None  # the sections view has no history table
    budget = None if height is None else max(3, (height - 1) // len(snap.jobs) - 4)
    if budget is not None and history is not None:  # two tables share the rows
        budget = max(2, (budget - 2) // 2)
    for job in snap.jobs:
        if parts:
            parts.append(Text(""))
        if job.error is not None:
            parts.append(Text.assemble(("job ", "dim"), (job.job, "bold cyan"), "  ", (job.error, "yellow")))
            continue
        if view == "sections":
            table, label = _sections_table(job, snap, width, budget, sort)
            parts.append(_header(job, snap, label))
            parts.append(table)
            continue
        if view == "ranks":
            chosen = [s for s in job.stats if s.key == stat]
            if not chosen:
                names = ", ".join(s.key for s in job.stats[:5]) or "none yet"
                parts.append(_header(job, snap, "no closed window yet"))
                parts.append(Text(f"no stat {stat} with a closed window in this job (stats: {names})", "yellow"))
                continue
            s = max(chosen, key=lambda c: c.start_ns)
            where = f"{_windows_label([s], snap.now_ns)}  stat {s.key}  median {abbreviate(s.median)}"
            parts.append(_header(job, snap, where))
            parts.append(_ranks_table(s, sort, width, budget, job))
            past = None if history is None else _ranks_history(job, s, history, width, budget)
            if past is not None:
                parts.extend((Text(""), past))
            continue
        parts.append(_header(job, snap, _windows_label(list(job.stats), snap.now_ns)))
        parts.append(_stats_table(job, sort, width, budget) if job.stats else Text("no closed window yet", "dim"))
        past = None if history is None else _stats_history(job, history, sort, width, budget)
        if past is not None:
            parts.extend((Text(""), past))
    return Group(*parts)
