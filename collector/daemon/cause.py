"""The cause of a straggler: which of a rank's sections carries its excess against the node, per step.

A rank's sections (:func:`shmstat.section`, group ``section``) in one window, or summed over several, are
:class:`SectionTimes`. Per step, each section takes its sum over the rank's steps; a rank's steps are the count of
its section entered most often (``shmstat.torch.instrument`` enters ``data``, ``forward``, ``backward`` and
``optimizer`` once a step). :func:`attribute` names, for one rank, the section (not a wait) whose time per step
exceeds the node's median the most, with the wait section (``wait=True``) in which the rank waits least of all
ranks, when there is one, as corroboration: in a synchronous job the fast ranks wait for the slow one, so the slow
rank is the one that waits least. :func:`step_figures` gives each rank's time per step in its sections (waits
excepted): the figure of the ``section/(step)`` stat the collector scores like any other, which finds a slow
rank whose sections are each only a little slower, or slower now and then (a p50 does not move).

The medians are the straggler rule's own (:func:`collector.daemon.scoring.score_ranks`): the collector, ``top``
and ``shmstat report`` all call :func:`attribute`, so every surface names the same cause.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .scoring import score_ranks

__all__ = ["CAUSE_FIELDS", "GPU_SUFFIX", "SECTION_GROUP", "STEP_STAT", "Cause", "SectionTimes", "attribute",
           "step_figures", "summed"]

SECTION_GROUP = "section"
"""The group of every section's Stat (:data:`shmstat.writer.sections.SECTION_GROUP`)."""
STEP_STAT = "(step)"
"""The stat, in group ``section``, the collector scores each rank's time per step in its sections on (waits
excepted): not a name a section takes (its parentheses say it is made by the collector)."""
GPU_SUFFIX = ".gpu"
"""A ``cuda=True`` section's GPU time (``<name>.gpu``): the same step as its CPU section, not added to the step."""
CAUSE_FIELDS = ("cause", "cause_section", "cause_ms", "cause_median_ms", "cause_excess_ms", "cause_wait_section",
                "cause_wait_ms", "cause_wait_median_ms")
"""The fields a straggler event gets when its cause is known (the wait ones only with a corroborating wait)."""


@dataclass(frozen=True)
class SectionTimes:
    """One rank's section in one window (or several summed): the milliseconds spent in it, how many times it was
    entered, and whether it is a wait section."""

    sum_ms: float
    count: int
    wait: bool


Ranks = Mapping[int, Mapping[str, SectionTimes]]
"""Each rank's sections by name."""


@dataclass(frozen=True)
class Cause:
    """The section that carries a rank's excess (times per step, ms) and, when the rank waits least of all in a
    wait section, that section."""

    rank: int
    section: str
    ms: float
    median_ms: float
    wait_section: str | None = None
    wait_ms: float = 0.0
    wait_median_ms: float = 0.0

    @property
    def excess_ms(self) -> float:
        """How much longer than the median the rank's section takes, per step."""
        return self.ms - self.median_ms

    def sentence(self) -> str:
        """The cause in words, e.g. ``its forward takes 41 ms against a median of 20 (+21 ms a step), and it
        waits least in allreduce (2 ms against 22)``."""
        said = (f"its {self.section} takes {_ms(self.ms)} ms against a median of {_ms(self.median_ms)} "
                f"(+{_ms(self.excess_ms)} ms a step)")
        if self.wait_section is not None:
            said += (f", and it waits least in {self.wait_section} ({_ms(self.wait_ms)} ms against "
                     f"{_ms(self.wait_median_ms)})")
        return said

    def fields(self) -> dict[str, str | float]:
        """The cause as a straggler event's fields (:data:`CAUSE_FIELDS`)."""
        out: dict[str, str | float] = {"cause": self.sentence(), "cause_section": self.section, "cause_ms": self.ms,
                                       "cause_median_ms": self.median_ms, "cause_excess_ms": self.excess_ms}
        if self.wait_section is not None:
            out.update(cause_wait_section=self.wait_section, cause_wait_ms=self.wait_ms,
                       cause_wait_median_ms=self.wait_median_ms)
        return out


def _ms(x: float) -> str:
    return f"{x:.3g}"


def _steps(sections: Mapping[str, SectionTimes]) -> int:
    plain = [t.count for t in sections.values() if not t.wait]
    return max(plain or [t.count for t in sections.values()] or [0])


def per_step(ranks: Ranks) -> dict[int, dict[str, tuple[float, bool]]]:
    """Each rank's sections as (ms per step, wait); ranks with no step left out."""
    out = {}
    for rank, sections in ranks.items():
        steps = _steps(sections)
        if steps > 0:
            out[rank] = {name: (t.sum_ms / steps, t.wait) for name, t in sections.items()
                         if math.isfinite(t.sum_ms) and t.sum_ms >= 0}
    return out


def step_figures(ranks: Ranks) -> dict[int, float]:
    """Each rank's time per step in its sections, waits and GPU twins (``<name>.gpu``) excepted: the figure of
    :data:`STEP_STAT`. Sections nested in another one are counted in it too: the figure assumes sections that do
    not nest (as :func:`shmstat.torch.instrument`'s)."""
    return {rank: sum(ms for name, (ms, wait) in sections.items() if not wait and not name.endswith(GPU_SUFFIX))
            for rank, sections in per_step(ranks).items()}


def attribute(ranks: Ranks, rank: int) -> Cause | None:
    """What carries ``rank``'s excess in ``ranks`` (the sections of one window or of several summed): its section,
    not a wait, whose time per step is longest against the node's median (on two ranks or more), and the wait
    section where it waits least of all ranks and less than the median, if any (the one with the largest
    shortfall). None when no section of the rank takes longer than the median."""
    steps = per_step(ranks)
    mine = steps.get(rank)
    if not mine:
        return None
    best: tuple[float, str, float, float] | None = None
    wait: tuple[float, str, float, float] | None = None
    for name in sorted(mine):
        ms, is_wait = mine[name]
        figures = {r: s[name][0] for r, s in steps.items() if name in s and s[name][1] == is_wait}
        median, scores = score_ranks(figures)
        if not scores:
            continue
        if not is_wait:
            if ms > median and (best is None or ms - median > best[0]):
                best = (ms - median, name, ms, median)
        elif ms < median and ms <= min(figures.values()) and (wait is None or median - ms > wait[0]):
            wait = (median - ms, name, ms, median)
    if best is None:
        return None
    _, name, ms, median = best
    if wait is None:
        return Cause(rank, name, ms, median)
    return Cause(rank, name, ms, median, wait[1], wait[2], wait[3])


def summed(windows: Iterable[Ranks]) -> dict[int, dict[str, SectionTimes]]:
    """Several windows' sections as one: per rank and section, the sums and counts added (a wait stays a wait)."""
    out: dict[int, dict[str, SectionTimes]] = {}
    for ranks in windows:
        for rank, sections in ranks.items():
            mine = out.setdefault(rank, {})
            for name, t in sections.items():
                had = mine.get(name)
                mine[name] = t if had is None else SectionTimes(had.sum_ms + t.sum_ms, had.count + t.count,
                                                                had.wait or t.wait)
    return out
