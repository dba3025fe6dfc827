"""Standard output and error that a dead reader cannot break (:func:`keep_writing`), for the long-running commands.

``shmstat run ... 2>&1 | tee train.log`` then Ctrl-C: the terminal's SIGINT reaches ``tee`` too, which dies, so
every later line the launcher or collector writes meets a pipe with no reader. Python ignores SIGPIPE, so the write
raises :class:`BrokenPipeError`, which, unhandled, would end the process before it stopped its ranks, emitted its
windows and removed the job's segment. With :func:`keep_writing`, the first such write points the stream's file
descriptor at ``/dev/null`` instead (what is written after it went nowhere anyway), and the process stops as it
would have.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO

__all__ = ["keep_writing"]


class _Unbreakable:
    """A text stream whose writes and flushes survive the reader's end (see the module docstring)."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except (BrokenPipeError, ConnectionResetError):
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._to_devnull()

    def _to_devnull(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            fd = self._inner.fileno()
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.dup2(null, fd, inheritable=fd <= 2)
            finally:
                os.close(null)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError, ValueError):
            self._inner.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def keep_writing() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` survive a reader that went away (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbreakable):
            setattr(sys, name, _Unbreakable(stream))
