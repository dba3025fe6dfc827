"""A job for one test: a unique id, a real collector capturing everything, waits on the data, rank processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ..errors import CollectorError, ConfigError
from ._collector import start_collector
from ._ranks import RankGroup, RankResult, start_command_ranks, start_function_ranks
from ._records import EventRecord, MetricRecord, Row, StreamTap

__all__ = ["ShmstatJob", "unique_job_id"]

_ANY: Any = object()
_LIVE: set[ShmstatJob] = set()
_LIVE_LOCK = threading.Lock()
_SAID = 200  # the collector's last stderr lines kept for a failure message


def unique_job_id(prefix: str = "pytest") -> str:
    """A job id no other test, xdist worker or concurrent run uses."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"{prefix}-{worker}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ShmstatJob:
    """One job with its own collector (``shmstat collect --job JOB`` in a subprocess; handlers ``*=null`` unless
    ``collector_args`` name some) and its own runtime directory; a subscriber of the test's own records every
    row, put metric and event the collector re-publishes.

    Rank processes join it through :attr:`env` / :meth:`rank_env` (no code change: ``subprocess``,
    ``multiprocessing``, ``torchrun``), or are started by :meth:`start_ranks` / :meth:`run_ranks`. Queries
    (:meth:`rows`, :meth:`events`, :meth:`metrics`) return what was captured so far; the ``wait_for_*`` methods
    wait on the data (never on the clock) and fail with what was seen. :meth:`close` (the fixture's teardown)
    ends the ranks and the collector and removes the segment and the runtime directory, whatever the test did;
    if the test process itself dies, the collector and the ranks it started die with it and the collector
    removes what was left.
    """

    def __init__(self, job: str | None = None, *, collector_args: Sequence[str] = (), grace_ms: int = 10,
                 start_timeout_s: float = 30.0) -> None:
        self.job = job or unique_job_id()
        self.runtime_dir = tempfile.mkdtemp(prefix="shmstat-t-")
        os.chmod(self.runtime_dir, 0o700)
        self._groups: list[RankGroup] = []
        self._closed = False
        self.env: dict[str, str] = dict(os.environ, SHMSTAT_JOB=self.job, SHMSTAT_RUNTIME_DIR=self.runtime_dir)
        """The environment every rank of this job needs (add :meth:`rank_env`'s rank variables, or let
        ``torchrun`` set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``: ``SHMSTAT_JOB`` names the job either way)."""
        for name in ("SHMSTAT_RANK", "SHMSTAT_LOCAL_RANK", "SHMSTAT_WORLD_SIZE"):
            self.env.pop(name, None)
        ready_file = os.path.join(self.runtime_dir, "collector.json")  # where the collector says its endpoints
        options = ["--handler", "*=null", "--grace-ms", str(grace_ms), "--status-interval", "0",
                   "--hold-ms", "600000", "--ready-file", ready_file, *collector_args]
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._process = start_collector(
                options, command=[sys.executable, "-m", "shmstat.testing._collector_main", self.runtime_dir, self.job],
                env=dict(self.env, SHMSTAT_TESTING_PARENT=str(os.getpid())), timeout_s=start_timeout_s,
                stdout=subprocess.DEVNULL, keep_lines=_SAID)
        except CollectorError:
            self.close()
            raise
        self._collector = self._process.proc
        self.publish_endpoint = self._process.publish
        """Where the collector re-publishes what it takes (its ready file said)."""
        self._tap = StreamTap(self.publish_endpoint)

    @property
    def collector_said(self) -> str:
        """The collector's last lines on stderr (warnings, errors), for a failure message."""
        process = getattr(self, "_process", None)
        return "" if process is None else "\n".join(process.lines[-_SAID:])

    # -- ranks ---------------------------------------------------------------------------------------------------
    def rank_env(self, rank: int, world_size: int, local_rank: int | None = None) -> dict[str, str]:
        """:attr:`env` plus this rank's ``SHMSTAT_RANK`` / ``SHMSTAT_LOCAL_RANK`` / ``SHMSTAT_WORLD_SIZE``."""
        return dict(self.env, SHMSTAT_RANK=str(rank), SHMSTAT_WORLD_SIZE=str(world_size),
                    SHMSTAT_LOCAL_RANK=str(rank if local_rank is None else local_rank))

    def start_ranks(self, target: Callable[..., Any] | str | Sequence[str], nranks: int,
                    args: Iterable[Any] = ()) -> RankGroup:
        """Start ``nranks`` rank processes: a function is called as ``target(rank, *args)`` in a fresh
        interpreter, so it must be importable (defined at module level of a module the test can import; a
        function defined inside the test, a lambda or a closure is refused with
        :class:`~shmstat.errors.ConfigError` before any rank starts); a script path or command list runs as a
        program (``args`` appended). Each rank has its rank's environment and a process group of its own;
        output goes to a file per rank."""
        if nranks < 1:
            raise ConfigError(f"nranks must be at least 1, got {nranks}")
        envs = [self.rank_env(r, nranks) for r in range(nranks)]
        outputs = [os.path.join(self.runtime_dir, f"rank{r}-{len(self._groups)}.out") for r in range(nranks)]
        if callable(target):
            group = start_function_ranks(target, envs, outputs, tuple(args))
        else:
            command = [target] if isinstance(target, str) else list(target)
            group = start_command_ranks([*command, *map(str, args)], envs, outputs)
        self._groups.append(group)
        return group

    def run_ranks(self, target: Callable[..., Any] | str | Sequence[str], nranks: int, args: Iterable[Any] = (),
                  timeout: float = 60.0) -> list[RankResult]:
        """:meth:`start_ranks`, then :meth:`RankGroup.wait`: returns once every rank exited 0; as soon as one
        exits non-zero the others are ended and :class:`RanksFailed` shows that rank's exit status, run time
        and output (so does a rank still running after ``timeout`` seconds)."""
        return self.start_ranks(target, nranks, args).wait(timeout)

    @contextlib.contextmanager
    def environ(self) -> Iterator[dict[str, str]]:
        """Within the block, ``os.environ`` names this job (``SHMSTAT_JOB``, ``SHMSTAT_RUNTIME_DIR``): processes
        started there (``multiprocessing`` included) join it; each still needs its rank (``SHMSTAT_RANK`` in its
        environment, or ``shmstat.init(rank=...)``). Restored afterwards."""
        names = ("SHMSTAT_JOB", "SHMSTAT_RUNTIME_DIR")
        saved = {n: os.environ.get(n) for n in names}
        os.environ.update({n: self.env[n] for n in names})
        try:
            yield self.env
        finally:
            for n, v in saved.items():
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v

    def attach_here(self, rank: int = 0, world_size: int = 1, **init_kwargs: Any) -> None:
        """Attach the test process itself as ``rank`` of this job (``shmstat.init``; detached again at
        :meth:`close`), for tests of code that logs from the test process."""
        from ..job.attach import init

        self._saved_runtime_dir = os.environ.get("SHMSTAT_RUNTIME_DIR")
        os.environ["SHMSTAT_RUNTIME_DIR"] = self.runtime_dir
        init(self.job, rank=rank, local_rank=rank, world_size=world_size, **init_kwargs)

    # -- what was captured -------------------------------------------------------------------------------------
    def rows(self, stat: str | None = None, agg: str | None = None, *, group: str | None = None,
             rank: int | None = _ANY) -> list[Row]:
        """The rows emitted so far, filtered (``rank=None``: merged rows only; a number: that rank's only)."""
        return [r for r in list(self._tap.rows)
                if (stat is None or r.stat == stat) and (agg is None or r.agg == agg)
                and (group is None or r.group == group) and (rank is _ANY or r.rank == rank)]

    def merged(self, stat: str, agg: str = "count") -> float:
        """The sum over every emitted window of the merged rows' ``agg`` (for ``count``/``sum``: the total; a
        count is an int)."""
        return sum(r.value for r in self.rows(stat, agg, rank=None))

    def per_rank(self, stat: str, agg: str = "count") -> dict[int, float]:
        """Per rank, the sum over every emitted window of its rows' ``agg`` (a count is an int: ``{0: 500}``)."""
        out: dict[int, float] = defaultdict(int)
        for r in self.rows(stat, agg):
            if r.rank is not None:
                out[r.rank] += r.value
        return dict(sorted(out.items()))

    def metrics(self, name: str | None = None, *, group: str | None = None) -> list[MetricRecord]:
        """The put metrics received so far, filtered."""
        return [m for m in list(self._tap.metrics)
                if (name is None or m.name == name) and (group is None or m.group == group)]

    def events(self, name: str | None = None) -> list[EventRecord]:
        """The events received so far (every rank's and the collector's own), filtered by name."""
        return [e for e in list(self._tap.events) if name is None or e.name == name]

    # -- waiting on the data -------------------------------------------------------------------------------------
    def wait_for_rows(self, stat: str, agg: str = "count", *, total: float | None = None, rank: int | None = None,
                      group: str | None = None, timeout: float = 10.0) -> list[Row]:
        """Wait until the rows of ``stat``'s ``agg`` (merged, or ``rank``'s) add up to exactly ``total`` (or, with
        no total, until one exists) and return them. Fails at once if they pass ``total``, and after
        ``timeout`` seconds with what was seen."""
        def check() -> list[Row] | None:
            got = self.rows(stat, agg, group=group, rank=rank)
            seen = sum(r.value for r in got)
            if total is not None and seen > total:
                raise AssertionError(f"{self._what(stat, agg, rank)} add up to {seen:g}, more than {total:g}: "
                                     f"{self._seen(stat, agg)}")
            return got if got and (total is None or seen == total) else None

        want = "any row" if total is None else f"a total of {total:g}"
        return self._wait(check, timeout, lambda: f"{self._what(stat, agg, rank)} to reach {want}: "
                                                  f"{self._seen(stat, agg)}")

    def wait_for_event(self, name: str, count: int = 1, timeout: float = 10.0) -> list[EventRecord]:
        """Wait until ``count`` events named ``name`` arrived and return them; fails after ``timeout`` seconds
        with what arrived."""
        def check() -> list[EventRecord] | None:
            got = self.events(name)
            return got if len(got) >= count else None

        def seen() -> str:
            names: dict[str, int] = defaultdict(int)
            for e in self.events():
                names[e.name] += 1
            return f"{count} events {name!r}: saw {len(self.events(name))}; all events so far: {dict(names)}"

        return self._wait(check, timeout, seen)

    def wait_for_metric(self, name: str, count: int = 1, *, group: str | None = None,
                        timeout: float = 10.0) -> list[MetricRecord]:
        """Wait until ``count`` put metrics named ``name`` were handled and return them."""
        def check() -> list[MetricRecord] | None:
            got = self.metrics(name, group=group)
            return got if len(got) >= count else None

        return self._wait(check, timeout, lambda: f"{count} metrics {name!r}: saw {len(self.metrics(name))}; "
                                                  f"names so far: {sorted({m.name for m in self.metrics()})}")

    def _wait(self, check: Callable[[], Any], timeout: float, describe: Callable[[], str]) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if self._collector.poll() is not None:
                raise AssertionError(f"the collector of job {self.job} exited ({self._collector.returncode}) "
                                     f"while waiting for {describe()}; it said: {self.collector_said}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {describe()}{self._failed_ranks()}")
            self._tap.wait(0.01)

    def _failed_ranks(self) -> str:
        """For a timed-out wait: the ranks this job started that failed meanwhile, with their last lines."""
        notes = []
        for group in self._groups:
            for r in group.results():
                if r.exitcode not in (None, 0) and not r.stopped:
                    last = " | ".join(line for line in r.output.strip().splitlines()[-3:])
                    notes.append(f"rank {r.rank} {r.how} after {r.seconds or 0:.2f} s ({last or 'no output'})")
        return f"; meanwhile {'; '.join(notes)}" if notes else ""

    def _what(self, stat: str, agg: str, rank: int | None) -> str:
        return f"{stat}.{agg} rows ({'merged' if rank is None else f'rank {rank}'})"

    def _seen(self, stat: str, agg: str) -> str:
        merged = self.rows(stat, agg, rank=None)
        return (f"merged {sum(r.value for r in merged):g} in {len(merged)} windows, per rank "
                f"{self.per_rank(stat, agg)}; stats seen: {sorted({r.stat for r in self.rows()})}")

    # -- teardown -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the ranks still running, stop the collector (it emits what it holds), stop the subscriber and
        remove the job's segment and runtime directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for group in self._groups:
            group.kill()
        from ..job.attach import shutdown
        from ..shm.segment import Segment
        from ._collector_main import cleanup

        if _attached_job() == self.job:  # detached while the collector still takes what it flushes
            shutdown(flush_timeout_s=0.5)
        if hasattr(self, "_saved_runtime_dir"):
            if self._saved_runtime_dir is None:
                os.environ.pop("SHMSTAT_RUNTIME_DIR", None)
            else:
                os.environ["SHMSTAT_RUNTIME_DIR"] = self._saved_runtime_dir
        process = getattr(self, "_process", None)
        if process is not None:
            try:
                process.stop(signal.SIGTERM, 20)
            except subprocess.TimeoutExpired:
                process.stop(signal.SIGKILL, 5)
        tap = getattr(self, "_tap", None)
        if tap is not None:
            tap.close()
        Segment.unlink(self.job)
        cleanup(self.job, self.runtime_dir, wait_s=0)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __enter__(self) -> ShmstatJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _attached_job() -> str | None:
    from ..job._state import STATE

    att = STATE.attachment
    return att.segment.job if att is not None else None


def close_all() -> None:
    """Close every job still open (an interrupted session's teardown)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for job in live:
        with contextlib.suppress(Exception):
            job.close()
