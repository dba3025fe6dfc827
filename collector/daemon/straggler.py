"""Stragglers: how each rank compares with the node, per closed window of a stat present on two ranks or more.

A rank's figure is its window's p50 when the stat keeps percentiles, else its mean; a stat that asked only for
COUNT is not scored (:data:`COUNT_ONLY_MASK`). Its score is
``median over ranks / figure`` for a stat where higher is worse (a time: the slow rank scores under 1), and
``figure / median`` for one that declared ``higher_is_better`` (a rate). Prior art: NVIDIA's resiliency extension
scores ranks the same way and flags under 0.75.

:class:`StragglerDetector` keeps, per job, the ranks currently slow and turns each emitted pass of per-rank rows
into scores (for the collector's ``shmstat`` group) and :data:`STRAGGLER_EVENT` / :data:`RECOVERED_EVENT`
events (for ``event/<name>``). Figures that are not finite leave their rank out of the window; a window with a
negative figure is not scored (a ratio of such figures means nothing). The collector's GPU figures
(:mod:`collector.gpu.figures`) are not scored: a rank's GPU is not slower for being busier; the straggler
event says instead what a slow rank's GPU did (:meth:`collector.gpu.sampler.JobGpu.describe`).

:class:`StragglerScorer` is the detector as a consumer of every collector pass (on the loop, registered first):
it publishes the events and adds the scores and flags to the pass, for the consumers after it (the handlers'
dispatcher, the Prometheus exporter; the console lines on the console handler's thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from elastic.metrics import StatMetricData
from shmstat import wire
from shmstat.errors import ConfigError

from ..read.columns import COUNT_ONLY_MASK
from ..read.passes import Flag
from ..read.rows import WindowSpan
from .cause import SECTION_GROUP, STEP_STAT, Ranks, SectionTimes, attribute, step_figures, summed
from .scoring import score_blocks, score_ranks

if TYPE_CHECKING:
    from ..read.columns import Columns
    from ..read.passes import Pass, Wanted

__all__ = [
    "COUNT_ONLY_MASK", "DEFAULT_FORGET_NS", "DEFAULT_THRESHOLD", "DEFAULT_WINDOWS", "EVENT_TOPICS", "MAX_WINDOWS",
    "RECOVERED_EVENT",
    "SCORE_METRIC_PREFIX", "SECTION_WINDOWS_KEPT", "STRAGGLER_EVENT", "Score", "StragglerDetector",
    "StragglerEvent", "StragglerScorer",
    "StragglerUpdate",
]

DEFAULT_THRESHOLD = 0.75
"""A rank scoring under this is slow for that window."""
DEFAULT_WINDOWS = 3
"""Consecutive slow windows before a rank is reported a straggler."""
MAX_WINDOWS = 1000
"""The most consecutive windows one may ask for."""
SECTION_WINDOWS_KEPT = 1000
"""The most section windows a detector keeps to name a straggler's cause (within ``forget_after_ns`` too)."""




STRAGGLER_EVENT = "shmstat.straggler"
"""The event a rank gets once it scored under the threshold for the configured number of windows in a row."""
RECOVERED_EVENT = "shmstat.straggler.recovered"
"""The event a reported rank gets when it scores at or above the threshold again for ``windows`` windows in a row
(``reason`` ``"recovered"``), or when the detector forgets it (``reason`` ``"gone"``: no window of that stat
scored it for a while)."""
EVENT_TOPICS = (wire.event_topic(STRAGGLER_EVENT), wire.event_topic(RECOVERED_EVENT))
"""The topics the events are published on."""
DEFAULT_FORGET_NS = 30 * 1_000_000_000
"""How long (in window time) a slow rank's state outlives the last window that scored it."""
SCORE_METRIC_PREFIX = "straggler.score."
"""Scores reach the ``shmstat`` group as ``straggler.score.<group>/<stat>`` with the rank set."""

EventData = dict[str, str | int | float | bool]


@dataclass(frozen=True)
class Score(WindowSpan):
    """One rank's score in one closed window of one stat."""

    group: str
    stat: str
    rank: int
    wid: int
    window_ms: int
    score: float
    figure: float
    median: float

    def metric(self, group: str, job: str) -> StatMetricData:
        """The score as a metric of ``group`` (the collector's own), named ``straggler.score.<group>/<stat>``,
        with its rank, window and job."""
        start, end = self.start_ns / 1e9, self.end_ns / 1e9
        return StatMetricData(end, group, f"{SCORE_METRIC_PREFIX}{self.group}/{self.stat}", self.score,
                              rank=self.rank, window_start=start, window_end=end, job=job)


@dataclass(frozen=True)
class StragglerEvent:
    """An event to publish: :data:`STRAGGLER_EVENT` or :data:`RECOVERED_EVENT` and its data."""

    name: str
    data: EventData


@dataclass(frozen=True)
class StragglerUpdate:
    """What one pass of rows gave: every score (for the metric group) and the events to publish."""

    scores: list[Score] = field(default_factory=list)
    events: list[StragglerEvent] = field(default_factory=list)


@dataclass
class _Slow:
    """A rank currently slow on a stat (ranks that are not slow have no state)."""

    since_ns: int  # start of the first slow window of the run
    last: Score  # the latest window that scored it
    windows: int = 1  # slow windows in a row
    reported: bool = False
    fine: int = 0  # windows in a row at or above the threshold since it was reported


class StragglerDetector:
    """Turns the per-rank rows of each emitted pass into scores and straggler/recovery events, for one job.

    Each window of a stat with a finite, non-negative figure on two ranks or more is scored
    (:func:`score_ranks`); a rank scoring under ``threshold`` is slow in that window. Once it was slow in
    ``windows`` windows in a row it is reported (:data:`STRAGGLER_EVENT`, once), and once it then scores at or
    above the threshold for as many windows in a row it is reported recovered (:data:`RECOVERED_EVENT`): a rank
    near the threshold whose windows cross it now and then is one episode, not one per crossing (a slow window
    restarts the count; it stays reported meanwhile). The count is over the windows that
    scored the rank: a window where it has no figure (no sample, a non-finite figure, fewer than two ranks) is no
    evidence either way and neither adds to nor resets it. A window a rank was already scored in (an older or
    the same window id) is ignored.

    State is kept only for ranks currently slow, by ``(group, stat, rank)``; the job is the detector's. A slow
    rank that no window scores for ``forget_after_ns`` of window time (measured against the latest window end
    seen in any row) is forgotten, with a :data:`RECOVERED_EVENT` of reason ``"gone"`` if it was reported: a rank
    that left, or a stat no longer added. Pure logic: no clock is read, time is the windows' own.

    Each window of the ``section`` group also gives every rank's time per step in its sections (waits excepted,
    :func:`collector.daemon.cause.step_figures`), scored as the stat ``section/(step)``
    (:data:`collector.daemon.cause.STEP_STAT`). A straggler event names its cause when the rank's sections are
    known over its slow windows (:func:`collector.daemon.cause.attribute`, the fields
    :data:`collector.daemon.cause.CAUSE_FIELDS`).
    """

    def __init__(self, job: str = "", *, threshold: float = DEFAULT_THRESHOLD, windows: int = DEFAULT_WINDOWS,
                 forget_after_ns: int = DEFAULT_FORGET_NS) -> None:
        if not 0 < threshold < 1:
            raise ConfigError(f"the straggler threshold must be between 0 and 1 (exclusive), got {threshold}")
        if not 1 <= windows <= MAX_WINDOWS:
            raise ConfigError(f"the straggler windows must be between 1 and {MAX_WINDOWS}, got {windows}")
        if forget_after_ns <= 0:
            raise ConfigError(f"forget_after_ns must be positive, got {forget_after_ns}")
        self.job = job
        self.threshold = threshold
        self.windows = windows
        self.forget_after_ns = forget_after_ns
        self._slow: dict[tuple[str, str, int], _Slow] = {}
        self._latest_ns = 0
        self._sections: dict[tuple[int, int], dict[int, dict[str, SectionTimes]]] = {}  # (wid, window_ms): ranks

    @property
    def tracked(self) -> int:
        """How many (group, stat, rank) the detector holds state for (ranks currently slow)."""
        return len(self._slow)

    def update_columns(self, cols: Columns, *, scores: bool = True) -> StragglerUpdate:
        """Score the per-rank rows of a pass (merged rows only advance time) in window order per stat, on
        arrays, and return the scores and the events they give. With ``scores=False`` the update's
        :attr:`~StragglerUpdate.scores` hold only the scores that can change a rank's state (under the threshold,
        or of a rank currently slow), not every score: the events are the same."""
        out = StragglerUpdate()
        if not len(cols):
            self._forget(out.events)
            return out
        self._latest_ns = max(self._latest_ns, int(cols.end_ns.max()))
        block = np.cumsum(cols.rank < 0) - 1  # a window of a stat: its merged row, then its per-rank rows
        with np.errstate(invalid="ignore"):
            fig = np.where(cols.hists.present, cols.p50, cols.mean)  # figure(): p50 if a histogram
            scored = (cols.rank >= 0) & (cols.count > 0) & np.isfinite(fig) & cols.scored_stats()
            rows = np.flatnonzero(scored)
        b, f = block[rows], fig[rows]
        order = np.lexsort((f, b))
        rows, b, f = rows[order], b[order], f[order]
        median, score, keep = score_blocks(b, f, cols.higher_is_better[rows])
        rows, f, median, score = rows[keep], f[keep], median[keep], score[keep]
        pick = np.ones(len(rows), bool) if scores else score < self.threshold
        if not scores and self._slow:
            names = {(g, n) for g, n, _ in self._slow}
            for j in np.flatnonzero(~pick).tolist():
                i = rows[j]
                key = (cols.group[i], cols.stat[i])
                if key in names and (*key, int(cols.rank[i])) in self._slow:
                    pick[j] = True
        chosen = [Score(cols.group[i], cols.stat[i], int(cols.rank[i]), int(cols.wid[i]), int(cols.window_ms[i]),
                        sc, fg, md)
                  for i, sc, fg, md in zip(rows[pick].tolist(), score[pick].tolist(), f[pick].tolist(),
                                           median[pick].tolist(), strict=True)]
        chosen += [sc for sc in self._keep_sections(cols)
                   if scores or sc.score < self.threshold or (sc.group, sc.stat, sc.rank) in self._slow]
        chosen.sort(key=lambda s: (s.group, s.stat, s.wid, s.rank))
        for sc in chosen:
            out.scores.append(sc)
            event = self._observe(sc)
            if event is not None:
                out.events.append(event)
        self._forget(out.events)
        return out

    def reported(self, group: str, stat: str, rank: int) -> bool:
        """Whether ``rank`` is reported slow on ``group/stat`` now (its straggler event said, no recovery since)."""
        slow = self._slow.get((group, stat, rank))
        return slow is not None and slow.reported

    def observe(self, scores: list[Score]) -> list[StragglerEvent]:
        """Take scores made elsewhere (the job-wide view, :mod:`collector.jobwide.watch`, scores across nodes), in
        window order per stat, as :meth:`update_columns` takes its own: the events they give, a rank no window scored
        for ``forget_after_ns`` forgotten."""
        events: list[StragglerEvent] = []
        for s in scores:
            self._latest_ns = max(self._latest_ns, s.end_ns)
            event = self._observe(s)
            if event is not None:
                events.append(event)
        self._forget(events)
        return events
    def _keep_sections(self, cols: Columns) -> list[Score]:
        """Keep each rank's sections of the pass's section windows (for the causes), and score each window's
        times per step (:data:`STEP_STAT`)."""
        rows = np.flatnonzero((cols.group == SECTION_GROUP) & (cols.rank >= 0) & (cols.count > 0))
        if not len(rows):
            return []
        touched = set()  # windows first seen now: a window is scored once
        for i in rows.tolist():
            key = (int(cols.wid[i]), int(cols.window_ms[i]))
            if key not in self._sections:
                touched.add(key)
            elif key not in touched:
                continue
            self._sections.setdefault(key, {}).setdefault(int(cols.rank[i]), {})[cols.stat[i]] = SectionTimes(
                float(cols.sum[i]), int(cols.count[i]), bool(cols.wait[i]))
        out = []
        for wid, window_ms in sorted(touched):
            figures = step_figures(self._sections[(wid, window_ms)])
            median, scores = score_ranks(figures)
            out += [Score(SECTION_GROUP, STEP_STAT, rank, wid, window_ms, sc, figures[rank], median)
                    for rank, sc in sorted(scores.items())]
        horizon = self._latest_ns - self.forget_after_ns
        for key in sorted(self._sections)[:-SECTION_WINDOWS_KEPT]:
            del self._sections[key]
        for key in [k for k in self._sections if (k[0] + 1) * k[1] * 1_000_000 < horizon]:
            del self._sections[key]
        return out

    def cause(self, rank: int, start_ns: int, end_ns: int) -> dict[str, str | float]:
        """The cause of ``rank``'s slowness between ``start_ns`` and ``end_ns`` (the section windows kept that
        overlap it, summed: :func:`collector.daemon.cause.attribute`) as event fields; empty when unknown."""
        windows: list[Ranks] = [ranks for (wid, ms), ranks in self._sections.items()
                                if wid * ms * 1_000_000 < end_ns and (wid + 1) * ms * 1_000_000 > start_ns]
        found = attribute(summed(windows), rank)
        return {} if found is None else found.fields()

    def _observe(self, s: Score) -> StragglerEvent | None:
        key = (s.group, s.stat, s.rank)
        slow = self._slow.get(key)
        if slow is not None and s.wid <= slow.last.wid:
            return None
        if s.score >= self.threshold:
            if slow is None:
                return None
            if not slow.reported:
                del self._slow[key]
                return None
            slow.fine += 1
            slow.last = s
            if slow.fine < self.windows:  # one noisy window back over the threshold is no recovery
                return None
            del self._slow[key]
            return self._event(RECOVERED_EVENT, s, slow, "recovered")
        if slow is None:
            slow = self._slow[key] = _Slow(s.start_ns, s)
        else:
            slow.windows += 1
            slow.fine = 0
            slow.last = s
        if slow.reported or slow.windows < self.windows:
            return None
        slow.reported = True
        return self._event(STRAGGLER_EVENT, s, slow, None)

    def _forget(self, events: list[StragglerEvent]) -> None:
        horizon = self._latest_ns - self.forget_after_ns
        for key in [k for k, v in self._slow.items() if v.last.end_ns < horizon]:
            slow = self._slow.pop(key)
            if slow.reported:
                events.append(self._event(RECOVERED_EVENT, slow.last, slow, "gone"))

    def _event(self, name: str, s: Score, slow: _Slow, reason: str | None) -> StragglerEvent:
        data: EventData = {
            "job": self.job, "rank": s.rank, "group": s.group, "stat": s.stat, "score": s.score,
            "figure": s.figure, "median": s.median, "windows": slow.windows, "window_start_ns": s.start_ns,
            "window_ms": s.window_ms, "since_ns": slow.since_ns, "threshold": self.threshold,
        }
        if reason is not None:
            data["reason"] = reason
        else:
            data.update(self.cause(s.rank, slow.since_ns, s.end_ns))
        return StragglerEvent(name, data)


class StragglerScorer:
    """The straggler detector of one job as a consumer of its passes (:class:`collector.read.passes.PassConsumer`,
    on the loop, registered before the consumers that read what it finds).

    Each pass's windows are scored (:meth:`StragglerDetector.update_columns`; every score when ``all_scores()``,
    else only those that can change a rank's state); the scores go into the pass (:attr:`Pass.scores`), and
    each straggler flagged or recovered is published (``publish(name, ts_ns, data)``: on ``event/<name>`` and to
    the events kept) and goes into the pass (:attr:`Pass.flags`) for the console lines. ``describe(rank,
    since_ns, end_ns)`` adds what the flagged rank's GPU did meanwhile (None: no GPU figures). ``needed()`` says
    whether anyone has a use for the scoring (then every group's windows are read)."""

    on_loop = True
    """It publishes on the relay, which only the loop's thread may use."""

    def __init__(self, detector: StragglerDetector, *, needed: Callable[[], bool], all_scores: Callable[[], bool],
                 publish: Callable[[str, int, EventData], None],
                 describe: Callable[[int, int, int], EventData] | None = None) -> None:
        self.detector = detector
        self._needed = needed
        self._all_scores = all_scores
        self._publish = publish
        self._describe = describe

    def wants(self, group: str, what: Wanted) -> bool:
        """Every group's windows, when someone has a use for the scores, events or console lines."""
        return what == "windows" and self._needed()

    def take(self, pass_: Pass) -> None:
        """Score the pass's windows, publish the events found, add the scores and flags to the pass."""
        if pass_.columns is None:
            return
        found = self.detector.update_columns(pass_.columns, scores=self._all_scores())
        pass_.scores.extend(found.scores)
        for ev in found.events:
            data = ev.data
            if self._describe is not None and ev.name == STRAGGLER_EVENT:  # what the slow rank's GPU did meanwhile
                end = int(data["window_start_ns"]) + int(data["window_ms"]) * 1_000_000
                data = {**data, **self._describe(int(data["rank"]), int(data["since_ns"]), end)}
            self._publish(ev.name, pass_.now_ns, data)
            pass_.flags.append(Flag(ev.name, data))
