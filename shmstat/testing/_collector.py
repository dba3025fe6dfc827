"""Starting a collector process for a test: ``python -m collector ARGS`` (or a wrapper that runs it), returned
once it serves, with the endpoints its ready file names, the lines it writes and a stop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import CollectorError

__all__ = ["CollectorProcess", "start_collector"]


@dataclass
class CollectorProcess:
    """A collector subprocess that serves, and where: what its ready file (``--ready-file``) said."""

    proc: subprocess.Popen[str]
    """The process (its stdout a pipe only when :func:`start_collector` was asked for one)."""
    ready_file: str
    info: dict[str, Any]
    """The ready file's whole content (``pid``, ``publish``; ``job`` and ``ingest`` for one job, ``jobs`` for
    several; ``prometheus``)."""
    lines: list[str] = field(default_factory=list)
    """What it wrote to stderr so far, one line an item (read by a thread of this process)."""
    _reader: threading.Thread | None = None
    _private_dir: str | None = None

    @property
    def publish(self) -> str:
        """The endpoint it re-publishes on (a subscriber connects here)."""
        return str(self.info["publish"])

    @property
    def ingest(self) -> str | None:
        """The ipc endpoint a job's ranks publish to (None for a collector of several jobs: one per job)."""
        return self.info.get("ingest")

    @property
    def prometheus(self) -> str | None:
        """The ``/metrics`` URL (None without ``--prometheus``)."""
        return self.info.get("prometheus")

    @property
    def notes(self) -> list[str]:
        """:attr:`lines` less the line saying where it serves (what a user reads beyond the endpoints)."""
        return [line for line in list(self.lines)
                if not (line.startswith("shmstat collector:") and " publish " in line)]

    def lines_seen(self, text: str, timeout_s: float = 10.0) -> str:
        """The first line on stderr containing ``text``, waited for (the reader may be behind the ready file);
        fails with :class:`AssertionError` after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = next((line for line in list(self.lines) if text in line), None)
            if line is not None:
                return line
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for a collector line containing "
                                     f"{text!r}; it said: {self.lines!r}")
            time.sleep(0.005)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` (if it still runs) and wait for its exit status; then :attr:`lines` holds all it said."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._done()

    def finish(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> tuple[int, str]:
        """Send ``sig`` (if it still runs), read its stdout (a pipe) to the end; its exit status and that output."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        assert self.proc.stdout is not None, "start_collector(stdout=subprocess.PIPE) gives an output to read"
        out = self.proc.stdout.read()  # to the end: the pipe is closed once it exits
        try:
            return self.proc.wait(timeout), out
        finally:
            self._done()

    def _done(self) -> None:
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.proc.poll() is not None and self._reader is not None:
            self._reader.join(10)  # the rest of what it said (the pipe ends with the process)
        if self.proc.stderr and (self._reader is None or not self._reader.is_alive()):
            self.proc.stderr.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def start_collector(args: Sequence[str], *, command: Sequence[str] | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None, timeout_s: float = 30.0,
                    stdout: int | IO[Any] | None = subprocess.PIPE, forward: Callable[[str], object] | None = None,
                    keep_lines: int | None = None,
                    preexec_fn: Callable[[], Any] | None = None) -> CollectorProcess:
    """Run ``command`` (``python -m collector`` by default) with ``args`` (``["collect", "--job", J, ...]``) and
    return once it serves: once its ready file, the collector's documented signal, exists. ``args`` may name the
    ready file (``--ready-file``); otherwise one is added in a private temporary directory, removed at the stop.

    stderr is read by a thread into :attr:`CollectorProcess.lines` (the last ``keep_lines`` only, when given),
    each line also passed to ``forward`` when given (as read, newline included); ``stdout`` is where its stdout
    goes (a pipe by default, for :meth:`CollectorProcess.finish`). ``env`` replaces this process's environment;
    ``preexec_fn`` runs in the child before the collector. Raises :class:`~shmstat.errors.CollectorError` with
    what it said if it ends before serving or does not serve within ``timeout_s`` seconds (then it is killed)."""
    args = list(args)
    private_dir = None
    if "--ready-file" in args:
        ready = args[args.index("--ready-file") + 1]
    else:
        private_dir = tempfile.mkdtemp(prefix="shmstat-ready-")
        ready = os.path.join(private_dir, "collector.json")
        args += ["--ready-file", ready]
    cmd = [*(command or (sys.executable, "-m", "collector")), *args]
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=None if env is None else dict(env), cwd=cwd, preexec_fn=preexec_fn)
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines, forward, keep_lines),
                              name="shmstat-testing-collector-err", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if not os.path.exists(ready):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            how = f"it did not serve within {timeout_s:g} s (killed)"
        else:
            how = f"it ended (exit status {proc.returncode})"
        reader.join(5)  # what it said before it ended
        if proc.stdout is not None:
            proc.stdout.close()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
        said = "\n".join(lines) or "(no output)"
        raise CollectorError(f"{' '.join(cmd[2:])} did not start: {how}; it said:\n{said}")
    with open(ready, encoding="utf-8") as f:
        info = json.load(f)
    return CollectorProcess(proc, ready, info, lines, reader, private_dir)


def _read_lines(stream: IO[str], lines: list[str], forward: Callable[[str], object] | None, keep: int | None) -> None:
    """Keep every line the collector writes to ``stream`` (the last ``keep``), passing each on to ``forward``."""
    for line in stream:
        lines.append(line.rstrip("\n"))
        if keep is not None and len(lines) > 2 * keep:
            del lines[:-keep]
        if forward is not None:
            forward(line)
