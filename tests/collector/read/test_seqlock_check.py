"""The scanner's one seqlock check of many banks at once, on banks of garbage (a ``seq`` no writer can produce).

The pass over short windows and the look at long-window slots used two copies of the check that disagreed on such
a bank (one took it as consistent, the other as torn). There is one rule now: a garbage bank is consistent and
empty, read as holding no window and never retried (retrying cannot make it consistent, and a slot whose bank
stays torn while its writer lives is held back pass after pass).
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest
from kit.support import unique_job

from collector.read.bank_reads import consistent_banks, read_banks
from collector.read.scanner import Scanner
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.segment import Segment

WINDOW_MS = 100
WNS = WINDOW_MS * 1_000_000
NOW = 17_000_000 * WNS + WNS // 2
GARBAGE_SEQS = (math.nan, -4.0, 2.0**63)


@pytest.fixture
def seg():
    job = unique_job("seqlock")
    s = Segment.open(job, geometry=L.Geometry(1, 2, 4))
    off = s.geometry.rank_offset(0)
    struct.pack_into("<qQqqqqq", s.buf, off + L.R_PID, os.getpid(), 1, 0, 0, 1, 0, 0)  # a live writer: this test
    struct.pack_into("<Q", s.buf, off + L.R_STATE, L.RankState.ACTIVE)
    yield s
    s.close()
    Segment.unlink(job)


def _bank(seg: Segment, stat: int, wid: int, seq: float) -> None:
    struct.pack_into("<dqddddqQ", seg.buf, seg.geometry.slot_offset(0, stat) + wid % seg.geometry.banks * L.BANK_SIZE,
                     seq, wid, 3.0, 1.0, 1.0, 1.0, wid * WNS, 1)


def test_a_garbage_bank_is_consistent_and_empty_a_torn_one_is_not(seg):
    cur = NOW // WNS
    seqs = (*GARBAGE_SEQS, 5.0, 6.0)  # garbage x3, then torn (odd: a write in progress), then 3 samples
    for k, seq in enumerate(seqs):
        _bank(seg, k // 4, cur - 1 - k, seq)
    grow = np.array([(k // 4) * seg.geometry.banks + (cur - 1 - k) % seg.geometry.banks for k in range(len(seqs))])
    ok, samples = consistent_banks(*read_banks(seg, grow))
    assert ok.tolist() == [True, True, True, False, True]
    assert samples[[0, 1, 2, 4]].tolist() == [0, 0, 0, 3]


@pytest.mark.parametrize("seq", GARBAGE_SEQS)
def test_a_pass_reads_a_live_writers_garbage_bank_as_empty_and_moves_on(seg, seq):
    cur = NOW // WNS
    codec.write_descriptor(seg.buf, seg.geometry, 0, 0, name=b"lat", group=b"g", window_ms=WINDOW_MS, max_samples=100,
                           agg_mask=1 << 4, incarnation=1, emitted_wid=cur - 3)
    struct.pack_into("<Q", seg.buf, seg.geometry.rank_offset(0) + L.R_NSTATS, 1)
    _bank(seg, 0, cur - 2, 4.0)  # 2 samples
    _bank(seg, 0, cur - 1, seq)  # the newest closed window's bank: garbage
    scanner = Scanner(seg, grace_ns=0)
    result = scanner.scan(NOW)
    rows = set(zip(result.columns.wid.tolist(), result.columns.count.tolist(), strict=True))
    assert rows == {(cur - 2, 2)}, rows  # the merged row and the rank's: the garbage window is not emitted
    marks = scanner.advance()
    assert marks.wids.tolist() == [cur - 1]  # past the garbage bank, not held back behind it
