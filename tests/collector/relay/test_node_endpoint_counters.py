"""The node collector's own endpoint (``--publish`` without ``--job``) on ``/metrics``: with CURVE, the handshakes
it refused are ``shmstat_node_publish_handshakes_refused_total`` (no job's: the node's), so an operator can alert
on strangers knocking. Real sockets and a real HTTP scrape in this process; no job is served."""

from __future__ import annotations

import urllib.request

import zmq
from kit.support import wait_for

from collector.cli.keys import make_keys
from collector.daemon.config import CollectorConfig
from collector.daemon.node import NodeCollector
from collector.relay.curve import ClientKeys, read_pair, secure_client


def _node_series(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {line.split("{", 1)[0]: line for line in text.splitlines() if line.startswith("shmstat_node_")}


def test_refused_subscribers_of_the_node_endpoint_are_counted_on_metrics(tmp_path):
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    make_keys(str(keys))
    make_keys(str(stranger))
    config = CollectorConfig(job="", publish="tcp://127.0.0.1:0", curve=str(keys), prometheus="127.0.0.1:0",
                             prometheus_node="node-x", status_interval_s=0.0)
    node = NodeCollector(config, jobs=["never-started-job"])
    ctx = zmq.Context()
    try:
        assert node.outlet is not None and node.exporter is not None
        server = read_pair(str(keys / "server.key_secret"))
        sock = ctx.socket(zmq.SUB)  # a stranger: a key pair not in DIR
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, ClientKeys(read_pair(str(stranger / "client.key_secret")), server.public))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(node.outlet.endpoint)
        url = node.exporter.url

        def refused() -> int:
            line = _node_series(url).get("shmstat_node_publish_handshakes_refused_total", "")
            return int(float(line.rsplit(" ", 1)[1])) if line else 0

        wait_for(lambda: node.curve is not None and node.curve.counts.refused >= 1, 15, what="the stranger refused")
        # /metrics re-renders the node's counters within its rendering's age limit (10 s) at the latest
        wait_for(lambda: refused() >= 1, 20, what="the refused handshake on /metrics")
        series = _node_series(url)
        assert 'node="node-x"' in series["shmstat_node_publish_handshakes_refused_total"]
        assert "job=" not in series["shmstat_node_publish_handshakes_refused_total"]  # the node's, no job's
        assert "shmstat_node_publish_subscription_resets_total" in series
        assert "shmstat_node_metrics_tls_handshakes_failed_total" not in series  # plain HTTP here
    finally:
        ctx.destroy(0)
        node.close()
