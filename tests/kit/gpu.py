"""Real ranks and a recorded GPU device for the GPU telemetry tests (tests/collector/gpu/test_gpu_telemetry.py).

``python tests/kit/gpu.py node WORKDIR``: in a private /dev/shm (the test's mount namespace), a node collector
(``shmstat collect``, no ``--job``) sampling the recording with one real rank on GPU 0: the kit waits for the
rank's GPU rows, stops the rank, waits until the collector says the job is done and its segment removed, stops the
collector and writes ``WORKDIR/result.json`` (its output, the rows, what is left in /dev/shm).

``python tests/kit/gpu.py JOB RANK WORLD DIR VALUE [child]``: a rank that registers as ``RANK`` (local rank too),
writes its pid to ``DIR/pid<RANK>`` (with ``child``: first starts a child process and writes the child's pid
to ``DIR/child<RANK>``), then adds ``VALUE`` to the stat ``step_ms`` (500 ms windows) every 10 ms until
``DIR/stop`` exists (ten times ``VALUE`` once ``DIR/slow<RANK>`` exists).

:func:`recording` writes a copy of the stored H200 recording (``tests/kit/gpu_h200_recording.json``, synthetic
but shaped like a real one) with the pids of real processes on each device.
It starts its collector itself rather than through shmstat.testing.start_collector: it runs as a program inside the
test's private /dev/shm (a mount namespace) and hands the outer test the collector's output in result.json, stdout
and stderr as one stream, waiting on its lines (no ready file: a node collector as a user starts it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

STORED = Path(__file__).resolve().parent / "gpu_h200_recording.json"
MIB = 1 << 20


def recording(path: Path, pids_on: dict[int, list[int]]) -> dict:
    """Write the stored recording to ``path`` with ``pids_on[device]`` as the processes on each device (810 MiB
    each, 24 % SM each); returns the document."""
    doc = json.loads(STORED.read_text())
    for index, device in enumerate(doc["devices"]):
        pids = pids_on.get(index, [])
        for frame in device["frames"]:
            frame["processes"] = [[pid, 810 * MIB] for pid in pids]
            frame["process_utilization"] = [[pid, 24] for pid in pids]
    path.write_text(json.dumps(doc))
    return doc


def main(argv: list[str]) -> int:
    """A rank (see the module docstring)."""
    job, rank, world, out, value = argv[0], int(argv[1]), int(argv[2]), Path(argv[3]), float(argv[4])
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    child = None
    if "child" in argv[5:]:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (out / f"child{rank}.tmp").write_text(str(child.pid))
        os.replace(out / f"child{rank}.tmp", out / f"child{rank}")
    (out / f"pid{rank}.tmp").write_text(str(os.getpid()))
    os.replace(out / f"pid{rank}.tmp", out / f"pid{rank}")
    stat = shmstat.Stat("step_ms", [A.MEAN, A.COUNT], 0.5, group="train")
    try:
        slow = out / f"slow{rank}"
        while not (out / "stop").exists():
            stat.add(value * 10 if slow.exists() else value)
            time.sleep(0.01)
    finally:
        if child is not None:
            child.kill()
            child.wait()
        shmstat.shutdown()
    return 0


def node(work: Path) -> int:
    """The node collector's run (see the module docstring)."""
    import tempfile
    import uuid

    repo = str(Path(__file__).resolve().parents[2])
    runtime = tempfile.mkdtemp(prefix="gpu-", dir="/tmp")  # Unix socket paths must stay short
    env = dict(os.environ, PYTHONPATH=repo, XDG_RUNTIME_DIR=runtime)
    job = f"gpu-{uuid.uuid4().hex[:8]}"
    out = work / "ranks"
    out.mkdir()
    rank = subprocess.Popen([sys.executable, __file__, job, "0", "1", str(out), "1.0"], env=env, cwd=repo)
    deadline = time.monotonic() + 60
    while not (out / "pid0").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    recording(work / "h200.json", {0: [int((out / "pid0").read_text())]})
    rows = work / "gpu.jsonl"
    coll = subprocess.Popen([sys.executable, "-m", "collector", "collect", "--gpu", "on", "--gpu-interval", "0.5",
                             "--handler", f"gpu=jsonl:{rows}", "--handler", "*=null", "--grace-ms", "10",
                             "--status-interval", "0"], env=dict(env, SHMSTAT_GPU_RECORDING=str(work / "h200.json")),
                            cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # notes on stderr
    lines: list[str] = []

    def read() -> None:
        assert coll.stdout is not None
        for line in coll.stdout:
            lines.append(line.strip())

    import threading

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait(predicate, what: str) -> bool:
        end = time.monotonic() + 60
        while not predicate():
            if time.monotonic() > end:
                lines.append(f"TIMED OUT waiting for {what}")
                return False
            time.sleep(0.05)
        return True

    def gpu_rows() -> bool:
        return rows.exists() and '"gpu0.util.mean"' in rows.read_text()

    wait(gpu_rows, "GPU rows")
    (out / "stop").touch()
    rank.wait(60)
    wait(lambda: any("segment removed" in line for line in lines), "the segment removed")
    coll.terminate()
    coll.wait(60)
    reader.join(10)
    text = rows.read_text() if rows.exists() else ""
    result = {"job": job, "lines": lines, "rows": [json.loads(x) for x in text.splitlines() if x.strip()],
              "left": sorted(os.listdir("/dev/shm")), "status": coll.returncode}
    (work / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if sys.argv[1] == "node":
        sys.exit(node(Path(sys.argv[2])))
    sys.exit(main(sys.argv[1:]))
