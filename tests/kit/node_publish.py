"""A node collector publishing every job on one TCP endpoint, in a private /dev/shm (a mount namespace):
``python tests/kit/node_publish.py WORKDIR`` starts ``shmstat collect --publish tcp://127.0.0.1:0 --ready-file``
with no ``--job``, reads the bound port from the ready file, starts ``shmstat subscribe ENDPOINT --json`` twice
(every topic; ``--topic event/``) and ``shmstat subscribe --job A --json`` on job A's own endpoint, then the ranks
of two jobs nobody named (torchrun-like run ids). Each rank waits until every subscriber has had a heartbeat of its
job, logs ``EVENTS`` events and adds ``SAMPLES`` samples. Once both node subscribers said both jobs ended they
are stopped; ``WORKDIR/result.json`` holds what everyone printed.
It starts its collector itself rather than through shmstat.testing.start_collector: it runs as a program inside the
test's private /dev/shm (a mount namespace) and hands the outer test the collector's output in result.json (its
stderr kept in a file there)."""

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
sys.path.insert(0, os.path.dirname(HERE))  # run as a script (its directory first on the path): the kit importable

from kit.subscribe import _beaten, _read, _wait  # noqa: E402  (the same waits and reads as the per-job subscribe kit)

REPO = os.path.dirname(os.path.dirname(HERE))
EVENTS = 200
SAMPLES = 500


def rank(run_id: str, rank: int, world: int, go: str) -> None:
    """A rank configured only as torchrun configures it: waits for ``go``, logs ``EVENTS`` events ``tick``
    (``{"rank", "i"}``), adds ``SAMPLES`` samples of stat ``train/steps``."""
    os.environ.update(TORCHELASTIC_RUN_ID=run_id, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, REPO)
    import datetime

    import shmstat
    from shmstat import Aggregation as A

    stat = shmstat.Stat("steps", [A.COUNT], 0.05, group="train")
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(EVENTS):
        shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {"rank": rank, "i": i}))
    for i in range(SAMPLES):
        stat.add(1.0)
        if i % 50 == 0:
            time.sleep(0.01)
    shmstat.shutdown(flush_timeout_s=20)


def main(workdir: str) -> None:
    runtime = tempfile.mkdtemp(prefix="npub-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime)
    os.environ["XDG_RUNTIME_DIR"] = runtime
    shmstat_cmd = [sys.executable, "-m", "collector"]
    ready = os.path.join(workdir, "ready.json")
    coll = subprocess.Popen([*shmstat_cmd, "collect", "--publish", "tcp://127.0.0.1:0", "--ready-file", ready,
                             "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0",
                             "--heartbeat-interval", "0.2"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(workdir, "coll.err"), "w"))  # noqa: SIM115 (the child's)
    _wait(lambda: os.path.exists(ready), 30)
    with open(ready, encoding="utf-8") as f:
        info = json.load(f)
    jobs = {f"a-{uuid.uuid4().hex[:8]}": 2, f"b-{uuid.uuid4().hex[:8]}": 1}
    job_a = next(iter(jobs))
    subs: dict[str, subprocess.Popen] = {}
    for name, args in (("all", [info["publish"]]), ("events", [info["publish"], "--topic", "event/"]),
                       ("job_a", ["--job", job_a])):
        with open(os.path.join(workdir, f"{name}.out"), "w") as out, \
                open(os.path.join(workdir, f"{name}.err"), "w") as err:  # the child keeps its own copies
            subs[name] = subprocess.Popen([*shmstat_cmd, "subscribe", "--json", *args], env=env, cwd=REPO,
                                          stdout=out, stderr=err)
    ctx = mp.get_context("spawn")
    procs = []
    for job, world in jobs.items():
        go = os.path.join(workdir, f"{job}.go")
        for r in range(world):
            procs.append(ctx.Process(target=rank, args=(job, r, world, go)))
    for p in procs:
        p.start()
    for job in jobs:  # the ranks start once every subscriber of their job receives its stream (a heartbeat)
        names = ("all", "events", "job_a") if job == job_a else ("all", "events")
        _wait(lambda job=job, names=names: all(_beaten(os.path.join(workdir, f"{n}.out"), job) for n in names), 30)
        open(os.path.join(workdir, f"{job}.go"), "w").close()
    for p in procs:
        p.join(120)
    _wait(lambda: all(f"job {job} ended" in _read(os.path.join(workdir, f"{n}.err"))
                      for job in jobs for n in ("all", "events")), 60)
    running = {name: proc.poll() is None for name, proc in subs.items()}  # job_a: exits once A ended
    codes = {}
    for name, proc in subs.items():
        if proc.poll() is None and name != "job_a":
            proc.send_signal(signal.SIGINT)
        try:
            codes[name] = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = None
    coll.send_signal(signal.SIGTERM)
    coll_code = coll.wait(30)
    shutil.rmtree(runtime, ignore_errors=True)
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump({"jobs": jobs, "ready": info, "exitcodes": [p.exitcode for p in procs], "running": running,
                   "codes": codes, "coll_code": coll_code, "coll_err": _read(os.path.join(workdir, "coll.err")),
                   "out": {n: _read(os.path.join(workdir, f"{n}.out")) for n in subs},
                   "err": {n: _read(os.path.join(workdir, f"{n}.err")) for n in subs}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
