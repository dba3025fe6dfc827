"""A real torchrun job (two ranks, static rendezvous) whose ranks make Stats of 10 ms and 1 ms windows
(``tests/kit/programs/short_windows.py``), served by one node collector, in a private /dev/shm (a mount namespace):
``python tests/kit/torchrun_short_windows_node.py WORKDIR`` writes ``WORKDIR/result.json`` (torchrun's and the
collector's exit codes, the collector's lines) beside the ranks' tallies, the jsonl file and torchrun's log.
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
    runtime = tempfile.mkdtemp(prefix="trsw-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=REPO, XDG_RUNTIME_DIR=runtime, OUT_DIR=workdir)
    for var in ("SHMSTAT_JOB", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = os.path.join(workdir, "m.jsonl")
    coll = subprocess.Popen([sys.executable, "-m", "collector", "collect", "--handler", f"*=jsonl:{out}",
                             "--status-interval", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)  # the default grace: the node collector as the issue ran it
    lines: list[str] = []

    def read() -> None:
        assert coll.stdout is not None
        for line in coll.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    script = os.path.join(HERE, "programs", "short_windows.py")
    with open(os.path.join(workdir, "torchrun.log"), "w") as log:
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(_free_port()), "--monitor-interval", "0.1", script],
            env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
        code = job.wait(240)
    deadline = time.monotonic() + 30  # the node collector emits the job's last windows and removes its segment
    while time.monotonic() < deadline and any(n.startswith("shmstat.") for n in os.listdir("/dev/shm")):
        time.sleep(0.05)
    coll.send_signal(signal.SIGTERM)
    coll_code = coll.wait(30)
    reader.join(5)
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump({"code": code, "collector": coll_code, "lines": lines}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
