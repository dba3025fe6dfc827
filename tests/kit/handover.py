"""A node collector taking a running job over from the collector that served it, run in a private /dev/shm (a mount
namespace, so that the node collector sees only this test's job): ``python tests/kit/handover.py WORKDIR MODE``.

MODE ``per-job``: the first collector is ``shmstat collect --job JOB`` in the ranks' runtime directory (the documented
hand-over); ``other-dir``: a node collector using another runtime directory. Two ranks add until told to stop; a node
collector started meanwhile leaves the job alone; the first collector is stopped (SIGTERM) while the ranks run, and
the ranks go on for a few windows under the node collector. Writes ``WORKDIR/result.json``: both collectors' notes
and exit statuses, the ranks' exit codes, how long the hand-over took; the ranks' tallies are
``WORKDIR/r<rank>.json`` (count per window start, from the clock their adds used), the collectors' rows
``first.jsonl`` and ``node.jsonl``, and their own figures (group ``shmstat``) ``first.own.jsonl`` and
``node.own.jsonl``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run as a script (its directory first on the path): the kit importable

from kit.procs import read_jsonl, start_collector  # noqa: E402
from kit.support import wait_for  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
WINDOW_MS = 1000
"""The 4-bank ring keeps a closed window K - 2 = 2 windows: room for the first collector's stop (over a second on a
loaded 2-core machine, seen) and the pick-up; a successor coming back only after the 5 s it waited before lost
some."""
RANKS = 2
WINDOWS_AFTER = 4
"""Windows the node collector emits while the ranks still run, after it took the job over."""


def rank(job: str, rank: int, stop_path: str, out: str) -> None:
    """Add 1.0 to ``steps`` until ``stop_path`` exists; write the count per window start (from the clock the adds
    used) to ``out`` (a failure's traceback to ``<out>.error``)."""
    try:
        _rank(job, rank, stop_path, out)
    except BaseException:
        import traceback

        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


def _rank(job: str, rank: int, stop_path: str, out: str) -> None:
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=RANKS)
    last = [0]

    def clock() -> int:
        last[0] = time.time_ns()
        return last[0]

    stat = shmstat.Stat("steps", [A.COUNT, A.SUM], WINDOW_MS / 1000, group="train", clock=clock)
    wns = WINDOW_MS * 1_000_000
    per_window: dict[str, int] = defaultdict(int)
    n = 0
    while not os.path.exists(stop_path):
        stat.add(1.0)
        per_window[repr(last[0] // wns * wns / 1e9)] += 1
        n += 1
        if n % 16 == 0:
            time.sleep(0.001)
    shmstat.shutdown()
    with open(out + ".tmp", "w") as f:
        json.dump(per_window, f)
    os.replace(out + ".tmp", out)


def _rows_of(path: str, job: str) -> int:
    return sum(1 for r in read_jsonl(path) if r["name"] == "steps.count" and r.get("job", job) == job)


def main(workdir: str, mode: str) -> None:
    runtime = tempfile.mkdtemp(prefix="ho-", dir="/tmp")  # Unix socket paths must stay short
    other = tempfile.mkdtemp(prefix="ho-other-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime)
    os.environ["XDG_RUNTIME_DIR"] = runtime  # the ranks' (spawned from here)
    job = f"handover-{uuid.uuid4().hex[:10]}"
    first_out, node_out = os.path.join(workdir, "first.jsonl"), os.path.join(workdir, "node.jsonl")
    stop = os.path.join(workdir, "stop")
    common = ("--grace-ms", "10", "--status-interval", "0")

    def outputs(path: str) -> tuple[str, ...]:
        return ("--handler", f"*=jsonl:{path}", "--handler", f"shmstat=jsonl:{path[:-len('.jsonl')]}.own.jsonl")

    if mode == "per-job":
        first = start_collector(job, *outputs(first_out), *common, env=env)
    else:
        first = start_collector(None, *outputs(first_out), *common, env=dict(env, XDG_RUNTIME_DIR=other))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank, args=(job, r, stop, os.path.join(workdir, f"r{r}.json"))) for r in range(RANKS)]
    for p in procs:
        p.start()
    node, first_code = None, None
    timings: dict[str, float] = {}  # seconds from the first collector's SIGTERM: to its exit, to the pick-up
    try:
        wait_for(lambda: _rows_of(first_out, job) >= RANKS, 60, 0.02, what="the first collector's windows")
        node = start_collector(None, *outputs(node_out), *common, env=env)
        node.lines_seen(f"leaving job {job} alone", 30)
        stopping = time.monotonic()
        first_code = first.stop(signal.SIGTERM, 30)  # the ranks run on: the node collector takes the job over
        timings["first_stop_s"] = time.monotonic() - stopping
        node.lines_seen(f"job {job} picked up", 30)
        timings["picked_up_s"] = time.monotonic() - stopping
        wait_for(lambda: _rows_of(node_out, job) >= RANKS * WINDOWS_AFTER, 60, 0.02,
                 what="the node collector's windows")
    finally:
        open(stop, "w").close()
        for p in procs:
            p.join(60)
    node_code = None
    if node is not None:
        node.lines_seen(f"job {job} done", 30)
        node_code = node.stop(signal.SIGTERM, 30)
    first.stop(signal.SIGKILL)  # (stopped above unless the test failed before)
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump({"job": job, "first_code": first_code, "node_code": node_code,
                   "exitcodes": [p.exitcode for p in procs], "timings": timings, "first_lines": first.lines,
                   "node_lines": node.lines if node is not None else []}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
