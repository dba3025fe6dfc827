"""A torchelastic-style training script using only ``elastic.metrics`` and ``shmstat`` (run by tests)."""

import os
import sys
import time

import shmstat
from elastic import metrics
from shmstat import Aggregation

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
steps = int(os.environ.get("STEPS", "100"))

if rank == fail_rank and attempt == 0:
    sys.exit(3)  # fails once, before doing any work

step_ms = shmstat.Stat("step_ms", [Aggregation.COUNT, Aggregation.SUM], 0.05, group="train")


@metrics.prof(group="trainer")
def train_step() -> None:
    step_ms.add(1.0)
    time.sleep(0.001)


for _ in range(steps):
    train_step()
metrics.put_metric("loss", 0.25 * (rank + 1), "trainer")
with open(os.path.join(os.environ["OUT_DIR"], f"done-{rank}-{attempt}"), "w") as f:
    f.write(str(steps))
shmstat.shutdown()
