"""A training script as torchrun starts it, with no shmstat configuration at all: the job and rank come from
torchrun's variables. Adds ``STEPS`` samples of ``rank + 1``, logs one event and one metric, writes its tally to
``$OUT_DIR/<run id>.r<rank>.json``."""

import datetime
import json
import os
import time

import elastic.metrics as metrics
import shmstat
import shmstat.job._state
from shmstat import Aggregation

rank = int(os.environ["RANK"])
steps = int(os.environ.get("STEPS", "3000"))
stat = shmstat.Stat("step_ms", [Aggregation.COUNT, Aggregation.SUM], 0.05, group="train")
for i in range(steps):
    stat.add(rank + 1.0)
    if i % 100 == 0:
        time.sleep(0.001)
shmstat.log_event(shmstat.Event("epoch.done", datetime.datetime.now(), {"rank": rank}))
metrics.put_metric("loss", 0.5 + rank, "trainer")
publisher = shmstat.job._state.STATE.publisher
shmstat.shutdown(flush_timeout_s=20)
sent, dropped = publisher.stats().sent_items, publisher.stats().dropped
out = os.path.join(os.environ["OUT_DIR"], f"{os.environ['TORCHELASTIC_RUN_ID']}.r{rank}.json")
with open(out, "w") as f:
    json.dump({"count": steps, "sum": steps * (rank + 1.0), "events_sent": sent, "events_dropped": dropped}, f)
