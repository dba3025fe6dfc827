"""Names at the edge of the name rule (:mod:`shmstat.names`), and a rank that uses them through every entry point.

The names are chosen to be hard to carry: non-ASCII letters and emoji exactly at the byte limits, a ``/`` inside a
name, the group and stat of the issue's topic collision (``a`` + ``b/c`` against ``a/b`` + ``c``)."""

from __future__ import annotations

import json
import os

STAT_MAX = "é" * 40  # 80 bytes: the longest stat name, two bytes a letter
STAT_EMOJI = "😀" * 20  # 80 bytes, four a character
STAT_SLASH = "loss/train 损失"
STATS = (STAT_MAX, STAT_EMOJI, STAT_SLASH)

GROUP_MAX = "ü" * 24  # 48 bytes: the longest group
GROUP_HAN = "训练组"
GROUP_TB = "tb.ü"
GROUP_A = "a"  # with the stat "b/c": the topic stat/a/b/c and the tag a/b/c.count are this pair's alone
GROUP_OTLP = "otlp-é"
GROUPS = (GROUP_MAX, GROUP_HAN, GROUP_TB, GROUP_OTLP)
PAIRS = (*((g, s) for g in GROUPS for s in STATS), (GROUP_A, "b/c"))
"""Every (group, stat) a rank of :func:`names_rank` writes."""

METRIC_MAX = "é" * 127 + "x"  # 255 bytes: the longest metric or event name
METRICS = ((GROUP_HAN, METRIC_MAX), (GROUP_TB, METRIC_MAX), (GROUP_A, "b/c"))
EVENT_MAX = "ü" * 127 + "!"
EVENTS = (EVENT_MAX, "epoch/end ✓")

ADDS = 60
"""Samples each rank adds to each stat."""


def names_rank(job: str, rank: int, world: int, out: str) -> None:
    """Rank ``rank`` of ``job``: ``ADDS`` samples of ``rank + 1`` to every stat of :data:`PAIRS` (COUNT and SUM,
    100 ms windows), one put metric per entry of :data:`METRICS` (value ``rank + 1``) and one event per name of
    :data:`EVENTS`; then tries the refused names of the issue and writes the errors to ``out`` (JSON)."""
    import datetime
    import time

    import shmstat
    from elastic import metrics
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    stats = [shmstat.Stat(name, [A.COUNT, A.SUM], 0.1, group=group) for group, name in PAIRS]
    for i in range(ADDS):
        for s in stats:
            s.add(float(rank + 1))
        if i % 20 == 0:
            time.sleep(0.05)  # a few windows
    for group, name in METRICS:
        metrics.put_metric(name, rank + 1, group)
    for name in EVENTS:
        shmstat.log_event(shmstat.Event(name, datetime.datetime.now(), {"rank": rank}))
    refused = {}
    for label, make in (("ufffd", lambda: shmstat.Stat("bad\ufffd", [A.COUNT], 0.1, group=GROUP_HAN)),
                        ("surrogate", lambda: shmstat.Stat("bad\ud800", [A.COUNT], 0.1, group=GROUP_HAN)),
                        ("group a/b", lambda: shmstat.Stat("c", [A.COUNT], 0.1, group="a/b")),
                        ("group rank0", lambda: shmstat.Stat("x", [A.COUNT], 0.1, group="rank0")),
                        ("metric group a/b", lambda: metrics.put_metric("c", 1, "a/b"))):
        try:
            make()
            refused[label] = None
        except shmstat.ConfigError as exc:
            refused[label] = str(exc)
    for s in stats:
        s.close()
    shmstat.shutdown()
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(refused, f)
    os.replace(out + ".tmp", out)
