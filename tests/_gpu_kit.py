"""Real ranks and a recorded GPU device for the GPU telemetry tests (tests/collector/test_gpu_telemetry.py).

``python tests/_gpu_kit.py JOB RANK WORLD DIR VALUE [child]``: a rank that registers as ``RANK`` (local rank too),
writes its pid to ``DIR/pid<RANK>`` (with ``child``: first starts a child process and writes the child's pid
to ``DIR/child<RANK>``), then adds ``VALUE`` to the stat ``step_ms`` (500 ms windows) every 10 ms until
``DIR/stop`` exists (ten times ``VALUE`` once ``DIR/slow<RANK>`` exists).

:func:`recording` writes a copy of the stored H200 recording (``collector/gpu_h200_recording.json``, synthetic
but shaped like a real one) with the pids of real processes on each device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

STORED = Path(__file__).resolve().parent / "collector" / "gpu_h200_recording.json"
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


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
