"""One node of a job spread over several, for the job-wide view (collector.watch, ``shmstat top --nodes``):
``python tests/kit/watch_node.py WORKDIR NODE JOB KEYDIR RANKS WORLD FIRST SLOW STUCK`` run in a private /dev/shm
(a mount namespace of its own, so several such nodes on one machine each have their own segment of the same job),
with its own runtime directory. It starts a node collector (``shmstat collect --publish tcp://127.0.0.1:0 --curve
KEYDIR --hang-after 1``), writes its endpoint to ``WORKDIR/NODE.ready`` and starts ``RANKS`` ranks, global ranks
``FIRST`` .. ``FIRST + RANKS - 1`` of ``WORLD``, configured as torchrun configures them.

Each rank steps (the section ``compute``: :data:`COMPUTE_S`, then the wait section ``allreduce``) and adds its
step's time to the stat ``train/step_ms``: :data:`STEP_MS` times its factor, a known figure whatever the load does
to sleeps. ``SLOW``: ``F`` (every rank of the node F times slower: a slow node) or ``R:F`` (global rank R only);
``-`` none. The ranks start together (each waits for every rank of the job, as after a rendezvous) and step until
``WORKDIR/hang`` exists; then global rank ``STUCK`` (``-``: none here) stays in ``compute`` and every other rank
waits in ``allreduce``, until ``WORKDIR/stop`` exists. Then the ranks end and the collector is
stopped; its stderr is kept in ``WORKDIR/NODE.err``. Meanwhile ``WORKDIR/NODE.kill`` SIGKILLs the node's collector
(a host's collector gone: no rows, no heartbeat; ``WORKDIR/NODE.killed`` says it is dead), and
``WORKDIR/NODE.restart`` then starts a successor on the same endpoint (``WORKDIR/NODE.restarted`` once it serves),
which takes the job's ranks over."""

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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
COMPUTE_S = 0.02
STEP_MS = 20.0
WAIT_S = 0.004
SECTION_WINDOW_S = "0.25"


def _wait_file(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def rank(job: str, rank: int, local: int, ranks: int, world: int, factor: float, stuck: bool, work: str) -> None:
    """One rank (see the module docstring)."""
    os.environ.update(TORCHELASTIC_RUN_ID=job, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", SHMSTAT_SECTION_WINDOW_S=SECTION_WINDOW_S)
    sys.path.insert(0, REPO)
    import shmstat
    from shmstat import Aggregation as A

    step = shmstat.Stat("step_ms", [A.COUNT, A.MEAN, A.P50], float(SECTION_WINDOW_S), group="train")
    hang, stop = os.path.join(work, "hang"), os.path.join(work, "stop")
    open(os.path.join(work, f"rank.{rank}"), "w").close()  # every rank of every node starts together, as after
    for r in range(world):  # a rendezvous
        _wait_file(os.path.join(work, f"rank.{r}"))
    while not os.path.exists(hang):
        with shmstat.section("compute"):
            time.sleep(COMPUTE_S)
        step.add(STEP_MS * factor)
        with shmstat.section("allreduce", wait=True):
            time.sleep(WAIT_S)
    if stuck:
        with shmstat.section("compute"):
            _wait_file(stop)
    else:
        with shmstat.section("allreduce", wait=True):
            _wait_file(stop)
    shmstat.shutdown(flush_timeout_s=20)


def main(work: str, node: str, job: str, keys: str, ranks: str, world: str, first: str, slow: str,
         stuck: str) -> None:
    runtime = tempfile.mkdtemp(prefix=f"watch-{node}-", dir="/tmp")  # Unix socket paths must stay short
    os.environ["XDG_RUNTIME_DIR"] = runtime
    env = dict(os.environ, PYTHONPATH=REPO)
    ready = os.path.join(work, f"{node}.ready.tmp")

    def collect(publish: str) -> subprocess.Popen[bytes]:
        with open(os.path.join(work, f"{node}.err"), "a") as err:  # the child keeps its own copy
            return subprocess.Popen([sys.executable, "-m", "collector", "collect", "--publish", publish,
                                     "--curve", keys, "--ready-file", ready, "--hang-after", "1", "--handler",
                                     "*=null", "--grace-ms", "10", "--status-interval", "0", "--heartbeat-interval",
                                     "0.2"], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)

    colls = [collect("tcp://127.0.0.1:0")]
    _wait_file(ready, 60)
    with open(ready) as f:
        publish = json.load(f)["publish"]
    os.rename(ready, os.path.join(work, f"{node}.ready"))
    done = threading.Event()

    def kill_and_restart() -> None:
        kill, restart = os.path.join(work, f"{node}.kill"), os.path.join(work, f"{node}.restart")
        while not done.is_set() and not os.path.exists(kill):
            time.sleep(0.02)
        if done.is_set():
            return
        colls[-1].kill()
        colls[-1].wait()
        open(os.path.join(work, f"{node}.killed"), "w").close()
        while not done.is_set() and not os.path.exists(restart):
            time.sleep(0.02)
        if done.is_set():
            return
        colls.append(collect(publish))
        _wait_file(ready, 60)
        os.rename(ready, os.path.join(work, f"{node}.restarted"))

    chaos = threading.Thread(target=kill_and_restart, daemon=True)
    chaos.start()
    n, size, start = int(ranks), int(world), int(first)
    factors = {r: 1.0 for r in range(start, start + n)}
    if slow != "-":
        who, _, f = slow.rpartition(":")
        for r in ([int(who)] if who else list(factors)):
            factors[r] = float(f)
    _wait_file(os.path.join(work, "go"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank, args=(job, r, r - start, n, size, factors[r], stuck == str(r), work))
             for r in range(start, start + n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    done.set()
    chaos.join()
    coll = colls[-1]
    coll.send_signal(signal.SIGTERM)
    coll.wait(30)
    shutil.rmtree(runtime, ignore_errors=True)
    with open(os.path.join(work, f"{node}.done"), "w") as f:
        json.dump({"exitcodes": [p.exitcode for p in procs], "collector": coll.returncode}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
