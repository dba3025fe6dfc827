"""Security: owner-only segment, runtime directory and socket; loopback-only by default."""

from __future__ import annotations

import os
import stat

import psutil
import pytest
from _procs import start_collector

from collector import Collector, CollectorConfig
from shmstat.runtime import runtime_dir
from shmstat.segment import Segment


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_segment_runtime_dir_and_ingest_socket_are_owner_only(job):
    c = Collector(CollectorConfig(job=job, handlers={"*": "null"}))
    try:
        assert _mode(f"/dev/shm/shmstat.{job}") == 0o600
        assert _mode(runtime_dir()) == 0o700
        sock_path = c.ingest_endpoint[len("ipc://"):]
        assert _mode(sock_path) & 0o077 == 0
        assert os.stat(sock_path).st_uid == os.getuid()
    finally:
        c.close()


def test_a_group_or_world_readable_segment_is_refused(job):
    seg = Segment.open(job)
    os.chmod(f"/dev/shm/shmstat.{job}", 0o644)
    try:
        with pytest.raises(Exception, match="accessible to other users"):
            Segment.open(job)
    finally:
        seg.close()


def test_the_collector_listens_on_loopback_only_by_default(job):
    coll = start_collector(job, "--handler", "*=null")
    try:
        assert coll.publish.startswith("tcp://127.0.0.1:")
        port = int(coll.publish.rsplit(":", 1)[1])
        listening = [c for c in psutil.Process(coll.proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", port)]
    finally:
        assert coll.stop() == 0
