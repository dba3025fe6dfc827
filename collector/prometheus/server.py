"""``/metrics`` served from a cached rendering, so a scrape never waits for the exposition to be built.

prometheus_client's text format costs about 20 µs a line here (it validates and escapes every label of every
line), so 8 ranks x 8,000 stats (232,000 lines) take ~5 s to render: longer than a scrape should. The body is
therefore rendered by ``prometheus_client.generate_latest`` (the library's exposition, never ours) into a cache
and a scrape sends the cached bytes:

- a background thread renders whenever new figures arrive, using at most :data:`MAX_RENDER_SHARE` of a core
  (after a rendering it waits ``cost * (1 / share - 1)`` before the next);
- a scrape that finds the cache older than the newest figures renders it on the spot while rendering is cheap
  (the last one took under :data:`CHEAP_RENDER_S`) and no rendering is under way: small collectors always
  serve the newest figures;
- otherwise a scrape sends the newest complete rendering: figures at most one rendering behind (counters stay
  monotonic, so ``rate()`` is unaffected).

With TLS (:mod:`collector.prometheus.tls`) the listening socket stays a plain one: each connection's TLS handshake
is made in that connection's own thread, under :data:`HANDSHAKE_TIMEOUT_S`, so a client that connects and never
speaks, or fails its handshake, holds up no other scrape. A plain-HTTP request to a TLS endpoint is answered
``400`` in one sentence saying to scrape ``https``.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import ssl
import threading
import time
from typing import Any, cast

_log = logging.getLogger("shmstat.prometheus")

__all__ = ["CHEAP_RENDER_S", "HANDSHAKE_TIMEOUT_S", "LISTEN_BACKLOG", "MAX_AGE_S", "MAX_RENDER_SHARE",
           "REQUEST_TIMEOUT_S", "MetricsServer", "RenderCache"]

CHEAP_RENDER_S = 0.1
"""A rendering that took less than this (seconds) is redone on a scrape that finds the cache stale."""
MAX_RENDER_SHARE = 0.2
"""The share of a core the background rendering may take."""
MAX_AGE_S = 10.0
"""A rendering older than this counts as stale even when no new figures arrived (the collector's own counters
are read when rendering)."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before ``/metrics`` accepts them (socketserver's default is 5: a burst of
scrapers past it had its connections dropped and retried after a second or more). The kernel caps it at
``net.core.somaxconn``."""
HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a connection to a TLS endpoint has to start and finish its handshake before it is closed (Prometheus'
default scrape timeout)."""
REQUEST_TIMEOUT_S = 30.0
"""Seconds a connection may wait between the bytes of its request, or a scraper between reading parts of the
answer, before it is closed: a client that connects and never asks holds a thread no longer than this."""
_TLS_RECORD_HANDSHAKE = 0x16  # the first byte of every TLS ClientHello


class RenderCache:
    """The newest exposition of ``registry`` (a prometheus_client collector registry) as bytes.

    :meth:`invalidate` says the figures changed; :meth:`body` returns what a scrape sends. Promises: a
    rendering never runs twice at once; ``body()`` returns within the time of one cheap rendering once a first
    rendering exists; the background thread stops on :meth:`close`.
    """

    def __init__(self, registry: Any, *, cheap_s: float = CHEAP_RENDER_S,
                 max_share: float = MAX_RENDER_SHARE, max_age_s: float = MAX_AGE_S) -> None:
        if not 0.0 < max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {max_share!r}")
        self._registry = registry
        self.cheap_s = cheap_s
        self.max_share = max_share
        self.max_age_s = max_age_s
        self._rendered_at = 0.0
        self._failed_version = -1
        self._cond = threading.Condition()
        self._render_lock = threading.Lock()
        self._version = 0
        self._rendered_version = -1
        self._body: bytes | None = None
        self._rendering = False
        self._closed = False
        self.last_cost_s = 0.0
        """Wall time the newest rendering took."""
        self.renders = 0
        """Renderings made so far."""
        self._thread = threading.Thread(target=self._run, name="shmstat-prometheus-render", daemon=True)
        self._thread.start()

    def invalidate(self) -> None:
        """The figures changed: the next scrape (or the background thread) renders them."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def body(self) -> bytes:
        """What a scrape sends (see the module docstring for how fresh it is)."""
        with self._cond:
            body = self._body
            fresh = self._rendered_version == self._version and not self._too_old()
            busy = self._rendering or self.last_cost_s >= self.cheap_s
        if body is not None and (fresh or busy):
            return body
        return self._render()

    def wait_rendered(self, timeout_s: float) -> bool:
        """Wait until the newest figures are rendered; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._rendered_version == self._version, timeout=timeout_s)

    def close(self) -> None:
        """Stop the background thread (a rendering under way finishes on its own)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _render(self) -> bytes:
        from prometheus_client import generate_latest

        with self._render_lock:
            with self._cond:
                version = self._version
                if self._body is not None and self._rendered_version == version and not self._too_old():
                    return self._body  # rendered while this caller waited for the lock
                self._rendering = True
            started = time.perf_counter()
            try:
                body = generate_latest(self._registry)
            finally:
                with self._cond:
                    self._rendering = False
            cost = time.perf_counter() - started
            with self._cond:
                self._body, self._rendered_version, self.last_cost_s = body, version, cost
                self._rendered_at = time.monotonic()
                self.renders += 1
                self._cond.notify_all()
            return body

    def _too_old(self) -> bool:
        return time.monotonic() - self._rendered_at > self.max_age_s

    def _wanted(self) -> bool:
        if self._version == self._failed_version:
            return False
        return self._rendered_version != self._version or self._too_old()

    def _run(self) -> None:
        not_before = 0.0
        while True:
            with self._cond:
                while not self._closed and not self._wanted():
                    self._cond.wait(timeout=self.max_age_s)
                if self._closed:
                    return
            pause = not_before - time.monotonic()
            if pause > 0:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=pause)
                continue
            try:
                self._render()
            except Exception:  # a scrape renders again and reports it; do not spin until the figures change
                _log.exception("rendering /metrics failed")
                with self._cond:
                    self._failed_version = self._version
            not_before = time.monotonic() + self.last_cost_s * (1.0 / self.max_share - 1.0)


class MetricsServer:
    """A threaded HTTP server on ``host:port`` (0: any free port) answering every GET with ``cache.body()``
    in the Prometheus text format 0.0.4, with a listen backlog of :data:`LISTEN_BACKLOG` (a burst of concurrent
    scrapers is queued, not refused); HTTPS when given ``tls`` (a server-side context: see the module docstring);
    stops on :meth:`close`."""

    def __init__(self, cache: RenderCache, host: str, port: int, *, tls: ssl.SSLContext | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

        family, _, _, _, sockaddr = next(iter(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE)))
        self.tls = tls
        self._failures_lock = threading.Lock()
        self.handshake_failures = 0
        """Connections closed before a TLS handshake completed (plain HTTP, refused or missing client
        certificates, timeouts; not those closed by the client before sending anything)."""
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = request_timeout_s

            def do_GET(self) -> None:
                try:
                    body, status, kind = cache.body(), 200, CONTENT_TYPE_PLAIN_0_0_4
                except Exception as exc:
                    _log.exception("rendering /metrics failed")
                    body, status, kind = f"rendering /metrics failed: {exc}\n".encode(), 500, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the scraper gave up (its timeout): nothing to do
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            request_queue_size = LISTEN_BACKLOG

            def finish_request(self, request: Any, client_address: Any) -> None:
                if tls is None:
                    super().finish_request(request, client_address)
                    return
                conn = outer._handshake(request, client_address, handshake_timeout_s)
                if conn is None:
                    return
                try:
                    super().finish_request(conn, client_address)
                finally:
                    conn.close()  # the plain socket it wraps was detached: shutdown_request has nothing to do

        # AI_PASSIVE with SOCK_STREAM gives an IPv4 or IPv6 address: (host, port) leads both
        self._server = Server(cast("tuple[str, int]", sockaddr[:2]), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="shmstat-prometheus-http",
                                        daemon=True)
        self._thread.start()

    def _handshake(self, sock: socket.socket, peer: Any, timeout_s: float) -> ssl.SSLSocket | None:
        """``sock`` after a TLS handshake made under ``timeout_s``, or None (counted, and closed by the caller's
        ``shutdown_request``) when it failed."""
        assert self.tls is not None
        sock.settimeout(timeout_s)
        try:
            first = sock.recv(1, socket.MSG_PEEK)
            if first and first[0] != _TLS_RECORD_HANDSHAKE:
                self._failed(peer, "it sent plain HTTP")
                with contextlib.suppress(OSError):
                    sock.recv(65536)  # the request, read so that closing does not reset the answer away
                    sock.sendall(_PLAIN_TO_TLS)
                return None
            if not first:  # connected and closed (a TCP health check): nothing to report
                return None
            conn = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as exc:
            self._failed(peer, str(exc) or type(exc).__name__)
            return None
        try:
            conn.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError, a timeout, a reset
            conn.close()
            self._failed(peer, getattr(exc, "reason", None) or str(exc) or type(exc).__name__)
            return None
        return conn

    def _failed(self, peer: Any, why: str) -> None:
        with self._failures_lock:
            self.handshake_failures += 1
            first = self.handshake_failures == 1
        # the first one is likely a misconfigured scraper, worth a warning; after that a scanner must not flood
        # the log
        _log.log(logging.WARNING if first else logging.INFO, "/metrics: a TLS connection from %s was closed before "
                 "its handshake completed: %s%s", peer[0] if peer else "?", why,
                 " (further ones are logged at INFO)" if first else "")

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()


_PLAIN_TO_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
                 b"this /metrics endpoint speaks HTTPS: scrape it with scheme https\n")
