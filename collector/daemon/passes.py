"""One collector pass out of the scanner and into every consumer (:func:`emit_scan`, the daemon's step).

Its watermark moves at once in the scanner's memory, and into the segment only once every handler took the pass
(:mod:`collector.daemon.commits`), so a collector killed mid-pass leaves that pass to the next one.

The pass is read as :class:`collector.read.columns.Columns` (merged by the one merge,
:func:`collector.read.columns.merge_parts`) and handed whole to the dispatcher
(:meth:`collector.handlers.dispatch.ThreadedDispatcher.emit_columns`: every handler takes it as columns), the
Prometheus exporter and the straggler detector. :class:`collector.read.rows.WindowRow` objects are built only
for subscribers of a group's ``stat/`` topics, and only when there are some.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from shmstat import wire

from ..handlers.compact import StragglerLines
from .config import PLATFORM_GROUP
from .straggler import EVENT_TOPICS, STRAGGLER_EVENT

if TYPE_CHECKING:
    from ..handlers.dispatch import ThreadedDispatcher
    from ..read.columns import Columns
    from ..read.scanner import Scanner
    from ..wire.relay import Relay
    from .commits import PendingCommits
    from .config import CollectorConfig
    from .gpu import JobGpu
    from .straggler import StragglerDetector

__all__ = ["PassCounts", "commit_pass", "emit_scan"]


class PassHost(Protocol):
    """What :func:`emit_scan` reads of :class:`collector.daemon.collector.Collector` (it changes none of it)."""

    config: CollectorConfig
    relay: Relay | None
    dispatcher: ThreadedDispatcher
    exporter: Any
    scanner: Scanner
    stragglers: StragglerDetector
    commits: PendingCommits
    gpu: JobGpu | None

    def publish_event(self, name: str, ts_ns: int, data: dict[str, str | int | float | bool]) -> None:
        """Publish an event the collector made and hand it to the events sinks."""


class PassCounts(NamedTuple):
    """What one pass did, for the collector to add to its counters."""

    windows: int
    """Windows emitted (merged rows, plus the windows nobody wanted, skipped unread)."""
    rows: int
    """Rows emitted (every row of the pass, plus those skipped unread)."""
    overwritten: int
    """Windows lost to a bank overwritten before they were read."""
    torn: int
    """Windows flagged torn (a writer died in the middle of an ``add``)."""


def emit_scan(c: PassHost, now: int, *, final: bool) -> PassCounts:
    """Scan ``c``'s segment at ``now`` (every window with data if ``final``), dispatch, publish, export and score
    the rows; returns what the pass counted (``c`` is only read). The caller then hands the pass to
    :func:`commit_pass`."""
    relay, dispatcher, exporter, job = c.relay, c.dispatcher, c.exporter, c.config.job
    assert relay is not None
    relay.update_subscriptions()  # first: rows nobody receives are never built
    lines = _straggler_lines(dispatcher)
    # straggler output: scores to our group, events to subscribers, lines to the console handlers
    scored = not dispatcher.discards(PLATFORM_GROUP) or any(map(relay.wants, EVENT_TOPICS)) or any(
        h is not None for h in lines.values())

    def wanted(group: str) -> bool:
        return (scored or exporter is not None or not dispatcher.discards(group)
                or relay.wants(wire.stat_topic(group, "")))

    result = c.scanner.scan(now, final=final, want=wanted)
    cols = result.columns
    dispatcher.emit_columns(cols)
    if len(cols) and relay.subscribed:
        for group in cols.groups():
            if relay.wants(wire.stat_topic(group, "")):
                _publish_rows(relay, cols.of_groups({group}))
    if exporter is not None:
        exporter.observe_columns(cols)
    scores_wanted = not dispatcher.discards(PLATFORM_GROUP)
    found = c.stragglers.update_columns(cols, scores=scores_wanted)  # scores to our group, events on event/<name>
    if found.scores and scores_wanted:
        dispatcher.emit_points(PLATFORM_GROUP, [s.metric(PLATFORM_GROUP, job) for s in found.scores])
    for ev in found.events:
        data = ev.data
        if c.gpu is not None and ev.name == STRAGGLER_EVENT:  # what the slow rank's GPU did meanwhile
            end = int(data["window_start_ns"]) + int(data["window_ms"]) * 1_000_000
            data = {**data, **c.gpu.describe(int(data["rank"]), int(data["since_ns"]), end)}
        c.publish_event(ev.name, now, data)
        group = str(data["group"])
        say = lines[group] if group in lines else lines["*"]
        if say is not None:
            say.say_straggler(ev.name, job, data)
    return PassCounts(windows=result.skipped_windows + int(np.count_nonzero(cols.rank < 0)),
                      rows=result.skipped_rows + len(cols), overwritten=result.overwritten, torn=result.torn)


def _straggler_lines(dispatcher: ThreadedDispatcher) -> dict[str, StragglerLines | None]:
    """Each configured group's handler if it prints straggler lines (else None), and ``*``: the default's."""
    inner = dispatcher.inner
    found: dict[str, StragglerLines | None] = {
        g: h if isinstance(h, StragglerLines) else None for g, h in inner.handlers.items()}
    found["*"] = inner.default if isinstance(inner.default, StragglerLines) else None
    return found


def commit_pass(c: PassHost) -> None:
    """Flush the handlers and hand the last pass's watermarks to ``c.commits``, which writes them into the segment
    once every handler took what was dispatched so far (:mod:`collector.daemon.commits`): the pass's rows and
    whatever was dispatched after them, such as the counters of the windows it found lost."""
    c.commits.add(c.dispatcher.flush(), c.scanner.advance())


def _publish_rows(relay: Relay, cols: Columns) -> None:
    """Publish the rows of one group on their ``stat/<group>/<name>`` topics, to the topics someone wants."""
    by_topic: dict[str, list[dict]] = {}
    wants = relay.wants
    for row in cols.to_rows():
        topic = wire.stat_topic(row.group, row.name)
        items = by_topic.get(topic)
        if items is None:
            items = by_topic[topic] = [] if wants(topic) else _NOBODY
        if items is not _NOBODY:
            items.append(row.to_wire())
    for topic, items in by_topic.items():
        if items is not _NOBODY:
            relay.publish(topic, "stat", items)


_NOBODY: list[dict] = []  # marks a topic no subscriber listens to
