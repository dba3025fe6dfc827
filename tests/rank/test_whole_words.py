"""Every word of the segment that another process reads while it may change is stored whole: a process SIGKILLed
at any moment of a loop of such stores leaves the old value or the new one, never a mix of their bytes (a
``struct.pack_into`` store left a mix after 26% of the kills: the phase sequence 254 -> 256 read as 0, a
collector's emitted watermark or a rank's delivered count torn into a number nobody wrote)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import pytest

from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.segment import Segment

KILLS = 120
# two values whose eight bytes all differ: a store cut short between two bytes reads as neither
OLD, NEW = 0x0202020202020202, 0x0404040404040404


def _word(seg: Segment, offset: int) -> int:
    return int(seg.i64[offset // 8])


def _stores(seg: Segment) -> dict[str, tuple[Callable[[int], None], int]]:
    """``{what: (store(value), byte offset of the word it stores)}``: the codec's stores of words read live."""
    buf, geo = seg.buf, seg.geometry
    publish = codec.phase_publisher(buf, geo, 0)
    return {
        "phase sequence (rank)": (lambda v: publish(v, 1, 2, 3), geo.rank_offset(0) + L.R_PHASE_SEQ),
        "emitted watermark (collector)": (lambda v: codec.write_emitted_wid(buf, geo, 0, 0, v),
                                          geo.desc_offset(0, 0) + L.D_EMITTED),
        "dispatched_ns (collector)": (lambda v: codec.write_dispatched_ns(buf, v), L.H_DISPATCHED),
        "collector heartbeat (collector)": (lambda v: codec.write_collector(buf, 7, v), L.H_COLLECTOR_BEAT),
        "delivered count (rank's publisher)": (lambda v: codec.write_delivered(buf, geo.mark_offset(0) + L.M_DELIVERED,
                                                                               v), geo.mark_offset(0) + L.M_DELIVERED),
        "events_end (rank's publisher)": (lambda v: codec.write_events_end(buf, geo, 0, v, 1),
                                          geo.rank_offset(0) + L.R_EVENTS_END),
    }


@pytest.mark.parametrize("what", [
    "phase sequence (rank)", "emitted watermark (collector)", "dispatched_ns (collector)",
    "collector heartbeat (collector)", "delivered count (rank's publisher)", "events_end (rank's publisher)"])
def test_a_process_killed_in_a_loop_of_stores_leaves_a_whole_word(job, what):
    seg = Segment.open(job)
    try:
        store, offset = _stores(seg)[what]
        moments = random.Random(what)
        for _ in range(KILLS):
            store(OLD)
            pid = os.fork()
            if pid == 0:  # the writer: stores the two values in turn until it is killed
                try:
                    while True:
                        store(NEW)
                        store(OLD)
                finally:
                    os._exit(1)
            time.sleep(moments.uniform(0.0002, 0.002))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            assert _word(seg, offset) in (OLD, NEW), f"{what}: {_word(seg, offset):#x} left by a kill"
    finally:
        seg.close()
