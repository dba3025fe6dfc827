"""collector.jobwide.JobWatch on a node's hang events (``shmstat.hang``, ``shmstat.hang.resolved``) as a node
collector publishes them, encoded and decoded as on the wire, with an injected clock."""

from __future__ import annotations

from kit.support import FakeClock

from collector.daemon.hangs import HANG_EVENT, RESOLVED_EVENT
from collector.jobwide.watch import JOB_HANG_EVENT, JOB_HANG_RESOLVED_EVENT, JobWatch
from shmstat import wire


def _event(clock: FakeClock, name: str, data: dict) -> wire.WireMessage:
    frames = wire.encode("event", -1, 1, 0, 0, [[name, clock(), data]])
    return wire.decode(wire.event_topic(name).encode(), frames)


def _hang(status: str) -> dict:
    return {"group": "section", "ranks": "0,1", "suspects": "1", "elsewhere": False, "rank.1.section": "data",
            "rank.1.wait": False, "rank.1.age_s": 3.0, "rank.1.status": status,
            "line": f"hang: job j: rank 0 in allreduce for 3 s; rank 1 in data for 3 s (pid 9, {status})"}


def test_a_node_hang_named_again_on_a_changed_picture_keeps_the_job_hang_open():
    """The node resolves its episode with reason ``changed`` and names it again at once (its suspect died): the job
    still hangs on the same rank, so no job-wide resolution and no second job-wide hang; real progress resolves."""
    clock = FakeClock()
    jw = JobWatch(settle_s=1.0, clock=clock)
    (hang,) = jw.take("a", _event(clock, HANG_EVENT, _hang("sleeping")), "j")
    assert (hang.name, hang.data["rank"], hang.data["node"]) == (JOB_HANG_EVENT, 1, "a")
    clock.advance_ms(500)
    changed = {"group": "section", "ranks": "0,1", "duration_s": 3.5, "reason": "changed", "line": "hang resolved"}
    assert jw.take("a", _event(clock, RESOLVED_EVENT, changed), "j") == []
    assert jw.take("a", _event(clock, HANG_EVENT, _hang("died")), "j") == []
    clock.advance_ms(500)
    (resolved,) = jw.take("a", _event(clock, RESOLVED_EVENT, {**changed, "reason": "ended"}), "j")
    assert resolved.name == JOB_HANG_RESOLVED_EVENT
