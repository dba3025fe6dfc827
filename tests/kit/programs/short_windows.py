"""A rank with Stats of 10 ms and 1 ms windows, configured only by its environment (as ``shmstat run`` or torchrun
start it): adds 1.0 to both for ``SECONDS`` seconds, then writes ``$OUT_DIR/short.r<rank>.json`` with what it added
per stat and the samples its rank's entry counts as dropped (read after its last add, so final)."""

import datetime
import json
import os
import time

import shmstat
from shmstat import Aggregation
from shmstat.job.attach import ensure_init

rank = int(os.environ["RANK"])
seconds = float(os.environ.get("SECONDS", "1.5"))
stats = {f"w{ms}ms": shmstat.Stat(f"w{ms}ms", [Aggregation.COUNT, Aggregation.SUM],
                                  datetime.timedelta(milliseconds=ms), group="short") for ms in (10, 1)}
added = dict.fromkeys(stats, 0)
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    for name, stat in stats.items():
        stat.add(1.0)
        added[name] += 1
    n += 1
    if n % 16 == 0:
        time.sleep(0.0002)
att = ensure_init()
assert att is not None and att.has_entry, "the rank runs in a job"
dropped = next(r.dropped for r in att.segment.ranks() if r.local_rank == att.owner_local_rank)
tally = {"rank": rank, "added": added, "dropped": dropped, "job": att.segment.job}
path = os.path.join(os.environ["OUT_DIR"], f"short.r{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(tally, f)
os.replace(path + ".tmp", path)
# an event waits at shutdown for a collector to take it: a rank leaves only once a collector serves its job
shmstat.log_event(shmstat.Event("done", datetime.datetime.now(), {"rank": rank}))
shmstat.shutdown(flush_timeout_s=20)
