"""The exception tree of shmstat.

::

    ShmstatError                      root of every error shmstat raises on purpose
     ├── ConfigError (ValueError)     a bad argument or environment value: job id, name, window, handler spec
     │    └── EventTooLargeError      an event to publish is over the wire's maximum size
     ├── CapacityError                the segment has no room left for another rank or stat
     ├── SegmentError                 the shared-memory segment cannot be created, attached or trusted
     │    └── LayoutMismatchError     the segment was made by another layout version or is not ours
     ├── WireError (ValueError)       a frame received on a socket is not a valid shmstat message
     └── CollectorError               the collector cannot start (e.g. another one runs for the job)

Every message is one sentence that says what to change, under about 160 characters; where a rule is too long to
repeat, the sentence names its page (:func:`see_docs`).
"""

from __future__ import annotations

__all__ = [
    "DOCS_BASE",
    "CapacityError",
    "CollectorError",
    "ConfigError",
    "EventTooLargeError",
    "LayoutMismatchError",
    "SegmentError",
    "ShmstatError",
    "WireError",
    "see_docs",
]

DOCS_BASE = "docs/"
"""Where every message's documentation links point: the documentation site's pages in the repository."""


def see_docs(page: str) -> str:
    """``see docs/<page>``: how a message names the page that states a rule (``page`` relative to the docs)."""
    return f"see {DOCS_BASE}{page}"


class ShmstatError(Exception):
    """Root of every error shmstat raises on purpose."""


class ConfigError(ShmstatError, ValueError):
    """A bad argument or environment value (job id, stat name, window size, handler spec)."""


class EventTooLargeError(ConfigError):
    """An event to be published is larger than :data:`shmstat.wire.MAX_EVENT_BYTES`; nothing was queued."""


class CapacityError(ShmstatError):
    """The segment has no room for another rank or stat; raised before anything is written."""


class SegmentError(ShmstatError):
    """The shared-memory segment cannot be created, attached or trusted."""


class LayoutMismatchError(SegmentError):
    """The segment was created by another layout version, with other capacities, or not by shmstat."""


class WireError(ShmstatError, ValueError):
    """A frame received on a socket is not a valid shmstat message."""


class CollectorError(ShmstatError):
    """The collector cannot start or run (for example, another collector already serves the job)."""
