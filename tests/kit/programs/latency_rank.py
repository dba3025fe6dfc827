"""A rank that says which event latency budget it runs with: ``SHMSTAT_EVENT_LATENCY_MS`` as it found it and its
publisher's budget in seconds, as JSON in ``$OUT_DIR/latency-<RANK>``."""

import json
import os

import shmstat
from shmstat.job import _state

shmstat.init()
pub = _state.STATE.publisher
with open(os.path.join(os.environ["OUT_DIR"], f"latency-{os.environ['RANK']}"), "w") as f:
    json.dump({"env": os.environ.get("SHMSTAT_EVENT_LATENCY_MS"),
               "budget_s": pub._sender._latency_s if pub is not None else None}, f)
shmstat.shutdown()
