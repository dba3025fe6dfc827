"""Real processes for integration tests: a collector subprocess and rank workers (spawn-safe functions)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from kit.support import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class CollectorProc:
    """A ``python -m collector`` subprocess and the endpoints it printed."""

    proc: subprocess.Popen
    publish: str
    ingest: str
    lines: list[str] = field(default_factory=list)
    """What the collector printed up to its endpoints line (e.g. its Prometheus endpoint)."""

    def lines_seen(self, text: str) -> str:
        """The first start-up line containing ``text``."""
        return next(line for line in self.lines if text in line)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()


def spawn(target, *args) -> mp.process.BaseProcess:
    """Start ``target(*args)`` in a fresh interpreter (spawn: nothing inherited from the test process)."""
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    return p


def start_collector(job: str, *args: str) -> CollectorProc:
    """Start a collector for ``job`` and wait for its start-up line."""
    # tests/ too: user handler classes given as pkg.module:Class live there
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "collector", "collect", "--job", job, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    while True:  # its notes are on stderr: the Prometheus endpoint, warnings, then where it serves
        line = proc.stderr.readline()
        lines.append(line.strip())
        if not line:
            proc.kill()
            raise AssertionError(f"collector did not start: {lines!r}")
        if line.startswith("shmstat collector:") and " publish " in line:
            break
    threading.Thread(target=_forward, args=(proc.stderr,), daemon=True).start()
    fields = line.split()
    return CollectorProc(proc, fields[fields.index("publish") + 1], fields[fields.index("ingest") + 1], lines)


def _forward(stream) -> None:
    """Pass what a collector writes to stderr after its start on to the test's stderr, as if inherited."""
    for line in stream:
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
