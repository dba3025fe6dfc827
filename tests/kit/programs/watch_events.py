"""``collector.watch`` as a subscriber's script runs it: follow the node endpoints given (``NODE=tcp://HOST:PORT``
...; ``--curve DIR`` as ``collector.watch`` takes it) and print every job-wide event as one JSON line (``name``,
``job``, ``data``), flushed, until SIGINT or SIGTERM; then a last line ``{"late": N, "lost": M}`` (rows scored
too late to count and items the heartbeats showed lost: what the watcher did not fold in) and exit 0.
tests/system/test_many_nodes_alerts.py reads its events on the ops side of the simulated hosts."""

import json
import signal
import sys

import collector
from collector.jobwide.watch import JobWatch


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _stop)
args = sys.argv[1:]
curve = None
if args[:1] == ["--curve"]:
    curve, args = args[1], args[2:]
state = JobWatch()
try:
    for ev in collector.watch(args, curve=curve, state=state):
        print(json.dumps({"name": ev.name, "job": ev.job, "data": ev.data}), flush=True)
except KeyboardInterrupt:
    pass
print(json.dumps({"late": state.late, "lost": state.lost}), flush=True)
