"""The shipped Prometheus rules (``shmstat prometheus-rules``) on three simulated hosts (tests/kit/cluster.py), as
docs/guides/many-nodes.md tells a user to set them up: on each host a node collector (``shmstat collect``, no
``--job``) serving ``/metrics`` with a ``--prometheus-sd`` target file, started before the job; a real multi-node
``torchrun`` job (gloo across the bridge, static rendezvous on host 1, two ranks per host) whose training script
calls ``shmstat.torch.instrument``; on the ops side a real Prometheus scraping every node and loading the rules
printed with short ``--interval``/``--windows``/``--hang-after`` (so each scenario takes seconds). Alerts are read
from Prometheus' ``/api/v1/alerts``, as Alertmanager gets them. Beside Prometheus, on the ops side, ``shmstat top
--nodes`` over the three hosts' endpoints and a ``collector.watch`` script (:class:`OpsView`) follow the same job:
:func:`check_top_nodes` reads what they show in scenarios 1, 3 and 4.

One job walks four scenarios in turn (the test steers its ranks through a control file, see
tests/kit/programs/many_nodes_train.py), each waiting for the previous one's alerts to resolve:

1. every rank of host 3 slowed 1.4x: ``ShmstatStragglerNode`` fires for host 3 and no rank alert fires for the
   healthy hosts;
2. one rank of host 2 slowed in its ``forward`` section: ``ShmstatStragglerRank`` names that rank, its host and
   the section, and no node alert fires;
3. one rank of host 1 stopped inside ``forward``: ``ShmstatHang`` names that rank, host and section while every
   other rank (the other hosts' too) waits in ``allreduce``;
4. host 2 killed mid-job (every process of its namespace SIGKILLed): ``ShmstatCollectorDown`` fires for it,
   nothing fires for the other hosts, whose ranks see the collective fail and end, and whose series in
   Prometheus stay exactly what their ranks did (forward passes per rank and per node)."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from kit.cluster import INTERFACE, OPS_ADDRESS, Cluster, Host, Proc, simulated_cluster
from kit.procs import REPO
from kit.prometheus import file_sd_job, needs_prometheus, prometheus_command, query
from kit.support import wait_for

from collector.jobwide.watch import JOB_HANG_EVENT, JOB_STRAGGLER_EVENT

RANKS_PER_HOST = 2
HOSTS = 3
INTERVAL_S = 3  # --interval: a rank is scored while it added samples within it
WINDOWS = 2  # --windows: a straggler alert fires after INTERVAL_S * WINDOWS seconds under the threshold
HANG_AFTER_S = 3.0
SLOW = 1.4  # the scenarios' slowdown: a score of 1/1.4 = 0.71, under the default threshold 0.75
PROMETHEUS_LISTEN = f"{OPS_ADDRESS}:9090"
_TRAIN = str(Path(REPO) / "tests" / "kit" / "programs" / "many_nodes_train.py")
_SHMSTAT = "import sys; from collector.cli.command import main; sys.exit(main())"  # the `shmstat` command

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="a real torchrun job needs PyTorch (pip install torch==2.13.0)")


def shmstat_command(host: Host, args: list[str], *, name: str) -> Proc:
    """``shmstat ARGS`` in ``host``, this worktree's code."""
    return host.popen([sys.executable, "-c", _SHMSTAT, *args], name=name, env=dict(host.env, PYTHONPATH=REPO),
                      cwd=REPO)


def alerts(cluster: Cluster, base: str) -> list[dict]:
    """Every alert Prometheus holds now (pending and firing), as its API gives them."""
    def get(url: str) -> list[dict]:
        with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=5) as r:
            return json.load(r)["data"]["alerts"]
    try:
        return cluster.ops.call(get, base)
    except OSError:  # not listening yet
        return []


def firing(cluster: Cluster, base: str, name: str | None = None) -> list[dict]:
    """The labels of every firing alert (of ``name``), the alert's name as ``alertname``."""
    return [a["labels"] for a in alerts(cluster, base)
            if a["state"] == "firing" and (name is None or a["labels"]["alertname"] == name)]


def named(labels: list[dict], *keys: str) -> set[tuple[str, ...]]:
    """``keys`` of each alert's labels, as a set of tuples."""
    return {tuple(a.get(k, "") for k in keys) for a in labels}


def show(cluster: Cluster, base: str, scenario: str) -> None:
    """Print the alerts Prometheus holds now, as its API gives them (the page's examples come from this)."""
    for a in sorted(alerts(cluster, base), key=lambda a: sorted(a["labels"].items())):
        labels = ", ".join(f"{k}={v}" for k, v in sorted(a["labels"].items()) if k != "alertname")
        print(f"[{scenario}] {a['labels']['alertname']} {a['state']} {{{labels}}} value={a['value']}: "
              f"{a['annotations'].get('summary', '')}")


def steer(control: Path, **what: object) -> None:
    """Tell every rank what to do (whole-file replace: a rank never reads half of it)."""
    tmp = control.with_suffix(".tmp")
    tmp.write_text(json.dumps(what) + "\n")
    tmp.replace(control)


def wait_alert(cluster: Cluster, base: str, until: Callable[[list[dict]], bool], timeout_s: float,
               what: str, seen: list[dict] | None = None) -> list[dict]:
    """Wait until ``until(firing alerts)``; returns those alerts, or fails with what was firing and pending.
    Every firing alert met on the way is appended to ``seen``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = firing(cluster, base)
        if seen is not None:
            seen.extend(now)
        if until(now):
            return now
        if time.monotonic() > deadline:
            held = [(a["labels"], a["state"], a["value"]) for a in alerts(cluster, base)]
            raise AssertionError(f"no {what} within {timeout_s} s; alerts: {held}\n{cluster.tails()}")
        time.sleep(0.2)


def quiet(cluster: Cluster, base: str, timeout_s: float = 30) -> None:
    """Wait until no straggler or hang alert is firing (the previous scenario's resolved)."""
    wait_alert(cluster, base, lambda now: not [a for a in now if a["alertname"] != "ShmstatCollectorDown"],
               timeout_s, "quiet (every alert resolved)")


@dataclass
class OpsView:
    """The job-wide view without Prometheus, on the ops side as the Many nodes page runs it: ``shmstat top
    --nodes`` over the three hosts' endpoints (frames printed one after the other: not a terminal) and a
    ``collector.watch`` script printing its events as JSON lines (tests/kit/programs/watch_events.py)."""

    top: Proc
    watch: Proc

    def mark(self) -> tuple[int, int]:
        """Where each one's output stands now (a scenario reads only what came after)."""
        return len(self.top.output()), len(self.watch.output())

    def frames(self, since: int) -> list[str]:
        """top's whole frames printed after ``since`` (the one being printed is left out)."""
        return [f for f in self.top.output()[since:].split("\n\n")[:-1] if f.startswith("job ")]

    def events(self, since: int, name: str) -> list[dict]:
        """The data of every ``name`` event the watcher printed after ``since`` (whole lines only)."""
        lines = self.watch.output()[since:].split("\n")[:-1]
        return [e["data"] for e in map(json.loads, lines) if e.get("name") == name]


_NODE_ROW = re.compile(r"(\S+)\s+(\d+) ranks\s+\S+\s+([\d.]+)( SLOW NODE)?")
_RANK_ROW = re.compile(r"\s+(\d+)\s+\S+\s+([\d.]+)( SLOW)?")


def top_rows(frame: str) -> tuple[list[tuple[str, bool]], dict[int, bool]]:
    """A frame's node rows (node, marked SLOW NODE) in order, and each rank row's mark (SLOW)."""
    nodes, ranks = [], {}
    for line in frame.splitlines():
        if m := _NODE_ROW.fullmatch(line.rstrip()):
            nodes.append((m[1], bool(m[4])))
        elif m := _RANK_ROW.fullmatch(line.rstrip()):
            ranks[int(m[1])] = bool(m[3])
    return nodes, ranks


def check_top_nodes(view: OpsView, since: tuple[int, int], scenario: str, expect: dict) -> str:
    """``shmstat top --nodes`` and ``collector.watch`` on the ops side, from ``since`` on (:meth:`OpsView.mark`
    when the scenario began): in "slow-node", ``expect["node"]`` marked ``SLOW NODE`` (and no other node, no rank
    of another node marked ``SLOW``) and named once as a node by a ``shmstat.job.straggler`` event; in "hang", the
    line naming ``expect["rank"]`` on ``expect["node"]`` in ``forward`` holding the job while the other hosts
    wait, and the ``shmstat.job.hang`` event saying the same; in "host-down" (``expect["node"]`` killed), no
    node or rank marked and no straggler or hang event since. Returns the frame that showed it (the last one)."""
    node, job = expect["node"], expect["job"]
    if scenario == "host-down":
        frames = view.frames(since[0])
        assert frames and not [f for f in frames if "SLOW" in f or "hang:" in f], frames
        assert [e for name in (JOB_STRAGGLER_EVENT, JOB_HANG_EVENT) for e in view.events(since[1], name)] == []
        return frames[-1]
    others = ",".join(n for n in expect["nodes"] if n != node)
    if scenario == "slow-node":
        def shown() -> str:
            return next((f for f in reversed(view.frames(since[0])) if (node, True) in top_rows(f)[0]), "")
        frame = wait_for(shown, 30, 0.2, what=f"top --nodes marking {node} SLOW NODE\n{view.top.tail(40)}")
        nodes, ranks = top_rows(frame)
        assert nodes == [(n, n == node) for n in expect["nodes"]], frame
        assert not [r for r, slow in ranks.items() if slow and r not in expect["ranks"]], frame
        wait_for(lambda: view.events(since[1], JOB_STRAGGLER_EVENT), 30, 0.2,
                 what=f"collector.watch's straggler events\n{view.watch.tail(40)}")
        named_now = view.events(since[1], JOB_STRAGGLER_EVENT)
        assert {e["node"] for e in named_now if e["rank"] == -1} == {node}, named_now
        assert {e["stat"] for e in named_now if e["rank"] == -1} <= {"forward", "backward"}, named_now
        assert [e for e in named_now if e["rank"] >= 0 and e["node"] != node] == [], named_now
        return frame
    assert scenario == "hang", scenario
    line = re.compile(rf"hang: job {re.escape(job)}: rank {expect['rank']} on node {node} in forward for \d+ s "
                      rf"holds the job; nodes {others} wait")

    def hung() -> str:
        return next((f for f in reversed(view.frames(since[0])) if line.search(f)), "")
    frame = wait_for(hung, 30, 0.2, what=f"top --nodes naming the hang\n{view.top.tail(40)}")
    events = wait_for(lambda: view.events(since[1], JOB_HANG_EVENT), 30, 0.2,
                      what=f"collector.watch's hang event\n{view.watch.tail(40)}")
    assert [(e["node"], e["rank"], e["section"], e["waiting"]) for e in events] == [
        (node, expect["rank"], "forward", others)], events
    assert line.fullmatch(events[0]["line"]), events
    return frame


@needs_torch
@needs_prometheus
@pytest.mark.slow
def test_three_hosts_the_shipped_rules_name_the_slow_node_the_slow_rank_the_hang_and_the_dead_host(tmp_path):
    started = time.monotonic()
    with simulated_cluster(tmp_path / "cluster", hosts=HOSTS) as cluster:
        _scenarios(cluster, tmp_path)
    print(f"three hosts, four scenarios: {time.monotonic() - started:.1f} s")


def _scenarios(cluster: Cluster, work: Path) -> None:
    hosts = cluster.hosts
    shared = work / "shared"
    shared.mkdir()
    rules = work / "shmstat-rules.yml"
    printed = cluster.ops.run([sys.executable, "-c", _SHMSTAT, "prometheus-rules", "--interval", str(INTERVAL_S),
                               "--windows", str(WINDOWS), "--hang-after", str(HANG_AFTER_S)], timeout=60)
    rules.write_text(printed)
    prom_dir = work / "prometheus"
    prom_dir.mkdir()
    prom = cluster.ops.popen(prometheus_command(prom_dir, file_sd_job(shared), PROMETHEUS_LISTEN, [rules]),
                             name="prometheus")
    base = f"http://{PROMETHEUS_LISTEN}"
    collectors = []
    for host in hosts:  # the page's plain node collector, with the hang detector's threshold of the rules
        collectors.append(shmstat_command(host, [
            "collect", "--publish", f"tcp://{host.address}:5557", "--allow-remote-publish",
            "--prometheus", f"{host.address}:9464",
            "--prometheus-sd", str(shared / f"{host.name}.json"), "--hang-after", str(HANG_AFTER_S),
            "--handler", f"*=jsonl:{work / f'{host.name}.metrics.jsonl'}"], name="collector"))
    for coll in collectors:
        wait_for(lambda c=coll: "serving every job" in c.notes() or c.popen.poll() is not None, 60,
                 what=f"{coll.name} to start")
        assert coll.popen.poll() is None, coll.tail()
    # the job across the nodes without Prometheus, as the page runs it (plain endpoints, as the collectors publish)
    endpoints = [f"{h.name}=tcp://{h.address}:5557" for h in hosts]
    ops_env = dict(cluster.ops.env, PYTHONPATH=REPO, COLUMNS="160")  # the hang line on one line
    view = OpsView(
        cluster.ops.popen([sys.executable, "-c", _SHMSTAT, "top", "--interval", "1", "--stat", "section/forward",
                           "--nodes", *endpoints], name="top-nodes", env=ops_env, cwd=REPO),
        cluster.ops.popen([sys.executable, str(Path(REPO) / "tests" / "kit" / "programs" / "watch_events.py"),
                           *endpoints], name="watch", env=ops_env, cwd=REPO))

    control = work / "control.json"
    steer(control)
    torchruns = []
    for i, host in enumerate(hosts):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(HOSTS), "--nproc-per-node",
                   str(RANKS_PER_HOST), "--node-rank", str(i), "--master-addr", hosts[0].address,
                   "--master-port", "29500", _TRAIN]
        env = dict(host.env, PYTHONPATH=REPO, OUT_DIR=str(work), CONTROL=str(control),
                   GLOO_SOCKET_IFNAME=INTERFACE, OMP_NUM_THREADS="1", TMPDIR=str(work),
                   SHMSTAT_SECTION_WINDOW_S="0.5")
        torchruns.append(host.popen(command, name="torchrun", env=env, cwd=work))
    ranks = {h.name: [i * RANKS_PER_HOST + r for r in range(RANKS_PER_HOST)] for i, h in enumerate(hosts)}
    every_rank = {(h, str(r)) for h, rs in ranks.items() for r in rs}

    def scored() -> bool:  # every rank's and node's forward scored job-wide
        try:
            got = cluster.ops.call(query, base, 'shmstat:straggler_score{group="section", stat="forward"}')
        except OSError:
            return False
        return named([r["metric"] for r in got], "node", "rank") == every_rank | {(h.name, "") for h in hosts}

    wait_for(lambda: scored() or any(t.popen.poll() is not None for t in torchruns), 120, 0.2,
             what=f"every rank's forward scored job-wide\n{cluster.tails()}")
    job = cluster.ops.call(query, base, "shmstat:straggler_score")[0]["metric"]["job"]
    healthy_for = INTERVAL_S * WINDOWS + 4
    time.sleep(healthy_for)  # a clean job, noise and all, fires nothing
    for which in ('rank!=""', 'rank=""'):  # the series a node exports (the page's "how it scales")
        print(f"[series] {which}: " + ", ".join(f"{r['metric']['node']} {r['value'][1]}" for r in cluster.ops.call(
            query, base, f'count by (node) ({{__name__=~"shmstat_.*", node!="", {which}}})')))
    assert firing(cluster, base) == [], cluster.tails()

    # 1. every rank of host 3 slowed 1.4x: the node alert names host 3; no rank alert for the healthy hosts
    slow_host = hosts[2].name
    since = view.mark()
    steer(control, slow={str(r): [SLOW, SLOW] for r in ranks[slow_host]})
    seen: list[dict] = []
    now = wait_alert(cluster, base, lambda f: {a["node"] for a in f if a["alertname"] == "ShmstatStragglerNode"}
                     == {slow_host}, 60, f"ShmstatStragglerNode for {slow_host}", seen)
    node_alerts = [a for a in now if a["alertname"] == "ShmstatStragglerNode"]
    assert {(a["job"], a["node"], a["group"], a.get("rank", "")) for a in node_alerts} == {
        (job, slow_host, "section", "")}, node_alerts
    assert {a["stat"] for a in node_alerts} <= {"forward", "backward"}
    assert {a["node"] for a in seen if a["alertname"] == "ShmstatStragglerRank"} <= {slow_host}, seen
    assert not [a for a in now if a["alertname"] in ("ShmstatHang", "ShmstatDataLost", "ShmstatCollectorDown")]
    names = [h.name for h in hosts]
    frame = check_top_nodes(view, since, "slow-node", {"job": job, "node": slow_host, "nodes": names,
                                                       "ranks": ranks[slow_host]})
    print(f"[top --nodes, slow node]\n{frame}")
    show(cluster, base, "slow node")
    steer(control)
    quiet(cluster, base)

    # 2. one rank of host 2 slowed in its forward section: the rank alert names it, its host and the section
    slow_rank = ranks[hosts[1].name][1]
    steer(control, slow={str(slow_rank): [SLOW, 1.0]})
    seen = []
    now = wait_alert(cluster, base, lambda f: any(a["alertname"] == "ShmstatStragglerRank" for a in f), 60,
                     f"ShmstatStragglerRank for rank {slow_rank}", seen)
    assert named([a for a in seen if a["alertname"].startswith("ShmstatStraggler")], "alertname", "node", "rank") \
        == {("ShmstatStragglerRank", hosts[1].name, str(slow_rank))}, seen
    assert named(firing(cluster, base, "ShmstatStragglerRank"), "job", "node", "rank", "group", "stat") == {
        (job, hosts[1].name, str(slow_rank), "section", "forward")}, now
    assert firing(cluster, base, "ShmstatStragglerNode") == [], "one slow rank of two is no slow node"
    show(cluster, base, "slow rank")
    steer(control)
    quiet(cluster, base)

    # 3. one rank of host 1 stopped inside forward: the hang names it while every other rank waits in allreduce
    held = ranks[hosts[0].name][1]
    since = view.mark()
    steer(control, hold=held)
    now = wait_alert(cluster, base, lambda f: any(a["alertname"] == "ShmstatHang" for a in f), 60,
                     f"ShmstatHang for rank {held}")
    assert named(firing(cluster, base, "ShmstatHang"), "job", "node", "rank", "section") == {
        (job, hosts[0].name, str(held), "forward")}, now
    waiting = cluster.ops.call(query, base, f'shmstat_rank_progress_age_seconds{{job="{job}"}}')
    assert {(r["metric"]["node"], r["metric"]["rank"], r["metric"]["section"], r["metric"]["wait"])
            for r in waiting} == {(h, r, "allreduce", "1") for h, r in every_rank - {(hosts[0].name, str(held))}} | {
        (hosts[0].name, str(held), "forward", "0")}
    frame = check_top_nodes(view, since, "hang", {"job": job, "node": hosts[0].name, "rank": held, "nodes": names})
    print(f"[top --nodes, hang]\n{frame}")
    show(cluster, base, "hang")
    steer(control)
    quiet(cluster, base)

    # 4. host 2 killed mid-job: its collector is down, nothing false fires for the others, their series exact
    dead = hosts[1]
    since = view.mark()
    assert dead.crash(), "host 2 ran nothing"
    seen = []
    now = wait_alert(cluster, base, lambda f: any(a["alertname"] == "ShmstatCollectorDown" for a in f), 60,
                     f"ShmstatCollectorDown for {dead.name}", seen)
    assert named(seen, "alertname", "node") == {("ShmstatCollectorDown", dead.name)}, seen
    assert named(firing(cluster, base, "ShmstatCollectorDown"), "node", "instance") == {
        (dead.name, f"{dead.address}:9464")}, now
    survivors = [h for h in hosts if h is not dead]
    tallies = {}
    for host in survivors:
        for rank in ranks[host.name]:
            path = work / f"rank{rank}.json"
            wait_for(path.exists, 60, 0.1, what=f"rank {rank} to end after host 2 died\n{cluster.tails()}")
            tallies[rank] = json.loads(path.read_text())
            assert tallies[rank]["ended"].startswith("collective failed"), tallies[rank]
            assert tallies[rank]["host"] == host.name and tallies[rank]["job"] == job

    def counted() -> dict[tuple[str, str], float]:
        got = cluster.ops.call(query, base, f'shmstat_stat_count_total{{job="{job}", group="section", '
                                            f'stat="forward", node!="{dead.name}"}}')
        return {(r["metric"]["node"], r["metric"].get("rank", "")): float(r["value"][1]) for r in got}

    exact = {(t["host"], str(rank)): float(t["forwards"]) for rank, t in tallies.items()} | {
        (h.name, ""): float(sum(tallies[r]["forwards"] for r in ranks[h.name])) for h in survivors}
    wait_for(lambda: counted() == exact, 30, 0.2, what=f"the survivors' forward counts {exact}: {counted()}")
    show(cluster, base, "host down")
    deadline = time.monotonic() + healthy_for  # for as long as a false alert would take to fire
    while time.monotonic() < deadline:
        now = firing(cluster, base)
        assert [a for a in now if a["alertname"] != "ShmstatCollectorDown"] == [], now
        assert named(now, "node") == {(dead.name,)}, now
        time.sleep(0.5)
    assert counted() == exact
    frame = check_top_nodes(view, since, "host-down", {"job": job, "node": dead.name, "nodes": names})
    print(f"[top --nodes, host down]\n{frame}")
    for proc in (view.top, view.watch):
        assert proc.stop(signal.SIGINT) == 0, proc.tail()
    print(f"[watch] {view.watch.output().splitlines()[-1]}")  # what it did not fold in: late rows, lost items
    for coll in collectors:
        if coll.popen.poll() is None:
            assert coll.stop() == 0, coll.tail()
    assert prom.stop() == 0, prom.tail()
