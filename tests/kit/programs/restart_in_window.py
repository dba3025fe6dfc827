"""A rank of ``shmstat run --max-restarts 1`` whose restart falls inside one window (run by tests).

First attempt: every rank adds ``K1`` samples of ``rank + 1``; then rank 0 fails (exit 1) once every rank has
added, rank 1 is stopped by the agent's SIGTERM and exits cleanly (its handler exits through shmstat's atexit), and
rank 2 is killed by that SIGTERM (the default action). Second attempt: every rank adds ``K2`` and succeeds. The
window (``WINDOW_MS``) is chosen by the test so that both attempts fall inside it.
"""

import os
import signal
import sys
import time

import shmstat
from shmstat import Aggregation

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out_dir = os.environ["OUT_DIR"]
if rank == 1:
    signal.signal(signal.SIGTERM, lambda _s, _f: sys.exit(0))

samples = shmstat.Stat("samples", [Aggregation.COUNT, Aggregation.SUM], int(os.environ["WINDOW_MS"]) / 1000,
                       group="restart")
for _ in range(int(os.environ["K1" if attempt == 0 else "K2"])):
    samples.add(float(rank + 1))
open(os.path.join(out_dir, f"added-{rank}-{attempt}"), "w").close()
if attempt == 0:
    if rank == 0:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(out_dir, f"added-{r}-0")) for r in range(world)):
            if time.monotonic() > deadline:
                sys.exit(2)
            time.sleep(0.01)
        sys.exit(1)
    time.sleep(120)  # until the agent stops this rank
shmstat.shutdown()
