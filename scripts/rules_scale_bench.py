"""Many nodes: what the shipped Prometheus rules (``shmstat prometheus-rules``) cost a Prometheus at scale, on
synthetic series (issue 43).

Usage::

    python scripts/rules_scale_bench.py                       # 128 nodes x 8 ranks, 5 sections, 60 s
    python scripts/rules_scale_bench.py --nodes 4 --seconds 15   # a smoke run

One loopback HTTP server (this process) serves, as one scrape target, every series the rules read for a job on
``--nodes`` nodes of ``--ranks`` ranks each (``honor_labels: true`` keeps each series' ``node``): per stat
(``--stats`` scored sections plus the ``allreduce`` wait section) ``shmstat_stat_count_total`` and
``shmstat_stat_p50`` (the newest window's) per rank, ``shmstat_stat_info`` per node, one
``shmstat_rank_progress_age_seconds`` per rank, and each node's ``shmstat_collector_<counter>_total``. The
counts grow with the wall clock (every rank 1,000 samples a second; one node's ranks 1.4x slower), so every rank
counts as adding. Debian's ``prometheus`` (found on ``PATH`` or at /usr/bin) scrapes it
every ``--scrape`` seconds and evaluates the rules printed by ``shmstat prometheus-rules`` (defaults but
``--interval``) every ``--evaluation`` seconds.

Measured, from Prometheus' own metrics after ``--seconds``: ``prometheus_rule_group_last_duration_seconds`` of
each group (its median and max over the run: ``prometheus_rule_group_duration_seconds`` quantiles are
per-evaluation), the series the head holds, the alerts firing (the slow node's, as a sanity check: the
rules must name it). Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.server
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from collector.cli.prometheus_rules import DATA_LOST_COUNTERS, rules_yaml  # noqa: E402

SECTIONS = ("forward", "backward", "optimizer", "data", "comm", "loss", "eval", "ckpt")
JOB = "bench-job"
START = time.time()


def exposition(nodes: int, ranks: int, stats: int, slow_node: int, now: float) -> bytes:
    """The text exposition of every series at ``now`` (counters since 0)."""
    names = [*SECTIONS[:stats], "allreduce"]
    lines = ["# TYPE shmstat_stat_count_total counter", "# TYPE shmstat_stat_p50 gauge",
             "# TYPE shmstat_stat_info gauge", "# TYPE shmstat_rank_progress_age_seconds gauge"]
    count, infos, ages = [], [], []
    for n in range(nodes):
        node = f"node{n:03d}"
        slow = 1.4 if n == slow_node else 1.0
        for stat in names:
            wait = stat == "allreduce"
            base = f'job="{JOB}",node="{node}",group="section",stat="{stat}"'
            infos.append(f'shmstat_stat_info{{{base},higher_is_better="0",scored="{0 if wait else 1}",'
                         f'wait="{1 if wait else 0}"}} 1')
            c = int(now * 1000)
            per_rank = 10.0 * (1.0 if wait else slow)
            for r in range(ranks):
                rank = n * ranks + r
                count.append(f'shmstat_stat_count_total{{{base},rank="{rank}"}} {c}')
                count.append(f'shmstat_stat_p50{{{base},rank="{rank}"}} {per_rank}')
        for r in range(ranks):
            ages.append(f'shmstat_rank_progress_age_seconds{{job="{JOB}",node="{node}",rank="{n * ranks + r}",'
                        f'section="forward",wait="0"}} 0.01')
        for counter in (*DATA_LOST_COUNTERS, "windows_emitted"):
            count.append(f'shmstat_collector_{counter}_total{{job="{JOB}",node="{node}"}} 0')
    return ("\n".join(lines + count + infos + ages) + "\n").encode()


def serve(nodes: int, ranks: int, stats: int) -> tuple[http.server.ThreadingHTTPServer, int]:
    """A loopback HTTP server (a thread) answering every GET with :func:`exposition` now; it and its port."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = exposition(nodes, ranks, stats, nodes - 1, time.time() - START)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def query(base: str, promql: str) -> list[dict]:
    """The result vector of an instant query."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)["data"]["result"]


def main() -> int:
    """Run it (see the module's doc); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--stats", type=int, default=4, help="scored sections (plus allreduce, a wait section)")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--scrape", type=int, default=5)
    parser.add_argument("--evaluation", type=int, default=5)
    parser.add_argument("--interval", type=int, default=20, help="the rules' --interval")
    args = parser.parse_args()
    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.path.exists(prometheus):
        print("needs Debian's prometheus package (apt-get install prometheus)", file=sys.stderr)
        return 2
    server, port = serve(args.nodes, args.ranks, args.stats)
    per_scrape = exposition(args.nodes, args.ranks, args.stats, args.nodes - 1, 1.0)
    series = per_scrape.count(b"\n") - 4
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "shmstat-rules.yml"
        rules.write_text(rules_yaml(interval_s=args.interval))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            listen = f"127.0.0.1:{s.getsockname()[1]}"
        config = Path(tmp) / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {args.scrape}s\n  evaluation_interval: {args.evaluation}s\n"
                          f"rule_files: ['{rules}']\nscrape_configs:\n  - job_name: shmstat\n"
                          f"    honor_labels: true\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
        prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/tsdb",
                                 f"--web.listen-address={listen}"], stdout=subprocess.DEVNULL,
                                stderr=open(Path(tmp) / "prometheus.log", "w"))  # noqa: SIM115
        base = f"http://{listen}"
        durations: dict[str, list[float]] = {}
        head = "?"
        try:
            began = time.monotonic()
            deadline = began + args.seconds
            while time.monotonic() < deadline:
                time.sleep(args.evaluation)
                if time.monotonic() - began < args.interval + 2 * args.scrape:
                    continue  # until a whole rate window is stored, the rules have (almost) nothing to compute
                try:
                    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
                        own = r.read().decode()
                except OSError:
                    continue
                for line in own.splitlines():  # Prometheus' own figures: on its /metrics, not in its TSDB
                    if line.startswith("prometheus_tsdb_head_series "):
                        head = line.rsplit(" ", 1)[1]
                    if line.startswith("prometheus_rule_group_last_duration_seconds{"):
                        group = line.split('rule_group="', 1)[1].split('"', 1)[0].rsplit(";", 1)[-1]
                        durations.setdefault(group, []).append(float(line.rsplit(" ", 1)[1]))
            firing = query(base, 'ALERTS{alertstate="firing"}')
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=30) as r:
                per_rule = [(g["name"], rule.get("name", ""), rule["evaluationTime"])
                            for g in json.load(r)["data"]["groups"] for rule in g["rules"]]
            scrape = query(base, 'scrape_duration_seconds{job="shmstat"}')
        except OSError:
            print((Path(tmp) / "prometheus.log").read_text()[-2000:], file=sys.stderr)
            raise
        finally:
            prom.terminate()
            prom.wait(30)
            server.shutdown()
    print(f"## Rules at scale: {args.nodes} nodes x {args.ranks} ranks, {args.stats} scored sections + allreduce "
          f"({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
          f"{platform.python_version()}, prometheus {prometheus}, load average {os.getloadavg()[0]:.1f})\n")
    print(f"- series the rules read: {series} ({series / args.nodes:.0f} per node); head series with the "
          f"recorded ones: {head}")
    print(f"- one scrape of all of them: {float(scrape[0]['value'][1]) * 1000:.0f} ms" if scrape else "- no scrape")
    print(f"- firing after {args.seconds:.0f} s: "
          + (", ".join(sorted({f"{r['metric']['alertname']}({r['metric'].get('node', '')})" for r in firing}))
             or "none"))
    print("\n| group | evaluations | min ms | median ms | max ms |\n|---|---|---|---|---|")
    for group, values in sorted(durations.items()):
        values = [v for v in values if v > 0]
        if values:
            print(f"| {group} | {len(values)} | {min(values) * 1000:.1f} | {statistics.median(values) * 1000:.1f} | "
                  f"{max(values) * 1000:.1f} |")
    print("\n| group | rule | its last evaluation, ms |\n|---|---|---|")
    for group, name, seconds in per_rule:
        print(f"| {group} | `{name}` | {seconds * 1000:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
