"""The one module that holds shmstat's process-global state.

Everything process-wide lives in :data:`STATE`: the registered event handlers, the attachment to a job's
segment (if any) and the rank's event publisher (if any). Nothing here reads the environment at import time.
Tests call :func:`reset` to start from a clean slate.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .rank import RankAttachment


_sync_hook: Callable[[tuple[Any, ...], Any, bool], None] | None = None


@dataclass
class GlobalState:
    """Process-wide state: handler registry, attachment and publisher, plus counters users can read.

    Three fields are also read by ``log_event``'s C twin, which keeps its own copy of them: :attr:`handler_tuple`,
    :attr:`publisher` and :attr:`auto_init_done` are properties whose setters pass the new values on (see
    :func:`set_sync_hook`); every other field is a plain attribute.
    """

    handlers: list[Any] = field(default_factory=list)
    """Registered handler handles, in registration order (see :mod:`shmstat.publish.events`)."""
    handler_errors: int = 0
    """Exceptions raised by event handlers (logged and counted, never propagated)."""
    attachment: RankAttachment | None = None
    publish_target: tuple[str, int, int] | None = None
    """(endpoint, rank, incarnation) of the publisher, so a forked child can open its own."""
    fork_owner: tuple[Any, int] | None = None
    """In a child forked from an attached rank: (segment, owner local rank) to register a writer entry under."""
    fork_environ: dict[str, str] | None = None
    """In a forked child: the identity variables its parent's environment had at the fork (a worker of the rank
    keeps them as they are; see :func:`shmstat.job.attach._inherited`)."""
    section_window_s: float | None = None
    """The window of section Stats given to ``init(section_window_s=)`` (None: the environment's or 5 s)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    _handler_tuple: tuple[Any, ...] = field(default=(), repr=False)
    _publisher: Any = field(default=None, repr=False)
    _auto_init_done: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self._mirror()

    @property
    def handler_tuple(self) -> tuple[Any, ...]:
        """The registered callbacks, in order, as one immutable snapshot (rebuilt on register/unregister);
        setting it passes it to the C ``log_event``."""
        return self._handler_tuple

    @handler_tuple.setter
    def handler_tuple(self, value: tuple[Any, ...]) -> None:
        self._handler_tuple = value
        self._mirror()

    @property
    def publisher(self) -> Any:
        """The rank's :class:`shmstat.publish.publisher.Publisher`, or None (typed loosely: the publisher imports
        this module, not the other way round); setting it passes it to the C ``log_event``."""
        return self._publisher

    @publisher.setter
    def publisher(self, value: Any) -> None:
        self._publisher = value
        self._mirror()

    @property
    def auto_init_done(self) -> bool:
        """Whether the environment was consulted for a job (done lazily, once); setting it passes it to the C
        ``log_event``."""
        return self._auto_init_done

    @auto_init_done.setter
    def auto_init_done(self, value: bool) -> None:
        self._auto_init_done = value
        self._mirror()

    def _mirror(self) -> None:
        """Pass the three fields the C ``log_event`` copies to it (no-op before :func:`set_sync_hook`)."""
        if _sync_hook is not None:
            _sync_hook(self._handler_tuple, self._publisher, self._auto_init_done)


STATE = GlobalState()

SECTION_EPOCH = [0]
"""Bumped whenever sections must bind again to this process's attachment (:mod:`shmstat.writer.sections`)."""


def rebind_sections() -> None:
    """Make every section bind again on its next enter (the process attached, detached, or was forked)."""
    SECTION_EPOCH[0] += 1


def check_window_s(value: Any, what: str) -> float:
    """``value`` as seconds of a section window (at least 1 ms, finite); :class:`ConfigError` otherwise."""
    from ..errors import ConfigError

    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} {value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0.001:
        raise ConfigError(f"{what} {value!r} is not a window of at least 0.001 seconds")
    return seconds


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
    rebind_sections()
    from ._degrade import reset_warnings

    reset_warnings()
