"""``python -m shmstat.testing._collector_main RUNTIME_DIR JOB [collect options]``: the test collector.

Runs ``shmstat collect --job JOB`` (the node side's own command line, through ``python -m collector``) so
that it dies with the test process that started it, whatever happened to that process (a parent-death signal:
SIGTERM, which the collector handles by flushing and exiting). When the test process died, it afterwards removes
the job's segment once no rank of it is alive, and the test's private runtime directory; when the test process
lives (its teardown stopped the collector, or the collector failed on its own), that is the test's teardown's
job, so the collector exits at once: waiting for the rank table to empty would wait for the test process itself
(a rank of the job after ``attach_here``) for nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import runpy
import shutil
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(Exception):  # Linux only; elsewhere the test's own teardown is all there is
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def cleanup(job: str, runtime_dir: str, wait_s: float = 5.0) -> None:
    """Remove ``job``'s segment once no process of its rank table is alive (waiting up to ``wait_s`` for ranks
    that are being killed), then ``runtime_dir``."""
    from shmstat.shm.segment import Segment

    deadline = time.monotonic() + wait_s
    while Segment.unlink_if_unused(job) is False and job in Segment.list_jobs() and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    """Run the collector for ``argv = [runtime_dir, job, *options]`` and clean up after it."""
    runtime_dir, job, *options = argv
    parent = int(os.environ.pop("SHMSTAT_TESTING_PARENT", os.getppid()))
    _die_with_parent(parent)
    sys.argv = ["collector", "collect", "--job", job, *options]
    code: object = 0
    try:
        runpy.run_module("collector", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        if os.getppid() != parent:  # the test process is gone (re-parented): nobody else will clean up
            cleanup(job, runtime_dir)
    return code if isinstance(code, int) else (0 if code is None else 1)


def _exit_now(code: int) -> None:
    """Exit as a normal exit would, less the interpreter's teardown of every module: the collector's shutdown
    has flushed its handlers and delivered its last messages (its sockets lingered, its ZeroMQ context ended),
    and what is left (atexit functions, the standard streams) is done here; the module teardown would add a
    fifth of a second (more on a loaded node) to every test's teardown, which waits for this process."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main(sys.argv[1:]))
