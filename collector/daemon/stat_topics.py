"""The relay's share of a collector pass: :class:`StatTopics` publishes what subscribers are sent of each pass.

A pass's windows go out as rows on their ``stat/<group>/<name>`` topics, built only for the topics someone
subscribed to; the collector's usage figures on ``stat/shmstat/usage``; the metrics made in the collector's own
process (the launcher's agent) on their ``metric/`` topics (a rank's put metrics were relayed as they came).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shmstat import wire

from .config import PLATFORM_GROUP

if TYPE_CHECKING:
    from ..read.columns import Columns
    from ..read.passes import Pass, Wanted
    from ..relay.relay import Relay

__all__ = ["USAGE_TOPIC", "StatTopics"]

USAGE_TOPIC = wire.stat_topic(PLATFORM_GROUP, "usage")
"""Where the collector's usage figures are published."""


class StatTopics:
    """Publishes each pass of one job on its relay (:class:`collector.read.passes.PassConsumer`, on the loop: the
    relay's sockets are the loop's)."""

    on_loop = True
    """The relay's sockets are used only on the loop's thread."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def wants(self, group: str, what: Wanted) -> bool:
        """A group's windows when someone subscribed to its ``stat/`` topics; the usage figures when someone
        subscribed to theirs (the agent's metrics are published whatever is asked)."""
        if what == "windows":
            return self.relay.wants(wire.stat_topic(group, ""))
        return what == "usage" and group == PLATFORM_GROUP and self.relay.wants(USAGE_TOPIC)

    def take(self, pass_: Pass) -> None:
        """Publish the pass's windows, the metrics made in this process, and the usage figures."""
        relay = self.relay
        cols = pass_.columns
        if cols is not None and len(cols) and relay.subscribed:
            for group in cols.groups():
                if relay.wants(wire.stat_topic(group, "")):
                    publish_rows(relay, cols.of_groups({group}))
        for put in pass_.puts:
            if put.here:
                m = put.metric
                relay.publish(wire.metric_topic(m.group_name, m.name), "metric",
                              [[m.group_name, m.name, m.value, m.timestamp]])
        if pass_.usage:
            relay.publish(USAGE_TOPIC, "stat", [
                {"group": md.group_name, "name": md.name, "value": md.value, "rank": getattr(md, "rank", None),
                 "timestamp": md.timestamp} for md in pass_.usage])


def publish_rows(relay: Relay, cols: Columns) -> None:
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
