"""``--handler '*=SPEC'`` serves every group, the collector's own ``shmstat`` group too (its counters and usage
points); a handler that names ``shmstat`` wins over ``*``, and without either the group goes nowhere, as before.

A real ``shmstat collect`` and a real rank adding to ``train/steps``; the jsonl file is read after the stop."""

from __future__ import annotations

import os

import pytest
from kit.procs import rank_worker, read_jsonl, spawn, start_collector, wait_file

from shmstat.names import COLLECTOR_GROUP


def _groups(job: str, tmp_path, *handlers: str) -> set[str]:
    out = str(tmp_path / "m.jsonl")
    args = [a for h in handlers for a in ("--handler", h.format(out=out))]
    coll = start_collector(job, *args, "--grace-ms", "10")
    try:
        p = spawn(rank_worker, job, 0, 1, 0.3, 100, str(tmp_path / "r0.json"))
        p.join(60)
        assert p.exitcode == 0
        wait_file(str(tmp_path / "r0.json"))
    finally:
        assert coll.stop() == 0
    return {r["group"] for r in read_jsonl(out)} if os.path.exists(out) else set()


@pytest.mark.parametrize(("handlers", "own"), [
    (("*=jsonl:{out}",), True),
    (("*=jsonl:{out}", "shmstat=null"), False),
    (("train=jsonl:{out}",), False),
], ids=["star", "star-but-shmstat-null", "named-group-only"])
def test_star_serves_the_collectors_own_group_unless_a_handler_names_it(job, tmp_path, handlers, own):
    groups = _groups(job, tmp_path, *handlers)
    assert "train" in groups, groups
    assert (COLLECTOR_GROUP in groups) is own, groups


def test_a_star_handler_object_serves_the_collectors_own_group_as_the_star_spec_does(job):
    """``handler_objects={"*": h}`` (the Python face of ``--handler '*=...'``) gets every group, the collector's own
    too (it got the job's groups only: ``*`` meant two things); a handler object naming ``shmstat`` wins."""
    from kit.handlers.user import Recording
    from kit.support import FakeClock, step_and_wait

    from collector import Collector, CollectorConfig
    from shmstat.aggregation import Aggregation as A
    from shmstat.job.attach import init, shutdown
    from shmstat.writer.stat import Stat

    groups = []
    for named in (False, True):
        clock = FakeClock()
        clock.to_window(100)
        star, own = Recording(), Recording()
        objects = {"*": star, **({COLLECTOR_GROUP: own} if named else {})}
        c = Collector(CollectorConfig(job=job, grace_ms=0, clock=clock, usage_interval_s=0.0),
                      handler_objects=objects)
        step_and_wait(c)
        try:
            init(job, rank=0, publish=False)
            stat = Stat("steps", [A.COUNT], 0.1, clock=clock, group="train")
            stat.add(1.0)
            clock.advance_ms(250)
            c.step()
        finally:
            c.close()
            shutdown()
        groups.append(({m.group_name for m in star.got}, {m.group_name for m in own.got}))
    (star_alone, _), (star_beside, own_named) = groups
    assert {"train", COLLECTOR_GROUP} <= star_alone, star_alone
    assert COLLECTOR_GROUP not in star_beside and COLLECTOR_GROUP in own_named, groups
