"""A job of three ranks for the seams of names and directions, run by ``shmstat run``: stats whose names look like
markup (:data:`HOSTILE`: rich's ``[...]`` tags, HTML, an emoji code) and a rate, ``train/tok[/s]``, declared
``higher_is_better``, where rank 1 is the fastest and rank 2 the slow one (:data:`RATES`: the median 1000, so a
surface scoring the rate as a time puts rank 1 at 0.625, under 0.75, and rank 2 at 3.33). ``train/step time [ms]``
is a time where rank 2 is slow too. Every value is fixed, so every window's figure is known; it adds every 5 ms
for ``SECONDS_TO_RUN`` (windows of ``WINDOW_S``)."""

import os
import time

import shmstat
from shmstat import Aggregation as A

RATE = ("train", "tok[/s]")
RATES = {0: 1000.0, 1: 1600.0, 2: 300.0}
"""Each rank's tokens/s (the figure of ``train/tok[/s]``): rank 2 is the straggler."""
STEP = ("train", "step time [ms]")
STEPS = {0: 10.0, 1: 10.0, 2: 30.0}
HOSTILE = (RATE, STEP, ("train", "[bold red]loss[/bold red]"), ("[b]io", "<script>"), ("train", ":thumbs_up: [/]"))
"""Every (group, stat) the job writes, each to be shown as written."""

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    seconds = float(os.environ.get("SECONDS_TO_RUN", "2"))
    window_s = float(os.environ.get("WINDOW_S", "0.2"))
    stats = {(g, n): shmstat.Stat(n, [A.MEAN, A.COUNT], window_s, group=g, higher_is_better=(g, n) == RATE)
             for g, n in HOSTILE}
    value = {RATE: RATES[rank], STEP: STEPS[rank]}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, s in stats.items():
            s.add(value.get(key, 1.0))
        time.sleep(0.005)
    shmstat.shutdown()
