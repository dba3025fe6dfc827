"""A training script that logs events both ways (``shmstat.log_event``, ``elastic.events.record``), run by
``shmstat run`` in tests: ``EVENTS`` of each per rank."""

import datetime
import os

import shmstat
from elastic import events

rank = int(os.environ["RANK"])
n = int(os.environ.get("EVENTS", "10"))
for i in range(n):
    shmstat.log_event(shmstat.Event("train.step", datetime.datetime.now(), {"rank": rank, "i": i}))
    events.record(events.Event(name="train.rec", source=events.EventSource.WORKER, metadata={"rank": rank, "i": i}))
shmstat.shutdown()
