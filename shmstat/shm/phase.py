"""The phase word of a rank entry: what the process holding the entry is doing now (its innermost open section).

Written by :mod:`shmstat.writer.sections` on every enter and exit (and by :func:`shmstat.advance_step`), read
by the collector with :func:`read_phase`. Layout (rank entry offsets in :mod:`shmstat.shm.layout`):
``phase_seq`` then two copies of ``(word, since_ns, step)``; ``word`` is ``ident | depth << 32`` where ``ident``
is 1 + the section Stat's descriptor index in the same entry (0: outside every section) — the descriptor names
the section and says whether it is a wait section, so no other table is needed.

A double-buffered seqlock: the writer fills the copy ``phase_seq`` does not point at, then publishes it with one
aligned 8-byte store of ``phase_seq + 2`` (even; copy ``(seq >> 1) & 1``). A reader copies ``phase_seq``, the
copy it names, then ``phase_seq`` again, and retries while it moved. The published copy is never written, so a
process SIGKILLed at any point leaves the last phase it published readable (never a torn one). Threads of one
process serialise on a lock (the entry has one writer per process); no system call on this path.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import layout as L
from .layout_codec import read_descriptor

if TYPE_CHECKING:  # pragma: no cover
    from .segment import Segment

__all__ = ["Phase", "PhaseWriter", "phase_writer", "read_phase"]

_COPY = struct.Struct("<QqQ")  # word, since_ns, step
_DEPTH_SHIFT = 32
_IDENT_MASK = (1 << 32) - 1


@dataclass(frozen=True)
class Phase:
    """What a rank entry's process was doing when it last entered or left a section."""

    section: str | None
    """The innermost open section's name; None outside every section (or a section whose Stat got no slot)."""
    wait: bool
    """Whether that section is a wait section (a collective, a barrier)."""
    depth: int
    """How many sections were open (0: none)."""
    since_ns: int
    """Wall-clock ns since when it is there (entered the section, or left the last one)."""
    step: int
    """Training steps counted so far (:func:`shmstat.advance_step`)."""
    ident: int
    """1 + the section Stat's descriptor index in the entry; 0 outside every section."""


def read_phase(segment: Segment, local_rank: int, retries: int = 64) -> Phase | None:
    """The phase word of rank entry ``local_rank`` (a rank's or a writer's), or None when the entry is free, no
    section was ever entered there, or a writer kept it moving for ``retries`` tries."""
    geo = segment.geometry
    if not 0 <= local_rank < geo.max_ranks:
        return None
    base = geo.rank_offset(local_rank)
    i64, buf = segment.i64, segment.buf
    seq_w = (base + L.R_PHASE_SEQ) // 8
    if i64[(base + L.R_STATE) // 8] == L.RankState.FREE:
        return None
    for _ in range(retries):
        seq = i64[seq_w]
        if seq <= 0:
            return None
        word, since, step = _COPY.unpack_from(buf, base + L.R_PHASE + ((seq >> 1) & 1) * L.PHASE_COPY_SIZE)
        if i64[seq_w] == seq:
            break
    else:
        return None
    ident, depth = word & _IDENT_MASK, word >> _DEPTH_SHIFT
    name, wait = None, False
    if ident:
        desc = read_descriptor(buf, geo, local_rank, ident - 1)
        if desc is not None:
            name, wait = desc.name, desc.wait
    return Phase(name, wait, depth, since, step, ident)


class PhaseWriter:
    """This process's writer of the phase word of its entry (see the module's docstring)."""

    def __init__(self, segment: Segment, local_rank: int) -> None:
        base = segment.geometry.rank_offset(local_rank)
        self.segment = segment
        self.seq_word = (base + L.R_PHASE_SEQ) // 8
        self.pid = os.getpid()
        buf, i64, seq_w = segment.buf, segment.i64, self.seq_word
        copies = (base + L.R_PHASE, base + L.R_PHASE + L.PHASE_COPY_SIZE)
        pack = _COPY.pack_into
        lock = threading.Lock()
        acquire, release = lock.acquire, lock.release
        offset = time.time_ns() - time.monotonic_ns()  # monotonic ns + offset = wall-clock ns
        seq = i64[seq_w]
        # seq, step, word, since; an entry taken over from an earlier process goes on from its sequence
        state = [seq + (seq & 1), 0, 0, 0]

        def enter(ident: int, depth: int, mono_ns: int) -> None:
            acquire()
            try:
                state[0] = seq = state[0] + 2
                state[2] = word = ident | depth << _DEPTH_SHIFT
                state[3] = since = mono_ns + offset
                pack(buf, copies[(seq >> 1) & 1], word, since, state[1])
                i64[seq_w] = seq
            finally:
                release()

        def step() -> None:
            acquire()
            try:
                state[0] = seq = state[0] + 2
                state[1] += 1
                pack(buf, copies[(seq >> 1) & 1], state[2], state[3], state[1])
                i64[seq_w] = seq
            finally:
                release()

        self.enter = enter
        """Publish: section ``ident`` (0: none) at ``depth``, there since ``mono_ns`` (``time.monotonic_ns``)."""
        self.step = step
        """Count one step (the section and its since stay)."""
        enter(0, 0, time.monotonic_ns())


class _NoPhase:
    """The phase writer of a process that holds no entry (in-process, or no room): writes nothing."""

    pid = -1

    def enter(self, ident: int, depth: int, mono_ns: int) -> None:
        """Nothing to publish."""

    def step(self) -> None:
        """Nothing to publish."""


_writer: list[PhaseWriter | _NoPhase] = []
_writer_lock = threading.Lock()


def phase_writer(segment: Segment | None, local_rank: int | None) -> PhaseWriter | _NoPhase:
    """This process's phase writer of entry ``local_rank`` of ``segment`` (a no-op one without a segment: the
    process is in-process or holds no entry)."""
    if segment is None or local_rank is None or local_rank < 0:
        return _NoPhase()
    with _writer_lock:
        current = _writer[0] if _writer else None
        if (isinstance(current, PhaseWriter) and current.pid == os.getpid() and current.segment is segment
                and current.seq_word == (segment.geometry.rank_offset(local_rank) + L.R_PHASE_SEQ) // 8):
            return current
        writer = PhaseWriter(segment, local_rank)
        _writer[:] = [writer]
        return writer
