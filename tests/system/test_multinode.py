"""README's "Many nodes" recipe, run for real on the simulated cluster (tests/kit/cluster.py): two hosts, two ranks
each, every command taken from README.md (tests/kit/recipe.py). Step 1 makes the keys (``shmstat keys``) and
certificates (openssl: one CA, a server certificate per host, a client certificate for Prometheus), handed out as
the recipe says; on each host the unit's node collector (``shmstat collect``, no ``--job``) publishing every job on
the host's address with CURVE and serving ``/metrics`` over TLS with client certificates, started before the job;
each host's ``torchrun`` line (``--nnodes 2``, here ``--nproc-per-node 2`` of a DDP training script, gloo across the
bridge) with no shmstat option and no ``--rdzv-id``, so both hosts name the job ``none-<hash>`` on their own; on
the ops side a real Prometheus with the recipe's scrape configuration (https, ``tls_config``, the collectors'
``--prometheus-sd`` files) and the recipe's one ``shmstat subscribe --curve`` following both hosts.

Each host's rows are exactly its own ranks' samples, put metrics and events, under the one job id; Prometheus
sums both hosts to every sample and merges their p99 within the bucket error; the subscriber receives every event
of all ranks exactly once, each with its job and rank; subscribers without a key of the set receive nothing, each
node collector counts their attempts, and plain HTTP gets no figures; nothing of the job is left in either host's
/dev/shm, runtime directory or the shared target directory."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kit import recipe as recipe
from kit.cluster import INTERFACE, OPS_ADDRESS, Cluster, Host, Proc
from kit.procs import REPO, read_jsonl
from kit.prometheus import needs_prometheus, prometheus_command, query, value
from kit.support import wait_for
from kit.tls import needs_openssl

from shmstat.job.identity import identity_from_env

STEPS = 40
EVENT_EVERY = 10  # the training script's
RANKS_PER_HOST = 2
METRICS_PORT = 9464  # the recipe's; every host is a network of its own: fixed ports collide with nothing
PROMETHEUS_LISTEN = f"{OPS_ADDRESS}:9090"
_TRAIN = os.path.join(REPO, "tests", "kit", "programs", "multinode_train.py")
_SHMSTAT = "import sys; from collector.cli.command import main; sys.exit(main())"  # the `shmstat` command

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="a real torchrun job needs PyTorch (pip install torch==2.13.0)")


def shmstat_command(host: Host, args: list[str], *, name: str) -> Proc:
    """``shmstat ARGS`` in ``host``, this worktree's code."""
    return host.popen([sys.executable, "-c", _SHMSTAT, *args], name=name, env=dict(host.env, PYTHONPATH=REPO),
                      cwd=REPO)


def places_of(cluster: Cluster, work: Path) -> recipe.Places:
    """Where the recipe's places are for ``cluster``: under ``work``."""
    return recipe.Places([h.address for h in cluster.hosts], admin=work / "admin", shared=work / "shared",
                         prometheus=work / "prometheus-etc", subscriber=work / "ops-keys")


def hand_out(cluster: Cluster, places: recipe.Places, work: Path) -> None:
    """Step 1, then its files handed out as the recipe says: to each host's ``/etc/shmstat`` (``etc-<host>``) the
    key set without the subscribers' secrets, the CA and its own certificate as ``node.crt``/``node.key``, and a
    ``/var/lib/shmstat`` (``var-<host>``); Prometheus' files; the subscriber's ``server.key`` and
    ``ops.key_secret``. Also a stranger's directory (``stranger-keys``): ``server.key`` and the client secret
    of a key set the collectors never saw."""
    other = subprocess.Popen([sys.executable, "-c", _SHMSTAT, "keys", str(work / "other")], cwd=REPO,
                             env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    recipe.run_step_one(places)  # meanwhile
    assert other.wait(60) == 0, other.communicate()[1]
    admin = places.admin
    for i, host in enumerate(cluster.hosts):
        etc = work / f"etc-{host.name}"
        shutil.copytree(admin / "keys", etc / "keys", ignore=lambda _d, names: [
            n for n in names if n.endswith(".key_secret") and n != "server.key_secret"])
        shutil.copy(admin / "ca.crt", etc)
        for ext in ("crt", "key"):
            shutil.copy(admin / f"node{i + 1}.{ext}", etc / f"node.{ext}")  # README's nodes count from 1
        (work / f"var-{host.name}").mkdir()
    places.prometheus.mkdir()
    for name in ("ca.crt", "prometheus.crt", "prometheus.key"):
        shutil.copy(admin / name, places.prometheus)
    places.shared.mkdir()
    for where, secret in ((places.subscriber, admin / "keys" / "ops.key_secret"),
                          (work / "stranger-keys", work / "other" / "client.key_secret")):
        where.mkdir(mode=0o700)
        shutil.copy(admin / "keys" / "server.key", where)
        shutil.copy(secret, where)


def start_node_collectors(cluster: Cluster, places: recipe.Places, work: Path) -> list[Proc]:
    """The recipe's node collector in each host (its unit's ``ExecStart``), plus for the test: events to
    ``work/<host>.events.jsonl``, a 10 ms grace, heartbeats every 0.2 s and its status line only as it stops;
    returns once they all serve."""
    colls = []
    for i, h in enumerate(cluster.hosts):
        args = recipe.collector_args(places, i, h.name, work / f"etc-{h.name}", work / f"var-{h.name}")
        colls.append(shmstat_command(h, [*args, "--events", f"jsonl:{work / f'{h.name}.events.jsonl'}",
                                         "--handler", f"shmstat=jsonl:{work / f'{h.name}.collector.jsonl'}",
                                         "--grace-ms", "10", "--heartbeat-interval", "0.2", "--status-interval",
                                         "3600"], name="collector"))
    for coll in colls:
        wait_for(lambda c=coll: "serving every job" in c.notes() or c.popen.poll() is not None, 60,
                 what=f"{coll.name} to start")
        assert coll.popen.poll() is None, coll.tail()
    return colls


def torchrun_command(places: recipe.Places, node: int) -> list[str]:
    """The recipe's torchrun line of node ``node``, with ``--nproc-per-node 2`` and the test's training script."""
    args = recipe.torchrun_args(places, node)
    assert "--rdzv-id" not in args and not any("shmstat" in a for a in args), args
    args[args.index("--nproc-per-node") + 1] = str(RANKS_PER_HOST)
    assert args[-1] == "train.py", args
    return [sys.executable, "-m", "torch.distributed.run", *args[:-1], _TRAIN]


def the_job(command: list[str]) -> str:
    """The job id every host gives a torchrun job started with ``command`` (no ``--rdzv-id``): from torchrun's
    default run id and the ``--master-addr``/``--master-port`` every host was given."""
    ident = identity_from_env({"TORCHELASTIC_RUN_ID": "none",
                               "MASTER_ADDR": command[command.index("--master-addr") + 1],
                               "MASTER_PORT": command[command.index("--master-port") + 1]})
    assert ident is not None and ident.job.startswith("none-")
    return ident.job


def start_ops_prometheus(cluster: Cluster, places: recipe.Places, work: Path) -> tuple[Proc, str]:
    """A real Prometheus on the ops side with the recipe's scrape configuration, scraping every second; returns
    it and its base URL (query it with ``cluster.ops.call(query, base, promql)``)."""
    prom_dir = work / "prometheus"
    prom_dir.mkdir()
    command = prometheus_command(prom_dir, recipe.scrape_configs(places), PROMETHEUS_LISTEN)
    return cluster.ops.popen(command, name="prometheus"), f"http://{PROMETHEUS_LISTEN}"


def received(sub: Proc) -> list[dict]:
    """Every whole JSON line a subscriber printed so far."""
    return [json.loads(line) for line in sub.output().split("\n")[:-1]]


def heard(sub: Proc, job: str, what: Callable[[dict], bool]) -> set[str]:
    """The endpoints from which ``sub`` printed a line of ``job`` that ``what`` accepts."""
    return {line["source"] for line in received(sub) if line.get("job") == job and what(line)}


def run_job(cluster: Cluster, work: Path, commands: list[list[str]], collectors: list[Proc], subscriber: Proc,
            job: str) -> dict[int, dict]:
    """``commands[i]`` (torchrun) on host ``i``, its ranks let go once ``subscriber`` has a heartbeat of ``job``
    from every host; to its end and until every host's node collector let it go. Returns what each rank
    added, by global rank."""
    go = work / "go"
    procs = []
    for host, command in zip(cluster.hosts, commands, strict=True):
        env = dict(host.env, PYTHONPATH=REPO, OUT_DIR=str(work), STEPS=str(STEPS), GLOO_SOCKET_IFNAME=INTERFACE,
                   OMP_NUM_THREADS="1", TMPDIR=str(work), GO_FILE=str(go))  # torchrun's logs go with the test's
        procs.append(host.popen(command, name="torchrun", env=env, cwd=work))
    wait_for(lambda: len(heard(subscriber, job, lambda m: m.get("kind") == "heartbeat")) == len(cluster.hosts)
             or any(p.popen.poll() is not None for p in procs), 120, 0.05,
             what=f"a heartbeat of job {job} from every host\n{cluster.tails()}")
    go.touch()
    for proc in procs:
        assert proc.wait(150) == 0, cluster.tails()
    for coll in collectors:
        wait_for(lambda c=coll: f"job {job}'s segment removed" in c.notes(), 30,
                 what=f"{coll.name} to let the job go\n{cluster.tails()}")
    tallies = {}
    for rank in range(len(cluster.hosts) * RANKS_PER_HOST):
        with open(work / f"rank{rank}.json") as f:
            tallies[rank] = json.load(f)
    return tallies


@needs_torch
@needs_prometheus
@needs_openssl
def test_a_two_node_torchrun_job_under_the_secured_recipe_reconciles_everywhere(sim_cluster: Cluster, tmp_path):
    started = time.monotonic()
    work = tmp_path / "job"
    work.mkdir()
    hosts = sim_cluster.hosts
    places = places_of(sim_cluster, work)
    hand_out(sim_cluster, places, work)
    commands = [torchrun_command(places, i) for i in range(len(hosts))]
    job = the_job(commands[0])
    prom, base = start_ops_prometheus(sim_cluster, places, work)
    collectors = start_node_collectors(sim_cluster, places, work)
    sub_args = recipe.subscribe_args(places)
    endpoints = {f"tcp://{h.address}:5557": h.name for h in hosts}
    assert [a for a in sub_args if a.startswith("tcp://")] == list(endpoints)
    sub = shmstat_command(sim_cluster.ops, sub_args, name="subscriber")
    no_keys = shmstat_command(sim_cluster.ops, ["subscribe", "--json", *endpoints], name="no-keys")
    stranger = shmstat_command(sim_cluster.ops, ["subscribe", "--json", "--curve", str(work / "stranger-keys"),
                                                 *endpoints], name="stranger")
    tallies = run_job(sim_cluster, work, commands, collectors, sub, job)
    assert {(t["run_id"], t["job"]) for t in tallies.values()} == {("none", job)}, "one job id on both hosts"
    everything = [s for t in tallies.values() for s in t["samples"]]
    rows = {h.name: work / f"var-{h.name}" / "metrics.jsonl" for h in hosts}
    own = {h.name: work / f"{h.name}.collector.jsonl" for h in hosts}  # the collector's group, asked for by name

    # Prometheus on the ops side, over https: both hosts' counters add up to every sample, and their buckets
    # to a p99 within a bucket of the exact one
    merged = f'sum(shmstat_stat_count_total{{job="{job}", stat="step_ms", rank=""}})'
    _wait_for_prometheus(sim_cluster, base, merged, len(everything), 60, lambda: {
        h.name: _overwritten(read_jsonl(str(own[h.name])), job) for h in hosts})
    assert sorted(t["scrapeUrl"] for t in sim_cluster.ops.call(_targets, base)) == [
        f"https://{h.address}:{METRICS_PORT}/metrics" for h in hosts]
    by_node = {r["metric"]["node"]: float(r["value"][1]) for r in sim_cluster.ops.call(
        query, base, f'sum by (node) (shmstat_stat_count_total{{job="{job}", stat="step_ms", rank=""}})')}
    assert by_node == {h.name: RANKS_PER_HOST * STEPS for h in hosts}
    sums = f'sum(shmstat_stat_sum_total{{job="{job}", stat="step_ms", rank=""}})'
    assert _ops_value(sim_cluster, base, sums) == sum(everything)
    per_rank = sim_cluster.ops.call(
        query, base, f'shmstat_stat_count_total{{job="{job}", stat="step_ms", rank!=""}}')
    assert sorted((r["metric"]["node"], int(r["metric"]["rank"]), float(r["value"][1])) for r in per_rank) == [
        (t["host"], rank, STEPS) for rank, t in sorted(tallies.items())]
    puts = f'sum(shmstat_metric_count_total{{job="{job}", name="loss_x1000"}})'
    assert _ops_value(sim_cluster, base, puts) == len(tallies) * STEPS
    assert _ops_value(sim_cluster, base, puts.replace("_count_", "_sum_")) == sum(
        v for t in tallies.values() for v in t["losses"])
    exact = float(np.quantile(everything, 0.99, method="inverted_cdf"))
    p99 = _ops_value(sim_cluster, base, "histogram_quantile(0.99, sum by (le) "
                                        f'(shmstat_stat_hist_bucket{{job="{job}", stat="step_ms"}}))')
    assert p99 is not None and abs(p99 - exact) / exact <= 2 ** 0.25 - 1, (p99, exact)
    for host in hosts:  # plain HTTP gets no figures
        status, body = sim_cluster.ops.call(_plain_scrape, host.address)
        assert status == 400 and "shmstat_" not in body, (host.name, status, body[:200])

    # the one subscriber holding a key of the set received every event of all ranks of both hosts exactly once
    wait_for(lambda: heard(sub, job, lambda m: m.get("record") == "end") == set(endpoints), 30, 0.05,
             what=f"the subscriber to see job {job} end on every host\n{sim_cluster.tails()}")
    lines = received(sub)
    got = sorted((endpoints[m["source"]], m["rank"], it["data"]["rank"], it["data"]["step"]) for m in lines
                 if m.get("kind") == "event" and m.get("topic") == "event/train.progress" and m["job"] == job
                 for it in m["items"])
    assert got == sorted((t["host"], rank, rank, step) for rank, t in tallies.items()
                         for step in range(0, STEPS, EVENT_EVERY))
    assert sum(t["events"] for t in tallies.values()) == len(got)
    assert {m["job"] for m in lines if "kind" in m} == {job}
    assert [m for m in lines if m.get("record") == "gap"] == []
    # ... and those without one received nothing, having been turned away by both hosts
    for proc, why in ((no_keys, "lets in only CURVE subscribers"), (stranger, "refused this CURVE key")):
        wait_for(lambda p=proc, w=why: p.err.read_text().count(w) >= len(hosts), 30, 0.05,
                 what=f"{proc.name} to be turned away by every host\n{proc.tail()}")
    for proc in (sub, no_keys, stranger):
        assert proc.stop(signal.SIGINT) == 130, proc.tail()  # Ctrl-C's status
    for proc, why in ((no_keys, "lets in only CURVE subscribers"), (stranger, "refused this CURVE key")):
        assert proc.output() == "", f"{proc.name} received something"
        assert sorted(line.split(": ")[1] for line in proc.err.read_text().splitlines() if why in line) == sorted(
            endpoints), proc.tail()

    for coll in collectors:  # each counted the turned-away subscribers' attempts, and says so as it stops
        assert coll.stop() == 0, coll.tail()
        final = coll.err.read_text().splitlines()[-1]
        assert re.search(r", [1-9]\d* subscriber keys refused, [1-9]\d* subscriber handshakes failed", final), final
    assert prom.stop() == 0, prom.tail()

    # each host's jsonl: exactly its own ranks' samples, put metrics and events
    for host in hosts:
        mine = {rank: t for rank, t in tallies.items() if t["host"] == host.name}
        assert len(mine) == RANKS_PER_HOST
        _reconcile_host(read_jsonl(str(rows[host.name])), read_jsonl(str(own[host.name])),
                        read_jsonl(str(work / f"{host.name}.events.jsonl")), job, mine)

    # nothing of the job is left on either host, nor a target file
    for host in hosts:
        assert host.shm() == [], f"{host.name}'s /dev/shm"
        assert [n for n in host.run_files() if job in n] == [], f"{host.name}'s runtime directory"
    assert os.listdir(places.shared) == []
    print(f"the secured recipe on two hosts, torchrun job included: {time.monotonic() - started:.1f} s")


def _plain_scrape(address: str) -> tuple[int, str]:
    """The status and body of a plain-HTTP GET of ``/metrics`` at ``address``."""
    try:
        with urllib.request.urlopen(f"http://{address}:{METRICS_PORT}/metrics", timeout=10) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


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


def _overwritten(rows: list[dict], job: str) -> int | None:
    """The newest ``collector.windows_overwritten`` of the job's collector in a host's rows."""
    counts = [r["value"] for r in rows if r["name"] == "collector.windows_overwritten" and r.get("job") == job]
    return counts[-1] if counts else None


def _ops_value(cluster: Cluster, base: str, promql: str) -> float | None:
    try:
        return cluster.ops.call(value, base, promql)
    except OSError:  # Prometheus not listening yet
        return None


def _reconcile_host(rows: list[dict], own: list[dict], events: list[dict], job: str,
                    mine: dict[int, dict]) -> None:
    """The rows of one host's node collector are exactly what its ranks added: per rank and merged, every
    sample counted once and summed exactly; every put value once; every event once, none of another host's."""
    assert rows and all(r["job"] == job for r in rows if r["group"] in ("train", "trainer"))
    assert not [r for r in rows if r["group"] == "shmstat"], "the collector's group reached '*' unasked"
    assert _overwritten(own, job) == 0, ("the node collector lost windows to the ring (starved of CPU for "
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
                        and e.get("job") == job and e.get("rank") == rank)
        assert logged == list(range(0, STEPS, EVENT_EVERY))
    merged = [r for r in stat if r["rank"] is None]
    assert sum(r["value"] for r in merged if r["name"] == "step_ms.count") == sum(
        len(t["samples"]) for t in mine.values())
    assert sum(r["value"] for r in merged if r["name"] == "step_ms.sum") == sum(
        s for t in mine.values() for s in t["samples"])
    assert {r["name"] for r in merged} >= {"step_ms.p50", "step_ms.p99"}
    assert {e.get("rank") for e in events if e.get("name") == "train.progress"} == set(mine)
