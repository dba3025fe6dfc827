"""A training script as torchrun starts it without ``--rdzv-id`` (so ``TORCHELASTIC_RUN_ID=none``), with no
shmstat configuration: adds ``STEPS`` samples of ``rank + 1``, logs one event, and writes
``$OUT_DIR/<tag>.r<rank>.a<restart>.json`` with the job shmstat chose and its tally. With ``FAIL_FIRST=1`` the
first attempt fails (rank 0 exits 1 once rank 1 has written its tally), so torchrun restarts both ranks: the job
must stay the same."""

import datetime
import json
import os
import time

import shmstat
from shmstat import Aggregation
from shmstat.job.identity import identity_from_env

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
steps = int(os.environ.get("STEPS", "2000"))
out_dir, tag = os.environ["OUT_DIR"], os.environ["TAG"]
fail = os.environ.get("FAIL_FIRST") == "1" and attempt == 0
if fail and rank == 0:  # rank 1 finishes this attempt first, so both tallies are whole
    peer = os.path.join(out_dir, f"{tag}.r1.a0.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(peer) and time.monotonic() < deadline:
        time.sleep(0.01)
stat = shmstat.Stat("step_ms", [Aggregation.COUNT, Aggregation.SUM], 0.05, group="train")
for i in range(steps):
    stat.add(rank + 1.0)
    if i % 100 == 0:
        time.sleep(0.001)
identity = identity_from_env()
assert identity is not None
job = identity.job
# an event waits at shutdown for a collector to take it: the ranks leave only once the node collector serves the job
shmstat.log_event(shmstat.Event("done", datetime.datetime.now(), {"rank": rank, "attempt": attempt}))
shmstat.shutdown(flush_timeout_s=20)
tally = {"job": job, "run_id": os.environ["TORCHELASTIC_RUN_ID"], "rank": rank, "attempt": attempt,
         "count": steps, "sum": steps * (rank + 1.0)}
path = os.path.join(out_dir, f"{tag}.r{rank}.a{attempt}.json")
with open(path + ".tmp", "w") as f:
    json.dump(tally, f)
os.replace(path + ".tmp", path)
if fail and rank == 0:
    raise SystemExit(1)
