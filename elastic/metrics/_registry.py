"""The one place that holds ``elastic``'s process-global state: which handler serves which metric group.

:data:`REGISTRY` is mutated in place only (never rebound), so modules may keep references to it and to its
``handlers`` dict. :func:`reset` puts it back to the import-time state; the test suite calls it around
every test.

State and its meaning:

- ``handlers``: ``group -> handler`` set by ``configure(handler, group)``;
- ``default``: the handler set by ``configure(handler)`` (group ``None``), or ``None`` while the built-in
  default is in force. The built-in default drops metrics like torchelastic's ``NullMetricHandler`` when
  the process is not attached to a job, and publishes them to the node's collector when it is;
- ``routing_disabled``: set after attaching from the environment failed once (the error is logged once and
  metrics and events stay in-process rather than raising in a training loop);
- ``dropped``: metrics the built-in default could not publish because a value was not a number (counted,
  the first one logged);
- ``on_change``: called after ``default`` changes (by ``configure`` and :meth:`MetricsRegistry.reset`), so that
  the C ``put_metric`` (handed the routing, not this registry) follows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from shmstat.errors import ShmstatError
from shmstat.job._state import STATE
from shmstat.job.attach import ensure_init

if TYPE_CHECKING:  # pragma: no cover
    from shmstat.publish.publisher import Publisher

    from ._handlers import MetricHandler

__all__ = ["REGISTRY", "MetricsRegistry", "publisher", "reset"]

_log = logging.getLogger("shmstat.elastic")


class MetricsRegistry:
    """Handler registry of ``elastic.metrics`` (see the module docstring for each field's meaning)."""

    __slots__ = ("default", "dropped", "handlers", "on_change", "routing_disabled")

    handlers: dict[str, MetricHandler]
    default: MetricHandler | None
    routing_disabled: bool
    dropped: int
    on_change: Callable[[], None]

    def __init__(self) -> None:
        """An empty registry: no group configured, the built-in default in force."""
        self.handlers = {}
        self.default = None
        self.routing_disabled = False
        self.dropped = 0
        self.on_change = _nothing

    def reset(self) -> None:
        """Forget every configured handler and counter, in place (``handlers`` stays the same dict)."""
        self.handlers.clear()
        self.default = None
        self.routing_disabled = False
        self.dropped = 0
        self.on_change()


def _nothing() -> None:
    """No one to tell (until ``elastic.metrics.emitting`` is imported)."""


REGISTRY = MetricsRegistry()
"""The process-wide registry; mutated in place, never rebound."""


def reset() -> None:
    """Return ``elastic.metrics`` to its import-time state (for tests): no handlers, built-in default."""
    REGISTRY.reset()


def publisher() -> Publisher | None:
    """This rank's publisher, attaching from the environment the first time; None when not attached.

    Attaching happens at most once (then :func:`shmstat.job.attach.ensure_init` is cached). If it fails (a bad
    variable, a segment of another layout), the error is logged once and None is returned from then on:
    metrics and events must not raise in a training loop because of the environment.
    """
    pub = STATE.publisher
    if pub is None and not STATE.auto_init_done and not REGISTRY.routing_disabled:
        try:
            ensure_init()
        except ShmstatError as exc:
            REGISTRY.routing_disabled = True
            _log.error("cannot attach to the job from the environment (%s); metrics and events stay in-process", exc)
        pub = STATE.publisher
    return pub
