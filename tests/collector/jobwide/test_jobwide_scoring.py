"""collector.jobwide.JobWatch's scoring on real wire messages (the ``stat/`` rows a node collector publishes,
encoded and decoded as on the wire) with an injected clock: a window is scored once every node sent a later one,
or after ``settle_s``; rows that come after their window was scored are counted, not folded in; what the collector
does not score (a wait section, a count alone) is not scored here either; the slow node is named once."""

from __future__ import annotations

from kit.support import FakeClock

from collector.jobwide.watch import (
    JOB_RECOVERED_EVENT,
    JOB_STRAGGLER_EVENT,
    NODE_BACK_EVENT,
    NODE_SILENT_EVENT,
    JobWatch,
)
from collector.read.rows import WindowRow
from shmstat import wire
from shmstat.aggregation import Aggregation as A
from shmstat.aggregation import to_mask
from shmstat.shm.layout_records import WindowFigures

MASK = to_mask([A.COUNT, A.MEAN])


def _msg(rows: list[tuple[int, int, float]], *, name: str = "step", mask: int = MASK, wait: bool = False):
    """One ``stat/train/<name>`` message of per-rank rows ``(rank, wid, figure)`` (5 samples each)."""
    items = [WindowRow("train", name, wid, 100, mask, rank, WindowFigures(5, 5 * f, f, f, f, 0), wait=wait).to_wire()
             for rank, wid, f in rows]
    return wire.decode(f"stat/train/{name}".encode(), wire.encode("stat", -1, 1, 0, 0, items))


def test_a_window_waits_for_every_node_then_a_late_row_is_counted_not_scored():
    clock = FakeClock()
    jw = JobWatch(windows=1, settle_s=1.0, clock=clock)
    assert jw.take("a", _msg([(0, 7, 10.0), (1, 7, 10.0)]), "j") == []
    assert jw.take("b", _msg([(2, 7, 30.0), (3, 7, 30.0)]), "j") == []
    clock.advance_ms(500)
    assert jw.take("a", _msg([(0, 8, 10.0), (1, 8, 10.0)]), "j") == []  # b has not sent a later window yet
    assert jw.views()[0].stats == ()
    clock.advance_ms(500)  # settle_s: window 7 is scored without b's window 8, which waits on
    found = jw.tick()
    (stat,) = jw.views()[0].stats
    assert stat.wid == 7 and stat.median == 20.0 and [n.score for n in stat.nodes] == [2.0, 20.0 / 30.0]
    assert [(e.data["node"], e.data["rank"]) for e in found if e.name == JOB_STRAGGLER_EVENT] == [("b", -1)]
    jw.take("b", _msg([(2, 7, 99.0)]), "j")
    assert jw.late == 1 and jw.views()[0].stats[0].median == 20.0
    jw.take("a", _msg([(0, 9, 10.0)]), "j")
    jw.take("b", _msg([(2, 8, 30.0), (3, 8, 30.0), (2, 9, 30.0)]), "j")  # window 8: every node sent a later one
    assert jw.views()[0].stats[0].wid == 8


def test_a_wait_section_and_a_count_alone_are_not_scored():
    jw = JobWatch(windows=1, settle_s=1.0, clock=FakeClock())
    for node, ranks in (("a", (0, 1)), ("b", (2, 3))):
        for wid in (1, 2):
            jw.take(node, _msg([(r, wid, 10.0 * (r + 1)) for r in ranks], name="wait", wait=True), "j")
            jw.take(node, _msg([(r, wid, 10.0 * (r + 1)) for r in ranks], name="n", mask=to_mask([A.COUNT])), "j")
    assert jw.views()[0].stats == ()


def test_a_node_followed_but_not_sending_yet_is_waited_for_up_to_settle_s():
    """Ranks that start late on one node: their windows are not scored without them while it may still come (a rank
    scored against the others only was seen recovered and flagged again under load)."""
    clock = FakeClock()
    jw = JobWatch(windows=1, settle_s=1.0, clock=clock)
    jw.expected = ("a", "b", "c")
    for wid in (7, 8):
        jw.take("a", _msg([(0, wid, 10.0), (1, wid, 10.0)]), "j")
        jw.take("b", _msg([(2, wid, 10.0), (3, wid, 40.0)]), "j")
    assert jw.views()[0].stats == ()  # c's ranks have not started
    jw.take("c", _msg([(4, 7, 40.0), (5, 7, 40.0)]), "j")
    jw.take("c", _msg([(4, 8, 40.0), (5, 8, 40.0)]), "j")
    (stat,) = jw.views()[0].stats
    assert stat.wid == 7 and stat.median == 25.0 and len(stat.ranks) == 6
    clock.advance_ms(1000)
    jw.tick()
    assert jw.views()[0].stats[0].wid == 8  # window 8 waited settle_s for nodes that sent no window 9


def test_a_slow_node_is_named_once_and_a_rank_slow_on_it_against_its_node():
    jw = JobWatch(windows=2, settle_s=1.0, clock=FakeClock())
    jw.expected = ("a", "b", "c")
    found = []
    for wid in (1, 2, 3):
        found += jw.take("a", _msg([(0, wid, 10.0), (1, wid, 10.0), (2, wid, 10.0)]), "j")
        found += jw.take("b", _msg([(3, wid, 10.0), (4, wid, 10.0), (5, wid, 10.0)]), "j")
        found += jw.take("c", _msg([(6, wid, 20.0), (7, wid, 20.0), (8, wid, 40.0)]), "j")
    flagged = [(e.data["node"], e.data["rank"], e.data["against"], e.data["score"], e.data["median"])
               for e in found if e.name == JOB_STRAGGLER_EVENT]
    assert sorted(flagged) == [("c", -1, "job", 0.5, 10.0), ("c", 8, "node", 0.5, 20.0)], found
    (rank8,) = [e.data["line"] for e in found if e.data.get("rank") == 8]
    assert "against its node's median (a slow node) 20 for 2 windows" in rank8, rank8


def test_a_slow_node_near_the_threshold_is_one_episode_not_flapping():
    """Node c 1.4x slower (score 0.71, ~5% under 0.75) with a noisy window now and then at 1.3x (0.77): named once,
    recovered only after ``windows`` windows in a row at or above the threshold (seen on three hosts under load:
    named, recovered, named again while still slow)."""
    jw = JobWatch(windows=3, settle_s=1.0, clock=FakeClock())
    jw.expected = ("a", "b", "c")
    found = []
    factors = [1.4, 1.4, 1.4, 1.3, 1.4, 1.3, 1.3, 1.4, 1.4, 1.4, 1.0, 1.3, 1.4, 1.0, 1.3, 1.0]
    for wid, k in enumerate([*factors, 1.0], start=1):  # the last window only closes the one before
        found += jw.take("a", _msg([(0, wid, 10.0), (1, wid, 10.0)]), "j")
        found += jw.take("b", _msg([(2, wid, 10.0), (3, wid, 10.0)]), "j")
        found += jw.take("c", _msg([(4, wid, 10.0 * k), (5, wid, 10.0 * k)]), "j")
    episode = [(e.name, e.data["node"], e.data["rank"], e.data["window_start_ns"] // 100_000_000) for e in found]
    assert episode == [(JOB_STRAGGLER_EVENT, "c", -1, 3), (JOB_RECOVERED_EVENT, "c", -1, 16)], found


def test_a_node_that_sends_nothing_is_silent_left_out_of_the_scores_and_back_when_heard():
    """Node c stops (its collector killed: no rows, no heartbeat): after ``silent_after_s`` it is named silent once,
    its window still waiting then is scored without it (not against the live nodes), no window waits for it any
    more, the view lists it as silent; when it is heard again (a heartbeat is enough) it is back."""
    clock = FakeClock()
    jw = JobWatch(windows=1, settle_s=5.0, silent_after_s=3.0, clock=clock)
    jw.expected = ("a", "b", "c")
    found = []
    for wid in (1, 2):
        found += jw.take("a", _msg([(0, wid, 10.0), (1, wid, 10.0)]), "j")
        found += jw.take("b", _msg([(2, wid, 10.0), (3, wid, 10.0)]), "j")
        found += jw.take("c", _msg([(4, wid, 10.0), (5, wid, 10.0)]), "j")
    assert jw.views()[0].stats[0].wid == 1 and len(jw.views()[0].stats[0].nodes) == 3
    found += jw.take("c", _msg([(4, 3, 90.0), (5, 3, 90.0)]), "j")  # c's last window, waiting for c's next
    for wid in (3, 4, 5, 6):
        clock.advance_ms(1000)
        found += jw.take("a", _msg([(0, wid, 10.0), (1, wid, 10.0)]), "j")
        found += jw.take("b", _msg([(2, wid, 10.0), (3, wid, 10.0)]), "j")
        found += jw.heard("a") + jw.heard("b") + jw.tick()  # their heartbeats
        assert jw.views()[0].stats[0].wid == (2 if wid < 5 else wid - 1)  # 3.. wait for c until it is silent
    silent = [e.data for e in found if e.name == NODE_SILENT_EVENT]
    assert [(d["node"], d["silent_s"]) for d in silent] == [("c", 3.0)], found
    assert silent[0]["line"] == ("node silent: job j: node c sent nothing, not even a heartbeat, for 3 s; its "
                                 "windows are left out of the scores")
    assert not [e for e in found if e.name == JOB_STRAGGLER_EVENT], found  # c's 90 never scored against a and b
    (view,) = jw.views()
    (stat,) = view.stats
    assert stat.wid == 5 and [n.node for n in stat.nodes] == ["a", "b"] and {r.node for r in stat.ranks} == {"a", "b"}
    assert view.silent == (("c", 4.0),) and view.nodes == ("a", "b", "c")
    clock.advance_ms(1000)
    back = jw.heard("c")
    assert [(e.name, e.data["node"], e.data["silent_s"]) for e in back] == [(NODE_BACK_EVENT, "c", 5.0)], back
    assert back[0].data["line"] == "node back: job j: node c heard again after 5 s silent"
    assert jw.views()[0].silent == () and jw.tick() == []
    jw.ended("c")  # c's final heartbeat: its quiet after it says nothing
    clock.advance_ms(10_000)
    jw.heard("a")
    jw.ended("b")
    assert jw.tick() == [] and jw.followed == ("a",) and jw.views()[0].silent == ()


def test_a_watcher_that_stalled_names_no_node_silent_whose_messages_wait_in_its_queue():
    """The watcher itself stalled (load, a pause) longer than ``silent_after_s``: the messages its nodes sent
    meanwhile wait in its sockets. Taking one node's does not judge the others before theirs are taken: silence is
    judged by :meth:`JobWatch.tick`, once every socket was read."""
    clock = FakeClock()
    jw = JobWatch(windows=1, settle_s=1.0, silent_after_s=2.0, clock=clock)
    for node, ranks in (("a", (0, 1)), ("b", (2, 3))):
        jw.take(node, _msg([(r, 1, 10.0) for r in ranks]), "j")
    clock.advance_ms(3000)  # stalled; both nodes sent window 2 and their heartbeats meanwhile
    found = jw.take("a", _msg([(0, 2, 10.0), (1, 2, 10.0)]), "j")
    found += jw.take("b", _msg([(2, 2, 10.0), (3, 2, 10.0)]), "j")
    found += jw.tick()
    assert [e for e in found if e.name == NODE_SILENT_EVENT] == [], found
