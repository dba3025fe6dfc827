"""A node collector run in a private /dev/shm (a mount namespace), so that it sees only this test's jobs:
``python tests/kit/node.py WORKDIR [torchrun]`` starts ``shmstat collect`` with no ``--job``, then the ranks
of two jobs nobody named (one configured like torchrun, with a random run id) or, with ``torchrun``, a real
``torchrun --standalone --nproc-per-node 2`` job; waits until the collector has let the jobs go, stops it and
writes ``WORKDIR/result.json`` (its output lines and the ranks' tallies)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run as a script (its directory first on the path): the kit importable

from kit.procs import start_collector  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
WINDOW_MS = 50


def torchrun_like_rank(run_id: str, rank: int, world: int, n: int, out: str) -> None:
    """A rank configured only as torchrun configures it; adds ``n`` samples of ``rank + 1`` (a failure's
    traceback goes to ``<out>.error``)."""
    try:
        _rank(run_id, rank, world, n, out)
    except BaseException:
        import traceback

        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


def _rank(run_id: str, rank: int, world: int, n: int, out: str) -> None:
    os.environ.update(TORCHELASTIC_RUN_ID=run_id, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, REPO)
    import shmstat
    from shmstat import Aggregation as A

    stat = shmstat.Stat("steps", [A.COUNT, A.SUM], WINDOW_MS / 1000, group="train")
    for i in range(n):
        stat.add(rank + 1.0)
        if i % 100 == 0:
            time.sleep(0.001)
    from shmstat.job import _state

    shmstat.log_event(shmstat.Event("done", __import__("datetime").datetime.now(), {"rank": rank}))
    pub = _state.STATE.publisher
    shmstat.shutdown(flush_timeout_s=20)
    stats = pub.stats()
    with open(out, "w") as f:
        json.dump({"count": n, "sum": n * (rank + 1.0), "events_sent": stats.sent_items,
                   "events_dropped": stats.dropped}, f)


def _start_torchrun(workdir: str, env: dict[str, str]) -> tuple[dict[str, int], list]:
    """A real ``torchrun --standalone`` job (its run id is torchrun's own random one), started as a user would."""
    script = os.path.join(HERE, "programs", "torchrun_train.py")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             script], env=dict(env, OUT_DIR=workdir), cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=180)
    with open(os.path.join(workdir, "torchrun.log"), "w") as f:
        f.write(output)
    tallies = [n for n in os.listdir(workdir) if n.endswith(".r0.json")]
    run_id = tallies[0][: -len(".r0.json")] if tallies else "none"
    return {run_id: 2}, [proc.returncode]


def main(workdir: str, mode: str = "") -> None:
    import tempfile

    runtime = tempfile.mkdtemp(prefix="node-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime)
    os.environ["XDG_RUNTIME_DIR"] = runtime
    out = os.path.join(workdir, "m.jsonl")
    coll = start_collector(None, "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0",
                           env=env)
    lines = coll.lines  # its notes (on stderr), as it writes them
    if mode == "torchrun":
        jobs, exitcodes = _start_torchrun(workdir, env)
    else:
        jobs = {f"torchrun-{uuid.uuid4().hex[:8]}": 2, f"other-{uuid.uuid4().hex[:8]}": 1}
        ctx = mp.get_context("spawn")
        procs = []
        for job, world in jobs.items():
            for r in range(world):
                procs.append(ctx.Process(target=torchrun_like_rank,
                                         args=(job, r, world, 3000, os.path.join(workdir, f"{job}.r{r}.json"))))
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        exitcodes = [p.exitcode for p in procs]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(1 for line in lines if "segment removed" in line) < len(jobs):
        time.sleep(0.05)
    code = coll.stop(signal.SIGTERM, 30)
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump({"jobs": jobs, "lines": lines, "code": code, "exitcodes": exitcodes,
                   "left": sorted(os.listdir("/dev/shm"))}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
