"""Two real torchrun jobs at once without ``--rdzv-id`` (static rendezvous: ``--master-addr``/``--master-port``, so
both get ``TORCHELASTIC_RUN_ID=none``), two ranks each, the first restarted once (``--max-restarts 1``), with one
node collector, in a private /dev/shm (a mount namespace): ``python tests/kit/torchrun_default_id_node.py WORKDIR``
writes ``WORKDIR/result.json`` (the collector's lines, the ranks' tallies, the torchrun exit codes).
It starts its collector itself rather than through shmstat.testing.start_collector: it runs as a program inside the
test's private /dev/shm (a mount namespace) and hands the outer test the collector's output in result.json beside
torchrun's, stdout and stderr as one stream (no ready file: a node collector as the issue ran it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(workdir: str) -> None:
    runtime = tempfile.mkdtemp(prefix="trid-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime, OUT_DIR=workdir)
    for var in ("SHMSTAT_JOB", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = os.path.join(workdir, "m.jsonl")
    own = os.path.join(workdir, "own.jsonl")  # the collector's counters: what it counted lost
    coll = subprocess.Popen([sys.executable, "-m", "collector", "collect", "--handler", f"*=jsonl:{out}",
                             "--handler", f"shmstat=jsonl:{own}", "--grace-ms", "10", "--status-interval", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,  # its notes are on stderr
                            text=True, env=env, cwd=REPO)
    lines: list[str] = []

    def read() -> None:
        assert coll.stdout is not None
        for line in coll.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # the node's collector runs before the jobs start, as the node's agent does: a rank that finished while none ran
    # yet left nothing for one (the job's last process removes a segment nobody serves), and lost its samples
    deadline = time.monotonic() + 60
    while not any("serving every job" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.02)
    script = os.path.join(HERE, "programs", "torchrun_default_id.py")
    jobs = {}
    for tag, fail in (("first", "1"), ("second", "0")):
        port = _free_port()
        log = open(os.path.join(workdir, f"{tag}.log"), "w")  # noqa: SIM115 (the child's)
        jobs[tag] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--max-restarts", "1", "--monitor-interval", "0.1", script],
            env=dict(env, TAG=tag, FAIL_FIRST=fail), cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    codes = {tag: proc.wait(240) for tag, proc in jobs.items()}
    deadline = time.monotonic() + 30  # the node collector lets the jobs go and removes their segments
    while time.monotonic() < deadline and any(n.startswith("shmstat.") for n in os.listdir("/dev/shm")):
        time.sleep(0.05)
    coll.send_signal(signal.SIGTERM)
    code = coll.wait(30)
    reader.join(5)
    tallies = []
    for name in sorted(os.listdir(workdir)):
        if name.endswith(".json") and ".r" in name:
            with open(os.path.join(workdir, name)) as f:
                tallies.append(dict(json.load(f), tag=name.split(".")[0]))
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump({"codes": codes, "code": code, "lines": lines, "tallies": tallies,
                   "left": sorted(os.listdir("/dev/shm"))}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
