"""Which entries of ``/dev/shm`` and of the runtime directory are this user's shmstat files, and which are not.

``/dev/shm`` is shared by every local user: anyone may create ``/dev/shm/shmstat.<name>`` as a directory, a
FIFO, a symbolic link or a segment of their own. Every command looks at an entry with ``lstat`` (never following
a link) before handing its name to ``posix_ipc`` or removing it: only regular files owned by this user are taken
as segments, lock files or leftovers; anything else is skipped, never touched and never a crash: this user's odd
entries with a one-line reason each (:class:`Skipped`), other users' all together in one line
(:func:`other_users_line`), as a shared node holds many.
"""

from __future__ import annotations

import os
import pwd
import stat as _stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError, SegmentError
from .runtime import validate_job

__all__ = ["SHM_DIR", "ShmScan", "Skipped", "check_segment_path", "entry_problem", "kind_of", "other_users_line",
           "own_skipped_lines", "scan_shm"]

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory objects (and shmstat's lock files) appear on Linux."""

_KINDS = (
    (_stat.S_ISDIR, "a directory"), (_stat.S_ISFIFO, "a FIFO"), (_stat.S_ISLNK, "a symbolic link"),
    (_stat.S_ISSOCK, "a socket"), (_stat.S_ISCHR, "a character device"), (_stat.S_ISBLK, "a block device"),
    (_stat.S_ISREG, "a regular file"),
)


def kind_of(mode: int) -> str:
    """``"a directory"``, ``"a FIFO"``, ... for an ``st_mode``."""
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True)
class Skipped:
    """An entry named like a shmstat file that is not this user's to touch, and why."""

    path: str
    reason: str
    owner: int | None = None
    """The uid that owns it when that is another user's (then it is counted in :func:`other_users_line`, not
    named); None for this user's own odd entries."""

    def line(self) -> str:
        """The one line a command prints about it."""
        return f"skipped {self.path}: {self.reason}"


def own_skipped_lines(skipped: Iterable[Skipped]) -> list[str]:
    """One line each for this user's own skipped entries (a directory or FIFO named like a segment, a bad name)."""
    return [entry.line() for entry in skipped if entry.owner is None]


def other_users_line(skipped: Iterable[Skipped]) -> str | None:
    """The one line that says how many entries of other users were left alone, and whose; None when none were."""
    owners = Counter(entry.owner for entry in skipped if entry.owner is not None)
    if not owners:
        return None
    count = sum(owners.values())
    whose = ", ".join(f"{_owner(uid)}: {owners[uid]}" for uid in sorted(owners))
    return f"left alone {count} shmstat entr{'y' if count == 1 else 'ies'} of other users ({whose})"


def entry_problem(st: os.stat_result, *, expect: str = "file") -> str | None:
    """Why an entry (its ``lstat``) is not this user's ``expect`` (``"file"``: a regular file, as segments and
    lock files are; ``"socket"``: a Unix socket, as collector endpoints are, or a regular file left in their
    place), or None when it is."""
    ok = _stat.S_ISREG(st.st_mode) or (expect == "socket" and _stat.S_ISSOCK(st.st_mode))
    if not ok:
        what = "a regular file (a segment or lock file)" if expect == "file" else "a collector's socket"
        return f"{kind_of(st.st_mode)}, not {what}"
    if st.st_uid != os.getuid():
        return f"owned by {_owner(st.st_uid)}, not by you"
    return None


@dataclass
class ShmScan:
    """What :func:`scan_shm` found."""

    segments: list[str]
    """Job ids of this user's segments (regular files ``shmstat.<job>`` owned by this uid), sorted."""
    lock_jobs: list[str]
    """Job ids with a lock file (or an older version's semaphore) of this user, sorted."""
    skipped: list[Skipped]
    """Entries named like shmstat's that are not this user's regular files, or whose job id is invalid."""


def scan_shm(directory: str = SHM_DIR) -> ShmScan:
    """Sort the ``shmstat.*`` and ``sem.shmstat.*`` entries of ``directory`` (see :class:`ShmScan`); an
    unreadable directory is an empty scan. Never raises for what another user put there."""
    found = ShmScan([], [], [])
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in sorted(entries, key=lambda e: e.name):
        name = entry.name
        if name.startswith("sem.shmstat.") and name.endswith(".lock"):
            job, is_lock = name[len("sem.shmstat.") : -len(".lock")], True
        elif name.startswith("shmstat."):
            is_lock = name.endswith(".lock")
            job = name[len("shmstat.") : -len(".lock") if is_lock else None]
        else:
            continue
        path = os.path.join(directory, name)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        try:
            validate_job(job)
        except ConfigError:
            found.skipped.append(Skipped(path, "not named after a valid job id", _other(st)))
            continue
        problem = entry_problem(st)
        if problem is not None:
            found.skipped.append(Skipped(path, problem, _other(st)))
        elif is_lock:
            found.lock_jobs.append(job)
        else:
            found.segments.append(job)
    found.lock_jobs = sorted(set(found.lock_jobs))
    return found


def _other(st: os.stat_result) -> int | None:
    return st.st_uid if st.st_uid != os.getuid() else None


def check_segment_path(job: str) -> None:
    """Raise :class:`SegmentError` when ``/dev/shm/shmstat.<job>`` exists but is not a regular file of this user
    (e.g. another user's directory of that name): checked before the name is handed to ``posix_ipc``."""
    path = f"{SHM_DIR}/shmstat.{validate_job(job)}"
    try:
        st = os.lstat(path)
    except OSError:
        return
    problem = entry_problem(st)
    if problem is not None:
        raise SegmentError(f"{path} is {problem}; pick another job id")
