"""Rank processes for a test: N copies of a Python function or of a script, each with its rank's environment,
in a process group of its own, their exit codes, run times and output collected. As with ``torchrun``, one rank
failing ends the others: a wait fails as soon as a rank exits non-zero, not at its timeout."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..errors import ConfigError, ShmstatError
from ._records import tail

__all__ = ["RankGroup", "RankResult", "RanksFailed"]

_PR_SET_PDEATHSIG = 1


class RanksFailed(ShmstatError, AssertionError):
    """A rank of a :class:`RankGroup` exited non-zero, was killed, or was still running at the timeout; the
    message names each such rank with its exit status, run time and the end of its output. An
    ``AssertionError``, so pytest reports it as a failed test."""

    def __init__(self, message: str, results: Sequence[RankResult] = ()) -> None:
        super().__init__(message)
        self.results = list(results)
        """Every rank's :class:`RankResult`, by rank."""

    def __reduce__(self) -> tuple[type[RanksFailed], tuple[str, list[RankResult]]]:
        return (type(self), (str(self), self.results))


@dataclass(frozen=True)
class RankResult:
    """How one rank process ended: its exit code (negative: killed by that signal; None: still running), the end
    of what it printed (stdout and stderr together), how long it ran (start to exit, seconds; None while
    running) and whether the group ended it (``stopped``: still running when another rank failed or at the
    timeout)."""

    rank: int
    exitcode: int | None
    output: str
    seconds: float | None = None
    stopped: bool = False

    @property
    def how(self) -> str:
        """The exit status in words: ``exit code 1``, ``killed by SIGKILL``, ``still running``."""
        return _how(self.exitcode)


def _how(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ranks(results: list[RankResult]) -> str:
    return ("rank " if len(results) == 1 else "ranks ") + ", ".join(str(r.rank) for r in results)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _own_group_and_die_with_parent() -> None:
    # A process group per rank, so ending a rank also ends what it started (data loader workers, a launcher's
    # children); a rank dies with the test process that started it.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent()


def _function_rank(payload: bytes, env: dict[str, str], out_path: str, rank: int) -> None:
    """The body of a function rank (spawned): its environment and output file first, so that even importing the
    target (unpickling ``payload``: the function and its arguments) fails into the rank's output, then
    ``target(rank, *args)``."""
    _own_group_and_die_with_parent()
    os.environ.update(env)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    target, args = pickle.loads(payload)
    target(rank, *args)


def _findable(module: str) -> bool:
    """Whether a fresh interpreter with this ``sys.path`` finds ``module`` (not merely this process, where it
    may sit in ``sys.modules`` only, as with pytest's ``importlib`` import mode)."""
    top, *subs = module.split(".")
    if top == "__main__" or top in sys.builtin_module_names:
        return True
    spec = None
    for finder in sys.meta_path:
        if type(finder).__module__.startswith("_pytest"):  # its assertion rewriter only re-finds test files
            continue
        with contextlib.suppress(Exception):
            spec = finder.find_spec(top, None)
        if spec is not None:
            break
    name = top
    for sub in subs:
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return False
        name = f"{name}.{sub}"
        spec = importlib.machinery.PathFinder.find_spec(name, list(where))
    return spec is not None


def pickled_target(target: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``(target, args)`` pickled for the ranks; refused, in one sentence, when a fresh interpreter cannot
    import the function (defined inside a function, a lambda, a closure, a name rebound since, a module off
    ``sys.path``) or the arguments do not pickle, before any rank starts."""
    module = getattr(target, "__module__", None) or "?"
    name = f"{module}.{getattr(target, '__qualname__', repr(target))}"
    rule = "run_ranks needs a function defined at module level of an importable module (each rank imports it " \
           "in a fresh interpreter), got "
    qualname = getattr(target, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ConfigError(f"{rule}{name}; move it to module level")
    try:
        pickle.dumps(target)
    except Exception as exc:
        raise ConfigError(f"{rule}{name} ({exc}); move it to module level") from None
    if not _findable(module):
        raise ConfigError(f"{rule}{name} from module {module!r}, which is not on sys.path (pytest's importlib "
                          f"import mode?); use pytest's default import mode or put the function in a module on "
                          f"sys.path") from None
    try:
        return pickle.dumps((target, args))
    except Exception as exc:
        raise ConfigError(f"run_ranks sends args to each rank's fresh interpreter, so they must pickle, but "
                          f"{exc}; pass plain data (numbers, strings, paths) instead") from None


def _pidfd(pid: int) -> int | None:
    # A descriptor that becomes readable when the process ends, whoever else holds its pipes (a rank's forked
    # children keep a multiprocessing sentinel open after the rank is gone).
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class RankGroup:
    """N rank processes started together; :meth:`wait` collects them (failing fast), :meth:`kill` ends any still
    running. A thread of the group notes each rank's exit the moment it happens."""

    def __init__(self, procs: list[Any], outputs: list[str], started: list[float] | None = None) -> None:
        self._procs = procs
        self._outputs = outputs
        now = time.monotonic()
        self._started = list(started) if started is not None else [now] * len(procs)
        self._codes: list[int | None] = [None] * len(procs)
        self._ended_at: list[float | None] = [None] * len(procs)
        self._stopped: set[int] = set()
        self._cond = threading.Condition()
        self._watcher = threading.Thread(target=self._watch, name="shmstat-testing-ranks", daemon=True)
        self._watcher.start()

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, by rank."""
        return [int(p.pid) for p in self._procs]

    # -- the watcher: the only reaper of the rank processes ----------------------------------------------------
    def _ended(self, i: int) -> None:
        """Rank ``i`` has ended and is not reaped yet (its pid cannot be reused): end what it left in its
        process group, reap it and note its exit code and time."""
        p = self._procs[i]
        with contextlib.suppress(OSError):
            if os.getpgid(p.pid) == p.pid != os.getpgrp():
                os.killpg(p.pid, signal.SIGKILL)
        with self._cond:
            if isinstance(p, subprocess.Popen):
                code = p.wait()
            else:
                p.join()
                deadline = time.monotonic() + 5.0
                while p.exitcode is None and time.monotonic() < deadline:  # multiprocessing's own reaper (run
                    time.sleep(0.001)  # at every Process.start) took the status and is about to record it
                code = p.exitcode if p.exitcode is not None else 255
            self._codes[i] = code
            self._ended_at[i] = time.monotonic()
            self._cond.notify_all()

    def _watch(self) -> None:
        fds: dict[int, int] = {}
        for i, p in enumerate(self._procs):
            fd = _pidfd(int(p.pid))
            if fd is None:
                for open_fd in fds:
                    os.close(open_fd)
                self._poll_each()
                return
            fds[fd] = i
        try:
            while fds:
                for ready in mp.connection.wait(list(fds)):
                    ready_fd = cast(int, ready)  # wait() returns the objects it was given: these fds
                    self._ended(fds.pop(ready_fd))
                    os.close(ready_fd)
        finally:
            for fd in fds:
                os.close(fd)

    def _poll_each(self) -> None:
        # Without pidfds (Linux before 5.3): poll for an ended rank without reaping it (WNOWAIT).
        left = set(range(len(self._procs)))
        while left:
            for i in sorted(left):
                try:
                    ended: object = os.waitid(os.P_PID, self._procs[i].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    ended = True
                if ended is not None:
                    left.discard(i)
                    self._ended(i)
            time.sleep(0.01)

    # -- waiting and ending --------------------------------------------------------------------------------------
    def results(self) -> list[RankResult]:
        """Every rank's result so far (``exitcode`` None: still running), without waiting or ending any."""
        return self._results()

    def _results(self) -> list[RankResult]:
        with self._cond:
            return [RankResult(i, self._codes[i], tail(self._outputs[i]),
                               None if (end := self._ended_at[i]) is None else end - self._started[i],
                               i in self._stopped)
                    for i in range(len(self._procs))]

    def wait(self, timeout: float = 60.0, *, check: bool = True, fail_fast: bool = True) -> list[RankResult]:
        """Wait for every rank to exit (at most ``timeout`` seconds in all) and return their results, by rank.

        With ``fail_fast`` (the default) the wait ends as soon as one rank exits non-zero or is killed, and the
        ranks still running are ended (SIGTERM to each rank's process group, SIGKILL after 3 s), as ``torchrun``
        does: a rank blocked in a collective with the failed one would otherwise wait for ever. With ``check``
        (the default) ranks still running at the timeout are ended too, and any rank that did not exit 0 raises
        :class:`RanksFailed` naming the failed ranks with their exit status, run time and output; without it,
        ranks still running at the timeout are left running (``exitcode`` None)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if all(c is not None for c in self._codes):
                    break
                if fail_fast and any(c not in (None, 0) for c in self._codes):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            failed_fast = fail_fast and any(c not in (None, 0) for c in self._codes)
            timed_out = not failed_fast and any(c is None for c in self._codes)
        if failed_fast or (timed_out and check):
            self.kill()
        results = self._results()
        if check and any(r.exitcode != 0 for r in results):
            raise RanksFailed(self._describe(results, timeout if timed_out else None), results)
        return results

    def _describe(self, results: list[RankResult], timeout: float | None) -> str:
        """``2 of 3 ranks failed: rank 1 exit code 1 after 0.42 s; ...`` then each failed rank's output."""
        failed = sorted((r for r in results if not r.stopped and r.exitcode != 0),
                        key=lambda r: r.seconds if r.seconds is not None else float("inf"))
        stopped = [r for r in results if r.stopped]
        parts = [f"rank {r.rank} {r.how} after {r.seconds:.2f} s" for r in failed if r.seconds is not None]
        if stopped and timeout is not None:
            parts.append(f"{_ranks(stopped)} still running after the {timeout:g} s timeout, so ended")
        elif stopped:
            parts.append(f"{_ranks(stopped)} still running, so ended")
        head = f"{len(failed) + (len(stopped) if timeout is not None else 0)} of {len(results)} ranks failed: "
        shown = failed if timeout is None else [*failed, *stopped]
        return head + "; ".join(parts) + "".join(
            f"\nrank {r.rank} ({r.how}), its output ends with:\n{r.output.rstrip() or '(nothing)'}" for r in shown)

    def kill(self, grace_s: float = 3.0) -> None:
        """End every rank still running: SIGTERM to its process group, then SIGKILL after ``grace_s``; returns
        once they all exited (and what they started in their group is killed)."""
        with self._cond:
            live = [i for i, c in enumerate(self._codes) if c is None]
            self._stopped.update(live)
        for i in live:
            self._signal(i, signal.SIGTERM)
        self._wait_ended(live, grace_s)
        for i in live:
            if self._codes[i] is None:
                self._signal(i, signal.SIGKILL)
        self._wait_ended(live, 10.0)
        for i in range(len(self._procs)):  # leftovers of a rank's group (its children), whichever way it ended
            with contextlib.suppress(OSError):
                os.killpg(self._procs[i].pid, signal.SIGKILL)

    def _wait_ended(self, ranks: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(self._codes[i] is None for i in ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _signal(self, i: int, sig: signal.Signals) -> None:
        pid = int(self._procs[i].pid)
        with self._cond:
            if self._codes[i] is not None:  # reaped: the pid may be another process's now
                return
            try:
                if os.getpgid(pid) == pid != os.getpgrp():
                    os.killpg(pid, sig)
                else:  # not yet in its own group (a spawned rank still starting)
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass


def start_function_ranks(target: Callable[..., Any], envs: list[dict[str, str]], outputs: list[str],
                         args: tuple[Any, ...]) -> RankGroup:
    """``target(rank, *args)`` in a fresh interpreter per rank (``spawn``: ``target`` must be importable, i.e.
    defined at the top level of a module; refused with :class:`~shmstat.errors.ConfigError` otherwise)."""
    payload = pickled_target(target, args)
    ctx = mp.get_context("spawn")
    procs, started = [], []
    for rank, (env, out) in enumerate(zip(envs, outputs, strict=True)):
        p = ctx.Process(target=_function_rank, args=(payload, env, out, rank), name=f"shmstat-rank-{rank}")
        started.append(time.monotonic())
        p.start()
        procs.append(p)
    return RankGroup(procs, outputs, started)


def start_command_ranks(command: Sequence[str], envs: list[dict[str, str]], outputs: list[str]) -> RankGroup:
    """``command`` once per rank (a ``.py`` path alone runs with this interpreter), each with its environment."""
    argv = list(command)
    if len(argv) >= 1 and argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    procs, started = [], []
    for env, out in zip(envs, outputs, strict=True):
        with open(out, "ab") as f:
            started.append(time.monotonic())
            procs.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=_own_group_and_die_with_parent))
    return RankGroup(procs, outputs, started)
