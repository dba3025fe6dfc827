"""``shmstat top``'s short history: the figures of the last windows each frame saw, per stat and per rank, and the
ranks that were stragglers in them, drawn as sparklines and marks under the frame's table.

A frame shows each stat's newest closed window (:mod:`collector.cli.top_snapshot`); :class:`History` keeps, for
each (job, stat, window length), the last :data:`DEFAULT_WINDOWS` distinct windows that frames showed: the merged
figure and each rank's (the straggler figure: the window's p50 when the stat keeps percentiles, else its mean) and
the ranks that scored under the threshold. A window is kept once however many frames show it; windows that ended
between two frames (windows shorter than ``--interval``) are not seen and not kept, so a sparkline is the windows
top saw, in window order. :func:`sparkline` and :func:`marks` draw them; the tables are built in
:mod:`collector.cli.top`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..daemon.scoring import figure
from .top_snapshot import StatView, TopSnapshot

__all__ = ["BLOCKS", "DEFAULT_WINDOWS", "History", "Point", "marks", "sparkline"]

DEFAULT_WINDOWS = 20
"""Windows kept per stat: one character each in a sparkline."""
BLOCKS = "▁▂▃▄▅▆▇█"
"""The sparkline's levels, lowest first."""
SLOW_MARK, FINE_MARK, UNSEEN_MARK = "!", "·", " "


@dataclass(frozen=True)
class Point:
    """One window of one stat as a frame showed it."""

    wid: int
    merged: float | None
    """The merged figure (None: no sample, or not finite)."""
    ranks: dict[int, float]
    """Each rank's figure (finite ones)."""
    slow: tuple[int, ...]
    """Ranks that scored under the threshold in this window."""


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class History:
    """The last ``windows`` windows of every stat that frames showed; :meth:`observe` each frame's snapshot."""

    def __init__(self, windows: int = DEFAULT_WINDOWS) -> None:
        if windows < 1:
            raise ValueError(f"History(windows={windows}): at least one window")
        self.windows = windows
        self._points: dict[tuple[str, str, int], deque[Point]] = {}

    def observe(self, snap: TopSnapshot) -> None:
        """Keep each stat's window of ``snap`` unless it is already kept (or older than the newest kept)."""
        for job in snap.jobs:
            for stat in job.stats:
                key = (job.job, stat.key, stat.window_ns)
                points = self._points.get(key)
                if points is None:
                    points = self._points[key] = deque(maxlen=self.windows)
                if points and stat.wid <= points[-1].wid:
                    continue
                points.append(_point(stat))

    def points(self, job: str, stat: StatView) -> list[Point]:
        """The kept windows of ``stat`` of ``job``, oldest first."""
        return list(self._points.get((job, stat.key, stat.window_ns), ()))

    def forget(self, jobs: set[str]) -> None:
        """Drop the history of jobs no longer shown."""
        for key in [k for k in self._points if k[0] not in jobs]:
            del self._points[key]


def _point(stat: StatView) -> Point:
    merged = _finite(figure(stat.merged)) if stat.merged.count else None
    ranks = {r.rank: r.figure for r in stat.ranks if _finite(r.figure) is not None}
    return Point(stat.wid, merged, ranks, stat.stragglers)


def sparkline(values: list[float | None], width: int) -> str:
    """The last ``width`` values as block characters scaled between their lowest and highest (all equal: the
    middle level), a space for a missing value; right-aligned in ``width`` characters."""
    shown = values[-width:]
    finite = [v for v in shown if v is not None]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    top = len(BLOCKS) - 1
    out = []
    for v in shown:
        if v is None:
            out.append(" ")
        elif hi == lo:
            out.append(BLOCKS[top // 2])
        else:
            out.append(BLOCKS[min(top, int((v - lo) / (hi - lo) * top + 0.5))])
    return "".join(out).rjust(width)


def marks(slow: list[bool | None], width: int) -> str:
    """The last ``width`` windows as ``!`` (a straggler in it), ``·`` (none) or a space (not seen), right-aligned."""
    shown = slow[-width:]
    return "".join(UNSEEN_MARK if s is None else SLOW_MARK if s else FINE_MARK for s in shown).rjust(width)
