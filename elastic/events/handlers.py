"""The logging handlers behind event destinations (``torch.distributed.elastic.events.handlers``).

``console`` writes each event's JSON on a line to standard error (the stream current at the time of
writing, so redirecting ``sys.stderr`` later works); ``null`` and ``dynamic_rendezvous`` discard it.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["get_logging_handler"]


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        """The current ``sys.stderr``."""
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        """Ignored: this handler always writes to the current ``sys.stderr``."""


_log_handlers: dict[str, logging.Handler] = {
    "console": _StderrHandler(),
    "dynamic_rendezvous": logging.NullHandler(),
    "null": logging.NullHandler(),
}


def get_logging_handler(destination: str = "null") -> logging.Handler:
    """The logging handler of ``destination`` (``console``, ``null`` or ``dynamic_rendezvous``).

    Returns the same handler object on every call. An unknown destination raises :class:`KeyError`
    naming the known ones.
    """
    try:
        return _log_handlers[destination]
    except KeyError:
        known = ", ".join(sorted(_log_handlers))
        raise KeyError(f"unknown event destination {destination!r}; known destinations: {known}") from None
