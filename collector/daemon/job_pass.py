"""One job's passes and their commit: what its collector reads, hands every consumer once, and commits.

A scan pass (:meth:`JobPass.scan`) reads the closed windows some consumer wants as
:class:`collector.read.columns.Columns` (merged by the one merge, :func:`collector.read.columns.merge_parts`) and
hands them on as one :class:`collector.read.passes.Pass` through the fan-out (:mod:`collector.daemon.fanout`). Its
watermark moves at once in the scanner's memory, and into the segment only once every handler took the pass
(:meth:`JobPass.commit`, :mod:`collector.daemon.commits`), so a collector killed mid-pass leaves that pass to the
next one.

Passes of metrics that belong to no window: the ``put_metric`` points a loop turn took (:func:`puts_of`), with
what other threads of the collector's process submitted (the launcher's agent: queued without a lock, a
deque's appends and pops being atomic, and taken by the loop each turn, :meth:`Submitted.drain`); and the
collector's own figures in the platform group, every rank's CPU and RSS and the collector's counters
(:func:`usage_points`; those the segment holds: :func:`drop_counters`; the relay's: :func:`relay_counts`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from elastic.metrics import MetricData, StatMetricData
from shmstat.errors import WireError
from shmstat.shm.layout_codec import rank_problem
from shmstat.shm.layout_records import RankInfo
from shmstat.shm.segment import Segment

from ..read.passes import Pass, Put
from ..read.scanner import Scanner
from ..relay.intake import Received
from .commits import PendingCommits
from .config import PLATFORM_GROUP
from .fanout import FanOut
from .liveness import Liveness

if TYPE_CHECKING:
    from ..handlers.dispatch import ThreadedDispatcher
    from ..relay.relay import Relay, RelayCounters

__all__ = ["JobPass", "PassCounts", "Submitted", "candidate_groups", "drop_counters", "point", "puts_of",
           "relay_counts", "usage_points"]

_log = logging.getLogger("shmstat.collector")


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


class JobPass:
    """One job's scan passes, handed to ``fanout`` and committed through ``commits`` once ``dispatcher``'s handlers
    took them; with what they counted (:attr:`windows_emitted`, :attr:`rows_emitted`, :attr:`overwritten`,
    :attr:`torn`)."""

    def __init__(self, job: str, segment: Segment, scanner: Scanner, relay: Relay, fanout: FanOut,
                 dispatcher: ThreadedDispatcher, commits: PendingCommits) -> None:
        self.job = job
        self._segment = segment
        self._scanner = scanner
        self._relay = relay
        self.fanout = fanout
        self._dispatcher = dispatcher
        self.commits = commits
        self.windows_emitted = 0
        self.rows_emitted = 0
        self.torn = 0

    @property
    def overwritten(self) -> int:
        """Windows of the job lost to the ring, counted once across collectors: the segment's count, which moves
        with the watermarks that pass them (:class:`collector.read.scanner.DurableMarks`); 0 once it is released."""
        try:
            return self._segment.overwritten()
        except (ValueError, TypeError):  # released at shutdown
            return 0

    def scan(self, now: int, *, final: bool, lost: Callable[[], None]) -> None:
        """Scan the segment at ``now`` (every window with data if ``final``) for the groups some consumer wants,
        hand the pass to every consumer, count it, and commit it (:meth:`commit`). Windows found torn are counted
        in the pass whose watermark moves past them: ``lost`` (which hands the counters on) runs before that
        watermark is committed, so a collector killed in between leaves both to the next one, which counts them
        again, and never the watermark without the count. Windows lost to the ring count when the watermark that
        moves past them is committed (:attr:`overwritten`): once, whoever commits."""
        counts = self._pass(now, final=final)
        self.windows_emitted += counts.windows
        self.rows_emitted += counts.rows
        self.torn += counts.torn
        if counts.torn:
            lost()
        self.commit()

    def _pass(self, now: int, *, final: bool) -> PassCounts:
        self._relay.update_subscriptions()  # first: rows nobody receives are never built
        fanout = self.fanout
        result = self._scanner.scan(now, final=final, want=lambda group: fanout.wants(group, "windows"))
        cols = result.columns
        if len(cols):  # before any handler sees it: a successor knows (see scanner)
            self._segment.set_dispatched(result.dispatch_until_ns)
        fanout.take(Pass(self.job, now, columns=cols))
        return PassCounts(windows=result.skipped_windows + int(np.count_nonzero(cols.rank < 0)),
                          rows=result.skipped_rows + len(cols), overwritten=result.overwritten, torn=result.torn)

    def commit(self) -> None:
        """Flush the handlers and hand the last pass's watermarks to ``commits``, which writes them into the
        segment once every handler took what was dispatched so far (:mod:`collector.daemon.commits`): the pass's rows
        and whatever was dispatched after them, such as the counters of the windows it found lost."""
        self.commits.add(self._dispatcher.flush(), self._scanner.advance())

    def usage(self, now: int, figures: Callable[[], list[StatMetricData]]) -> None:
        """Hand the collector's own ``figures()`` at ``now`` on as one pass; none are made when no consumer wants
        them (a null or compact handler, no subscriber)."""
        if self.fanout.wants(PLATFORM_GROUP, "usage"):
            self.fanout.take(Pass(self.job, now, usage=figures()))

    def puts(self, now: int, puts: list[Put]) -> None:
        """Hand ``puts`` (points of no window) on as one pass, if any."""
        if puts:
            self.fanout.take(Pass(self.job, now, puts=puts))


# -- metrics that belong to no window: put metrics, the collector's own figures ----------------------------
def puts_of(job: str, msg: Received, fanout: FanOut, relay_counters: RelayCounters) -> list[Put]:
    """The points of one ``metric/`` message, for a pass (none, left undecoded, when no consumer wants its
    group's put metrics); a message decode refuses is counted in ``relay_counters.rejected``."""
    if not any(fanout.wants(group, "puts") for group in candidate_groups(msg.raw_topic)):
        return []  # nobody would see an item: they stay undecoded (the relay re-published the frames)
    try:
        items = msg.items
    except WireError:  # the C check let through what decode refuses (a bug): count it, never stop
        relay_counters.rejected += 1
        _log.error("a metric message on %r passed the intake check but not wire.decode", msg.topic)
        return []
    rank = msg.rank
    return [Put(point(float(ts), group, name, value, rank, job), rank) for group, name, value, ts in items]


def usage_points(job: str, now: int, ranks: list[RankInfo], liveness: Liveness,
                 counters: dict[str, int]) -> list[StatMetricData]:
    """The collector's figures in the platform group at ``now``: every active rank's CPU and RSS, the
    collector's own CPU and RSS, and ``counters``."""
    ts = now / 1e9
    rows: list[StatMetricData] = []
    for u in liveness.usage(ranks):
        rows.append(point(ts, PLATFORM_GROUP, "rank.cpu_percent", u.cpu_percent, u.rank, job))
        rows.append(point(ts, PLATFORM_GROUP, "rank.rss_bytes", u.rss_bytes, u.rank, job))
    cpu_s, rss = Liveness.self_usage()
    for name, value in {**counters, "cpu_seconds": cpu_s, "rss_bytes": rss}.items():
        rows.append(point(ts, PLATFORM_GROUP, f"collector.{name}", value, None, job))
    return rows


def relay_counts(c: RelayCounters) -> dict[str, int]:
    """The relay's counters by the names the collector reports them (status line, platform group, /metrics)."""
    return {
        "events_relayed": c.events, "metrics_relayed": c.metrics,
        "frames_rejected": c.rejected, "seq_gaps": c.gaps, "subscription_resets": c.subscription_resets,
        "items_resent": c.resent,
        "subscriber_items_lost": sum(c.subscriber_lost.values()),
        "subscriber_queue_full": sum(c.queue_full.values()),
        "handshakes_refused": c.handshakes.refused, "handshakes_failed": c.handshakes.failed,
        "key_revocations": c.handshakes.revocations,
        **{f"subscriber_items_lost_{kind}": n for kind, n in c.subscriber_lost.items()},
        **{f"subscriber_queue_full_{kind}": n for kind, n in c.queue_full.items()},
    }


def drop_counters(segment: Segment | None) -> dict[str, int]:
    """What the job's processes could not write (read from the segment: header and rank entries); zeros once
    the segment is released."""
    if segment is None:
        return {"samples_dropped": 0, "no_room_ranks": 0, "no_room_workers": 0, "no_room_stats": 0}
    try:
        h = segment.header()
        geometry = segment.geometry
        ranks = [r for r in segment.ranks() if rank_problem(r, geometry) is None]  # garbage entries count nothing
    except (ValueError, TypeError):  # released at shutdown
        return {"samples_dropped": 0, "no_room_ranks": 0, "no_room_workers": 0, "no_room_stats": 0}
    return {"samples_dropped": h.dropped + sum(r.dropped for r in ranks), "no_room_ranks": h.ranks_refused,
            "no_room_workers": sum(r.writers_refused for r in ranks),
            "no_room_stats": sum(r.stats_refused for r in ranks)}


def candidate_groups(topic: bytes) -> list[str]:
    """The group a valid ``metric/<group>/<name>`` message on ``topic`` carries, as a list (empty for a topic no
    valid message has): a group holds no ``/`` (:mod:`shmstat.names`, checked by the wire), a name may."""
    group, sep, _ = bytes(topic)[len(b"metric/"):].decode("utf-8").partition("/")
    return [group] if sep else []


def point(ts: float, group: str, name: str, value: float, rank: int | None, job: str) -> StatMetricData:
    """A metric that belongs to no window (a rank's put_metric, a usage sample), with its rank and job."""
    return StatMetricData(ts, group, name, value, rank=rank, window_start=None, window_end=None,  # type: ignore[arg-type]
                          job=job)


# -- what other threads of the collector's process submit -----------------------------------------------------
_EventItem = tuple[str, int, dict[str, str | int | float | bool]]  # (name, ts_ns, data)


class Submitted:
    """Metrics and events made in this process, in the order submitted; any thread may add, one loop takes."""

    def __init__(self) -> None:
        self._items: deque[MetricData | _EventItem] = deque()

    def __bool__(self) -> bool:
        """Whether something waits to be taken."""
        return bool(self._items)

    def metric(self, metric: MetricData) -> None:
        """Queue a metric (thread-safe)."""
        self._items.append(metric)

    def event(self, name: str, data: dict[str, str | int | float | bool]) -> None:
        """Queue an event stamped now (thread-safe); ``data`` is copied."""
        self._items.append((name, time.time_ns(), dict(data)))

    def drain(self, publish_event: Callable[[str, int, dict[str, str | int | float | bool]], None]) -> list[Put]:
        """On the loop's thread: hand every queued event to ``publish_event``, and return every queued metric as
        a put metric made here (no rank), in the order submitted, for the loop's next pass."""
        puts: list[Put] = []
        while self._items:
            item = self._items.popleft()
            if isinstance(item, MetricData):
                puts.append(Put(item, None, here=True))
            elif isinstance(item, tuple):
                publish_event(*item)
        return puts
