"""Real processes for integration tests: a collector subprocess started on its ready file, and rank workers
(spawn-safe functions)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Mapping

from kit.support import wait_for
from shmstat.errors import CollectorError
from shmstat.testing import CollectorProcess
from shmstat.testing import start_collector as start_collector_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


CollectorProc = CollectorProcess
"""A ``python -m collector collect`` subprocess, and where it serves as its ready file said (the shipped
:class:`shmstat.testing.CollectorProcess`)."""


def spawn(target, *args) -> mp.process.BaseProcess:
    """Start ``target(*args)`` in a fresh interpreter (spawn: nothing inherited from the test process)."""
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    return p


def collector_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment by default) with the repository and tests/ first on ``PYTHONPATH``
    (tests/: the handler classes of tests/kit/handlers/ are named in SPECs as ``kit.handlers.<module>:Class``)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    return env


def start_collector(job: str | None, *args: str, env: Mapping[str, str] | None = None,
                    timeout_s: float = 30.0, python: str | None = None) -> CollectorProc:
    """Start ``shmstat collect`` (``--job job``; none for a node collector, or give ``--job`` in ``args`` for
    several) with ``args`` and return once it serves: when its ready file (``--ready-file``, the collector's
    documented signal) exists, whose endpoints the result holds. ``args`` may name the ready file; otherwise it
    goes in a private temporary directory. ``env`` replaces this process's environment (the repository and
    tests/ are put on its ``PYTHONPATH`` either way); SIGINT, SIGQUIT and SIGHUP start at their default actions
    (:func:`default_signals`). stdout is a pipe the test may read (:meth:`CollectorProc.finish`); stderr is
    collected in :attr:`CollectorProc.lines`. ``python`` is the interpreter that runs it (this one by default)."""
    jobs = ("--job", job) if job is not None else ()
    try:
        return start_collector_process(["collect", *jobs, *args], command=[python or sys.executable, "-m", "collector"],
                                       env=collector_env(env), cwd=REPO, timeout_s=timeout_s, forward=_to_stderr,
                                       preexec_fn=default_signals)
    except CollectorError as exc:
        raise AssertionError(str(exc)) from None


def _to_stderr(line: str) -> None:
    """Pass a collector's line on to the test's stderr (whatever it is at the time), as if inherited."""
    sys.stderr.write(line)


def read_jsonl(path: str) -> list[dict]:
    """Every line of a jsonl output (missing file: none)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # a collector still running may be in the middle of writing its last line: only whole lines count
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def window_counts(rows: list[dict], stat: str) -> tuple[dict[float, float], dict[tuple[int, float], float]]:
    """From jsonl rows: merged ``{window_start: count}`` and per-rank ``{(rank, window_start): count}``."""
    merged: dict[float, float] = defaultdict(float)
    per_rank: dict[tuple[int, float], float] = defaultdict(float)
    for r in rows:
        if r["name"] != f"{stat}.count":
            continue
        if r["rank"] is None:
            merged[r["window_start"]] += r["value"]
        else:
            per_rank[(r["rank"], r["window_start"])] += r["value"]
    return dict(merged), dict(per_rank)


def rank_worker(job: str, rank: int, world: int, seconds: float, window_ms: int, out_path: str,
                endpoint: str | None = None, events: int = 0, ready_path: str | None = None) -> None:
    """Add 1.0 per step to Stat ``steps`` for ``seconds``; write ``{window_start_s: count}`` to ``out_path``."""
    import datetime

    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world, endpoint=endpoint)
    last_t = [0]

    def clock() -> int:
        last_t[0] = time.time_ns()
        return last_t[0]

    stat = shmstat.Stat("steps", [A.COUNT, A.SUM, A.MAX], window_ms / 1000, group="train", clock=clock)
    counts: dict[str, int] = defaultdict(int)
    wns = window_ms * 1_000_000
    for i in range(events):
        shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {"rank": rank, "i": i}))
    if ready_path:
        open(ready_path, "w").close()
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        stat.add(float(rank + 1))
        counts[repr((last_t[0] // wns) * wns / 1e9)] += 1
        n += 1
        if n % 64 == 0:
            time.sleep(0.001)
    with open(out_path + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(out_path + ".tmp", out_path)
    shmstat.shutdown()


def load_counts(path: str) -> dict[float, int]:
    """What a rank_worker wrote."""
    with open(path) as f:
        return {float(k): v for k, v in json.load(f).items()}


def wait_file(path: str, timeout_s: float = 30.0) -> None:
    """Wait until a worker wrote ``path``."""
    wait_for(lambda: os.path.exists(path), timeout_s, what=path)


def assert_rank_workers_reconcile(rows: list[dict], tmp_path, ranks: int, stat: str = "steps") -> None:
    """The ``rank_worker`` tallies ``r<rank>.json`` in ``tmp_path`` match the jsonl rows exactly: every
    (rank, window) count, and the merged total (a window missing or emitted twice fails)."""
    merged, per_rank = window_counts(rows, stat)
    counts = {r: load_counts(str(tmp_path / f"r{r}.json")) for r in range(ranks)}
    for rank, c in counts.items():
        for start, n in c.items():
            assert per_rank.get((rank, start)) == n, f"rank {rank} window {start}: a window missing or emitted twice"
    assert sum(merged.values()) == sum(sum(c.values()) for c in counts.values())


def default_signals() -> None:
    """``preexec_fn`` for a process a test stops by a signal: SIGINT, SIGQUIT and SIGHUP back to their default
    actions (a test run started in the background by a shell inherits SIGINT and SIGQUIT ignored, and a process
    keeps a signal ignored at its start ignored, as under nohup)."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
