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
