"""Opt-in Python stacks for the collector's hang reports (``shmstat.init(hang_stacks=True)`` or
``SHMSTAT_HANG_STACKS=1``).

A rank that opts in registers :func:`faulthandler.register` for ``SIGUSR2`` into a file of its own in the owner-only
runtime directory (:func:`stacks_path`: the job and the pid name it, mode 0600). The file is also the opt-in the
collector checks: it sends ``SIGUSR2`` only to a live rank whose file exists (its default action would end a rank
that did not opt in). faulthandler writes from its C signal handler, so a rank stuck holding the GIL still dumps.
The file is removed when the rank detaches (:func:`disable`); a rank killed outright leaves it behind.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from typing import IO

from ..errors import ConfigError
from ..shm.runtime import runtime_dir, validate_job

__all__ = ["SIGNAL", "VARIABLE", "disable", "enable", "stacks_path", "wanted"]

VARIABLE = "SHMSTAT_HANG_STACKS"
"""The environment variable that opts a rank in (``1``) when ``init`` is not told."""
SIGNAL = signal.SIGUSR2
"""The signal the collector sends for a dump."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_held: list[tuple[IO[str], str, int]] = []  # the open file, its path, the pid that registered


def stacks_path(job: str, pid: int) -> str:
    """Where process ``pid`` of ``job`` dumps its stacks (in the owner-only runtime directory)."""
    return os.path.join(runtime_dir(), f"{validate_job(job)}.stacks.{pid}")


def wanted(chosen: bool | None) -> bool:
    """Whether this rank opts in: ``chosen`` (``init(hang_stacks=...)``), else :data:`VARIABLE`."""
    if chosen is not None:
        return bool(chosen)
    raw = os.environ.get(VARIABLE, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{VARIABLE}={raw!r} is not 1 or 0")


def enable(job: str) -> str:
    """Register this process's stack dump on :data:`SIGNAL` into :func:`stacks_path` (owner-only, appended to);
    returns the path."""
    disable()
    path = stacks_path(job, os.getpid())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    f = os.fdopen(fd, "w", encoding="utf-8")
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    _held.append((f, path, os.getpid()))
    return path


def disable() -> None:
    """Undo :func:`enable` in the process that called it (a forked child leaves its parent's file alone)."""
    while _held:
        f, path, pid = _held.pop()
        if pid != os.getpid():
            continue
        with contextlib.suppress(Exception):
            faulthandler.unregister(SIGNAL)
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            f.close()
