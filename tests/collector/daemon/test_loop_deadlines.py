"""The serving loop's timing: it sleeps until the next thing is due (a window's end, a look at the rank table, a look
for new stats, usage, heartbeat, a pending commit) instead of waking every few ms, and while messages flow it turns
once per gathering pause, not once per message. Real segments, real sockets, a real rank; the windows on an
injected clock, the loop's deadlines on the monotonic clock they are made of."""

from __future__ import annotations

import time

from kit.support import FakeClock, wait_for

from collector import Collector, CollectorConfig
from collector.daemon.config import SERVING_RANK_LOOK_S
from collector.daemon.loop import (
    CHORE_SLACK_S,
    COMMIT_POLL_S,
    MAX_POLL_MS,
    RELAY_TURN_S,
    STAT_LOOK_S,
    gather_pause,
    relay_turn_s,
    wait_quietly,
)
from collector.daemon.node import NODE_MAX_WAIT_S, NodeCollector
from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init
from shmstat.publish.events import Event, log_event
from shmstat.shm.layout import DEFAULT_BANKS, min_window_ms
from shmstat.writer.stat import Stat

_EPS_S = 0.002  # rounding of the loop's poll timeout to whole ms


def _serving(job: str) -> Collector:
    c = Collector(CollectorConfig(job=job, status_interval_s=0.0, hold_ms=0))
    c.rank_look_s = SERVING_RANK_LOOK_S  # as run() and a node collector serve
    return c


def test_an_idle_serving_collector_sleeps_until_its_next_deadline(job):
    clock = FakeClock()
    clock.to_window(1000)
    c = Collector(CollectorConfig(job=job, status_interval_s=0.0, hold_ms=0, clock=clock, grace_ms=0))
    try:
        c.rank_look_s = SERVING_RANK_LOOK_S
        init(job, rank=0, publish=False)
        s = Stat("slow", [A.COUNT], 1.0, clock=clock, group="g")
        s.add(1.0)
        c.step(0)  # a rank look: the stat is known, its window due at the end of this second plus grace
        mono = time.monotonic()
        # nothing is due for a while: the loop sleeps until the next rank look, which may be CHORE_SLACK_S late (the
        # looks for new stats are made inside the wait, one word each: wait_quietly)
        assert c.next_due() <= mono + SERVING_RANK_LOOK_S + CHORE_SLACK_S + _EPS_S
        assert STAT_LOOK_S * 1000 < c.loop.poll_timeout_ms() <= (SERVING_RANK_LOOK_S + CHORE_SLACK_S) * 1000 + 1
        started = time.monotonic()
        wait_quietly(c.loop.poller(), 100, (c,))  # no message, no new stat: it waits it all, looking for stats within
        assert time.monotonic() >= started + 0.1 and c.next_stat_look > started + STAT_LOOK_S
        # a window ending sooner than that is what the loop wakes for (the window clock is injected)
        clock.advance_ms(1000 - 5)
        assert c.next_due() <= time.monotonic() + 0.005 + _EPS_S
        clock.advance_ms(5)
        assert c.loop.poll_timeout_ms() == 0  # due now
        c.step(0)  # the pass: its watermark waits for the handlers to take it
        if len(c.commits):
            assert c.next_due() <= time.monotonic() + COMMIT_POLL_S + _EPS_S
        for _ in range(3):
            assert 0 <= c.loop.poll_timeout_ms() <= MAX_POLL_MS
    finally:
        c.close()


def test_a_stat_made_between_rank_looks_is_found_within_the_stat_look(job):
    """A stat of the shortest window the layout allows, made just after a rank look: the wait ends at the look for
    new stats (the segment's entries epoch moved), not at the next rank look, so its windows are read before its
    ring wraps."""
    clock = FakeClock()
    c = Collector(CollectorConfig(job=job, status_interval_s=0.0, hold_ms=0, clock=clock))
    try:
        c.rank_look_s = SERVING_RANK_LOOK_S
        init(job, rank=0, publish=False)
        c.step(0)  # the first rank look: no stat yet
        looked = time.monotonic()
        window_ms = min_window_ms(DEFAULT_BANKS)
        stat = Stat("fast", [A.COUNT], window_ms / 1000, clock=clock, group="g")
        stat.add(1.0)
        assert looked + STAT_LOOK_S < c.next_due()  # no turn for the look: the wait makes it
        rank_look = c._next_rank_look
        c.step(c.loop.poll_timeout_ms())
        assert c.scanner._slots.get(0), "the new stat was not found by the step after the wait"
        assert c._next_rank_look == rank_look, "found by a rank look, not by the look for new stats"
    finally:
        c.close()


def test_a_node_collector_sleeps_until_the_earliest_deadline_of_its_jobs(job):
    init(job, rank=0, publish=False)
    node = NodeCollector(CollectorConfig(job="", status_interval_s=0.0, hold_ms=0), jobs=[job],
                         discover_interval_s=0.2)
    try:
        node.loop.step(0)  # discovers the job
        (c,) = node.collectors.values()
        c.step(0)
        assert node.loop.next_due() <= min(c.next_due(), node._next_discovery + CHORE_SLACK_S) + _EPS_S
        assert 0 <= node.loop.poll_timeout_ms() <= NODE_MAX_WAIT_S * 1000
        assert node.loop.poller() is node.loop.poller()  # one poller while the jobs served stay the same
    finally:
        node.close()


def test_a_turn_that_relayed_messages_is_followed_by_a_gathering_pause(job):
    c = _serving(job)
    try:
        init(job, rank=0)
        for i in range(3):
            log_event(Event("e", __import__("datetime").datetime.now(), {"i": i}))
        relayed: list[int] = []

        def stepped() -> bool:
            c.step(5)
            relayed.append(c.relayed_last_step)
            return c.relay_counters.events >= 3

        wait_for(stepped, 20, what="the rank's events relayed")
        assert c.relay_counters.events == 3 and sum(relayed) == c.relay_counters.messages > 0
        c.step(0)
        assert c.relayed_last_step == 0  # nothing came since
        started = time.monotonic()
        assert gather_pause(started) == 0
        assert time.monotonic() - started >= RELAY_TURN_S  # what arrives meanwhile is taken in one turn
        assert gather_pause(time.monotonic() - 1.0) == 0  # a turn that took longer than the pause: none
        started = time.monotonic()
        assert gather_pause(started, relay_turn_s(100)) == 0  # a 100 ms budget: a turn every 50 ms while flowing
        assert time.monotonic() - started >= 0.05
    finally:
        c.close()


def test_the_relay_turn_follows_the_event_latency_budget() -> None:
    """While messages flow the loop turns every half of the budget (--event-latency), never more often than
    RELAY_TURN_S: a short budget costs what the loop cost before there was one."""
    assert CollectorConfig(job="j").event_latency_ms == 20
    assert relay_turn_s(20) == 0.01
    assert relay_turn_s(1) == RELAY_TURN_S
