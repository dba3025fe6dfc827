"""The simulated cluster kit (tests/kit/cluster.py) itself: its hosts are separate machines as far as shmstat can tell
(hostname, /dev/shm, runtime directory), reach each other and the ops side over TCP across the bridge, leave
the machine's own network alone, and are gone, with every process started in them, after the test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from kit.cluster import INTERFACE, OPS_ADDRESS, simulated_cluster
from kit.support import wait_for

# a one-connection-at-a-time server that answers every connection with the host's name
_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 7000))
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode())
    c.close()
"""


def _ask(address: str) -> str:
    """What the server at ``address`` answers (empty while it is not listening yet)."""
    try:
        with socket.create_connection((address, 7000), timeout=2) as c:
            return c.recv(100).decode()
    except OSError:
        return ""


def test_hosts_have_their_own_name_and_shared_memory_and_talk_over_the_bridge(tmp_path):
    with simulated_cluster(tmp_path, hosts=2) as c:
        node0, node1 = c.hosts
        assert [h.run(["hostname"]).strip() for h in (node0, node1, c.ops)] == ["node0", "node1", "ops"]
        node0.run(["sh", "-c", "echo x > /dev/shm/kit-probe && mkdir \"$XDG_RUNTIME_DIR/shmstat\""])
        assert (node0.shm(), node1.shm()) == (["kit-probe"], [])
        assert (node0.run_files(), node1.run_files()) == (["shmstat"], [])
        assert not os.path.exists("/dev/shm/kit-probe")
        assert node0.env["XDG_RUNTIME_DIR"] == node1.env["XDG_RUNTIME_DIR"], "the same path, a tmpfs each"
        assert f"inet {node1.address}/24" in node1.run(["ip", "-o", "addr", "show", INTERFACE])
        assert "node1" in node0.run(["getent", "hosts", node1.address]), "every host's /etc/hosts names the others"
        for host in c.hosts:
            host.popen([sys.executable, "-c", _SERVER, host.address], name="server")
        # node0 to node1 across the bridge, and the ops side (a thread of this test in its network) to both
        answer = node0.run([sys.executable, "-c", "import socket, sys, time\nfor _ in range(100):\n"
                            "    try: print(socket.create_connection((sys.argv[1], 7000), 2).recv(100).decode()); "
                            "break\n    except OSError: time.sleep(0.05)", node1.address])
        assert answer.strip() == "node1", c.tails()
        for host in c.hosts:
            wait_for(lambda h=host: c.ops.call(_ask, h.address) == h.name, 10, what=f"{host.name} from ops")
        assert OPS_ADDRESS not in _root_addresses() and node0.address not in _root_addresses()
        namespaces = {h.netns for h in [*c.hosts, c.ops]}
        holders = [h.holder for h in [*c.hosts, c.ops]]
        assert len(namespaces) == 3 and os.readlink("/proc/self/ns/net") not in namespaces
    assert all(h.poll() is not None for h in holders)
    assert [p for p in _pids() if _netns(p) in namespaces] == [], "every process of a simulated host is gone"


def _root_addresses() -> str:
    return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout


def _netns(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def test_a_failing_test_leaves_nothing_not_even_a_process_that_left_its_group(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"), simulated_cluster(tmp_path, hosts=1) as c:
        (host,) = c.hosts
        host.popen(["setsid", "-f", "sleep", "600"], name="escapee")  # a new session: not the kit's group
        wait_for(lambda: any(_netns(p) == host.netns and _comm(p) == "sleep" for p in _pids()), 10,
                 what="the escapee to run")
        namespaces = {host.netns, c.ops.netns}
        run_dir = host.runtime_dir
        raise RuntimeError("the test failed")
    assert [p for p in _pids() if _netns(p) in namespaces] == []
    assert not os.path.exists(run_dir), "the runtime directory's mount point is removed"


def test_a_crashed_host_runs_nothing_and_the_cluster_stays_up(tmp_path):
    with simulated_cluster(tmp_path, hosts=2) as c:
        dead, alive = c.hosts
        server = dead.popen([sys.executable, "-c", _SERVER, dead.address], name="server")
        dead.popen(["setsid", "-f", "sleep", "600"], name="escapee")  # outside every group the kit knows
        wait_for(lambda: alive.call(_ask, dead.address) == dead.name, 30, 0.05, what="the server to answer")
        killed = dead.crash()
        assert server.popen.wait(10) != 0 and len(killed) >= 2, killed
        assert [p for p in _pids() if _netns(p) == dead.netns and _comm(p) not in ("sh", "sleep")
                and p != str(dead.holder.pid)] == []
        assert not [p for p in _pids() if _netns(p) == dead.netns and _comm(p) == "sleep"
                    and "600" in _cmdline(p)], "the escapee survived"
        assert alive.call(_ask, dead.address) == ""  # nothing answers there any more
        assert dead.run(["hostname"]).strip() == dead.name  # the host itself (its namespaces) is still there


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_without_root_or_tools_the_reason_is_said(monkeypatch):
    from kit import cluster

    monkeypatch.setattr(os, "getuid", lambda: 1000)
    assert "needs root" in cluster._why_not()
    monkeypatch.setattr(os, "getuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ip" else f"/usr/bin/{tool}")
    assert cluster._why_not() == "ip not installed (apt-get install util-linux iproute2)"


def _pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
