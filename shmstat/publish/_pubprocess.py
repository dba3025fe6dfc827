"""Publishers and the process's life: the registry of live publishers, the fork hook and the exit flush.

A publisher belongs to the process that created it. In a forked child, :func:`after_fork_in_child` (registered
with :func:`os.register_at_fork`) marks every inherited publisher dead and clears
``shmstat.job._state.STATE.publisher`` if it held one. At interpreter exit, and at the exit of a ``multiprocessing``
child (which leaves through ``os._exit`` and skips ``atexit``), live publishers are flushed and closed within
about :data:`EXIT_BUDGET_S` seconds in total.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import time
import weakref
from typing import Any, Protocol

from ..job import _state


class LivePublisher(Protocol):
    """What this module needs of a :class:`shmstat.publish.publisher.Publisher` (named here by shape, not imported:
    the publisher imports this module)."""

    _owner_pid: int
    _dead: bool

    @property
    def closed(self) -> bool: ...

    def _mark_dead_in_child(self) -> None: ...

    def close(self, linger_ms: int = ...) -> None: ...

__all__ = ["EXIT_BUDGET_S", "after_fork_in_child", "ensure_exit_hooks", "forget", "keep_fork_orphans", "register"]

EXIT_BUDGET_S = 2.0
"""Seconds the exit flush may take for all of a process's publishers together."""

_LIVE: weakref.WeakSet[LivePublisher] = weakref.WeakSet()
_FORK_ORPHANS: list[Any] = []  # zmq objects inherited by a forked child: kept alive, never closed, never used


def register(pub: LivePublisher) -> None:
    """Count ``pub`` among this process's live publishers (flushed at exit, marked dead in a forked child)."""
    _LIVE.add(pub)


def forget(pub: LivePublisher) -> None:
    """``pub`` is closed (or given up): no exit flush, no fork handling for it any more."""
    _LIVE.discard(pub)


def keep_fork_orphans(*objects: Any) -> None:
    """Keep the parent's zmq objects alive in a forked child, never closed: closing or collecting them here
    would act on the parent's socket and context."""
    _FORK_ORPHANS.append(objects)


def after_fork_in_child() -> None:
    """Make every publisher inherited from the parent process unusable, and clear ``STATE.publisher``.

    Runs automatically in a child made by ``os.fork()`` (registered with :func:`os.register_at_fork`);
    idempotent. Inherited publishers never touch the parent's socket, context or thread again; their
    ``publish*`` calls become no-ops counted as dropped. Publishers created in this process are untouched.
    """
    me = os.getpid()
    for pub in list(_LIVE):
        if pub._owner_pid != me and not pub._dead:
            pub._mark_dead_in_child()
            _LIVE.discard(pub)
    st = _state.STATE
    if st.publisher is not None and st.publisher._owner_pid != me:
        st.publisher = None


_hooks_pid = -1


def ensure_exit_hooks() -> None:
    """Register the exit flush for this process (once per process; a forked child registers its own)."""
    global _hooks_pid
    if _hooks_pid == os.getpid():
        return
    _hooks_pid = os.getpid()
    # multiprocessing children leave through os._exit (fork) and skip atexit: close from its finalizers too
    multiprocessing.util.Finalize(None, _close_all_at_exit, exitpriority=100)


def _close_all_at_exit() -> None:
    """Flush and close this process's live publishers, within about two seconds in total (best effort)."""
    deadline = time.monotonic() + EXIT_BUDGET_S
    me = os.getpid()
    for pub in list(_LIVE):
        if pub._owner_pid != me or pub.closed:
            continue
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        with contextlib.suppress(Exception):
            pub.close(linger_ms=remaining_ms)


os.register_at_fork(after_in_child=after_fork_in_child)
atexit.register(_close_all_at_exit)
