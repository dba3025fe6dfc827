"""The collector's drop counters (status line, platform group, /metrics) count only rank entries a reader can
use: an entry the scanner skips as garbage (a pid out of range, an unknown state) adds nothing, however large the
``dropped`` word written into it."""

from __future__ import annotations

import os
import struct

from kit.support import unique_job

from collector.cli.admin import segment_info
from collector.daemon.job_pass import drop_counters
from shmstat.shm import layout as L
from shmstat.shm.segment import Segment


def _entry(seg: Segment, local_rank: int, pid: int, state: int, dropped: int, stats_refused: int) -> None:
    off = seg.geometry.rank_offset(local_rank)
    struct.pack_into("<qQqqqq", seg.buf, off + L.R_PID, pid, 1, local_rank, local_rank, 4, 0)
    struct.pack_into("<QQQ", seg.buf, off + L.R_DROPPED, dropped, stats_refused, 0)
    struct.pack_into("<Q", seg.buf, off + L.R_STATE, state)


def test_a_garbage_rank_entry_adds_nothing_to_the_drop_counters():
    job = unique_job("drops")
    seg = Segment.open(job, geometry=L.Geometry(4, 8, 4))
    try:
        _entry(seg, 0, os.getpid(), L.RankState.ACTIVE, dropped=5, stats_refused=1)
        _entry(seg, 1, os.getpid(), L.RankState.DIED, dropped=7, stats_refused=0)
        _entry(seg, 2, 1 << 40, L.RankState.ACTIVE, dropped=1 << 62, stats_refused=1 << 40)  # pid out of range
        _entry(seg, 3, os.getpid(), 99, dropped=1 << 61, stats_refused=1 << 39)  # no such state
        counts = drop_counters(seg)
        assert counts["samples_dropped"] == seg.header().dropped + 5 + 7
        assert counts["no_room_stats"] == 1
    finally:
        seg.close()
        Segment.unlink(job)


def test_ls_counts_neither_the_ranks_nor_the_drops_of_a_garbage_entry():
    job = unique_job("drops")
    seg = Segment.open(job, geometry=L.Geometry(4, 8, 4))
    try:
        _entry(seg, 0, os.getpid(), L.RankState.ACTIVE, dropped=5, stats_refused=1)
        _entry(seg, 2, 1 << 40, L.RankState.ACTIVE, dropped=1 << 62, stats_refused=1 << 40)  # pid out of range
        info = segment_info(job)
        assert (info.ranks_alive, info.ranks_total, info.dropped) == (1, 1, seg.header().dropped + 5)
        assert info.refused == (0, 0, 1)
    finally:
        seg.close()
        Segment.unlink(job)
