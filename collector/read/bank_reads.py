"""The seqlock reads of banks that the scanner's pass (:mod:`collector.read.scanner`) makes: many banks at once
(:func:`read_banks`), those found torn again one by one (:func:`retry_torn`), and one window's histogram with its
bank (:func:`read_hist`). They hold no scanner state: each reads the segment it is given.
"""

from __future__ import annotations

import numpy as np

from shmstat.histogram import Histogram
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.layout_records import StatDescriptor
from shmstat.shm.segment import Segment

__all__ = ["read_banks", "read_hist", "retry_torn"]

_WORDS = L.BANK_WORDS


def read_banks(segment: Segment, grow: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, wid) of the banks numbered ``grow``, then those banks whole, then (seq, wid) again: three
    copies out of the segment, in this order (the seqlock reader's order, for all banks at once)."""
    geo = segment.geometry
    view = np.frombuffer(segment.buf, np.int64, geo.max_ranks * geo.max_stats * geo.banks * _WORDS,
                         geo.bank_base).reshape(-1, _WORDS)
    try:
        first = view[grow, :2]
        data = view[grow]
        second = view[grow, :2]
    finally:
        del view  # no array may keep the mapping exported (the segment must stay closable)
    return first, data, second


def retry_torn(segment: Segment, retry: np.ndarray, grow: np.ndarray, pos: np.ndarray, data: np.ndarray,
               count: np.ndarray) -> list[int]:
    """Read the banks ``retry`` (indices into the copies of :func:`read_banks`) again one by one, updating
    ``data``/``count`` in place; returns the slot positions whose bank stayed torn."""
    buf, base = segment.buf, segment.geometry.bank_base
    stuck: set[int] = set()
    for j in retry.tolist():
        snap = codec.read_bank(buf, base + int(grow[j]) * L.BANK_SIZE)
        if snap.torn or not 0 <= snap.count < 2**61:
            stuck.add(int(pos[j]))
            continue
        row = data[j]
        f = row.view(np.float64)
        row[L.B_WID], row[L.B_TS] = snap.wid, snap.last_ts
        f[L.B_SEQ], f[L.B_SUM], f[L.B_MIN], f[L.B_MAX], f[L.B_LAST] = (
            2.0 * snap.count, snap.sum, snap.min, snap.max, snap.last)
        count[j] = snap.count
    return sorted(stuck)


def read_hist(segment: Segment, d: StatDescriptor, wid: int, count: int) -> Histogram | None:
    """The histogram of window ``wid`` of a slot, read with its bank under the bank's seqlock; None if the
    bank no longer holds that window as it was read (overwritten since: reported without percentiles)."""
    geo = segment.geometry
    bank = wid % geo.banks
    snap = codec.read_bank(segment.buf, geo.slot_offset(d.local_rank, d.index) + bank * L.BANK_SIZE,
                           hist_offset=geo.hist_offset(d.local_rank, d.hist) + bank * L.HIST_SIZE)
    if snap.torn or snap.wid != wid or snap.count != count:
        return None
    return snap.hist
