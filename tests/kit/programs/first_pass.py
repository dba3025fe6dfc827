"""A job's collector and its rank in one fresh interpreter (argv: job, jsonl path): prints as JSON the windows the
collector's first passes emitted and the modules those passes imported (on the loop's thread, where an import under
load takes longer than a small ring keeps a window)."""

import json
import sys
import time

import shmstat
from collector import Collector, CollectorConfig
from shmstat import Aggregation as A
from shmstat.job.attach import init

job, out = sys.argv[1], sys.argv[2]
init(job, rank=0, publish=False)
stat = shmstat.Stat("steps", [A.COUNT, A.MEAN], 0.05, group="train")
c = Collector(CollectorConfig(job=job, handlers={"*": f"jsonl:{out}"}, status_interval_s=0.0, hold_ms=0,
                              grace_ms=0))
stat.add(1.0)
c.step()  # its first turn, as serving begins: the rank table read and the stat found
before = set(sys.modules)
end = time.monotonic() + 20
while c.passes.windows_emitted < 2 and time.monotonic() < end:
    stat.add(1.0)
    c.step(10)
imported = sorted(set(sys.modules) - before)
c.close()
print(json.dumps({"windows": c.passes.windows_emitted, "imported": imported}))
