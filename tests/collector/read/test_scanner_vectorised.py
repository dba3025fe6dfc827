"""The vectorised scanner against the reference rules of ``SegmentReader.read_slot``, on random segments.

Banks are written directly (random windows around ``now``, random counts, banks a dead or a live writer left
torn, random watermarks, several window lengths), then one pass of :class:`collector.read.scanner.Scanner` is
compared with what a slot-by-slot pass through ``read_slot`` gives: the same rows in the same order, the
same counters and the same new watermarks.
"""

from __future__ import annotations

import os
import random
import struct

import pytest
from kit.merge_reference import merge_all
from kit.support import unique_job

from collector.read.rows import WindowRow
from collector.read.scanner import Scanner
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.layout_records import WindowFigures
from shmstat.shm.reader import SegmentReader
from shmstat.shm.segment import Segment

WINDOWS_MS = (100, 1000)


@pytest.fixture
def seg():
    job = unique_job("vec")
    s = Segment.open(job, geometry=L.Geometry(4, 24, 4))
    yield s
    s.close()
    Segment.unlink(job)


def _populate(seg: Segment, rng: random.Random, now_ns: int) -> None:
    geo, buf = seg.geometry, seg.buf
    for r in range(geo.max_ranks):
        off = geo.rank_offset(r)
        dead = r == 3
        struct.pack_into("<qQqqqqq", buf, off + L.R_PID, os.getpid(), 1, 10 + r, r, 4, 0, 0)
        struct.pack_into("<Q", buf, off + L.R_STATE, L.RankState.DIED if dead else L.RankState.ACTIVE)
        nstats = rng.randint(1, geo.max_stats)
        for j in range(nstats):
            window_ms = rng.choice(WINDOWS_MS)
            codec.write_descriptor(buf, geo, r, j, name=f"s{j % 5}".encode(), group=rng.choice([b"a", b"b"]),
                               window_ms=window_ms, max_samples=1 << 40, agg_mask=0b1111100, incarnation=1)
            wns = window_ms * 1_000_000
            cur = now_ns // wns
            after = rng.choice([-1, cur - 1, cur - 2, cur - 3, cur - 6, cur - 40])
            codec.write_emitted_wid(buf, geo, r, j, after)
            for b in range(geo.banks):
                wid = rng.choice([cur - 8 + k for k in range(10)] + [0])
                wid -= (wid - b) % geo.banks  # a bank holds windows w with w % K == b
                count = rng.choice([0, 1, 3, 7])
                seq = 2.0 * count + (1.0 if rng.random() < 0.15 else 0.0)  # odd: a writer stopped mid-add
                vals = [rng.uniform(-5, 5) for _ in range(4)]
                struct.pack_into("<dqddddqQ", buf, geo.slot_offset(r, j) + b * L.BANK_SIZE, seq, wid,
                                 *vals, wid * wns + rng.randint(0, wns - 1), 1)
        struct.pack_into("<Q", buf, off + L.R_NSTATS, nstats)


def _reference(seg: Segment, now_ns: int, grace_ns: int, final: bool):
    """The slot-by-slot pass (the scanner's rules before it was vectorised), plus the hold-back of a stat's
    windows behind a live writer's torn bank."""
    reader = SegmentReader(seg)
    by_key: dict = {}
    overwritten = 0
    safe: dict[tuple[int, int], int] = {}
    held: dict = {}  # key -> first window a live writer's torn bank holds back (a stall under K-2 windows)
    slots = []
    for info in reader.ranks():
        for desc in reader.descriptors(info.local_rank):
            wns = desc.window_ns
            at = now_ns if not final else (now_ns // wns + 2) * wns + grace_ns
            alive = False if info.state == L.RankState.DIED else None
            read = reader.read_slot(info, desc, at, grace_ns, desc.emitted_wid, writer_alive=alive)
            key = (desc.group, desc.name, desc.window_ms, desc.agg_mask)
            overwritten += read.overwritten
            newest = (at - grace_ns) // wns - 1
            if read.safe_wid < newest and newest - read.safe_wid < seg.geometry.banks - 2:
                held[key] = min(held.get(key, read.safe_wid + 1), read.safe_wid + 1)
            slots.append((info, desc, key, read))
    windows = torn = 0
    for info, desc, key, read in slots:
        limit = held.get(key, 1 << 62)
        for w in read.windows:
            if w.wid >= limit:
                continue
            by_key.setdefault((key, w.wid), []).append((info.rank, w))
            windows += 1
            torn += w.torn
        top = min(read.safe_wid, limit - 1)
        if final:  # a last pass: no further than the slot's newest window (its next incarnation writes the later)
            base = seg.geometry.slot_offset(info.local_rank, desc.index)
            held_wid = max(struct.unpack_from("<q", seg.buf, base + b * L.BANK_SIZE + 8)[0]
                           for b in range(seg.geometry.banks))
            top = min(top, max(desc.emitted_wid, held_wid))
        if top > desc.emitted_wid:
            safe[(info.local_rank, desc.index)] = top
    rows = []
    for (key, wid) in sorted(by_key, key=lambda k: (k[1], k[0])):
        group, name, window_ms, mask = key
        parts = by_key[(key, wid)]
        by_rank: dict[int, list[WindowFigures]] = {}  # slots of one rank (its writers) are summed into its row
        for rank, w in sorted(parts, key=lambda part: part[0]):
            by_rank.setdefault(rank, []).append(WindowFigures(w.count, w.sum, w.min, w.max, w.last, w.last_ts, w.torn))
        per_rank = [WindowRow(group, name, wid, window_ms, mask, rank, ss[0] if len(ss) == 1 else merge_all(ss))
                    for rank, ss in by_rank.items()]
        rows.append(WindowRow(group, name, wid, window_ms, mask, None,
                              merge_all(s for ss in by_rank.values() for s in ss), ranks=len(by_rank)))
        rows.extend(per_rank)
    return rows, windows, overwritten, torn, safe


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_vectorised_pass_matches_read_slot(seg, seed, final):
    rng = random.Random(seed)
    now_ns = 1_800_000_000 * 1_000_000_000 + rng.randint(0, 10**9)
    grace_ns = rng.choice([0, 20_000_000])
    _populate(seg, rng, now_ns)
    want_rows, want_windows, want_over, want_torn, want_safe = _reference(seg, now_ns, grace_ns, final)
    sc = Scanner(seg, grace_ns)
    got = sc.scan(now_ns, final=final)
    assert got.rows == want_rows
    assert (got.windows_read, got.overwritten, got.torn) == (want_windows, want_over, want_torn)
    sc.commit()
    for (r, j), wid in want_safe.items():
        assert seg.descriptors(r)[j].emitted_wid == wid
    assert sc.scan(now_ns, final=final).rows == []  # nothing twice


@pytest.mark.parametrize("seed", range(20))
def test_unwanted_groups_are_counted_not_built(seg, seed):
    rng = random.Random(100 + seed)
    now_ns = 1_800_000_000 * 1_000_000_000 + rng.randint(0, 10**9)
    _populate(seg, rng, now_ns)
    want_rows, want_windows, *_ = _reference(seg, now_ns, 0, False)
    sc = Scanner(seg, 0)
    got = sc.scan(now_ns, want=lambda g: g == "a")
    assert got.rows == [r for r in want_rows if r.group == "a"]
    skipped = [r for r in want_rows if r.group != "a"]
    assert got.skipped_rows == len(skipped)
    assert got.skipped_windows == sum(1 for r in skipped if r.rank is None)
    assert got.windows_read == want_windows
