"""The jsonl handler made slow and observable, so a test can SIGKILL its collector at chosen moments of a pass
(loaded by the collector as ``kit.handlers.slow_jsonl:SlowJsonl,path=...,progress=...``)."""

from __future__ import annotations

import io
import os
import time

from collector.handlers.jsonl import JsonlMetricHandler


class _Noting(io.RawIOBase):
    """The file under the handler's buffer: each write puts at most ``chunk`` bytes in the file (the buffer writes
    the rest in further calls, as a full buffer does), is noted, then pauses."""

    def __init__(self, fd: int, note, pause_s: float, chunk: int) -> None:
        self.fd, self.note, self.pause_s, self.chunk = fd, note, pause_s, chunk

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, b) -> int:
        data = bytes(b)
        n = os.write(self.fd, data[: self.chunk])
        self.note("w1" if data[:n].endswith(b"\n") else "w0")  # w0: the file now ends in a cut line
        time.sleep(self.pause_s)
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


class SlowJsonl(JsonlMetricHandler):
    """:class:`JsonlMetricHandler` writing ``buffer`` bytes at a time, noting in ``progress`` every write
    to the file (``w1`` at a line's end, ``w0`` in the middle of one) and every flush (``f``, once the pass is in
    the file and before the handler returns), pausing ``pause_ms`` after each write and ``flush_pause_ms`` after
    each flush: the moments a test kills the collector at."""

    def __init__(self, path: str, progress: str, buffer: int = 8192, pause_ms: float = 2.0,
                 flush_pause_ms: float = 30.0) -> None:
        super().__init__(path)
        self._progress = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._flush_pause_s = flush_pause_ms / 1000
        self._out.flush()
        fd = os.dup(self._out.fileno())
        self._out.close()
        raw = _Noting(fd, self._note, pause_ms / 1000, buffer)
        self._out = io.TextIOWrapper(io.BufferedWriter(raw, buffer), encoding="utf-8")

    def _note(self, what: str) -> None:
        os.write(self._progress, f"{os.getpid()} {what}\n".encode())

    def flush(self) -> None:
        super().flush()
        self._note("f")
        time.sleep(self._flush_pause_s)
