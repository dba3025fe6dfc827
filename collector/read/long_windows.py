"""Which slots of windows over an hour have something to read: the scanner's cheap look before its slow read.

A window longer than :data:`shmstat.shm.layout.LONG_WINDOW_MS` also closes, for each writer, when the writer filled it
(``max_samples``), moved to a later window, or ended (:mod:`shmstat.shm.layout`). The scanner looks every
``LONG_POLL_MS``; reading every long slot one by one each time would cost ~80 µs per slot (a node with thousands
of them would spend its time there), so all their banks' ``(seq, wid)`` words are gathered at once and only the
slots with a window closed past their watermark go on to :meth:`shmstat.shm.reader.SegmentReader.read_slot`, which
decides by the same rules. A bank torn at that instant reads as not full: the slot is looked at again next poll.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shmstat.shm import layout as L

__all__ = ["long_slots_to_read"]

_MIN = np.iinfo(np.int64).min


def long_slots_to_read(read_banks: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]], banks: int,
                       row0: np.ndarray, max_samples: np.ndarray, after: np.ndarray, after_inc: np.ndarray,
                       newest: np.ndarray, gone: np.ndarray, entry_inc: np.ndarray) -> np.ndarray:
    """For long-window slots (first bank ``row0``, ``max_samples``, watermark ``after`` written by incarnation
    ``after_inc``, newest window closed on the wall clock ``newest``, writer ``gone``, entry incarnation
    ``entry_inc``): whether each has a closed window past its watermark, or its watermark window re-written by a
    restarted rank (see :meth:`shmstat.shm.reader.SegmentReader.read_slot`).

    ``read_banks(rows)`` is the scanner's seqlock gather: ``(seq, wid)`` words, the banks, ``(seq, wid)`` again.
    """
    m = len(row0)
    if not m:
        return np.zeros(0, bool)
    first, data, second = read_banks((row0[:, None] + np.arange(banks)).ravel())
    seq_bits = data[:, L.B_SEQ]
    seq = seq_bits.view(np.float64)
    with np.errstate(invalid="ignore"):
        sane = (seq >= 0) & (seq < 2.0**62)
    count = np.where(sane, seq, 0.0).astype(np.int64)
    ok = sane & (first[:, 0] == second[:, 0]) & (first[:, 1] == second[:, 1]) & (first[:, 0] == seq_bits) & (
        first[:, 1] == data[:, L.B_WID]) & ((count & 1) == 0)
    wid = data[:, L.B_WID].reshape(m, banks)
    rows = np.arange(m)
    top_bank = wid.argmax(axis=1)
    top = wid[rows, top_bank]
    top_at = rows * banks + top_bank
    full = ok[top_at] & ((count[top_at] >> 1) >= max_samples)
    # a writer never goes back to an older window: all but its newest are closed, that one too when full or gone
    closed = np.maximum(np.where(gone | full, top, np.maximum(top, _MIN + 1) - 1), newest)
    top_inc = data[:, L.B_INC][top_at] & np.int64(2**63 - 1)
    reopened = (after_inc >= 0) & (top == after) & (top_inc != after_inc) & (top_inc == entry_inc) & (top_inc != 0)
    return (closed > after) | (reopened & (closed >= after))
