"""Rank bodies for tests/test_testing_plugin.py (spawned: they must live in an importable module)."""

from __future__ import annotations

import datetime
import os
import sys
import time

import shmstat
from elastic.metrics import put_metric


def counting_rank(rank: int, samples: int) -> None:
    """Add ``samples`` samples of ``rank + 1`` to ``step_ms``, put one metric, log one event."""
    step = shmstat.Stat("step_ms", [shmstat.Aggregation.COUNT, shmstat.Aggregation.SUM], 0.05, group="train")
    for _ in range(samples):
        step.add(float(rank + 1))
    put_metric("loss", rank * 10, "train")
    shmstat.log_event(shmstat.Event("ckpt.saved", datetime.datetime.now(), {"rank": rank}))


def failing_rank(rank: int) -> None:
    """Rank 1 fails with a message; the others succeed."""
    print(f"rank {rank} starting", flush=True)
    if rank == 1:
        raise RuntimeError("rank 1 lost its data loader")


def forever_rank(rank: int, ready_dir: str) -> None:
    """Attach, say so in ``ready_dir``, then add samples until killed."""
    step = shmstat.Stat("spin", [shmstat.Aggregation.COUNT], 0.05)
    step.add(1.0)
    with open(os.path.join(ready_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        step.add(1.0)
        time.sleep(0.001)




def mp_rank(rank: int, samples: int) -> None:
    """A multiprocessing child: the job comes from the environment it inherited, the rank from its argument."""
    shmstat.init(rank=rank, world_size=2)
    step = shmstat.Stat("mp_step", [shmstat.Aggregation.COUNT], 0.05)
    for _ in range(samples):
        step.add(1.0)
    shmstat.shutdown()


def torchrun_main() -> None:
    """A torchrun worker: nothing shmstat-specific but the Stat; job from SHMSTAT_JOB, rank from torchrun's RANK."""
    step = shmstat.Stat("tr_step", [shmstat.Aggregation.COUNT], 0.05)
    for _ in range(300):
        step.add(1.0)
    shmstat.log_event(shmstat.Event("tr.done", datetime.datetime.now(), {"rank": int(os.environ["RANK"])}))
    shmstat.shutdown()


if __name__ == "__main__":  # a script rank: python _plugin_ranks.py SAMPLES | torchrun
    if sys.argv[1:] == ["torchrun"]:
        torchrun_main()
    else:
        counting_rank(int(os.environ["SHMSTAT_RANK"]), int(sys.argv[1]))
