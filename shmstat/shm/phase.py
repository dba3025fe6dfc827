"""The phase word of a rank entry: what the process holding the entry is doing now (its innermost open section).

Written by :mod:`shmstat.writer.sections` on every enter and exit (and by :func:`shmstat.advance_step`), read
by the collector with :func:`read_phase`. Layout (rank entry offsets in :mod:`shmstat.shm.layout`; the bytes are
moved by :mod:`shmstat.shm.layout_codec`):
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
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .layout_codec import phase_publisher, read_descriptor, read_phase_seq, read_phase_word

if TYPE_CHECKING:  # pragma: no cover
    from .segment import Segment

__all__ = ["Phase", "PhaseWriter", "phase_writer", "read_phase"]

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
    copy = read_phase_word(segment.buf, geo, local_rank, retries)
    if copy is None:
        return None
    word, since, step = copy
    ident, depth = word & _IDENT_MASK, word >> _DEPTH_SHIFT
    name, wait = None, False
    if ident:
        desc = read_descriptor(segment.buf, geo, local_rank, ident - 1)
        if desc is not None:
            name, wait = desc.name, desc.wait
    return Phase(name, wait, depth, since, step, ident)


class PhaseWriter:
    """This process's writer of the phase word of its entry (see the module's docstring)."""

    def __init__(self, segment: Segment, local_rank: int) -> None:
        self.segment = segment
        self.local_rank = local_rank
        self.pid = os.getpid()
        publish = phase_publisher(segment.buf, segment.geometry, local_rank)
        lock = threading.Lock()
        acquire, release = lock.acquire, lock.release
        offset = time.time_ns() - time.monotonic_ns()  # monotonic ns + offset = wall-clock ns
        seq = read_phase_seq(segment.buf, segment.geometry, local_rank)
        # seq, step, word, since; an entry taken over from an earlier process goes on from its sequence
        state = [seq + (seq & 1), 0, 0, 0]

        def enter(ident: int, depth: int, mono_ns: int) -> None:
            acquire()
            try:
                state[0] = seq = state[0] + 2
                state[2] = word = ident | depth << _DEPTH_SHIFT
                state[3] = since = mono_ns + offset
                publish(seq, word, since, state[1])
            finally:
                release()

        def step() -> None:
            acquire()
            try:
                state[0] = seq = state[0] + 2
                state[1] += 1
                publish(seq, state[2], state[3], state[1])
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
                and current.local_rank == local_rank):
            return current
        writer = PhaseWriter(segment, local_rank)
        _writer[:] = [writer]
        return writer
