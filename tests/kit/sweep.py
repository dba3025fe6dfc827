"""A node collector and a job whose ranks are SIGKILLed, in a private /dev/shm (a mount namespace), so the node
collector sees only this job: ``python tests/kit/sweep.py WORKDIR MODE``.

``MODE`` ``later``: two ranks add their samples, are SIGKILLed (and reaped), THEN ``shmstat collect`` (no
``--job``) starts. ``MODE`` ``running``: the node collector runs first, picks the job up, then the ranks are
SIGKILLed. Either way the kit waits until the collector says the segment is removed, stops it and writes
``WORKDIR/result.json``: its output lines, the samples each rank added, and what is left in /dev/shm.
It starts its collector itself rather than through shmstat.testing.start_collector: it runs as a program inside the
test's private /dev/shm (a mount namespace) and hands the outer test the collector's output in result.json, stdout
and stderr as one stream, waiting on its lines (no ready file: a node collector as a user starts it)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SAMPLES = {0: 1234, 1: 777}  # per rank: K samples of value rank + 1


def rank_main(job: str, rank: int, ready: str) -> None:
    """Register as ``rank`` of a 2-rank job, add SAMPLES[rank] samples to a 60 s window (still open when the
    rank is killed: only the collector's final pass emits it), say so, then wait to be killed."""
    sys.path.insert(0, REPO)
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=2)
    stat = shmstat.Stat("steps", [A.COUNT, A.SUM], 60.0, group="train")
    for _ in range(SAMPLES[rank]):
        stat.add(rank + 1.0)
    with open(ready, "w") as f:
        f.write("ready")
    while True:
        time.sleep(60)


def _empty_segment(job: str, age_s: float) -> None:
    """A segment in which no rank registered, made ``age_s`` ago (its header's creation time)."""
    import struct

    sys.path.insert(0, REPO)
    from shmstat.shm import layout as L
    from shmstat.shm.segment import Segment

    seg = Segment.open(job)
    struct.pack_into("<q", seg.buf, L.H_CREATED, time.time_ns() - int(age_s * 1e9))
    seg.close()


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def main(workdir: str, mode: str) -> None:
    import tempfile

    runtime = tempfile.mkdtemp(prefix="sweep-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime)
    os.environ["XDG_RUNTIME_DIR"] = runtime
    job = f"killed-{uuid.uuid4().hex[:8]}"
    tag = uuid.uuid4().hex[:8]
    empty_old, empty_new = f"empty-old-{tag}", f"empty-new-{tag}"  # (made in mode "later")
    out = os.path.join(workdir, "m.jsonl")
    lines: list[str] = []
    coll: subprocess.Popen | None = None

    def start_collector() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "collector", "collect", "--handler", f"*=jsonl:{out}",
                                 "--grace-ms", "10", "--status-interval", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        return proc

    try:
        if mode == "running":
            coll = start_collector()
            _wait(lambda: any("serving" in line for line in lines), 60, "the node collector to start")
        if mode == "later":
            _empty_segment(empty_old, age_s=120)  # no rank ever registered, two minutes ago
            _empty_segment(empty_new, age_s=0)  # a rank may be about to register
        ctx = mp.get_context("spawn")
        ranks = []
        for r in SAMPLES:
            p = ctx.Process(target=rank_main, args=(job, r, os.path.join(workdir, f"ready.{r}")))
            p.start()
            ranks.append(p)
        _wait(lambda: all(os.path.exists(os.path.join(workdir, f"ready.{r}")) for r in SAMPLES), 120,
              "the ranks to add their samples")
        if mode == "running":
            _wait(lambda: any(f"job {job} picked up" in line for line in lines), 60, "the job to be picked up")
        left_before = sorted(os.listdir("/dev/shm"))
        for p in ranks:
            os.kill(p.pid, signal.SIGKILL)
        for p in ranks:
            p.join(30)  # reaped: a zombie counts as alive
        if mode == "later":
            coll = start_collector()
            _wait(lambda: any(f"job {empty_old}'s segment removed" in line for line in lines), 60,
                  "the old empty segment's removal")
        _wait(lambda: any(f"job {job}'s segment removed" in line for line in lines), 60, "the segment's removal")
        coll.send_signal(signal.SIGTERM)
        code = coll.wait(30)
    finally:
        if coll is not None and coll.poll() is None:
            coll.kill()
            coll.wait()
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump({"job": job, "empty": [empty_old, empty_new], "lines": lines,
                   "code": coll.returncode if coll else None,
                       "samples": SAMPLES, "left_before": locals().get("left_before", []),
                       "left": sorted(os.listdir("/dev/shm")), "runtime_left": sorted(os.listdir(runtime))}, f)
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
