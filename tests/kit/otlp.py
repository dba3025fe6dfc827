"""A local OTLP/HTTP receiver (metrics and logs) for the OTLP handler's and events sink's tests, and a rank writing
to two groups."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """``POST /v1/metrics`` and ``POST /v1/logs`` on 127.0.0.1 (a free port): decodes each
    ``ExportMetricsServiceRequest`` (``ExportLogsServiceRequest``) and answers an empty response, or ``status``
    when it is set to an error (e.g. 500)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as pb

        self.requests: list[Any] = []
        self.log_requests: list[Any] = []
        self.refused = 0
        self.status = 200
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path not in ("/v1/metrics", "/v1/logs"):
                    self._answer(404, b"")
                    return
                if receiver.status != 200:
                    with receiver._lock:
                        receiver.refused += 1
                    self._answer(receiver.status, b"")
                    return
                if self.path == "/v1/logs":
                    logs = logs_pb.ExportLogsServiceRequest()
                    logs.ParseFromString(body)
                    with receiver._lock:
                        receiver.log_requests.append(logs)
                    self._answer(200, logs_pb.ExportLogsServiceResponse().SerializeToString())
                    return
                request = pb.ExportMetricsServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.requests.append(request)
                self._answer(200, pb.ExportMetricsServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/metrics"
        self.logs_endpoint = f"http://127.0.0.1:{self.port}/v1/logs"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self.server.shutdown()
            self._thread.join()
        self.server.server_close()

    def points(self) -> list[tuple[Any, Any, Any, dict[str, Any]]]:
        """Every data point received: (resource attributes, metric, point, point attributes) in arrival order."""
        out = []
        with self._lock:
            requests = list(self.requests)
        for req in requests:
            for rm in req.resource_metrics:
                res = _attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        for p in getattr(m, kind).data_points:
                            out.append((res, m, p, _attrs(p.attributes)))
        return out


    def log_records(self) -> list[tuple[dict[str, Any], str, Any, dict[str, Any]]]:
        """Every log record received: (resource attributes, scope name, record, record attributes) in arrival
        order."""
        out = []
        with self._lock:
            requests = list(self.log_requests)
        for req in requests:
            for rl in req.resource_logs:
                res = _attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for rec in sl.log_records:
                        out.append((res, sl.scope.name, rec, _attrs(rec.attributes)))
        return out


@contextlib.contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


def _attrs(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def two_group_rank(job: str, rank: int, seconds: float, window_ms: int, out: str) -> None:
    """Add 1.0 per step to ``train/steps`` and ``other/steps`` for ``seconds``; write ``{window_start_s: count}``
    (the same for both stats) to ``out``."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=1)
    seen = [0]

    def clock() -> int:
        seen[0] = time.time_ns()
        return seen[0]

    train = shmstat.Stat("steps", [A.COUNT, A.SUM], window_ms / 1000, group="train", clock=lambda: seen[0])
    other = shmstat.Stat("steps", [A.COUNT, A.SUM], window_ms / 1000, group="other", clock=lambda: seen[0])
    counts: dict[str, int] = defaultdict(int)
    wns = window_ms * 1_000_000
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        clock()
        train.add(1.0)
        other.add(1.0)
        counts[repr(seen[0] // wns * wns / 1e9)] += 1
        n += 1
        if n % 64 == 0:
            time.sleep(0.001)
    with open(out + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(out + ".tmp", out)
    shmstat.shutdown()
