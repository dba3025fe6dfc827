"""Real processes for integration tests: a collector subprocess started on its ready file, and rank workers
(spawn-safe functions)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from kit.support import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class CollectorProc:
    """A ``python -m collector collect`` subprocess, and where it serves as its ready file said."""

    proc: subprocess.Popen
    publish: str
    ingest: str | None
    """The ipc endpoint ranks publish to (None for a collector of several jobs, which has one per job)."""
    prometheus: str | None
    """The ``/metrics`` URL (None without ``--prometheus``)."""
    ready_file: str
    lines: list[str] = field(default_factory=list)
    """Every line the collector wrote to stderr so far (read by a thread, which passes them on to the test's
    stderr as if inherited): its notes (the Prometheus endpoint, warnings), its status lines."""
    _reader: threading.Thread | None = None
    _private_dir: str | None = None

    def lines_seen(self, text: str, timeout_s: float = 10.0) -> str:
        """The first line on stderr containing ``text``, waited for (the reader may be behind the ready file)."""
        def seen() -> str | None:
            return next((line for line in list(self.lines) if text in line), None)

        line = wait_for(seen, timeout_s, what=f"a collector line containing {text!r}")
        assert line is not None
        return line

    @property
    def notes(self) -> list[str]:
        """:attr:`lines` less the line saying where it serves (what a user reads beyond the endpoints)."""
        return [line for line in list(self.lines)
                if not (line.startswith("shmstat collector:") and " publish " in line)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` (if it still runs) and wait for its exit status; then :attr:`lines` holds all it said."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._done()

    def finish(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> tuple[int, str]:
        """Send ``sig`` (if it still runs), read its stdout to the end; its exit status and that output."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        assert self.proc.stdout is not None
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
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)


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
    private_dir = None
    if "--ready-file" in args:
        ready = args[args.index("--ready-file") + 1]
    else:
        private_dir = tempfile.mkdtemp(prefix="shmstat-ready-")
        ready = os.path.join(private_dir, "collector.json")
        args = (*args, "--ready-file", ready)
    jobs = ("--job", job) if job is not None else ()
    proc = subprocess.Popen([python or sys.executable, "-m", "collector", "collect", *jobs, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=collector_env(env), cwd=REPO,
                            preexec_fn=default_signals)
    lines: list[str] = []
    reader = threading.Thread(target=_collect_and_forward, args=(proc.stderr, lines), daemon=True)
    reader.start()

    def ready_or_ended() -> bool:
        return os.path.exists(ready) or proc.poll() is not None

    try:
        wait_for(ready_or_ended, timeout_s, what=f"the collector's ready file {ready}")
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    if not os.path.exists(ready):
        reader.join(5)  # what it said before it ended
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
        raise AssertionError(f"collector did not start (exit status {proc.returncode}): {lines!r}")
    with open(ready, encoding="utf-8") as f:
        info = json.load(f)
    return CollectorProc(proc, info["publish"], info.get("ingest"), info.get("prometheus"), ready, lines,
                         reader, private_dir)


def _collect_and_forward(stream, lines: list[str]) -> None:
    """Keep every line a collector writes to stderr, and pass it on to the test's stderr, as if inherited."""
    for line in stream:
        lines.append(line.rstrip("\n"))
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
