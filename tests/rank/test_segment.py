"""The segment: creation, validation, registration, capacity and error messages."""

from __future__ import annotations

import os
import stat as st
import struct

import pytest

from shmstat.errors import CapacityError, ConfigError, LayoutMismatchError, SegmentError
from shmstat.job.rank import RankAttachment
from shmstat.shm import layout as L
from shmstat.shm.runtime import segment_name, validate_job
from shmstat.shm.segment import Segment


def test_created_owner_only_with_header(job):
    seg = Segment.open(job, geometry=L.Geometry(4, 8, 4))
    try:
        assert seg.created
        mode = os.stat("/dev/shm" + segment_name(job)).st_mode
        assert st.S_IMODE(mode) == 0o600
        h = seg.header()
        assert h.magic == L.MAGIC and h.version == L.LAYOUT_VERSION
        assert (h.max_ranks, h.max_stats, h.banks) == (4, 8, 4)
        assert h.total_size == L.Geometry(4, 8, 4).total_size
    finally:
        seg.close()


def test_second_open_attaches_and_validates(job):
    a = Segment.open(job, geometry=L.Geometry(4, 8, 4))
    b = Segment.open(job)  # accepts what is there
    c = Segment.open(job, geometry=L.Geometry(4, 8, 4))
    try:
        assert not b.created and b.geometry == a.geometry and not c.created
        with pytest.raises(LayoutMismatchError, match="same capacities"):
            Segment.open(job, geometry=L.Geometry(8, 8, 4))
    finally:
        for s in (a, b, c):
            s.close()


def test_missing_segment_without_create_is_a_clear_error(job):
    with pytest.raises(SegmentError, match="no shared memory segment exists"):
        Segment.open(job, create=False)


def test_other_layout_version_and_foreign_magic_are_refused(job):
    seg = Segment.open(job, geometry=L.Geometry(2, 2, 4))
    struct.pack_into("<Q", seg.buf, L.H_VERSION, L.LAYOUT_VERSION + 1)
    with pytest.raises(LayoutMismatchError, match="layout version"):
        Segment.open(job)
    struct.pack_into("<Q", seg.buf, L.H_VERSION, L.LAYOUT_VERSION)
    struct.pack_into("<8s", seg.buf, 0, b"NOTOURS!")
    with pytest.raises(LayoutMismatchError, match="not created by shmstat"):
        Segment.open(job)
    seg.close()


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 65, "sp ace", "..", "é"])
def test_bad_job_ids_are_refused(bad):
    with pytest.raises(ConfigError, match="job id"):
        validate_job(bad)


def test_register_bumps_incarnation_and_refuses_live_holder(job):
    seg = Segment.open(job, geometry=L.Geometry(2, 4, 4))
    try:
        a = RankAttachment.register(seg, rank=0, local_rank=0)
        assert a.incarnation == 1
        b = RankAttachment.register(seg, rank=0, local_rank=0)  # same pid: re-registration
        assert b.incarnation == 2
        with pytest.raises(ConfigError, match="held by live pid"):
            RankAttachment.register(seg, rank=0, local_rank=0, pid=os.getppid())
        with pytest.raises(CapacityError, match="max-ranks"):
            RankAttachment.register(seg, rank=5, local_rank=2)
        info = seg.rank(0)
        assert info.pid == os.getpid() and info.state_name == "active" and info.incarnation == 2
    finally:
        seg.close()


def test_descriptor_capacity_and_names(job):
    seg = Segment.open(job, geometry=L.Geometry(1, 2, 4))
    try:
        att = RankAttachment.register(seg, rank=0, local_rank=0)
        i = att.allocate_stat("a", "g", 100, 10, 0b11)
        j = att.allocate_stat("a", "g", 100, 10, 0b11)  # the same key in one process: the same slot
        assert (i, j) == (0, 0)
        assert att.allocate_stat("a", "g", 200, 10, 0b11) == 1  # another window: another stat
        with pytest.raises(CapacityError, match="max-stats"):
            att.allocate_stat("b", "g", 100, 10, 0b11)
        with pytest.raises(ConfigError, match="shorten"):
            att.allocate_stat("n" * (L.MAX_NAME_BYTES + 1), "g", 100, 10, 1)
        descs = seg.descriptors(0)
        assert [(d.name, d.group, d.window_ms, d.max_samples, d.agg_mask, d.emitted_wid) for d in descs] == [
            ("a", "g", 100, 10, 3, -1), ("a", "g", 200, 10, 3, -1)
        ]
        again = RankAttachment.register(seg, rank=0, local_rank=0)  # a restarted rank reuses its stats
        assert again.allocate_stat("a", "g", 200, 10, 0b11) == 1
    finally:
        seg.close()


def test_seqlock_read_reports_a_write_in_progress(job):
    seg = Segment.open(job, geometry=L.Geometry(1, 1, 4))
    try:
        off = seg.geometry.slot_offset(0, 0)
        struct.pack_into("<dqddddqQ", seg.buf, off, 6.0, 42, 3.0, 0.5, 2.0, 1.0, 7, 1)
        snap = seg.read_bank(0, 0, 0)
        assert (snap.wid, snap.count, snap.sum, snap.torn) == (42, 3, 3.0, False)
        struct.pack_into("<d", seg.buf, off, 7.0)  # writer stopped mid-add
        assert seg.read_bank(0, 0, 0).torn
    finally:
        seg.close()


def test_unlink_if_unused_keeps_a_segment_while_a_registered_process_lives(job):
    import subprocess
    import sys

    seg = Segment.open(job, geometry=L.Geometry(2, 4, 4))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        RankAttachment.register(seg, rank=0, local_rank=0, pid=child.pid)
        assert not Segment.unlink_if_unused(job)  # its process still runs (even if it already said goodbye)
        assert os.path.exists("/dev/shm" + segment_name(job))
        child.kill()
        child.wait()
        assert Segment.unlink_if_unused(job)
        assert not os.path.exists("/dev/shm" + segment_name(job))
        assert not os.path.exists(f"/dev/shm/shmstat.{job}.lock")
        assert not Segment.unlink_if_unused(job)  # nothing left to remove
    finally:
        child.kill()
        seg.close()
        Segment.unlink(job)


def test_a_segment_removed_between_its_opening_and_the_registration_is_opened_again(job):
    """A rank opens the job's segment, the node collector removes it (no process of the job alive: a torchrun
    restart between attempts) and the rank registers just after: it must not register in the unlinked mapping,
    whose samples no collector reads (torchrun's restarted rank lost a whole attempt so), but open the job's
    segment again. The registration refuses the removed one; ``init`` then attaches to a new segment that
    ``/dev/shm`` names, and its samples are there."""
    from shmstat.job.rank import SegmentRemoved

    opened = Segment.open(job)
    assert Segment.unlink(job)  # as the sweep does, under the job lock, while no process is registered
    try:
        with pytest.raises(SegmentRemoved):
            RankAttachment.register(opened, rank=0, local_rank=0, world_size=1)
    finally:
        opened.close()
    import shmstat

    shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False)
    try:
        stat = shmstat.Stat("steps", [shmstat.Aggregation.COUNT], 60)
        stat.add(1.0)
        again = Segment.open(job, create=False)
        try:
            assert again.linked() and again.rank(0).pid == os.getpid()
        finally:
            again.close()
    finally:
        shmstat.shutdown()
        Segment.unlink(job)
