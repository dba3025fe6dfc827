"""Ending a worker group as torchrun's agent does, and leaving no process of it behind (:func:`stop_group`).

Each worker is started in a session (and process group) of its own, so a terminal's Ctrl-C reaches only the
launcher, which forwards it once. Stopping signals each worker's whole process group (its DataLoader workers and
other children) and every descendant seen while its parent lived (one that moved to a session of its own too):
first the signal the launcher received (SIGINT stays SIGINT, so a script's ``except KeyboardInterrupt: save()``
runs), then SIGTERM, then SIGKILL, each after ``grace_s`` without every process gone. A further signal from the
user skips the rest of the current grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

import psutil

__all__ = ["stop_group"]

_POLL_S = 0.02
_KILL_WAIT_S = 5.0  # after SIGKILL: processes die at once unless stuck in the kernel (D state)


def stop_group(procs: Sequence[subprocess.Popen], first: int, grace_s: float, *,
               insisted: Callable[[], int] = lambda: 0) -> list[int]:
    """Stop every process of ``procs``' process groups and their descendants: ``first``, then SIGTERM (unless
    ``first`` was SIGTERM), then SIGKILL, waiting up to ``grace_s`` after each for all of them to be gone
    (``insisted()`` growing, e.g. a second Ctrl-C, ends the wait at once). Reaps ``procs``. Returns the
    signals sent, in order (empty when nothing was left to stop)."""
    groups = {p.pid for p in procs}  # started with start_new_session: pid == process group id
    known: dict[int, psutil.Process] = {}
    _note_descendants(procs, known)
    if not _remaining(procs, groups, known):
        return []
    steps = [first] + ([signal.SIGTERM] if first != signal.SIGTERM else []) + [signal.SIGKILL]
    sent: list[int] = []
    for sig in steps:
        seen = insisted()  # read before sending: a signal the user sends as soon as ours lands is insisting
        _note_descendants(procs, known)
        _signal_all(groups, known, sig)
        sent.append(sig)
        deadline = time.monotonic() + (_KILL_WAIT_S if sig == signal.SIGKILL else grace_s)
        while _remaining(procs, groups, known):
            if time.monotonic() >= deadline or insisted() != seen:
                break
            _note_descendants(procs, known)
            time.sleep(_POLL_S)
        else:
            break
    return sent


def _note_descendants(procs: Sequence[subprocess.Popen], known: dict[int, psutil.Process]) -> None:
    """Remember the live descendants of the live workers (a process that left its worker's process group is
    found only while its parent lives)."""
    for p in procs:
        if p.returncode is not None:
            continue
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(p.pid).children(recursive=True):
                known.setdefault(child.pid, child)


def _signal_all(groups: set[int], known: dict[int, psutil.Process], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for proc in known.values():
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)  # psutil refuses a pid reused by another process


def _remaining(procs: Sequence[subprocess.Popen], groups: set[int], known: dict[int, psutil.Process]) -> list[int]:
    """The pids still running: workers not yet reaped, members of their process groups, known descendants
    (zombies, dead but not yet reaped by their new parent, do not count)."""
    left = [p.pid for p in procs if p.poll() is None]
    for pid, proc in list(known.items()):
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
                continue
        del known[pid]
    if groups:
        left.extend(_group_members(groups))
    return left


def _group_members(groups: set[int]) -> list[int]:
    """Live (not zombie) processes whose process group is one of ``groups``."""
    occupied = set()
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue  # an empty group: nobody to look for
        except PermissionError:
            pass
        occupied.add(pgid)
    if not occupied:
        return []
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) in occupied and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
    return members
