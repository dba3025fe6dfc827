"""Ending a worker group as torchrun's agent does, and leaving no process of it behind (:func:`stop_group`).

Each worker is started in a session (and process group) of its own, so a terminal's Ctrl-C reaches only the
launcher, which forwards it once. Stopping signals each worker's whole process group (its DataLoader workers and
other children) and every descendant seen while its parent lived (one that moved to a session of its own too):
first the signal the launcher received (SIGINT stays SIGINT, so a script's ``except KeyboardInterrupt: save()``
runs), then SIGTERM, then SIGKILL, each after ``grace_s`` without every process gone. A further signal from the
user skips the rest of the current grace period.

A daemon a worker starts (``setsid sleep 600 &``, any double-forked helper) leaves both its worker's process group
and its parent at once, so neither is a way to find it. ``shmstat run`` therefore makes itself a child subreaper
(:func:`become_subreaper`): such an orphan is reparented to the launcher instead of init, and with ``adopted``
:func:`stop_group` stops every process below the launcher, orphans included, and reaps those that ended
(:func:`reap_adopted` reaps them during the run too).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import psutil

__all__ = ["become_subreaper", "reap_adopted", "stop_group"]

_POLL_S = 0.02
_KILL_WAIT_S = 5.0  # after SIGKILL: processes die at once unless stuck in the kernel (D state)
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER, 1)``): every descendant whose
    parent dies is reparented to it rather than to init. Returns whether it is one (False elsewhere, or if the
    call failed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def reap_adopted(procs: Sequence[subprocess.Popen]) -> int:
    """Reap this process's children that ended and are not ``procs`` (orphans reparented to a subreaper; the
    workers themselves are reaped through their ``Popen``); returns how many."""
    reaped = 0
    ours = {p.pid for p in procs}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid in ours:
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE and os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                    reaped += 1
    return reaped


def stop_group(procs: Sequence[subprocess.Popen], first: int, grace_s: float, *,
               insisted: Callable[[], int] = lambda: 0, adopted: bool = False) -> list[int]:
    """Stop every process of ``procs``' process groups and their descendants: ``first``, then SIGTERM (unless
    ``first`` was SIGTERM), then SIGKILL, waiting up to ``grace_s`` after each for all of them to be gone
    (``insisted()`` growing, e.g. a second Ctrl-C, ends the wait at once). Reaps ``procs``. With ``adopted``
    (this process is the job's subreaper and started nothing else), every descendant of this process is one of
    the job's too, orphans reparented to it included, and those are reaped as well. Returns the signals sent, in
    order (empty when nothing was left to stop)."""
    groups = {p.pid for p in procs}  # started with start_new_session: pid == process group id
    known: dict[int, psutil.Process] = {}
    try:
        return _stop(procs, first, grace_s, insisted, adopted, groups, known)
    finally:
        if adopted:
            reap_adopted(procs)


def _stop(procs: Sequence[subprocess.Popen], first: int, grace_s: float, insisted: Callable[[], int],
          adopted: bool, groups: set[int], known: dict[int, psutil.Process]) -> list[int]:
    _note_descendants(procs, known, adopted)
    if not _remaining(procs, groups, known):
        return []
    steps = [first] + ([signal.SIGTERM] if first != signal.SIGTERM else []) + [signal.SIGKILL]
    sent: list[int] = []
    for sig in steps:
        seen = insisted()  # read before sending: a signal the user sends as soon as ours lands is insisting
        _note_descendants(procs, known, adopted)
        _signal_all(groups, known, sig)
        sent.append(sig)
        deadline = time.monotonic() + (_KILL_WAIT_S if sig == signal.SIGKILL else grace_s)
        while _remaining(procs, groups, known):
            if time.monotonic() >= deadline or insisted() != seen:
                break
            _note_descendants(procs, known, adopted)
            if adopted:
                reap_adopted(procs)
            time.sleep(_POLL_S)
        else:
            break
    return sent


def _note_descendants(procs: Sequence[subprocess.Popen], known: dict[int, psutil.Process], adopted: bool) -> None:
    """Remember the live descendants of the live workers (a process that left its worker's process group is
    found only while its parent lives); with ``adopted``, every descendant of this process but the workers."""
    if adopted:
        ours = {p.pid for p in procs}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):
                if child.pid not in ours:
                    known.setdefault(child.pid, child)
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
