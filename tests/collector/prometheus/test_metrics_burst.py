"""``/metrics`` queues a burst of concurrent scrapers instead of refusing them: its listen backlog holds 200
connections while the server process is stopped (SIGSTOP: only the kernel can take them), and every one is
answered once it runs again. With socketserver's default backlog of 5, all but about 6 connections are dropped
and retried after a second or more (what scrapers saw: 2-3 s per request)."""

from __future__ import annotations

import errno
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

from kit.procs import REPO

from collector.prometheus.server import LISTEN_BACKLOG

_SERVER = """
import sys, time
from prometheus_client import CollectorRegistry, Gauge
from collector.prometheus.server import MetricsServer, RenderCache
registry = CollectorRegistry(auto_describe=False)
Gauge("probe", "a probe", registry=registry).set(7)
server = MetricsServer(RenderCache(registry), "127.0.0.1", 0)
print(server.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
"""

SCRAPERS = 200


def test_a_burst_of_200_concurrent_scrapes_is_queued_by_the_kernel_and_all_answered():
    assert LISTEN_BACKLOG >= 128
    env = dict(os.environ, PYTHONPATH=REPO)
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env, cwd=REPO)
    socks: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        os.kill(server.pid, signal.SIGSTOP)  # nothing accepts now: only the listen backlog can hold connections
        for _ in range(SCRAPERS):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            assert s.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
            socks.append(s)
            sel.register(s, selectors.EVENT_WRITE)
        connected = 0
        deadline = time.monotonic() + 0.9  # below the 1 s SYN retransmission: a dropped SYN cannot make it
        while connected < SCRAPERS and time.monotonic() < deadline:
            for key, _ in sel.select(0.05):
                s = key.fileobj
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "connection refused"
                sel.unregister(s)
                connected += 1
        assert connected == SCRAPERS, f"only {connected} of {SCRAPERS} connections queued while the server was stopped"
        for s in socks:
            s.setblocking(True)
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        os.kill(server.pid, signal.SIGCONT)
        answers = []
        for s in socks:
            s.settimeout(30)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            answers.append(data)
        took = time.monotonic() - started
        assert all(a.startswith(b"HTTP/1.0 200") and b"\nprobe 7.0\n" in a for a in answers)
        assert took < 10, f"{SCRAPERS} queued scrapes took {took:.1f} s to answer"
    finally:
        for s in socks:
            s.close()
        sel.close()
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
            server.kill()
        server.wait(30)
