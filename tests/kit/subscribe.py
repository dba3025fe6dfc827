"""Node-wide ``shmstat subscribe`` in a private /dev/shm (a mount namespace): ``python tests/kit/subscribe.py
WORKDIR`` first runs ``shmstat subscribe --timeout 1`` with no collector on the node, then starts ``shmstat
subscribe --json`` with no endpoint and no ``--job``, a node collector, and the ranks of two jobs nobody named;
each rank attaches, waits until the subscriber has had a heartbeat of its job, adds its samples and logs an
event. Once the subscriber said both jobs ended it is stopped; ``WORKDIR/result.json`` holds what it printed.
It starts its collector itself rather than through shmstat.testing.start_collector: it runs as a program inside the
test's private /dev/shm (a mount namespace) and hands the outer test the collector's output on the kit's own stderr,
as inherited."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SAMPLES = 500


def rank(job: str, rank: int, world: int, go: str) -> None:
    """Attach as ``rank`` of ``job`` (so the node collector picks the job up), wait for ``go``, add ``SAMPLES``
    samples of stat ``train/steps`` and log event ``done``."""
    os.environ.update(SHMSTAT_JOB=job, SHMSTAT_RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    sys.path.insert(0, REPO)
    import datetime

    import shmstat
    from shmstat import Aggregation as A

    stat = shmstat.Stat("steps", [A.COUNT], 0.05, group="train")
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(SAMPLES):
        stat.add(1.0)
        if i % 50 == 0:
            time.sleep(0.01)
    shmstat.log_event(shmstat.Event("done", datetime.datetime.now(), {"rank": rank}))
    shmstat.shutdown(flush_timeout_s=20)


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _beaten(path: str, job: str) -> bool:
    lines = [json.loads(line) for line in _read(path).split("\n")[:-1]]
    return any(line.get("kind") == "heartbeat" and line.get("job") == job for line in lines)


def main(workdir: str) -> None:
    runtime = tempfile.mkdtemp(prefix="subs-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime)
    shmstat_cmd = [sys.executable, "-m", "collector"]
    idle = subprocess.run([*shmstat_cmd, "subscribe", "--timeout", "1"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    out, err = os.path.join(workdir, "sub.out"), os.path.join(workdir, "sub.err")
    with open(out, "w") as stdout, open(err, "w") as stderr:  # the child keeps its own copies
        sub = subprocess.Popen([*shmstat_cmd, "subscribe", "--json"], env=env, cwd=REPO, stdout=stdout,
                               stderr=stderr)
    ready = os.path.join(runtime, "ready.json")
    coll = subprocess.Popen([*shmstat_cmd, "collect", "--handler", "*=null", "--grace-ms", "10",
                             "--status-interval", "0", "--ready-file", ready], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL)
    _wait(lambda: os.path.exists(ready), 60)
    # a node collector runs, no job yet: a node-wide subscriber says that, not that no collector serves
    waiting = subprocess.run([*shmstat_cmd, "subscribe", "--timeout", "1"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    jobs = {f"a-{uuid.uuid4().hex[:8]}": 2, f"b-{uuid.uuid4().hex[:8]}": 1}
    ctx = mp.get_context("spawn")
    procs = []
    os.environ["XDG_RUNTIME_DIR"] = runtime
    for job, world in jobs.items():
        go = os.path.join(workdir, f"{job}.go")
        for r in range(world):
            procs.append(ctx.Process(target=rank, args=(job, r, world, go)))
    for p in procs:
        p.start()
    for job in jobs:  # the ranks start adding once the subscriber receives their job's stream (a heartbeat)
        _wait(lambda job=job: _beaten(out, job), 30)
        open(os.path.join(workdir, f"{job}.go"), "w").close()
    for p in procs:
        p.join(120)
    _wait(lambda: all(f"job {job} ended" in _read(err) for job in jobs), 60)
    sub.send_signal(signal.SIGINT)
    code = sub.wait(30)
    coll.send_signal(signal.SIGTERM)
    coll.wait(30)
    shutil.rmtree(runtime, ignore_errors=True)
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump({"jobs": jobs, "exitcodes": [p.exitcode for p in procs], "code": code, "out": _read(out),
                   "err": _read(err), "idle_code": idle.returncode, "idle_err": idle.stderr,
                   "waiting_err": waiting.stderr, "collector_pid": coll.pid}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
