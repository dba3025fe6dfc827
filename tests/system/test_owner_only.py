"""Security: owner-only segment, runtime directory and socket; loopback-only by default."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import psutil
import pytest
from kit.procs import REPO, start_collector

from collector import Collector, CollectorConfig
from shmstat.shm.runtime import publish_endpoint, runtime_dir
from shmstat.shm.segment import Segment


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


_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c"]
_CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused")
else:
    print("connected")
"""


def _as_nobody_connect(path: str) -> str:
    if os.getuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to act as another local user")
    return subprocess.run([*_NOBODY, _CONNECT, path], capture_output=True, text=True, timeout=30).stdout.strip()


def test_the_default_publish_endpoint_is_owner_only_ipc_and_nothing_listens_on_the_network(job):
    coll = start_collector(job, "--handler", "*=null")
    try:
        assert coll.publish == publish_endpoint(job) and coll.publish.startswith("ipc://")
        listening = [c for c in psutil.Process(coll.proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening == []
        for endpoint in (coll.publish, coll.ingest):
            path = endpoint[len("ipc://"):]
            assert _mode(path) & 0o077 == 0 and _mode(os.path.dirname(path)) == 0o700
            assert _as_nobody_connect(path) == "refused"
    finally:
        assert coll.stop() == 0
    assert not os.path.exists(coll.publish[len("ipc://"):]), "a clean exit leaves no socket file"
    assert not os.path.exists(coll.ingest[len("ipc://"):])


def test_tcp_only_when_asked_with_a_warning_and_loopback_unless_remote_is_allowed(job):
    coll = start_collector(job, "--handler", "*=null", "--publish", "tcp://127.0.0.1:0")
    try:
        assert coll.publish.startswith("tcp://127.0.0.1:")
        port = int(coll.publish.rsplit(":", 1)[1])
        listening = [c for c in psutil.Process(coll.proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", port)]
    finally:
        assert coll.stop() == 0
    env = dict(os.environ, PYTHONPATH=REPO)
    warned = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--publish",
                             "tcp://127.0.0.1:0", "--handler", "*=null", "--grace-ms", "51"],
                            capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert warned.returncode == 2 and "--grace-ms" in warned.stderr and "Traceback" not in warned.stderr
    refused = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--publish",
                              "tcp://0.0.0.0:0", "--handler", "*=null"],
                             capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert refused.returncode == 2
    assert "--allow-remote-publish" in refused.stderr and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_the_tcp_warning_is_printed(job):
    coll = start_collector(job, "--publish", "tcp://127.0.0.1:0", "--handler", "*=null")
    coll.stop()
    err = "\n".join(coll.lines)  # its notes: the warning, then where it serves
    assert "any local user can subscribe" in err
