"""Metrics the collector hands on that belong to no window: a rank's ``put_metric`` points, relayed to the
handlers and the Prometheus exporter (:func:`dispatch_put_metrics`), and the collector's own figures in the
platform group, every rank's CPU and RSS and the collector's counters (:func:`emit_usage`; those the segment
holds: :func:`drop_counters`). Called by
:class:`collector.daemon.collector.Collector`'s loop; nothing here keeps state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic.metrics import MetricData, StatMetricData
from shmstat import wire
from shmstat.errors import WireError

from .config import PLATFORM_GROUP
from .liveness import Liveness

if TYPE_CHECKING:
    from shmstat.shm.layout_records import RankInfo
    from shmstat.shm.segment import Segment

    from ..handlers.dispatch import ThreadedDispatcher
    from ..prometheus.exporter import PrometheusExporter
    from ..wire.intake import Received
    from ..wire.relay import Relay, RelayCounters

__all__ = ["candidate_groups", "dispatch_put_metrics", "drop_counters", "emit_usage", "point", "relay_counts"]

_log = logging.getLogger("shmstat.collector")


def dispatch_put_metrics(job: str, msg: Received, dispatcher: ThreadedDispatcher,
                         exporter: PrometheusExporter | None, relay_counters: RelayCounters) -> None:
    """Hand the points of one ``metric/`` message to the exporter and to the handlers of their groups (left
    undecoded when nobody would see one); a message decode refuses is counted in ``relay_counters.rejected``."""
    discards = dispatcher.discards_points
    if exporter is None and all(map(discards, candidate_groups(msg.raw_topic))):
        return  # nobody would see an item: they stay undecoded (the relay re-published the frames)
    try:
        items = msg.items
    except WireError:  # the C check let through what decode refuses (a bug): count it, never stop
        relay_counters.rejected += 1
        _log.error("a metric message on %r passed the intake check but not wire.decode", msg.topic)
        return
    for group, name, value, ts in items:
        p = point(float(ts), group, name, value, msg.rank, job)
        if exporter is not None:
            exporter.observe_metric(job, p, msg.rank)
        if not discards(group):
            dispatcher.emit_points(group, [p])


def emit_usage(job: str, now: int, ranks: list[RankInfo], liveness: Liveness, counters: Callable[[], dict[str, int]],
               dispatcher: ThreadedDispatcher, relay: Relay) -> None:
    """Emit, in the platform group, every active rank's CPU and RSS, the collector's own and ``counters()``
    (with each group's handler drops), to the handlers and on the ``stat/`` topic of ``usage``."""
    ts = now / 1e9
    rows: list[MetricData] = []
    for u in liveness.usage(ranks):
        rows.append(point(ts, PLATFORM_GROUP, "rank.cpu_percent", u.cpu_percent, u.rank, job))
        rows.append(point(ts, PLATFORM_GROUP, "rank.rss_bytes", u.rss_bytes, u.rank, job))
    cpu_s, rss = Liveness.self_usage()
    figures = {**counters(), "cpu_seconds": cpu_s, "rss_bytes": rss}
    figures.update({f"handler_dropped.{g}": n for g, n in dispatcher.dropped_by_group.items()})
    for name, value in figures.items():
        rows.append(point(ts, PLATFORM_GROUP, f"collector.{name}", value, None, job))
    items = []
    dispatcher.emit_points(PLATFORM_GROUP, rows)
    for md in rows:
        items.append({"group": md.group_name, "name": md.name, "value": md.value,
                      "rank": getattr(md, "rank", None), "timestamp": md.timestamp})
    relay.publish(wire.stat_topic(PLATFORM_GROUP, "usage"), "stat", items)


def relay_counts(c: RelayCounters) -> dict[str, int]:
    """The relay's counters by the names the collector reports them (status line, platform group, /metrics)."""
    return {
        "events_relayed": c.events, "metrics_relayed": c.metrics,
        "frames_rejected": c.rejected, "seq_gaps": c.gaps, "subscription_resets": c.subscription_resets,
        "items_resent": c.resent,
        "subscriber_overflows": sum(c.overflows.values()),
        "handshakes_refused": c.handshakes.refused, "handshakes_failed": c.handshakes.failed,
        "key_revocations": c.handshakes.revocations,
        **{f"subscriber_overflows_{kind}": n for kind, n in c.overflows.items()},
    }


def drop_counters(segment: Segment | None) -> dict[str, int]:
    """What the job's processes could not write (read from the segment: header and rank entries); zeros once
    the segment is released."""
    if segment is None:
        return {"samples_dropped": 0, "no_room_ranks": 0, "no_room_workers": 0, "no_room_stats": 0}
    try:
        h = segment.header()
        ranks = segment.ranks()
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
