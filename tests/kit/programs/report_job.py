"""A short training job for ``shmstat report`` and the Grafana dashboard's tests, run by ``shmstat run``: each rank
adds a step time to ``train/step_ms`` (mean, count, min, max and percentiles; the last rank is three times slower,
a straggler), a loss to ``train/loss`` (mean) and a made-up utilisation to ``gpu/util_percent`` (mean: a stat of
the ``gpu`` group, as the collector's GPU sampling writes them), logs a ``train.checkpoint`` event every
``CHECKPOINT_EVERY`` steps (the first with markup in its data, which a page must show as text), for
``SECONDS_TO_RUN``; with ``PUT_METRICS`` set, it also puts ``train/lr`` (a put metric) at each checkpoint; with
``CRASH_ONCE`` set the first incarnation of rank 0 exits with status 1 halfway
(``--max-restarts 1`` restarts it)."""

import datetime
import os
import time

import shmstat
from elastic import metrics
from shmstat import Aggregation as A

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
seconds = float(os.environ.get("SECONDS_TO_RUN", "2"))
window_s = float(os.environ.get("WINDOW_S", "0.2"))
every = int(os.environ.get("CHECKPOINT_EVERY", "50"))
restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
crash = bool(os.environ.get("CRASH_ONCE")) and rank == 0 and not restarted
put = bool(os.environ.get("PUT_METRICS"))

step = shmstat.Stat("step_ms", [A.MEAN, A.COUNT, A.MIN, A.MAX, A.P50, A.P99], window_s, group="train")
loss = shmstat.Stat("loss", [A.MEAN, A.COUNT], window_s, group="train")
util = shmstat.Stat("util_percent", [A.MEAN, A.COUNT], window_s, group="gpu")
slow = 3.0 if rank == world - 1 else 1.0
end = time.monotonic() + (seconds / 2 if crash else seconds)
i = 0
while time.monotonic() < end:
    ms = slow * (1.0 + (i % 7) / 10)
    time.sleep(ms / 1000)
    step.add(ms)
    loss.add(1.0 / (1 + i))
    util.add(90.0 - 10 * rank + i % 3)
    if i % every == 0:
        data = {"step": i, "rank": rank}
        if i == 0:
            data["note"] = "</script><img src=x onerror=alert(1)>"
        shmstat.log_event(shmstat.Event("train.checkpoint", datetime.datetime.now(), data))
        if put:
            metrics.put_metric("lr", 100 + 10 * rank + i // every, "train")
    i += 1
if crash:
    os._exit(1)
shmstat.shutdown()
