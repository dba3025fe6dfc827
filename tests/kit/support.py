"""Shared test helpers: unique job ids, an injectable clock and bounded waiting (no sleep-and-hope)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

MS = 1_000_000


def unique_job(prefix: str = "t") -> str:
    """A job id no other test uses."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def run_with_private_dev_shm(script: str, env: dict[str, str], cwd: str,
                             timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``sh -c script`` in a mount namespace of its own (the script mounts its own tmpfs on /dev/shm, so a
    node collector in it sees only the test's jobs); skips the test where root or ``unshare --mount`` is missing."""
    import pytest

    if not shutil.which("unshare") or os.getuid() != 0:
        pytest.skip("needs root and unshare (util-linux) for a private /dev/shm")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env, cwd=cwd,
                          timeout=timeout, capture_output=True, text=True)


class FakeClock:
    """A wall clock in ns that only moves when told to."""

    def __init__(self, start_ns: int = 1_700_000_000_000 * MS) -> None:
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += int(ms * MS)

    def to_window(self, window_ms: int, wid_offset: int = 0) -> None:
        """Jump to the start of window (current + wid_offset) of the given length."""
        w = window_ms * MS
        self.now = (self.now // w + wid_offset) * w


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.005, what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy or the deadline passes (then fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(interval_s)


def wait_growing(count: Callable[[], int], target: int, stall_s: float, what: str,
                 explain: Callable[[], str] = lambda: "") -> int:
    """Poll ``count`` until it reaches ``target``, as long as it keeps growing: fail once it stayed put for
    ``stall_s`` (what stopped, told from a consumer a loaded machine slows down, however much it has to take)."""
    last, moved = count(), time.monotonic()
    while last < target:
        time.sleep(0.05)
        now = count()
        if now > last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise AssertionError(f"{what}: {last} of {target}, none more for {stall_s:g} s {explain()}")
    return last


def step_and_wait(collector) -> None:
    """Make ``collector.step()`` return only once its handlers (threads of their own) took what the step
    dispatched, so a test can look at a recording handler right after a step."""
    step = collector.step

    def stepped(*args, **kwargs) -> None:
        step(*args, **kwargs)
        assert collector.dispatcher.wait(10), "a handler did not take its rows within 10 s"
        collector.commits.apply(collector.segment)  # the watermarks of the passes they took

    collector.step = stepped


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (e.g. ``"64k"``) mounted at ``where`` (made here) for a full-disk test, unmounted
    after; the test is skipped, with the reason, where mounting needs root it does not have."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        import pytest

        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)

