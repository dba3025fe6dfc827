"""Reading and writing the records of a job's segment as :mod:`shmstat.shm.layout` draws them: the header, rank
entries, descriptors (publishing one, and the collector's watermark in it), banks under their seqlock and
histograms; the checks a reader applies to records a rank could never have written (garbage in the segment);
and the encoding of stat names. The layout itself (offsets, sizes, record formats) stays in
:mod:`shmstat.shm.layout`; this module owns only the code that moves bytes in and out of it.
"""

from __future__ import annotations

import struct
from itertools import compress
from typing import TYPE_CHECKING

from .. import names as _names
from ..histogram import MAX_SCALE as _MAX_SCALE
from ..histogram import MIN_SCALE as _MIN_SCALE
from ..histogram import Histogram as _Histogram
from .layout import (
    _BANK,
    _COUNTS,
    _DESC_HEAD,
    _HEADER,
    _HIST_HEAD,
    _RANK,
    _RANK_DROPS,
    _SEQ_WID,
    D_EMITTED,
    D_GROUP,
    D_NAME,
    D_STATE,
    H_MAGIC,
    HIST_BUCKETS,
    HIST_COUNTS,
    LAYOUT_VERSION,
    MAGIC,
    MAX_GROUP_BYTES,
    MAX_NAME_BYTES,
    MAX_WINDOW_MS,
    PERCENTILE_BITS,
    R_DROPPED,
    VALID_AGG_MASK,
    Geometry,
    RankState,
)
from .layout_records import BankSnapshot, Header, RankInfo, StatDescriptor

if TYPE_CHECKING:  # pragma: no cover
    from ..histogram import Histogram

__all__ = [
    "descriptor_problem",
    "encode_name",
    "rank_problem",
    "read_bank",
    "read_descriptor",
    "read_header",
    "read_hist",
    "read_rank",
    "write_descriptor",
    "write_emitted_wid",
    "write_header",
]


def read_header(buf: memoryview) -> Header:
    """Decode the header from the start of ``buf``."""
    return Header(*_HEADER.unpack_from(buf, 0))


def write_header(buf: memoryview, geometry: Geometry, created_ns: int) -> None:
    """Write a fresh header; the magic is written last so a half-initialised segment is never trusted."""
    _HEADER.pack_into(
        buf, 0, b"\x00" * 8, LAYOUT_VERSION, geometry.max_ranks, geometry.max_stats, geometry.banks,
        geometry.total_size, created_ns, 0, 0, geometry.hist_slots, 0, 0,
    )
    struct.pack_into("<8s", buf, H_MAGIC, MAGIC)


def read_rank(buf: memoryview, geometry: Geometry, local_rank: int) -> RankInfo:
    """Decode rank entry ``local_rank``."""
    off = geometry.rank_offset(local_rank)
    (state, pid, inc, rank, _lr, world, start, beat, nstats, nan, disc, writer_of) = _RANK.unpack_from(buf, off)
    dropped, stats_refused, writers_refused, events_end, events_inc = _RANK_DROPS.unpack_from(buf, off + R_DROPPED)
    return RankInfo(local_rank, state, pid, inc, rank, world, start, beat, nstats, nan, disc, writer_of, dropped,
                    stats_refused, writers_refused, events_end, events_inc)


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
    struct.pack_into("<Q", buf, off + D_STATE, 1)


def write_emitted_wid(buf: memoryview, geometry: Geometry, local_rank: int, stat: int, wid: int) -> None:
    """Record (collector only) that every window up to ``wid`` of this slot has been emitted."""
    struct.pack_into("<q", buf, geometry.desc_offset(local_rank, stat) + D_EMITTED, wid)


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
        hist = read_hist(buf, hist_offset) if hist_offset is not None and seq >= 2.0 else None
        seq2, wid2 = seq_wid(buf, offset)
        if seq == seq2 and wid == wid2 and not (int(seq) & 1):
            return BankSnapshot(wid, int(seq) >> 1, total, lo, hi, last, ts, inc, hist=hist)
        fields = unpack(buf, offset)
    seq, wid, total, lo, hi, last, ts, inc = fields
    count = int(seq) >> 1 if seq == seq else 0
    if count == 0:
        # Caught in the reset for a new window: the data words may still be the previous window's (or hold
        # the one sample being written); no complete sample is known, so no figure is reported.
        return BankSnapshot(wid, 0, 0.0, 0.0, 0.0, 0.0, 0, inc, torn=True)
    return BankSnapshot(wid, count, total, lo, hi, last, ts, inc, torn=True)


def read_hist(buf: memoryview, offset: int) -> Histogram | None:
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


def encode_name(text: str, limit: int, what: str) -> bytes:
    """UTF-8 encode a stat name (``limit`` :data:`MAX_NAME_BYTES`) or group (:data:`MAX_GROUP_BYTES`), or raise
    ConfigError naming the rule (:mod:`shmstat.names`) if it breaks it."""
    text = _names.check_group(text, what) if limit == MAX_GROUP_BYTES else _names.check_name(text, what, limit)
    return text.encode("utf-8")
