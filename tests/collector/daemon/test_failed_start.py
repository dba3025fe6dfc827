"""A per-job collector whose start fails part-way (here: the Prometheus port in use) releases, in this process, what
it had opened: the handlers of the dispatcher it built (closed as a collector that stops closes them), the job's
segment. ``shmstat run`` and tests start collectors in-process, where nothing ends with the process."""

from __future__ import annotations

import os
import re
import socket

import pytest

from collector import Collector, CollectorConfig
from collector.handlers.jsonl import JsonlMetricHandler
from shmstat.errors import ShmstatError
from shmstat.shm.segment import Segment


def _open_paths() -> set[str]:
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the fd of the listing itself, closed meanwhile
    return paths


def test_a_start_that_fails_at_the_prometheus_port_closes_the_handlers_it_built(job, tmp_path):
    rows = str(tmp_path / "rows.jsonl")
    handler = JsonlMetricHandler(rows)  # given as an object: held here, its file stays open unless it is closed
    assert rows in _open_paths()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ShmstatError, match=re.escape(address)):
            Collector(CollectorConfig(job=job, prometheus=address), handler_objects={"*": handler})
    assert rows not in _open_paths()
    with pytest.raises(ShmstatError):
        Segment.open(job, create=False)  # the segment it made is gone too
