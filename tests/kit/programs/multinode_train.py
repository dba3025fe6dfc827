"""A small DDP training job (gloo) as torchrun starts it on each node of a multi-node job, with no shmstat
configuration at all: the job is torchrun's run id, the rank torchrun's. Per step it adds its step time to
``train/step_ms`` (COUNT, SUM, P50, P99; 250 ms windows) and puts its loss (``trainer/loss_x1000``); every
``EVENT_EVERY`` steps it logs an event. With ``GO_FILE`` set (the test's, not shmstat's) it waits, once its
stat is made (the job is in the node's /dev/shm), until that file exists: the test's subscribers then follow the
job before its first event. At the end it writes what it added, and the job shmstat named it (``job``), to
``$OUT_DIR/rank<RANK>.json``."""

import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import elastic.metrics as metrics
import shmstat
import shmstat.job._state
from shmstat import Aggregation as A

STEPS = int(os.environ.get("STEPS", "40"))
EVENT_EVERY = 10

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.Generator().manual_seed(rank)
# 250 ms: a node collector starved of CPU (two of these jobs on 2 busy cores stalled its loop ~0.6 s) still reads
# every window before the ring's 4 banks wrap (3 windows later), so the test can ask for exact figures
step_ms = shmstat.Stat("step_ms", [A.COUNT, A.SUM, A.P50, A.P99], 0.25, group="train")
go = os.environ.get("GO_FILE")
deadline = time.monotonic() + 120
while go and not os.path.exists(go):
    assert time.monotonic() < deadline, f"{go} not made within 120 s"
    time.sleep(0.02)
samples: list[float] = []
losses: list[int] = []
events = 0
for step in range(STEPS):
    start = time.perf_counter()
    x = torch.randn(32, 16, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()  # DDP's all-reduce over gloo, across both nodes
    optimizer.step()
    # in 1/64 ms: every sum of these is exact in a double, so totals compare with ==
    ms = round((time.perf_counter() - start) * 1000 * 64) / 64
    step_ms.add(ms)
    samples.append(ms)
    losses.append(int(loss.item() * 1000))
    metrics.put_metric("loss_x1000", losses[-1], "trainer")
    if step % EVENT_EVERY == 0:
        shmstat.log_event(shmstat.Event("train.progress", datetime.datetime.now(), {"rank": rank, "step": step}))
        events += 1
    time.sleep(0.01)  # the job spans several windows
publisher = shmstat.job._state.STATE.publisher
attachment = shmstat.job._state.STATE.attachment
job = attachment.segment.job if attachment is not None else None
shmstat.shutdown(flush_timeout_s=20)
stats = publisher.stats() if publisher is not None else None
dist.destroy_process_group()
out = os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json")
with open(out + ".tmp", "w") as f:
    json.dump({"host": socket.gethostname(), "run_id": os.environ["TORCHELASTIC_RUN_ID"], "job": job,
               "samples": samples, "losses": losses, "events": events,
               "events_sent": stats.sent_items if stats else None,
               "events_dropped": stats.dropped if stats else None}, f)
os.replace(out + ".tmp", out)
