"""A job whose ranks' typical step and mean step disagree, run by ``shmstat run``: every rank adds to
``train/step_ms`` (percentiles kept) one value every millisecond for ``SECONDS_TO_RUN``; the healthy ranks add
10 ms three times out of four and 100 ms the fourth (p50 10, mean 32.5), the last rank 15 ms every time (p50 and
mean 15). By the p50 the collector scores, the last rank is the straggler; by the mean it is the fastest. Each
window holds both of a healthy rank's values, so every window gives the same figures."""

import os
import time

import shmstat
from shmstat import Aggregation as A

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
seconds = float(os.environ.get("SECONDS_TO_RUN", "2"))
window_s = float(os.environ.get("WINDOW_S", "0.2"))

step = shmstat.Stat("step_ms", [A.MEAN, A.COUNT, A.P50], window_s, group="train")
end = time.monotonic() + seconds
i = 0
while time.monotonic() < end:
    step.add(15.0 if rank == world - 1 else (100.0 if i % 4 == 3 else 10.0))
    time.sleep(0.001)
    i += 1
shmstat.shutdown()
