"""The one module that holds shmstat's process-global state.

Everything process-wide lives in :data:`STATE`: the registered event handlers, the attachment to a job's
segment (if any) and the rank's event publisher (if any). Nothing here reads the environment at import time.
Tests call :func:`reset` to start from a clean slate.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .rank import RankAttachment


@dataclass
class GlobalState:
    """Process-wide state: handler registry, attachment and publisher, plus counters users can read."""

    handlers: list[Any] = field(default_factory=list)
    """Registered handler handles, in registration order (see :mod:`shmstat.publish.events`)."""
    handler_tuple: tuple[Any, ...] = ()
    """The registered callbacks, in order, as one immutable snapshot (rebuilt on register/unregister)."""
    handler_errors: int = 0
    """Exceptions raised by event handlers (logged and counted, never propagated)."""
    attachment: RankAttachment | None = None
    publisher: Any = None
    """The rank's :class:`shmstat.publish.publisher.Publisher`, or None (typed loosely: the publisher imports this
    module, not the other way round)."""
    publish_target: tuple[str, int, int] | None = None
    """(endpoint, rank, incarnation) of the publisher, so a forked child can open its own."""
    fork_owner: tuple[Any, int] | None = None
    """In a child forked from an attached rank: (segment, owner local rank) to register a writer entry under."""
    auto_init_done: bool = False
    """Whether the environment was consulted for a job (done lazily, once)."""
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assign, and pass the fields ``log_event``'s C twin reads on every call to it (see set_sync_hook)."""
        object.__setattr__(self, name, value)
        if name in _SYNCED and _sync_hook is not None:
            _sync_hook(self.handler_tuple, self.publisher, self.auto_init_done)


_SYNCED = frozenset({"handler_tuple", "publisher", "auto_init_done"})
_sync_hook: Callable[[tuple[Any, ...], Any, bool], None] | None = None

STATE = GlobalState()


def set_sync_hook(hook: Callable[[tuple[Any, ...], Any, bool], None]) -> None:
    """Call ``hook(handler_tuple, publisher, auto_init_done)`` now and whenever one of them is assigned.

    The C ``log_event`` keeps its own copy of these fields rather than looking them up on every call.
    """
    global _sync_hook
    _sync_hook = hook
    hook(STATE.handler_tuple, STATE.publisher, STATE.auto_init_done)


def reset() -> None:
    """Detach from any job, close the publisher and forget every handler (for tests and forks)."""
    old = STATE
    if old.publisher is not None:
        with contextlib.suppress(Exception):
            old.publisher.close(linger_ms=0)
    if old.attachment is not None:
        with contextlib.suppress(Exception):
            old.attachment.detach()
    GlobalState.__init__(STATE)  # in place: other modules hold a reference to STATE
    from ._drops import reset_warnings

    reset_warnings()
