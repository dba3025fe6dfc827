"""A real multi-node torchrun job on the simulated cluster (tests/cluster.py): two hosts, two ranks each, a DDP
training script (gloo across the bridge) with no shmstat configuration, one node collector per host (``shmstat
collect``, no ``--job``) writing jsonl and serving ``/metrics`` on the host's fabric address, and a real
Prometheus on the ops side scraping both. Each host's rows are exactly its own ranks' samples, put metrics and
events; Prometheus sums both hosts to every sample of the job and merges their p99 within the bucket error; and
nothing of the job is left in either host's /dev/shm or runtime directory."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from _procs import REPO, read_jsonl
from _prom_kit import needs_prometheus, prometheus_command, query, static_job, value
from _support import unique_job, wait_for
from cluster import INTERFACE, OPS_ADDRESS, Cluster, Host, Proc

STEPS = 40
RANKS_PER_HOST = 2
METRICS_PORT = 9464  # every host is a network of its own: fixed ports collide with nothing
MASTER_PORT = 29500
PUBLISH_PORT = 5555
PROMETHEUS_LISTEN = f"{OPS_ADDRESS}:9090"
_TRAIN = os.path.join(REPO, "tests", "scripts", "multinode_train.py")
_SHMSTAT = "import sys; from collector.cli.command import main; sys.exit(main())"  # the `shmstat` command

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="a real torchrun job needs PyTorch (pip install torch==2.13.0)")


def shmstat_command(host: Host, args: list[str], *, name: str) -> Proc:
    """``shmstat ARGS`` in ``host``, this worktree's code."""
    return host.popen([sys.executable, "-c", _SHMSTAT, *args], name=name, env=dict(host.env, PYTHONPATH=REPO),
                      cwd=REPO)


def start_node_collectors(hosts: list[Host], workdir: Path,
                          per_host: Callable[[Host], Sequence[str]] = lambda h: ()) -> list[Proc]:
    """A node collector in each host as a user starts one: every job of the user, rows to
    ``workdir/<host>.jsonl``, events to ``workdir/<host>.events.jsonl``, ``/metrics`` on the host's fabric
    address, plus the options ``per_host(host)``; returns once they all serve."""
    colls = [shmstat_command(h, ["collect", "--handler", f"*=jsonl:{workdir / f'{h.name}.jsonl'}", "--events",
                                 f"jsonl:{workdir / f'{h.name}.events.jsonl'}", "--prometheus",
                                 f"{h.address}:{METRICS_PORT}", "--grace-ms", "10", "--status-interval", "0",
                                 *per_host(h)], name="collector") for h in hosts]
    for coll in colls:
        wait_for(lambda c=coll: "serving every job" in c.output() or c.popen.poll() is not None, 60,
                 what=f"{coll.name} to start")
        assert coll.popen.poll() is None, coll.tail()
    return colls


def start_torchrun(host: Host, node_rank: int, cluster: Cluster, run_id: str, workdir: Path) -> Proc:
    """``torchrun`` of the training script on ``host`` as node ``node_rank`` of the cluster's (static rendezvous on
    the first host's address), environment as a plain host's plus the worktree on the path and gloo on the
    fabric."""
    env = dict(host.env, PYTHONPATH=REPO, OUT_DIR=str(workdir), STEPS=str(STEPS), GLOO_SOCKET_IFNAME=INTERFACE,
               OMP_NUM_THREADS="1", TMPDIR=str(workdir))  # torchrun's log directories go with the test's files
    return host.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.hosts)),
                       "--nproc-per-node", str(RANKS_PER_HOST), "--node-rank", str(node_rank), "--master-addr",
                       cluster.hosts[0].address, "--master-port", str(MASTER_PORT), "--rdzv-id", run_id, _TRAIN],
                      name="torchrun", env=env, cwd=workdir)


def start_ops_prometheus(cluster: Cluster, workdir: Path) -> tuple[Proc, str]:
    """A real Prometheus on the ops side scraping every host's node collector every second; returns it and
    its base URL (query it with ``cluster.ops.call(query, base, promql)``)."""
    prom_dir = workdir / "prometheus"
    prom_dir.mkdir()
    targets = [f"{h.address}:{METRICS_PORT}" for h in cluster.hosts]
    prom = cluster.ops.popen(prometheus_command(prom_dir, static_job(targets), PROMETHEUS_LISTEN), name="prometheus")
    return prom, f"http://{PROMETHEUS_LISTEN}"


def publish_on_fabric(host: Host) -> list[str]:
    """The node collector options that publish its streams on the host's fabric address, for a subscriber on the
    ops side: ``start_node_collectors(hosts, workdir, publish_on_fabric)`` (needs the node collector's
    ``--publish``, which is not there yet)."""
    return ["--publish", f"tcp://{host.address}:{PUBLISH_PORT}", "--allow-remote-publish"]


def start_ops_subscriber(cluster: Cluster, *extra: str) -> Proc:
    """``shmstat subscribe --json`` on the ops side, following every host's node collector as
    :func:`publish_on_fabric` publishes it; read what it received with :func:`subscribed_events`. With the node
    collector's ``--publish``, a test of one subscriber receiving every event of all ranks of both hosts is this,
    the job above and a comparison with the tallies' ``events``."""
    endpoints = [f"tcp://{h.address}:{PUBLISH_PORT}" for h in cluster.hosts]
    return shmstat_command(cluster.ops, ["subscribe", "--json", *extra, *endpoints], name="subscriber")


def subscribed_events(sub: Proc, run_id: str, name: str = "train.progress") -> dict[tuple[str, int], int]:
    """How many ``name`` events of ``run_id`` a subscriber printed, by (source endpoint, rank)."""
    got: dict[tuple[str, int], int] = {}
    for line in sub.output().splitlines():
        msg = json.loads(line)
        if msg.get("kind") == "event" and msg.get("topic") == f"event/{name}" and msg.get("job") == run_id:
            key = (msg["source"], msg["rank"])
            got[key] = got.get(key, 0) + len(msg["items"])
    return got


def run_job(cluster: Cluster, workdir: Path, run_id: str, collectors: list[Proc]) -> dict[int, dict]:
    """The training job on every host under torchrun (``--rdzv-id run_id``), to its end and until every host's
    node collector let it go; returns what each rank added, by global rank."""
    jobs = [start_torchrun(h, r, cluster, run_id, workdir) for r, h in enumerate(cluster.hosts)]
    for job in jobs:
        assert job.wait(150) == 0, cluster.tails()
    for coll in collectors:
        wait_for(lambda c=coll: f"job {run_id}'s segment removed" in c.output(), 30,
                 what=f"{coll.name} to let the job go\n{cluster.tails()}")
    tallies = {}
    for rank in range(len(cluster.hosts) * RANKS_PER_HOST):
        with open(workdir / f"rank{rank}.json") as f:
            tallies[rank] = json.load(f)
    return tallies


@needs_torch
@needs_prometheus
def test_a_two_node_torchrun_job_reconciles_on_each_host_and_in_prometheus(sim_cluster: Cluster, tmp_path):
    started = time.monotonic()
    work = tmp_path / "job"
    work.mkdir()
    run_id = unique_job("mn")
    hosts = sim_cluster.hosts
    prom, base = start_ops_prometheus(sim_cluster, work)
    collectors = start_node_collectors(hosts, work)
    tallies = run_job(sim_cluster, work, run_id, collectors)
    everything = [s for t in tallies.values() for s in t["samples"]]

    # (b) Prometheus on the ops side: both hosts' counters add up to every sample, and their buckets to a p99
    # within a bucket of the exact one
    merged = f'sum(shmstat_stat_count_total{{job="{run_id}", stat="step_ms", rank=""}})'
    _wait_for_prometheus(sim_cluster, base, merged, len(everything), 60, lambda: {
        h.name: _overwritten(read_jsonl(str(work / f"{h.name}.jsonl")), run_id) for h in hosts})
    by_node = {r["metric"]["node"]: float(r["value"][1]) for r in sim_cluster.ops.call(
        query, base, f'sum by (node) (shmstat_stat_count_total{{job="{run_id}", stat="step_ms", rank=""}})')}
    assert by_node == {h.name: RANKS_PER_HOST * STEPS for h in hosts}
    sums = f'sum(shmstat_stat_sum_total{{job="{run_id}", stat="step_ms", rank=""}})'
    assert _ops_value(sim_cluster, base, sums) == sum(everything)
    per_rank = sim_cluster.ops.call(
        query, base, f'shmstat_stat_count_total{{job="{run_id}", stat="step_ms", rank!=""}}')
    assert sorted((r["metric"]["node"], int(r["metric"]["rank"]), float(r["value"][1])) for r in per_rank) == [
        (t["host"], rank, STEPS) for rank, t in sorted(tallies.items())]
    puts = f'sum(shmstat_metric_count_total{{job="{run_id}", name="loss_x1000"}})'
    assert _ops_value(sim_cluster, base, puts) == len(tallies) * STEPS
    assert _ops_value(sim_cluster, base, puts.replace("_count_", "_sum_")) == sum(
        v for t in tallies.values() for v in t["losses"])
    exact = float(np.quantile(everything, 0.99, method="inverted_cdf"))
    p99 = _ops_value(sim_cluster, base, "histogram_quantile(0.99, sum by (le) "
                                        f'(shmstat_stat_hist_bucket{{job="{run_id}", stat="step_ms"}}))')
    assert p99 is not None and abs(p99 - exact) / exact <= 2 ** 0.25 - 1, (p99, exact)

    for coll in collectors:
        assert coll.stop() == 0, coll.tail()
    assert prom.stop() == 0, prom.tail()

    # (a) each host's jsonl: exactly its own ranks' samples, put metrics and events
    for host in hosts:
        mine = {rank: t for rank, t in tallies.items() if t["host"] == host.name}
        assert len(mine) == RANKS_PER_HOST
        _reconcile_host(read_jsonl(str(work / f"{host.name}.jsonl")),
                        read_jsonl(str(work / f"{host.name}.events.jsonl")), run_id, mine)

    # (c) nothing of the job is left on either host
    for host in hosts:
        assert host.shm() == [], f"{host.name}'s /dev/shm"
        assert [n for n in host.run_files() if run_id in n] == [], f"{host.name}'s runtime directory"
    print(f"two-node torchrun job, collectors and Prometheus: {time.monotonic() - started:.1f} s")


def _wait_for_prometheus(cluster: Cluster, base: str, promql: str, want: float, timeout_s: float,
                         overwritten: Callable[[], object]) -> None:
    """Wait until ``promql`` is ``want`` in Prometheus on the ops side; else fail saying what it had, how its
    scrapes went and the windows each node collector lost to the ring (``overwritten()``)."""
    deadline = time.monotonic() + timeout_s
    while (got := _ops_value(cluster, base, promql)) != want:
        if time.monotonic() > deadline:
            try:
                targets = [(t["scrapeUrl"], t["health"], t["lastError"], t["lastScrapeDuration"])
                           for t in cluster.ops.call(_targets, base)]
            except OSError as exc:
                targets = [repr(exc)]
            raise AssertionError(f"{promql} is {got}, not {want}, after {timeout_s} s; scrapes: {targets}; "
                                 f"windows overwritten: {overwritten()}\n{cluster.tails()}")
        time.sleep(0.1)


def _targets(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=5) as r:
        return json.load(r)["data"]["activeTargets"]


def _overwritten(rows: list[dict], run_id: str) -> int | None:
    """The newest ``collector.windows_overwritten`` of the job's collector in a host's rows."""
    counts = [r["value"] for r in rows if r["name"] == "collector.windows_overwritten" and r.get("job") == run_id]
    return counts[-1] if counts else None


def _ops_value(cluster: Cluster, base: str, promql: str) -> float | None:
    try:
        return cluster.ops.call(value, base, promql)
    except OSError:  # Prometheus not listening yet
        return None


def _reconcile_host(rows: list[dict], events: list[dict], run_id: str, mine: dict[int, dict]) -> None:
    """The rows of one host's node collector are exactly what its ranks added: per rank and merged, every
    sample counted once and summed exactly; every put value once; every event once, none of another host's."""
    assert rows and all(r["job"] == run_id for r in rows if r["group"] in ("train", "trainer"))
    assert _overwritten(rows, run_id) == 0, ("the node collector lost windows to the ring (starved of CPU for "
                                             "longer than 3 windows): the figures below cannot be exact")
    stat = [r for r in rows if r["group"] == "train"]
    assert {r["rank"] for r in stat} == {*mine, None}, "a host's rows are its own ranks' and their merge"
    for rank, tally in mine.items():
        counts = [r for r in stat if r["name"] == "step_ms.count" and r["rank"] == rank]
        assert sum(r["value"] for r in counts) == len(tally["samples"]) == STEPS
        assert len({r["window_start"] for r in counts}) == len(counts), "a window emitted twice"
        assert sum(r["value"] for r in stat if r["name"] == "step_ms.sum" and r["rank"] == rank) == sum(
            tally["samples"])
        puts = [r["value"] for r in rows if r["group"] == "trainer" and r["rank"] == rank]
        assert puts == tally["losses"]
        assert (tally["events_sent"], tally["events_dropped"]) == (tally["events"] + STEPS, 0)
        logged = sorted(e["data"]["step"] for e in events if e.get("name") == "train.progress"
                        and e.get("job") == run_id and e.get("rank") == rank)
        assert logged == list(range(0, STEPS, 10))
    merged = [r for r in stat if r["rank"] is None]
    assert sum(r["value"] for r in merged if r["name"] == "step_ms.count") == sum(
        len(t["samples"]) for t in mine.values())
    assert sum(r["value"] for r in merged if r["name"] == "step_ms.sum") == sum(
        s for t in mine.values() for s in t["samples"])
    assert {r["name"] for r in merged} >= {"step_ms.p50", "step_ms.p99"}
    assert {e.get("rank") for e in events if e.get("name") == "train.progress"} == set(mine)
