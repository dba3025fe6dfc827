"""A synchronous training loop in sections, for the report across nodes: run by ``shmstat run`` on each simulated
host (tests/kit/cluster.py) with the same job id, so ranks of different nodes have the same rank numbers.

Each step is ``data`` (4 ms), ``forward`` (15 ms; 30 ms on the rank ``SLOW`` names as ``host/rank``) and the
wait section ``allreduce``, which lasts what the slow rank's forward takes more (plus 1 ms): every rank's step
takes the same time, the healthy ranks wait longest. Once, ``HANG_AT_S`` seconds in, the rank ``STUCK`` names creates
``$SYNC_DIR/stuck``, sleeps ``HANG_S`` seconds in ``data`` and then creates ``$SYNC_DIR/released``; meanwhile
every other rank, on every host, waits in ``allreduce``. The job runs ``SECONDS_TO_RUN`` seconds of steps."""

import os
import socket
import time

import shmstat

rank = int(os.environ["RANK"])
me = f"{socket.gethostname()}/{rank}"
seconds = float(os.environ.get("SECONDS_TO_RUN", "3"))
sync = os.environ["SYNC_DIR"]
stuck_file, released = os.path.join(sync, "stuck"), os.path.join(sync, "released")
slow = me == os.environ.get("SLOW")
stuck = me == os.environ.get("STUCK")
hang_at, hang_s = float(os.environ.get("HANG_AT_S", "1")), float(os.environ.get("HANG_S", "3"))
shmstat.init()
start = time.monotonic()
hung = False
while time.monotonic() - start < seconds + (hang_s if hung else 0.0):
    with shmstat.section("data"):
        time.sleep(0.004)
        if stuck and not hung and time.monotonic() - start >= hang_at:
            hung = True
            open(stuck_file, "w").close()
            time.sleep(hang_s)
            open(released, "w").close()
    with shmstat.section("forward"):
        time.sleep(0.030 if slow else 0.015)
    with shmstat.section("allreduce", wait=True):
        time.sleep(0.001 if slow else 0.016)
        if os.path.exists(stuck_file) and not os.path.exists(released) and not stuck:
            hung = True
            while not os.path.exists(released):
                time.sleep(0.01)
    shmstat.advance_step()
shmstat.shutdown()
