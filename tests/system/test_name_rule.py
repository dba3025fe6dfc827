"""The name rule end to end: names at the rule's limits (non-ASCII, emoji, a '/' in a name) put by real ranks
through every entry point reach every sink of a real collector exactly as given (jsonl, the stream topics,
Prometheus' /metrics and a real Prometheus scraping it, TensorBoard, OTLP), each (group, name) in its own topic
and tag, every sample counted; the names the issue found lost or colliding are refused at the call instead."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections import defaultdict

import zmq
from kit.names import (
    ADDS,
    EVENTS,
    GROUP_A,
    GROUP_OTLP,
    GROUP_TB,
    GROUPS,
    METRICS,
    PAIRS,
    names_rank,
)
from kit.procs import read_jsonl, spawn, start_collector
from kit.support import wait_for

from shmstat import wire

WORLD = 2
_HAVE_TB = importlib.util.find_spec("tensorboard") is not None
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
_HAVE_OTEL = all(importlib.util.find_spec(m) is not None for m in (
    "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.proto"))


class _Topics:
    """A SUB socket on the collector's stream: every (topic, item) received, decoded as subscribers decode."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        for prefix in (b"stat/", b"metric/", b"event/"):
            self.sock.setsockopt(zmq.SUBSCRIBE, prefix)
        self.sock.connect(endpoint)
        self.items: list[tuple[str, object]] = []
        self.raw_topics: set[bytes] = set()

    def drain(self) -> list[tuple[str, object]]:
        while self.sock.poll(0):
            topic, payload, _job = self.sock.recv_multipart()
            msg = wire.decode(topic, payload)
            self.raw_topics.add(topic)
            self.items.extend((msg.topic, it) for it in msg.items)
        return self.items

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _families(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode("utf-8"))}


def _tb_scalars(logdir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(logdir, size_guidance={TENSORS: 0})
    acc.Reload()
    return {tag: [tensor_util.make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)]
            for tag in acc.Tags()[TENSORS]}


class _Prometheus:
    """A real Prometheus (Debian's) scraping the collector through the ``file_sd`` file it writes."""

    def __init__(self, tmp_path, sd_file) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: shmstat\n    honor_labels: true\n"
            f"    file_sd_configs:\n      - files: ['{sd_file}']\n        refresh_interval: 1s\n")
        self.log = tmp_path / "prometheus.log"
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "w"))  # noqa: SIM115

    def query(self, promql: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                doc = json.load(r)
        except OSError:  # not listening yet
            return []
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def test_names_at_the_limits_reach_every_sink_exactly_in_their_own_topics_and_tags(job, tmp_path):
    rows_path, tb, tb_a = tmp_path / "rows.jsonl", tmp_path / "tb", tmp_path / "tb_a"
    sd_file = tmp_path / "sd.json"
    own_path = tmp_path / "collector.jsonl"  # the collector's own group, asked for by name
    args = ["--handler", f"*=jsonl:{rows_path}", "--handler", f"shmstat=jsonl:{own_path}",
            "--handler", f"{GROUP_TB}=tensorboard:{tb}",
            "--handler", f"{GROUP_A}=tensorboard:{tb_a}", "--grace-ms", "10", "--prometheus", "127.0.0.1:0",
            "--prometheus-sd", str(sd_file), "--status-interval", "0"]
    rx = None
    if _HAVE_OTEL:
        from kit.otlp import Receiver

        rx = Receiver()
        args += ["--handler", f"{GROUP_OTLP}=otlp:{rx.endpoint}"]
    coll = start_collector(job, *args)
    topics = _Topics(coll.publish)
    prom = _Prometheus(tmp_path, sd_file) if os.path.exists(PROMETHEUS) else None
    try:
        url = coll.prometheus
        wait_for(lambda: topics.drain(), 15, what="the collector's stream flowing")
        outs = [str(tmp_path / f"r{r}.json") for r in range(WORLD)]
        procs = [spawn(names_rank, job, r, WORLD, outs[r]) for r in range(WORLD)]
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        total_count = ADDS * WORLD
        total_sum = float(ADDS * sum(range(1, WORLD + 1)))

        def merged(fams: dict, family: str, label: str) -> dict[tuple[str, str], float]:
            return {(s.labels["group"], s.labels[label]): s.value for s in fams[family].samples
                    if "rank" not in s.labels and s.labels.get("job") == job}

        def prometheus_done() -> dict | None:
            fams = _families(url)
            counts = merged(fams, "shmstat_stat_count", "stat") if "shmstat_stat_count" in fams else {}
            return fams if all(counts.get(p) == total_count for p in PAIRS) else None

        fams = wait_for(prometheus_done, 30, what="every sample counted on /metrics under its own labels")

        def topics_done() -> bool:
            got: dict[str, int] = defaultdict(int)
            for topic, item in topics.drain():
                if topic.startswith("stat/") and not topic.startswith("stat/shmstat/") and item["rank"] is None:
                    got[topic] += item["count"]
            return (all(got[wire.stat_topic(g, s)] == total_count for g, s in PAIRS)
                    and sum(t.startswith("event/") for t, _ in topics.items) == WORLD * len(EVENTS)
                    and sum(t.startswith("metric/") for t, _ in topics.items) == WORLD * len(METRICS))

        wait_for(topics_done, 30, what="every window, metric and event on its own topic")

        if prom is not None:  # a real Prometheus stores and answers every label as given
            def scraped() -> dict | None:
                got = {(r["metric"]["group"], r["metric"]["stat"]): float(r["value"][1]) for r in
                       prom.query(f'shmstat_stat_count_total{{job="{job}",rank=""}}')}
                return got if all(got.get(p) == total_count for p in PAIRS) else None

            got = wait_for(scraped, 60, what=f"Prometheus to store every series (log: {prom.log})")
            assert set(got) == set(PAIRS)
            one = prom.query(f'shmstat_stat_count_total{{group="{GROUP_A}",stat="b/c",rank="0"}}')
            assert [float(r["value"][1]) for r in one] == [ADDS]
            put = {(r["metric"]["group"], r["metric"]["name"], r["metric"]["rank"]): float(r["value"][1])
                   for r in prom.query(f'shmstat_metric{{job="{job}"}}')}
            assert put == {(g, n, str(r)): r + 1 for g, n in METRICS for r in range(WORLD)}
    finally:
        assert coll.stop() == 0
        topics.close()
        if prom is not None:
            prom.close()
        if rx is not None:
            rx.close()

    # the names the issue found lost or colliding were refused at the call, naming the rule
    for out in outs:
        refused = json.load(open(out, encoding="utf-8"))  # noqa: SIM115
        assert all(msg is not None and "the name rule" in msg for msg in refused.values()), refused

    # /metrics: labels exactly as given, one series per (group, stat), sums and put metrics exact
    sums = merged(fams, "shmstat_stat_sum", "stat")
    assert {p: sums[p] for p in PAIRS} == {p: total_sum for p in PAIRS}
    put = {(s.labels["group"], s.labels["name"], s.labels["rank"]): s.value for s in fams["shmstat_metric"].samples
           if s.labels.get("job") == job}
    assert put == {(g, n, str(r)): r + 1 for g, n in METRICS for r in range(WORLD)}
    assert {g for g, _ in merged(fams, "shmstat_stat_count", "stat")} == {*GROUPS, GROUP_A}

    # topics: stat/<group>/<name>, metric/<group>/<name>, event/<name>, each carrying its own name
    for topic, item in topics.items:
        kind, _, rest = topic.partition("/")
        if kind == "stat" and not rest.startswith("shmstat/"):
            assert rest == f"{item['group']}/{item['name']}" and (item["group"], item["name"]) in PAIRS
        elif kind == "metric":
            assert topic == wire.metric_topic(item[0], item[1]) and (item[0], item[1]) in METRICS
        elif kind == "event":
            assert topic == wire.event_topic(item[0]) and item[0] in EVENTS
    assert b"stat/a/b/c" in topics.raw_topics and not any(t.startswith(b"stat/a/b/") and t != b"stat/a/b/c"
                                                          for t in topics.raw_topics)

    # jsonl: every row under its group and <name>.<aggregation>, counts reconciling exactly
    rows = read_jsonl(str(rows_path))
    counts: dict[tuple[str, str], float] = defaultdict(float)
    for r in rows:
        if r["rank"] is None and r["window_start"] is not None and r["name"].endswith(".count"):
            counts[(r["group"], r["name"][: -len(".count")])] += r["value"]
    jsonl_pairs = [p for p in PAIRS if p[0] not in (GROUP_TB, GROUP_A, GROUP_OTLP)]
    assert {p: counts[p] for p in jsonl_pairs} == {p: total_count for p in jsonl_pairs}
    metric_rows = {(r["group"], r["name"], r["rank"]) for r in rows if r["window_start"] is None
                   and r["group"] != "shmstat"}
    assert metric_rows == {(g, n, r) for g, n in METRICS if g not in (GROUP_TB, GROUP_A) for r in range(WORLD)}
    refused_descriptors = [r["value"] for r in read_jsonl(str(own_path))
                           if r["name"] == "collector.descriptors_refused"]
    assert refused_descriptors and max(refused_descriptors) == 0  # nothing a rank accepted was dropped later

    # TensorBoard: <group>/<stat>.<agg> merged, rank<N>/<group>/<stat>.<agg> per rank, every sample counted
    if _HAVE_TB:
        for logdir, group in ((tb, GROUP_TB), (tb_a, GROUP_A)):
            scalars = _tb_scalars(str(logdir / job))
            names = [s for g, s in PAIRS if g == group]
            for stat in names:
                assert sum(scalars[f"{group}/{stat}.count"]) == total_count
                for r in range(WORLD):
                    assert sum(scalars[f"rank{r}/{group}/{stat}.count"]) == ADDS
            put_tags = {f"rank{r}/{g}/{n}" for g, n in METRICS if g == group for r in range(WORLD)}
            want = {f"{pre}{group}/{s}.{agg}" for s in names for agg in ("count", "sum")
                    for pre in ["", *(f"rank{r}/" for r in range(WORLD))]}
            assert set(scalars) == want
            assert set(_tb_scalars(str(logdir / job / "metrics"))) == put_tags  # put metrics: their own run

    # OTLP: group and stat attributes as given
    if rx is not None:
        seen: dict[str, float] = defaultdict(float)
        for _res, metric, point, attrs in rx.points():
            assert attrs["group"] == GROUP_OTLP and attrs["job"] == job
            if metric.name == f"{attrs['stat']}.count" and "rank" not in attrs:
                seen[attrs["stat"]] = max(seen[attrs["stat"]], point.as_int)
        assert seen == {s: total_count for g, s in PAIRS if g == GROUP_OTLP}
    assert os.path.exists(rows_path)

