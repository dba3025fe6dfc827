"""Rank processes for a test: N copies of a Python function or of a script, each with its rank's environment,
their exit codes and output collected, and killed at teardown if still running."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._records import tail

__all__ = ["RankGroup", "RankResult"]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankResult:
    """How one rank process ended: its exit code (negative: killed by that signal; None: still running when
    the wait gave up) and the end of what it printed (stdout and stderr together)."""

    rank: int
    exitcode: int | None
    output: str


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _function_rank(target: Callable[..., Any], env: dict[str, str], out_path: str, rank: int,
                   args: tuple[Any, ...]) -> None:
    """The body of a function rank (spawned): its environment, its output file, then ``target(rank, *args)``."""
    _die_with_parent()
    os.environ.update(env)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    target(rank, *args)


class RankGroup:
    """N rank processes started together; :meth:`wait` collects them, :meth:`kill` ends any still running."""

    def __init__(self, procs: list[Any], outputs: list[str]) -> None:
        self._procs = procs
        self._outputs = outputs

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, by rank."""
        return [int(p.pid) for p in self._procs]

    def _exitcode(self, i: int) -> int | None:
        p = self._procs[i]
        return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode

    def wait(self, timeout: float = 60.0, *, check: bool = True) -> list[RankResult]:
        """Wait for every rank to exit (at most ``timeout`` seconds in all), then return their results. With
        ``check`` (the default) a rank still running, killed or exiting non-zero fails with its output."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            left = max(0.0, deadline - time.monotonic())
            if isinstance(p, subprocess.Popen):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(left)
            else:
                p.join(left)
        results = [RankResult(i, self._exitcode(i), tail(self._outputs[i])) for i in range(len(self._procs))]
        if check:
            bad = [r for r in results if r.exitcode != 0]
            if bad:
                self.kill()
                lines = []
                for r in bad:
                    how = "still running" if r.exitcode is None else f"exit code {r.exitcode}"
                    lines.append(f"rank {r.rank}: {how}; its output ends with:\n{r.output.rstrip() or '(nothing)'}")
                raise AssertionError(f"{len(bad)} of {len(results)} ranks failed after {timeout} s:\n"
                                     + "\n".join(lines))
        return results

    def kill(self, grace_s: float = 3.0) -> None:
        """SIGTERM every rank still running, then SIGKILL what is left after ``grace_s``."""
        live = [i for i in range(len(self._procs)) if self._exitcode(i) is None]
        for i in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[i].pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for i in live:
            while self._exitcode(i) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._exitcode(i) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._procs[i].pid, signal.SIGKILL)
        for p in self._procs:
            if isinstance(p, subprocess.Popen):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
            else:
                p.join(5)


def start_function_ranks(target: Callable[..., Any], envs: list[dict[str, str]], outputs: list[str],
                         args: tuple[Any, ...]) -> RankGroup:
    """``target(rank, *args)`` in a fresh interpreter per rank (``spawn``: ``target`` must be importable, i.e.
    defined at the top level of a module)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank, (env, out) in enumerate(zip(envs, outputs, strict=True)):
        p = ctx.Process(target=_function_rank, args=(target, env, out, rank, args), name=f"shmstat-rank-{rank}")
        p.start()
        procs.append(p)
    return RankGroup(procs, outputs)


def start_command_ranks(command: Sequence[str], envs: list[dict[str, str]], outputs: list[str]) -> RankGroup:
    """``command`` once per rank (a ``.py`` path alone runs with this interpreter), each with its environment."""
    argv = list(command)
    if len(argv) >= 1 and argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    procs = []
    for env, out in zip(envs, outputs, strict=True):
        with open(out, "ab") as f:
            procs.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
    return RankGroup(procs, outputs)
