"""An Event's naive (local-time) timestamp becomes exactly the Unix time ``datetime.timestamp()`` gives, to the
microsecond, in zones with DST, half-hour and 45-minute offsets and half-hour DST (Lord Howe), in the repeated
hour (``fold``) and the skipped one, before 1970 and far ahead; C path and pure-Python path alike. Each zone in
a fresh process (``TZ`` set before start: the offsets looked up are cached per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kit.procs import REPO

_CHECK = r"""
import datetime, random
from shmstat.publish.events import Event, _c_naive_ns
import sys
assert (_c_naive_ns is None) == (sys.argv[1] == "python"), sys.argv
rng = random.Random(7)
n = 0
for _ in range(20000):
    t = rng.randint(-2_000_000_000, 4_000_000_000)
    dt = datetime.datetime.fromtimestamp(t).replace(microsecond=rng.randint(0, 999_999))
    for fold in (0, 1):
        d = dt.replace(fold=fold)
        want = round(d.replace(microsecond=0).timestamp()) * 10**9 + d.microsecond * 1000
        for _ in range(2):  # the second time from the cached offset
            assert Event("x", d, {})._timestamp_ns() == want, (d, fold)
        n += 1
print("checked", n)
"""


@pytest.mark.parametrize("tz", ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
                                "Asia/Kathmandu", "Pacific/Chatham"])
def test_naive_timestamps_are_exactly_what_datetime_timestamp_says(tz, backend):
    if not os.path.exists(f"/usr/share/zoneinfo/{tz}"):
        pytest.skip(f"the zone {tz} is not installed (tzdata)")
    r = subprocess.run([sys.executable, "-c", _CHECK, backend], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, TZ=tz, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr
    assert "checked 40000" in r.stdout
