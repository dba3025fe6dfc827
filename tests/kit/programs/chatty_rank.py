"""A rank that calls ``put_metric`` and an ``@prof`` function on every step and adds one sample per step to a Stat
(tests/collector/cli/test_quiet_default.py): STEPS calls of each; ``steps-<rank>`` holds STEPS once the rank is done."""

import os

import shmstat
from elastic import metrics
from shmstat import Aggregation

rank = int(os.environ["RANK"])
steps = int(os.environ["STEPS"])
step_ms = shmstat.Stat("step_ms", [Aggregation.COUNT, Aggregation.MEAN, Aggregation.P99], 0.1, group="chatty")


@metrics.prof(group="chatty")
def train_step(i: int) -> None:
    step_ms.add(float(i % 7))


for i in range(steps):
    train_step(i)
    metrics.put_metric("loss", 1.0 / (i + 1), "chatty")
with open(os.path.join(os.environ["OUT_DIR"], f"steps-{rank}"), "w") as f:
    f.write(str(steps))
shmstat.shutdown()
