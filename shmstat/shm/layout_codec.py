"""Reading and writing the records of a job's segment as :mod:`shmstat.shm.layout` draws them: the header (and the
words the collector and the ranks set in it), rank entries (registering one, its counters and ``events_end``),
descriptors (publishing one, and the collector's watermark in it), banks under their seqlock, histograms and
delivered marks; the checks a reader applies to records a rank could never have written (garbage in the segment);
and the encoding of stat names.

With :mod:`shmstat.shm.layout` (where each field is: offsets and sizes) and :mod:`shmstat.shm.layout_records` (what
a record read out is, as a value), this module is the one home of the segment's bytes: it holds the records'
binary formats, and every pack and unpack of segment bytes is one of its functions. Nothing outside these three
modules uses ``struct`` on a segment (the collector's vectorised reads of many banks at once,
:mod:`collector.read.scanner`, view the same words as NumPy arrays, with the offsets and word indices of
:mod:`shmstat.shm.layout`). The functions take the segment's byte view (``buf``) and, where a record is found by
its index, the :class:`~shmstat.shm.layout.Geometry`; they take no lock (the callers hold the job lock where the
layout asks for it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import compress
from typing import TYPE_CHECKING

from .. import names as _names
from ..histogram import MAX_SCALE as _MAX_SCALE
from ..histogram import MIN_SCALE as _MIN_SCALE
from ..histogram import Histogram as _Histogram
from .layout import (
    D_EMITTED,
    D_GROUP,
    D_HIST,
    D_NAME,
    D_STATE,
    H_COLLECTOR_BEAT,
    H_COLLECTOR_PID,
    H_DISPATCHED,
    H_ENTRIES_EPOCH,
    H_MAGIC,
    H_OVERWRITTEN,
    H_WARNED,
    HIST_BUCKETS,
    HIST_COUNTS,
    LAYOUT_VERSION,
    M_PID,
    M_RANK,
    MAGIC,
    MAX_GROUP_BYTES,
    MAX_NAME_BYTES,
    MAX_WINDOW_MS,
    PERCENTILE_BITS,
    PHASE_COPY_SIZE,
    R_DROPPED,
    R_EVENTS_END,
    R_NHIST,
    R_NSTATS,
    R_PHASE,
    R_PHASE_SEQ,
    R_PID,
    R_STATE,
    R_WRITER_OF,
    VALID_AGG_MASK,
    Geometry,
    RankState,
)
from .layout_records import BankSnapshot, Header, RankInfo, StatDescriptor

if TYPE_CHECKING:  # pragma: no cover
    from ..histogram import Histogram

__all__ = [
    "bank_seq_wid",
    "bump_entries_epoch",
    "clear_events_end",
    "decode_hist",
    "descriptor_hist",
    "descriptor_problem",
    "empty_bank",
    "encode_name",
    "phase_publisher",
    "rank_nhist",
    "rank_problem",
    "read_bank",
    "read_delivered_marks",
    "read_descriptor",
    "read_dispatched_ns",
    "read_entries_epoch",
    "read_header",
    "read_overwritten",
    "read_phase_seq",
    "read_phase_word",
    "read_rank",
    "read_warned",
    "write_collector",
    "write_delivered",
    "write_delivered_mark",
    "write_descriptor",
    "write_dispatched_ns",
    "write_emitted_wid",
    "write_events_end",
    "write_header",
    "write_rank_entry",
    "write_rank_nhist",
    "write_rank_nstats",
    "write_rank_pid",
    "write_rank_state",
    "write_warned",
]

# The records' binary formats (little-endian; the fields' offsets and meanings are :mod:`shmstat.shm.layout`'s).
_HEADER = struct.Struct("<8sQQQQQqqqQQQ")  # magic .. ranks_refused
_RANK = struct.Struct("<QqQqqqqqQQQQ")  # state .. writer_of
_RANK_DROPS = struct.Struct("<QQQQQ")  # dropped, stats_refused, writers_refused, events_end, events_inc
_RANK_ID = struct.Struct("<qQqqqqq")  # pid, incarnation, rank, local_rank, world_size, start_ns, heartbeat_ns
_EVENTS_END = struct.Struct("<QQ")  # events_end, events_inc
_DESC_HEAD = struct.Struct("<QQqQqQQQQq")  # state .. hist
_HIST_HEAD = struct.Struct("<qQqqqqQQ")
_COUNTS = struct.Struct(f"<{HIST_BUCKETS}I")
_BANK = struct.Struct("<dqddddqQ")
_SEQ_WID = struct.Struct("<dq")
_MARK = struct.Struct("<qqQQQ")  # pid, rank, incarnation, delivered, origin
_MARK_TAIL = struct.Struct("<qQQQ")  # rank, incarnation, delivered, origin
_MAGIC = struct.Struct("<8s")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")


# Every word another process reads while it may change (a seqlock's sequence, a publish flag, a watermark, a counter)
# is stored by one 8-byte store through a typed view (memoryview item assignment is a single ``memcpy`` of 8
# bytes). ``struct.pack_into`` writes such a word byte by byte: a process killed in the middle of it leaves a value
# that is neither the old nor the new one (26% of 2,000 SIGKILLs in a tight loop of them did), e.g. the phase
# sequence 254 -> 256 read as 0 (tests/rank/test_whole_words.py). Records written under a sequence or flag may
# still go through ``struct``: the word published last guards them.
def _store_u64(buf: memoryview, offset: int, value: int) -> None:
    memoryview(buf)[offset:offset + 8].cast("Q")[0] = value


def _store_i64(buf: memoryview, offset: int, value: int) -> None:
    memoryview(buf)[offset:offset + 8].cast("q")[0] = value


def _store_f64(buf: memoryview, offset: int, value: float) -> None:
    memoryview(buf)[offset:offset + 8].cast("d")[0] = value


def read_header(buf: memoryview) -> Header:
    """Decode the header from the start of ``buf``."""
    return Header(*_HEADER.unpack_from(buf, 0))


def write_header(buf: memoryview, geometry: Geometry, created_ns: int) -> None:
    """Write a fresh header; the magic is written last so a half-initialised segment is never trusted."""
    _HEADER.pack_into(
        buf, 0, b"\x00" * 8, LAYOUT_VERSION, geometry.max_ranks, geometry.max_stats, geometry.banks,
        geometry.total_size, created_ns, 0, 0, geometry.hist_slots, 0, 0,
    )
    _store_u64(buf, H_MAGIC, int.from_bytes(MAGIC, "little"))


def write_collector(buf: memoryview, pid: int, beat_ns: int) -> None:
    """Record the serving collector's pid and heartbeat in the header."""
    _store_i64(buf, H_COLLECTOR_PID, pid)
    _store_i64(buf, H_COLLECTOR_BEAT, beat_ns)


def read_dispatched_ns(buf: memoryview) -> int:
    """The header's ``dispatched_ns``: windows ended by then may have reached a collector's handlers (0: none)."""
    return int(_I64.unpack_from(buf, H_DISPATCHED)[0])


def write_dispatched_ns(buf: memoryview, ns: int) -> None:
    """Set the header's ``dispatched_ns`` (the collector, before it dispatches a pass)."""
    _store_i64(buf, H_DISPATCHED, ns)


def read_overwritten(buf: memoryview) -> int:
    """The header's ``overwritten``: the job's windows lost to the ring, as committed by its collectors."""
    return int(_U64.unpack_from(buf, H_OVERWRITTEN)[0])


def read_entries_epoch(buf: memoryview) -> int:
    """The header's ``entries_epoch`` (moves whenever an entry is taken or a descriptor published)."""
    return int(_U64.unpack_from(buf, H_ENTRIES_EPOCH)[0])


def bump_entries_epoch(buf: memoryview) -> None:
    """Move the header's ``entries_epoch`` on by one (the job lock is held)."""
    _store_u64(buf, H_ENTRIES_EPOCH, (read_entries_epoch(buf) + 1) & ((1 << 64) - 1))


def read_warned(buf: memoryview) -> int:
    """The header's ``warned`` bit mask (kinds of degradation a process of the job reported already)."""
    return int(_U64.unpack_from(buf, H_WARNED)[0])


def write_warned(buf: memoryview, mask: int) -> None:
    """Set the header's ``warned`` bit mask (the job lock is held)."""
    _store_u64(buf, H_WARNED, mask)


def read_rank(buf: memoryview, geometry: Geometry, local_rank: int) -> RankInfo:
    """Decode rank entry ``local_rank``."""
    off = geometry.rank_offset(local_rank)
    (state, pid, inc, rank, _lr, world, start, beat, nstats, nan, disc, writer_of) = _RANK.unpack_from(buf, off)
    dropped, stats_refused, writers_refused, events_end, events_inc = _RANK_DROPS.unpack_from(buf, off + R_DROPPED)
    return RankInfo(local_rank, state, pid, inc, rank, world, start, beat, nstats, nan, disc, writer_of, dropped,
                    stats_refused, writers_refused, events_end, events_inc)


def write_rank_entry(buf: memoryview, geometry: Geometry, local_rank: int, *, pid: int, incarnation: int, rank: int,
                     world_size: int, now_ns: int, writer_of: int) -> None:
    """Take entry ``local_rank`` for a process (job lock held): its identity, start and heartbeat ``now_ns``,
    ``writer_of`` (-1 for a rank's own entry, else the local rank it writes for), ``events_end`` cleared (the last
    occupant's is not this process's), and ``state = active`` written last."""
    off = geometry.rank_offset(local_rank)
    _RANK_ID.pack_into(buf, off + R_PID, pid, incarnation, rank, local_rank, world_size, now_ns, now_ns)
    _store_u64(buf, off + R_WRITER_OF, writer_of + 1)
    _store_u64(buf, off + R_EVENTS_END, 0)
    _store_u64(buf, off + R_EVENTS_END + 8, 0)
    _store_u64(buf, off + R_STATE, RankState.ACTIVE)


_PHASE = struct.Struct("<QqQ")  # a phase copy: word, since_ns, step


def read_phase_seq(buf: memoryview, geometry: Geometry, local_rank: int) -> int:
    """Entry ``local_rank``'s ``phase_seq`` (0: no phase word written yet)."""
    return int(_U64.unpack_from(buf, geometry.rank_offset(local_rank) + R_PHASE_SEQ)[0])


def read_phase_word(buf: memoryview, geometry: Geometry, local_rank: int,
                    retries: int = 64) -> tuple[int, int, int] | None:
    """Entry ``local_rank``'s published phase copy ``(word, since_ns, step)`` (double-buffered seqlock, see
    :mod:`shmstat.shm.phase`); None for a free entry, one never written, or one whose writer kept moving it."""
    base = geometry.rank_offset(local_rank)
    if _U64.unpack_from(buf, base + R_STATE)[0] == RankState.FREE:
        return None
    for _ in range(retries):
        (seq,) = _U64.unpack_from(buf, base + R_PHASE_SEQ)
        if seq == 0:
            return None
        copy = _PHASE.unpack_from(buf, base + R_PHASE + ((seq >> 1) & 1) * PHASE_COPY_SIZE)
        if _U64.unpack_from(buf, base + R_PHASE_SEQ)[0] == seq:
            return copy
    return None


def phase_publisher(buf: memoryview, geometry: Geometry, local_rank: int) -> Callable[[int, int, int, int], None]:
    """``publish(seq, word, since_ns, step)`` for entry ``local_rank``: fills copy ``(seq >> 1) & 1`` (the one
    ``phase_seq`` does not name while ``seq`` is the previous sequence + 2), then stores ``seq`` (one aligned 8-byte
    store). The caller (the entry's one writing process, serialised) keeps ``seq`` even and increasing."""
    base = geometry.rank_offset(local_rank)
    copies = (base + R_PHASE, base + R_PHASE + PHASE_COPY_SIZE)
    seq_at = base + R_PHASE_SEQ
    pack = _PHASE.pack_into
    seq_word = memoryview(buf)[seq_at:seq_at + 8].cast("Q")  # stored whole (see _store_u64)

    def publish(seq: int, word: int, since_ns: int, step: int) -> None:
        pack(buf, copies[(seq >> 1) & 1], word, since_ns, step)
        seq_word[0] = seq

    return publish


def write_rank_state(buf: memoryview, geometry: Geometry, local_rank: int, state: int) -> None:
    """Set entry ``local_rank``'s state (a :class:`~shmstat.shm.layout.RankState` value)."""
    _store_u64(buf, geometry.rank_offset(local_rank) + R_STATE, state)


def write_rank_pid(buf: memoryview, geometry: Geometry, local_rank: int, pid: int) -> None:
    """Set entry ``local_rank``'s pid (a writer entry handed back to its rank's process; job lock held)."""
    _store_i64(buf, geometry.rank_offset(local_rank) + R_PID, pid)


def write_rank_nstats(buf: memoryview, geometry: Geometry, local_rank: int, nstats: int) -> None:
    """Set entry ``local_rank``'s ``nstats`` (descriptors handed out; job lock held)."""
    _store_u64(buf, geometry.rank_offset(local_rank) + R_NSTATS, nstats)


def rank_nhist(buf: memoryview, geometry: Geometry, local_rank: int) -> int:
    """Entry ``local_rank``'s ``nhist`` (histograms handed out so far)."""
    return int(_U64.unpack_from(buf, geometry.rank_offset(local_rank) + R_NHIST)[0])


def write_rank_nhist(buf: memoryview, geometry: Geometry, local_rank: int, nhist: int) -> None:
    """Set entry ``local_rank``'s ``nhist`` (job lock held)."""
    _store_u64(buf, geometry.rank_offset(local_rank) + R_NHIST, nhist)


def write_events_end(buf: memoryview, geometry: Geometry, local_rank: int, end: int, incarnation: int) -> None:
    """Set entry ``local_rank``'s ``events_end`` and ``events_inc`` (its process, as its publisher closes)."""
    off = geometry.rank_offset(local_rank) + R_EVENTS_END
    _store_u64(buf, off, end)
    _store_u64(buf, off + 8, incarnation)


def clear_events_end(buf: memoryview, geometry: Geometry, local_rank: int, pid: int, end: int) -> bool:
    """Set entry ``local_rank``'s ``events_end`` to 0 if the entry still holds ``pid`` and ``end``; True if it did
    (the collector, under the job lock)."""
    off = geometry.rank_offset(local_rank)
    (held,) = _I64.unpack_from(buf, off + R_PID)
    (now,) = _U64.unpack_from(buf, off + R_EVENTS_END)
    if held != pid or now != end:
        return False
    _store_u64(buf, off + R_EVENTS_END, 0)
    return True


def rank_problem(info: RankInfo, geometry: Geometry) -> str | None:
    """Why a rank entry cannot be used by a reader (garbage written into the segment), or None if it can."""
    if info.state not in RankState.NAMES:
        return f"unknown state {info.state}"
    if not 0 < info.pid < 1 << 31:
        return f"pid {info.pid} out of range"
    if info.rank < 0 or info.world_size < 0:
        return "negative rank or world size"
    if info.writer_of > geometry.max_ranks or info.writer_of == info.local_rank + 1:
        return f"writer_of {info.writer_of} out of range"
    return None


def descriptor_problem(desc: StatDescriptor, geometry: Geometry | None = None) -> str | None:
    """Why a published descriptor cannot be used by a reader (garbage in the segment), or None if it can.

    Ranks never publish such a descriptor (``Stat`` refuses the parameters first); a reader skips one.
    """
    if desc.agg_mask & PERCENTILE_BITS and desc.hist < 0:
        return "percentile aggregations without a histogram"
    if geometry is not None and desc.hist >= geometry.hist_slots:
        return f"histogram {desc.hist} outside the table of {geometry.hist_slots}"
    if not 1 <= desc.window_ms <= MAX_WINDOW_MS:
        return f"window of {desc.window_ms} ms outside 1..{MAX_WINDOW_MS}"  # 0, "negative" (u64), 2**62 ms
    if desc.max_samples < 1:
        return f"max_samples {desc.max_samples} under 1"
    if desc.agg_mask & ~VALID_AGG_MASK:
        return f"aggregation mask {desc.agg_mask:#x} names no known aggregation"
    for what, text, problem in (("name", desc.name, _names.name_problem(desc.name, MAX_NAME_BYTES)),
                                ("group", desc.group, _names.group_problem(desc.group))):
        if problem is not None:
            if any("\udc80" <= ch <= "\udcff" for ch in text):  # read_descriptor's mark of bytes that are not UTF-8
                return f"the {what} is not valid UTF-8"
            return f"the {what} {text[:40]!r} breaks the name rule: it {problem}"
    return None


def read_descriptor(buf: memoryview, geometry: Geometry, local_rank: int, stat: int) -> StatDescriptor | None:
    """Decode a descriptor, or None if it is not published yet."""
    off = geometry.desc_offset(local_rank, stat)
    state, window_ms, max_samples, mask, emitted, name_len, group_len, inc, flags, hist = _DESC_HEAD.unpack_from(
        buf, off)
    if state != 1:
        return None
    name_len = min(name_len, MAX_NAME_BYTES)
    group_len = min(group_len, MAX_GROUP_BYTES)
    # bytes that are not UTF-8 become lone surrogates, which descriptor_problem refuses (a rank never writes them)
    name = bytes(buf[off + D_NAME : off + D_NAME + name_len]).decode("utf-8", "surrogateescape")
    group = bytes(buf[off + D_GROUP : off + D_GROUP + group_len]).decode("utf-8", "surrogateescape")
    return StatDescriptor(local_rank, stat, name, group, window_ms, max_samples, mask, emitted, inc, flags, hist - 1)


def write_descriptor(
    buf: memoryview, geometry: Geometry, local_rank: int, stat: int, *, name: bytes, group: bytes,
    window_ms: int, max_samples: int, agg_mask: int, incarnation: int, flags: int = 0, hist: int = -1,
    emitted_wid: int = -1,
) -> None:
    """Publish a descriptor: every field first, ``state = 1`` last (``hist``: -1 for no histogram;
    ``emitted_wid``: the slot's first watermark, the window before the first one its writer can write)."""
    off = geometry.desc_offset(local_rank, stat)
    buf[off + D_NAME : off + D_NAME + MAX_NAME_BYTES] = name.ljust(MAX_NAME_BYTES, b"\x00")
    buf[off + D_GROUP : off + D_GROUP + MAX_GROUP_BYTES] = group.ljust(MAX_GROUP_BYTES, b"\x00")
    _DESC_HEAD.pack_into(buf, off, 0, window_ms, max_samples, agg_mask, emitted_wid, len(name), len(group), incarnation,
                         flags, hist + 1)
    _store_u64(buf, off + D_STATE, 1)


def descriptor_hist(buf: memoryview, geometry: Geometry, local_rank: int, stat: int) -> int:
    """The histogram index of a descriptor as stored (``1 +`` the index in its rank's table; 0 for none)."""
    return int(_I64.unpack_from(buf, geometry.desc_offset(local_rank, stat) + D_HIST)[0])


def write_emitted_wid(buf: memoryview, geometry: Geometry, local_rank: int, stat: int, wid: int) -> None:
    """Record (collector only) that every window up to ``wid`` of this slot has been emitted."""
    _store_i64(buf, geometry.desc_offset(local_rank, stat) + D_EMITTED, wid)


def read_bank(buf: memoryview, offset: int, retries: int = 64, hist_offset: int | None = None) -> BankSnapshot:
    """Copy one bank consistently (seqlock protocol above), retrying a torn read up to ``retries`` times;
    with ``hist_offset``, the bank's histogram too, under the same seqlock.

    If every attempt sees a write in progress, the last copy is returned with ``torn=True`` (and no
    histogram): the caller decides (a dead writer's bank is emitted flagged; a live writer's is read again).
    """
    unpack = _BANK.unpack_from
    seq_wid = _SEQ_WID.unpack_from
    fields = unpack(buf, offset)
    for _ in range(retries):
        seq, wid, total, lo, hi, last, ts, inc = fields
        hist = decode_hist(buf, hist_offset) if hist_offset is not None and seq >= 2.0 else None
        seq2, wid2 = seq_wid(buf, offset)
        if seq == seq2 and wid == wid2 and not (int(seq) & 1):
            return BankSnapshot(count=int(seq) >> 1, sum=total, min=lo, max=hi, last=last, last_ts=ts, hist=hist,
                                wid=wid, incarnation=inc)
        fields = unpack(buf, offset)
    seq, wid, total, lo, hi, last, ts, inc = fields
    count = int(seq) >> 1 if seq == seq else 0
    if count == 0:
        # Caught in the reset for a new window: the data words may still be the previous window's (or hold
        # the one sample being written); no complete sample is known, so no figure is reported.
        return BankSnapshot(torn=True, wid=wid, incarnation=inc)
    return BankSnapshot(count=count, sum=total, min=lo, max=hi, last=last, last_ts=ts, torn=True, wid=wid,
                        incarnation=inc)


def bank_seq_wid(buf: memoryview, offset: int) -> tuple[float, int]:
    """A bank's ``(seq, wid)`` as they are, with no seqlock (for a bank whose writer is gone: nothing moves it)."""
    seq, wid = _SEQ_WID.unpack_from(buf, offset)
    return seq, wid


def empty_bank(buf: memoryview, offset: int) -> None:
    """Set a bank's ``seq`` to 0 (no samples; a gone writer's bank whose samples were counted as dropped)."""
    _store_f64(buf, offset, 0.0)


def decode_hist(buf: memoryview, offset: int) -> Histogram | None:
    """Decode the histogram at ``offset`` (the caller holds the seqlock's copy discipline); None if its
    header is not one a writer can produce (garbage: the window is then reported without percentiles)."""
    scale, zero, pos_lo, pos_hi, neg_lo, neg_hi, pos_inf, neg_inf = _HIST_HEAD.unpack_from(buf, offset)
    if not _MIN_SCALE <= scale <= _MAX_SCALE or (zero | pos_inf | neg_inf) >> 63:  # counts past 2**63: garbage
        return None
    h = _Histogram(scale, zero, pos_inf=pos_inf, neg_inf=neg_inf)
    m = HIST_BUCKETS
    for lo, hi, base, side in ((pos_lo, pos_hi, offset + HIST_COUNTS, h.pos),
                               (neg_lo, neg_hi, offset + HIST_COUNTS + 4 * m, h.neg)):
        if lo > hi:
            continue
        n = hi - lo + 1
        if n > m:
            return None
        start = lo % m  # the indices in use are one run of the ring, or two when it wraps
        counts = _COUNTS.unpack_from(buf, base)
        run = counts[start : start + n] if start + n <= m else counts[start:] + counts[: start + n - m]
        side.update(compress(zip(range(lo, hi + 1), run, strict=True), run))  # the nonzero counts, at C speed
    return h


def read_delivered_marks(buf: memoryview, geometry: Geometry) -> list[tuple[int, int, int, int, int, int]]:
    """Every delivered mark in use: ``(index, pid, rank, incarnation, delivered, origin)``."""
    out = []
    unpack = _MARK.unpack_from
    for index in range(geometry.max_marks):
        pid, rank, incarnation, delivered, origin = unpack(buf, geometry.mark_offset(index))
        if pid > 0:
            out.append((index, pid, rank, incarnation, delivered, origin))
    return out


def write_delivered_mark(buf: memoryview, geometry: Geometry, index: int, pid: int, rank: int, incarnation: int,
                         delivered: int, origin: int) -> None:
    """(Re)use mark ``index``: its pid is cleared first and written last, so a writer killed mid-write leaves a
    free mark, never a torn one."""
    offset = geometry.mark_offset(index)
    _store_i64(buf, offset + M_PID, 0)
    _MARK_TAIL.pack_into(buf, offset + M_RANK, rank, incarnation, delivered, origin)
    _store_i64(buf, offset + M_PID, pid)


def write_delivered(buf: memoryview, word_offset: int, delivered: int) -> None:
    """Store a mark's ``delivered`` word at byte ``word_offset`` (``mark_offset(index) + M_DELIVERED``: callers on
    the event path keep it computed); one aligned 8-byte store."""
    _store_u64(buf, word_offset, delivered)


def encode_name(text: str, limit: int, what: str) -> bytes:
    """UTF-8 encode a stat name (``limit`` :data:`MAX_NAME_BYTES`) or group (:data:`MAX_GROUP_BYTES`), or raise
    ConfigError naming the rule (:mod:`shmstat.names`) if it breaks it."""
    text = _names.check_group(text, what) if limit == MAX_GROUP_BYTES else _names.check_name(text, what, limit)
    return text.encode("utf-8")
