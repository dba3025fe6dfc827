"""A short job with sections, for ``shmstat top --sections`` and the Grafana dashboard's tests, run by ``shmstat run``:
each step of each rank is ``data`` (4 ms), ``FORWARD`` (6 ms; a name like markup, which every view must show as
written) and ``allreduce`` (a wait section, 2 ms), then ``shmstat.advance_step()``, for ``SECONDS_TO_RUN``. The
ranks in ``SLOW_RANKS`` (comma-separated, or ``*`` for every rank: a slow node) take ``SLOW_FACTOR`` times longer
in ``data`` and ``FORWARD``. While the file ``STUCK_FILE`` exists, rank ``STUCK_RANK`` stays in ``data`` and the
other ranks wait in ``allreduce`` (a hang with its culprit); removing the file lets every rank go on."""

import os
import time

import shmstat

FORWARD = "[b]forward[/b]"

rank = int(os.environ["RANK"])
seconds = float(os.environ.get("SECONDS_TO_RUN", "2"))
listed = os.environ.get("SLOW_RANKS", "")
slow_ranks = {int(r) for r in listed.split(",") if r.strip().isdigit()}
slow = float(os.environ.get("SLOW_FACTOR", "1")) if listed == "*" or rank in slow_ranks else 1.0
stuck_file = os.environ.get("STUCK_FILE", "")
stuck_rank = int(os.environ.get("STUCK_RANK", "0"))
end = time.monotonic() + seconds


def held() -> bool:
    return bool(stuck_file) and os.path.exists(stuck_file) and time.monotonic() < end


while time.monotonic() < end:
    with shmstat.section("data"):
        time.sleep(0.004 * slow)
        while rank == stuck_rank and held():
            time.sleep(0.02)
    with shmstat.section(FORWARD):
        time.sleep(0.006 * slow)
    with shmstat.section("allreduce", wait=True):
        time.sleep(0.002)
        while rank != stuck_rank and held():
            time.sleep(0.02)
    shmstat.advance_step()
shmstat.shutdown()
