"""Degrading instead of raising: the drop counters in the segment, the once-only warnings, capacities from the
environment.

Telemetry's own state (a full table, a segment that cannot be created or was removed, a lock file that cannot be
used) never raises into the user's code: what cannot be written is dropped and counted in the segment (see the
``dropped`` fields in :mod:`shmstat.shm.layout`), and the problem is reported once, on the ``shmstat`` logger (Python
``logging``, level WARNING: with no logging configured it reaches stderr), with the one action that helps.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from .._backend import backend
from ..errors import ConfigError
from ..shm import layout as L
from ..shm import layout_codec as codec

if TYPE_CHECKING:  # pragma: no cover
    from ..shm.segment import Segment

__all__ = ["CAPACITY_VARIABLES", "REPORTED_VARIABLE", "add_counter", "geometry_from_env", "reported", "warn_once",
           "warn_once_in_job"]

_log = logging.getLogger("shmstat")

CAPACITY_VARIABLES = ("SHMSTAT_MAX_RANKS", "SHMSTAT_MAX_STATS", "SHMSTAT_MAX_PERCENTILE_STATS")
"""Environment variables a rank reads for the capacities of a segment it creates (torchrun has no flag of ours)."""

_warned: set[str] = set()  # kinds this process has reported (inherited by a forked child: it said it already)
_plain_lock = threading.Lock()

# Bits of the header's ``warned`` word: a kind reported by one process of the job is not reported again by the
# others (a DataLoader starts new workers every epoch: one warning per job, not one per worker).
KINDS = {"ranks": 1, "writers": 2, "stats": 4, "percentiles": 8, "takeover": 16, "removed": 32, "uncollected": 64}

REPORTED_VARIABLE = "SHMSTAT_REPORTED"
"""Set by a process for the children it starts afterwards (spawn and forkserver workers inherit the environment):
``JOB:kind,kind`` — the problems of that job already reported, which a child does not report again (with no
segment to hold the flag, e.g. one removed from /dev/shm or a /dev/shm too full to create it)."""


def add_counter(segment: Segment, offset: int, n: int = 1) -> None:
    """Add ``n`` to the u64 counter at byte ``offset`` of the segment: one atomic read-modify-write with the C
    path (several processes add to these counters); the pure-Python fallback adds under a thread lock, so two
    processes adding in the same instant may lose one count there."""
    if n <= 0:
        return
    try:
        c_add = backend().add_u64  # None: the pure-Python add below
        if c_add is not None:
            c_add(segment.buf, offset, n)
            return
        with _plain_lock:
            word = offset // 8
            segment.i64[word] = (segment.i64[word] + n) & ((1 << 63) - 1)
    except (ValueError, TypeError):  # the mapping was closed (detached): nothing left to count in
        pass


def warn_once(kind: str, message: str, segment: Segment | None = None, job: str | None = None) -> bool:
    """Log ``message`` at WARNING unless this process (or, with ``segment`` given and the job lock held by the
    caller, any process of the job; or the process that started this one, for ``job``) already reported ``kind``;
    True if it was logged. Children started afterwards inherit the report (:data:`REPORTED_VARIABLE`)."""
    if kind in _warned:
        return False
    _warned.add(kind)
    job = segment.job if job is None and segment is not None else job
    if job is not None:
        if reported(job, kind):
            return False
        _pass_on(job, kind)
    bit = KINDS.get(kind, 0)
    if segment is not None and bit:
        try:
            seen = codec.read_warned(segment.buf)
            if seen & bit:
                return False
            codec.write_warned(segment.buf, seen | bit)
        except (ValueError, TypeError):
            pass
    _log.warning("shmstat: %s", message)
    return True


def warn_once_in_job(kind: str, message: str, segment: Segment) -> bool:
    """:func:`warn_once` for the whole job from a caller that does not hold the job lock: takes it while the
    job's lock file is there (never making one: a removed job leaves nothing behind), else flags unlocked."""
    from ..shm.runtime import lock_path

    try:
        if os.path.exists(lock_path(segment.job)):
            with segment.locked():
                return warn_once(kind, message, segment)
    except Exception:  # the lock file is unusable: the flag in the segment still tells the others
        pass
    return warn_once(kind, message, segment)


def reported(job: str, kind: str) -> bool:
    """Whether the process that started this one (or this one) reported ``kind`` for ``job``
    (:data:`REPORTED_VARIABLE`)."""
    owner, _, kinds = os.environ.get(REPORTED_VARIABLE, "").partition(":")
    return owner == job and kind in kinds.split(",")


def _pass_on(job: str, kind: str) -> None:
    owner, _, kinds = os.environ.get(REPORTED_VARIABLE, "").partition(":")
    known = [k for k in kinds.split(",") if k] if owner == job else []
    os.environ[REPORTED_VARIABLE] = f"{job}:{','.join([*known, kind])}"


def reset_warnings() -> None:
    """Forget which problems this process reported (for tests)."""
    _warned.clear()
    os.environ.pop(REPORTED_VARIABLE, None)


def geometry_from_env(env: dict[str, str] | None = None) -> L.Geometry | None:
    """The capacities ``SHMSTAT_MAX_RANKS`` / ``SHMSTAT_MAX_STATS`` / ``SHMSTAT_MAX_PERCENTILE_STATS`` ask for (the
    others at their defaults), or None when none is set. Used when this process creates the job's segment; an
    existing segment is taken as it is. Raises :class:`ConfigError` for a value that is not a number in range."""
    source = os.environ if env is None else env
    values: list[int | None] = []
    for name, low, high in (("SHMSTAT_MAX_RANKS", 1, 4096), ("SHMSTAT_MAX_STATS", 1, 65536),
                            ("SHMSTAT_MAX_PERCENTILE_STATS", 0, 65536)):
        raw = source.get(name)
        if raw in (None, ""):
            values.append(None)
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
        if not low <= value <= high:
            raise ConfigError(f"environment variable {name}={raw!r} must be between {low} and {high}")
        values.append(value)
    if all(v is None for v in values):
        return None
    ranks, stats, hists = values
    return L.Geometry(L.DEFAULT_MAX_RANKS if ranks is None else ranks, L.DEFAULT_MAX_STATS if stats is None else stats,
                      L.DEFAULT_BANKS, L.DEFAULT_HIST_SLOTS if hists is None else hists)
