"""The ``shmstat top`` command: frames of :mod:`collector.cli.top` refreshed in place (``rich.live.Live``, on the
terminal's alternate screen), or printed one after the other when stdout is not a terminal, or one (``--once``).

Segments are only looked at: opened with ``create=False, wait=False`` (never waiting for a job's lock, never
creating anything), re-listed every frame when no job is named so jobs that start or end come and go. Only this
user's segments are listed: entries of ``/dev/shm`` that are another user's, or not segments at all (a
directory, a FIFO, a link), are left out silently (a line per frame would be noise; ``shmstat ls`` names them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from rich.console import Console, RenderableType
from rich.live import Live

from shmstat.errors import ConfigError, ShmstatError
from shmstat.shm.reader import SegmentReader
from shmstat.shm.runtime import validate_job
from shmstat.shm.segment import Segment

from .top import SECTION_SORTS, SORTS, TopSnapshot, render, snapshot
from .top_history import DEFAULT_WINDOWS, History

_MAX_HISTORY = 1000

__all__ = ["live_frames", "run_top"]


def _check(stat: str | None, sort: str, interval_s: float, iterations: int | None, sections: bool = False) -> None:
    if sections and stat is not None:
        raise ConfigError("--sections and --stat are two views: give one of them")
    if not 0 < interval_s <= 3600:
        raise ConfigError(f"--interval must be more than 0 and at most 3600 seconds, got {interval_s:g}")
    if iterations is not None and iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {iterations}")
    if sort not in SORTS:
        raise ConfigError(f"--sort must be one of {', '.join(SORTS)}, got {sort!r}")
    if sections and sort not in SECTION_SORTS:
        raise ConfigError(f"--sort {sort} does not apply to --sections (a rank has one per section): sort its ranks "
                          f"by {' or '.join(SECTION_SORTS)}")
    if stat is not None and ("/" not in stat or stat.startswith("/") or stat.endswith("/")):
        raise ConfigError(f"--stat takes GROUP/NAME (as the stats table shows it), got {stat!r}")


class _Segments:
    """The segments a frame reads: one named job, or every job of this user on the node (re-listed)."""

    def __init__(self, job: str | None) -> None:
        self.job = job
        self.open: dict[str, SegmentReader] = {}
        """One reader per job, kept across frames (so a garbage entry is warned about once, not every frame)."""
        if job is not None:
            validate_job(job)
            seg = Segment.open(job, create=False, wait=False)  # a missing job: one sentence, exit 2
            self.open[job] = SegmentReader(seg)

    def current(self) -> list[Segment | SegmentReader]:
        """The segments to show now (a named job's stays mapped even once its file is removed)."""
        if self.job is None:
            listed = Segment.list_jobs()  # this user's segments only: another user's entries are left out
            for gone in set(self.open) - set(listed):
                self.open.pop(gone).segment.close()
            for j in listed:
                if j not in self.open:
                    try:
                        self.open[j] = SegmentReader(Segment.open(j, create=False, wait=False))
                    except (ShmstatError, OSError, ValueError):
                        continue  # another user's, half-made or foreign: not shown
        return [self.open[j] for j in sorted(self.open)]

    def close(self) -> None:
        for reader in self.open.values():
            with contextlib.suppress(Exception):
                reader.segment.close()
        self.open.clear()


def live_frames(console: Console, frame: Callable[[int | None], RenderableType], iterations: int | None,
                wait: Callable[[], object]) -> int:
    """Draw ``frame(height)`` on the terminal's alternate screen, ``wait()`` between frames, until ``iterations``
    frames (never when None: until Ctrl-C); 0. The live loop of every ``top`` (one job, ``--nodes``)."""
    with Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        drawn = 0
        while True:
            live.update(frame(console.height), refresh=True)
            drawn += 1
            if iterations is not None and drawn >= iterations:
                return 0
            wait()


def run_top(job: str | None = None, *, stat: str | None = None, sort: str = "name", interval_s: float = 1.0,
            once: bool = False, iterations: int | None = None, console: Console | None = None,
            clock: Callable[[], int] = time.time_ns, history: int = DEFAULT_WINDOWS, sections: bool = False) -> int:
    """Show ``shmstat top`` until Ctrl-C (exit status 0), for ``iterations`` frames, or one frame (``once``).

    ``job`` None shows every job of this user on the node; ``stat`` (``GROUP/NAME``) switches to the per-rank
    view of that stat; ``sections`` to the sections view (each rank's time split across its sections, its current
    section and for how long). Frames after the first show the last ``history`` windows seen (sparklines, straggler
    marks; :mod:`collector.cli.top_history`). Raises :class:`ConfigError` / :class:`SegmentError` for a bad
    option or a missing job.
    """
    _check(stat, sort, interval_s, iterations, sections)
    if not 1 <= history <= _MAX_HISTORY:
        raise ConfigError(f"--history must be between 1 and {_MAX_HISTORY} windows, got {history}")
    view = "sections" if sections else "stats" if stat is None else "ranks"
    console = console or Console()
    segments = _Segments(job)
    past = None if once else History(history)

    def frame(height: int | None) -> RenderableType:
        snap: TopSnapshot = snapshot(segments.current(), clock())
        if past is not None:
            past.observe(snap)
            past.forget({j.job for j in snap.jobs})
        return render(snap, view=view, stat=stat, sort=sort, width=console.width, height=height, history=past)

    try:
        if once:
            console.print(frame(None))
            return 0
        if not console.is_terminal:  # piped: frames one after the other, no escape codes
            n = 0
            while True:
                console.print(frame(None))
                n += 1
                if iterations is not None and n >= iterations:
                    return 0
                console.print()
                time.sleep(interval_s)
        return live_frames(console, frame, iterations, lambda: time.sleep(interval_s))
    except KeyboardInterrupt:
        return 0
    finally:
        segments.close()
