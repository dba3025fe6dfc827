"""Many nodes: a node collector's cost and end-to-end event latency, CURVE on and off, side by side (issue 26).

Usage (as root: it builds a simulated cluster of network, mount and UTS namespaces)::

    python scripts/multinode_bench.py                  # 2 hosts x 2 ranks, 1,000 events/s per rank, 2 rounds of 10 s
    python scripts/multinode_bench.py --seconds 1 --rate 100 --rounds 1   # a smoke run

It imports the test kit ``tests/kit/cluster.py`` (the simulated hosts: each its own network, ``/dev/shm``, runtime
directory and hostname, joined by a bridge to an ops namespace at 10.77.0.254) by putting the repository's
``tests/`` directory on ``sys.path``. Where namespaces, veth pairs or bridges cannot be made it exits with status 2
and one line saying why.

One cluster serves the whole run; the modes run back to back, alternating (plain, CURVE, then CURVE, plain, ...),
each on fresh collectors, a fresh job and a fresh port. Per run, on every host: a node collector (``shmstat
collect``, no ``--job``, ``--handler *=null``) publishing every job on ``tcp://<host address>:PORT`` — with
``--allow-remote-publish`` (plain TCP) or ``--curve DIR`` (keys of ``shmstat keys DIR``) — and ``--ranks-per-host``
rank processes (no torch: ``shmstat.init`` + a ``Stat.add`` and a ``log_event`` per tick, ``--rate`` ticks per
second on a fixed schedule, each event's data carrying ``time.time_ns()`` taken just before it is logged). On the
ops side one subscriber process (pyzmq SUB sockets, one per host, CURVE client keys in CURVE mode) takes the receive
time of every message before decoding it: latency = receive time - send time (one machine, one clock: namespaces do
not change ``CLOCK_REALTIME``). Everything is started, and every subscription is in place, before the ranks' first
event. Sent (events logged) and received (distinct events, duplicates apart) must match: any difference is loss.

Cost: CPU seconds (user + system, all threads) of each node collector process per wall second over the steady part
(from a warm-up of up to 1 s after the first event to the last event's scheduled time), read with psutil from this
script (only network, mount and UTS namespaces are unshared, so the collectors' pids are this namespace's: checked
for each one), and its RSS at the end of that part. The ops subscriber's and the ranks' CPU are read the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)
for _path in (REPO, os.path.join(REPO, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MODES = {"plain": "plain TCP", "curve": "CURVE"}
_SHMSTAT = "import sys; from collector.cli.command import main; sys.exit(main())"  # the `shmstat` command
_EVENT = "bench"
COLLECTOR_GROUP = "shmstat"  # shmstat.names.COLLECTOR_GROUP: the collector's own figures, on stat/shmstat/usage
_COUNTERS = {f"collector.{n}" for n in ("events_relayed", "seq_gaps", "subscriber_queue_full_event",
                                        "key_revocations", "handshakes_refused")}


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"multinode_bench: {msg}", file=sys.stderr, flush=True)


def write_json(path: str | Path, data: object) -> None:
    """``data`` as JSON at ``path``, whole or not at all (readers poll for the file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


# ================================================================================= the processes of a run


def rank_worker(cfg: dict[str, Any]) -> None:
    """One rank: attach, get the collector's subscription, say ready, then on the go file's start time log
    ``rate`` events/s (and add as many samples) for ``seconds``; write what it sent to ``cfg["out"]``."""
    import shmstat
    from shmstat import Aggregation as A
    from shmstat.job import _state

    shmstat.init(cfg["job"], rank=cfg["rank"], local_rank=cfg["local_rank"], world_size=cfg["world"])
    stat = shmstat.Stat("step_ms", [A.COUNT, A.SUM, A.MAX], 1.0, group="bench")
    pub = _state.STATE.publisher
    assert pub is not None
    shmstat.log_event(shmstat.Event("warmup", dt.datetime.now(), {"rank": cfg["rank"]}))  # not subscribed to
    wait_until(lambda: pub.stats().subscribed, 60, "the collector's subscription")
    pub.flush(10)
    write_json(cfg["ready"], {"pid": os.getpid()})
    wait_until(lambda: os.path.exists(cfg["go"]), 120, "the go file")
    start_ns = int(read_json(cfg["go"])["start"] * 1e9)
    n = round(cfg["seconds"] * cfg["rate"])
    period_ns = 1e9 / cfg["rate"]
    event, now, log_event, add = shmstat.Event, dt.datetime.now, shmstat.log_event, stat.add
    max_late_ns = 0
    for i in range(n):
        delay = start_ns + int(i * period_ns) - time.time_ns()
        if delay > 0:
            time.sleep(delay / 1e9)
        else:
            max_late_ns = max(max_late_ns, -delay)
        add(float(i % 100))
        log_event(event(_EVENT, now(), {"t": time.time_ns(), "i": i, "last": i == n - 1}))
    shmstat.shutdown(flush_timeout_s=30)
    st = pub.stats()
    write_json(cfg["out"], {"logged": n, "queued": st.queued, "sent": st.sent_items, "dropped": st.dropped,
                            "max_late_ms": max_late_ns / 1e6})


def subscriber_worker(cfg: dict[str, Any]) -> None:
    """The ops-side subscriber: a SUB socket per host (CURVE client keys if ``cfg["curve"]``); says ready once every
    host's heartbeat of the job came through, then records every event's latency until each rank's last event
    arrived (or the deadline); writes what it received to ``cfg["out"]``."""
    import zmq

    from shmstat.errors import WireError
    from shmstat.wire import decode_with_job

    ctx = zmq.Context()
    poller = zmq.Poller()
    socks: dict[zmq.Socket[bytes], str] = {}
    for host, endpoint in cfg["endpoints"].items():
        sock = ctx.socket(zmq.SUB)
        sock.rcvhwm = 0  # the instrument must not lose what the collector sent
        if cfg["curve"]:
            from collector.relay.curve import load_client, secure_client

            secure_client(sock, load_client(cfg["curve"]))
        sock.subscribe(f"event/{_EVENT}".encode())
        sock.subscribe(b"heartbeat/")
        sock.subscribe(f"stat/{COLLECTOR_GROUP}/usage".encode())  # the collector's own counters, once a second
        sock.connect(endpoint)
        poller.register(sock, zmq.POLLIN)
        socks[sock] = host
    job, expected = cfg["job"], set(cfg["ranks"])
    beaten: set[str] = set()
    seen: dict[int, set[int]] = {r: set() for r in expected}
    duplicates, wire_errors, others = 0, 0, 0
    done: set[int] = set()
    latencies_us: list[int] = []
    messages = 0
    next_seq: dict[tuple[int, int, int], int] = {}  # the wire's sequence numbers, per sender: where a loss was
    gaps: list[list[Any]] = []
    deadline = cfg["deadline"]
    counters: dict[str, dict[str, Any]] = {}  # host -> the newest of the collector's counters kept below
    counted_at: dict[str, int] = {}
    completed_ns = 0  # when every rank's last event was in; then wait for every host's next counters
    while time.time() < deadline and not (completed_ns and all(counted_at.get(h, 0) > completed_ns for h in
                                                               cfg["endpoints"])):
        if not completed_ns and done == expected:
            completed_ns = time.time_ns()
            deadline = min(deadline, time.time() + 3)
        for sock, _ in poller.poll(100):
            frames = sock.recv_multipart()
            t_recv = time.time_ns()
            try:
                msg, msg_job = decode_with_job(frames)
            except WireError:
                wire_errors += 1
                continue
            if msg_job != job:
                others += 1
            elif msg.kind == "heartbeat":
                if socks[sock] not in beaten:
                    beaten.add(socks[sock])
                    if len(beaten) == len(socks):
                        write_json(cfg["ready"], {"pid": os.getpid()})
            elif msg.kind == "stat":
                host = socks[sock]
                for item in msg.items:
                    if item.get("name") in _COUNTERS and item.get("rank") is None:
                        counters.setdefault(host, {})[item["name"].split(".", 1)[1]] = item["value"]
                counted_at[host] = t_recv
            elif msg.kind == "event":
                messages += 1
                sender = (msg.rank, msg.pid, msg.incarnation)
                if sender in next_seq and msg.seq != next_seq[sender]:
                    gaps.append([msg.rank, next_seq[sender], msg.seq, socks[sock], t_recv])
                next_seq[sender] = msg.seq + len(msg.items)
                got = seen.setdefault(msg.rank, set())
                for _name, _ts, data in msg.items:
                    latencies_us.append((t_recv - data["t"]) // 1000)
                    if data["i"] in got:
                        duplicates += 1
                    got.add(data["i"])
                    if data["last"]:
                        done.add(msg.rank)
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    write_json(cfg["out"], {"latencies_us": latencies_us, "received": {str(r): len(s) for r, s in seen.items()},
                            "duplicates": duplicates, "messages": messages, "wire_errors": wire_errors,
                            "other_jobs": others, "complete": done == expected, "gaps": gaps,
                            "collector_counters": counters,
                            "missing": {str(r): _ranges(sorted(set(range(max(s, default=-1) + 1)) - s))
                                        for r, s in seen.items()}})


def _ranges(values: list[int]) -> list[list[int]]:
    """``values`` (sorted) as [first, last] runs."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return runs


# ================================================================================= one run, on the cluster


@dataclass
class RunResult:
    """What one run of one mode measured."""

    mode: str
    index: int
    sent: int = 0
    received: int = 0
    duplicates: int = 0
    dropped: int = 0  # counted by the ranks' publishers
    latencies_us: list[int] = field(default_factory=list)
    collector_cpu: dict[str, float] = field(default_factory=dict)  # host -> CPU s per wall s
    collector_rss_mib: dict[str, float] = field(default_factory=dict)
    collector_idle_cpu: dict[str, float] = field(default_factory=dict)  # the same, ranks attached but not sending
    collector_io_cpu: dict[str, float] = field(default_factory=dict)  # its libzmq I/O threads' part
    subscriber_cpu: float = 0.0
    rank_cpu: float = 0.0  # mean over ranks, CPU s per wall s
    steady_s: float = 0.0
    max_late_ms: float = 0.0
    messages: int = 0  # event messages received (a rank's publisher batches the events it has at hand)
    overflowed: int = 0  # times an event message found a subscriber queue full (the collectors count)
    problems: list[str] = field(default_factory=list)


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _io_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s libzmq I/O threads (where CURVE encrypts and TCP is written), by thread name."""
    import psutil

    total = 0.0
    for t in psutil.Process(pid).threads():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{t.id}/comm", encoding="utf-8") as f:
            if f.read().startswith("ZMQbg/IO"):
                total += t.user_time + t.system_time
    return total


def _check_pid(pid: int, host: Any) -> None:
    """The collector ``pid`` is this script's pid namespace's and runs in ``host``'s network namespace."""
    if os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid"):
        raise RuntimeError(f"collector pid {pid} is in another pid namespace: psutil cannot read it from here")
    if os.readlink(f"/proc/{pid}/ns/net") != host.netns:
        raise RuntimeError(f"pid {pid} is not in {host.name}'s network namespace")


@dataclass
class Started:
    """The processes of one run, once every one of them is ready."""

    collectors: list[Any]  # cluster.Proc, one per host
    collector_pids: dict[str, int]  # host -> pid (checked: this pid namespace, that host's network namespace)
    subscriber: Any
    ranks: list[Any]
    rank_ids: list[int]


def start_run(cluster: Any, mode: str, index: int, args: argparse.Namespace, run_dir: Path, keys: str) -> Started:
    """Start the node collectors, the ops subscriber and the ranks of one run; return once every rank is collected
    and the subscriber hears every host (raises if something exits or a wait times out)."""
    job, port = f"mnb{index}-{mode}-{os.getpid()}", args.port + index
    hosts, per_host = cluster.hosts, args.ranks_per_host
    opts = ["--allow-remote-publish"] if mode == "plain" else ["--curve", keys]
    colls = [h.popen([sys.executable, "-c", _SHMSTAT, "collect", "--publish", f"tcp://{h.address}:{port}", *opts,
                      "--handler", "*=null", "--status-interval", str(args.status_interval), "--ready-file",
                      str(run_dir / f"{h.name}.ready.json")], name=f"collector{index}",
                     env=dict(h.env, PYTHONPATH=REPO), cwd=REPO) for h in hosts]
    procs: list[Any] = list(colls)

    def alive_and(path: Path) -> bool:
        dead = [p for p in procs if p.popen.poll() is not None]  # nothing ends before the ranks' go
        if dead:
            raise RuntimeError(f"{dead[0].name} exited early\n{dead[0].tail()}")
        return path.exists()

    pids = {}
    for h in hosts:
        wait_until(lambda h=h: alive_and(run_dir / f"{h.name}.ready.json"), 60, f"{h.name}'s collector")
        pids[h.name] = read_json(run_dir / f"{h.name}.ready.json")["pid"]
        _check_pid(pids[h.name], h)
    rank_ids = [i * per_host + local for i in range(len(hosts)) for local in range(per_host)]
    sub_cfg = {"job": job, "endpoints": {h.name: f"tcp://{h.address}:{port}" for h in hosts}, "ranks": rank_ids,
               "curve": keys if mode == "curve" else None, "ready": str(run_dir / "sub.ready"),
               "out": str(run_dir / "sub.json"), "deadline": time.time() + args.seconds + 120}
    sub = cluster.ops.popen([sys.executable, SCRIPT, "--subscriber-worker", json.dumps(sub_cfg)],
                            name=f"subscriber{index}", env=dict(cluster.ops.env, PYTHONPATH=REPO), cwd=REPO)
    procs.append(sub)
    ranks = []
    for g in rank_ids:
        h = hosts[g // per_host]
        cfg = {"job": job, "rank": g, "local_rank": g % per_host, "world": len(rank_ids), "rate": args.rate,
               "seconds": args.seconds, "ready": str(run_dir / f"rank{g}.ready"), "go": str(run_dir / "go"),
               "out": str(run_dir / f"rank{g}.json")}
        ranks.append(h.popen([sys.executable, SCRIPT, "--rank-worker", json.dumps(cfg)], name=f"rank{g}.{index}",
                             env=dict(h.env, PYTHONPATH=REPO), cwd=REPO))
    procs += ranks
    for g in rank_ids:
        wait_until(lambda g=g: alive_and(run_dir / f"rank{g}.ready"), 90, f"rank {g} to be collected")
    wait_until(lambda: alive_and(run_dir / "sub.ready"), 60, "the ops subscriber to hear every host")
    log(f"run {index + 1}: {MODES[mode]}, collectors {pids} on port {port}, {len(ranks)} ranks and the ops "
        f"subscriber ready; {args.idle:g} s idle, then sending for {args.seconds:g} s")
    return Started(colls, pids, sub, ranks, rank_ids)


def measure(res: RunResult, p: Started, args: argparse.Namespace, run_dir: Path) -> None:
    """The collectors' CPU while idle, then the go, then every process's CPU over the steady part (into ``res``)."""
    import psutil

    colls = p.collector_pids
    t0, cpu0 = time.monotonic(), {n: _cpu_s(pid) for n, pid in colls.items()}
    time.sleep(args.idle)
    t1, cpu1 = time.monotonic(), {n: _cpu_s(pid) for n, pid in colls.items()}
    res.collector_idle_cpu = {n: (cpu1[n] - cpu0[n]) / (t1 - t0) for n in colls}
    start = time.time() + 0.3
    write_json(run_dir / "go", {"start": start})
    watched = {**{f"c.{n}": pid for n, pid in colls.items()}, "sub": p.subscriber.popen.pid,
               **{f"r.{k}": r.popen.pid for k, r in enumerate(p.ranks)}}
    time.sleep(max(0.0, start + min(1.0, args.seconds / 4) - time.time()))  # the warm-up
    t0, cpu0, io0 = time.monotonic(), {k: _cpu_s(v) for k, v in watched.items()}, {
        n: _io_cpu_s(pid) for n, pid in colls.items()}
    time.sleep(max(0.0, start + args.seconds - time.time()))
    t1, cpu1, io1 = time.monotonic(), {k: _cpu_s(v) for k, v in watched.items()}, {
        n: _io_cpu_s(pid) for n, pid in colls.items()}
    res.steady_s = t1 - t0
    per_s = {k: (cpu1[k] - cpu0[k]) / res.steady_s for k in watched}
    res.collector_cpu = {n: per_s[f"c.{n}"] for n in colls}
    res.collector_io_cpu = {n: (io1[n] - io0[n]) / res.steady_s for n in colls}
    res.collector_rss_mib = {n: psutil.Process(pid).memory_info().rss / 2**20 for n, pid in colls.items()}
    res.subscriber_cpu = per_s["sub"]
    res.rank_cpu = sum(per_s[f"r.{k}"] for k in range(len(p.ranks))) / len(p.ranks)


def gather(res: RunResult, p: Started, args: argparse.Namespace, run_dir: Path) -> None:
    """Wait for the ranks and the subscriber to finish, read what they wrote, stop the collectors (into ``res``)."""
    for r in p.ranks:
        if r.wait(args.seconds + 90) != 0:
            res.problems.append(f"{r.name} exit code {r.popen.returncode}\n{r.tail()}")
    for g in p.rank_ids:
        if (run_dir / f"rank{g}.json").exists():
            out = read_json(run_dir / f"rank{g}.json")
            res.sent += out["logged"]
            res.dropped += out["dropped"]
            res.max_late_ms = max(res.max_late_ms, out["max_late_ms"])
    if p.subscriber.wait(args.seconds + 150) != 0:
        res.problems.append(f"the subscriber's exit code is {p.subscriber.popen.returncode}\n{p.subscriber.tail()}")
    got = read_json(run_dir / "sub.json") if (run_dir / "sub.json").exists() else {}
    res.latencies_us = got.get("latencies_us", [])
    res.received = sum(got.get("received", {}).values())
    res.duplicates = got.get("duplicates", 0)
    res.messages = got.get("messages", 0)
    if got and not got["complete"]:
        res.problems.append("the subscriber's deadline passed before every rank's last event arrived")
    counters = got.get("collector_counters", {})
    for host_counters in counters.values():
        res.overflowed += host_counters.get("subscriber_queue_full_event", 0)
        if host_counters.get("key_revocations") or host_counters.get("handshakes_refused"):
            res.problems.append(f"a collector refused a handshake or revoked a key: {host_counters}")
    if len(counters) != len(p.collectors):
        res.problems.append(f"the collectors' counters did not reach the subscriber from every host: {counters}")
    if res.received != res.sent:
        res.problems.append(f"lost {res.sent - res.received} events: missing by rank {got.get('missing')}, wire "
                            f"sequence gaps (rank, expected, got, host, receive time) {got.get('gaps')}; the "
                            f"collectors' counters {counters}")
    if got.get("wire_errors"):
        res.problems.append(f"{got['wire_errors']} messages did not decode")
    for c in p.collectors:
        if c.stop(signal.SIGTERM, 30) != 0:
            res.problems.append(f"{c.name} exit code {c.popen.returncode}\n{c.tail()}")


def run_mode(cluster: Any, mode: str, index: int, args: argparse.Namespace, work: Path, keys: str) -> RunResult:
    """One run of ``mode`` (fresh collectors, job and port): start everything, measure, stop everything."""
    res = RunResult(mode, index)
    run_dir = work / f"run{index}"
    run_dir.mkdir()
    started = start_run(cluster, mode, index, args, run_dir, keys)
    measure(res, started, args, run_dir)
    gather(res, started, args, run_dir)
    lat = sorted(res.latencies_us)
    log(f"run {index + 1}: {MODES[mode]}: received {res.received:,} of {res.sent:,} events, latency p50 "
        f"{_pct(lat, 0.5) / 1000:.2f} ms p99 {_pct(lat, 0.99) / 1000:.2f} ms; collector CPU "
        + ", ".join(f"{n} {v:.3f}" for n, v in res.collector_cpu.items()) + " s/s")
    return res


# ================================================================================= the report


def _pct(sorted_values: list[int], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``sorted_values``; nan when empty."""
    if not sorted_values:
        return float("nan")
    k = max(0, math.ceil(round(q * len(sorted_values), 6)) - 1)
    return float(sorted_values[k])


def _machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores (nproc; {platform.machine()}, Linux {platform.release()})"


def report(runs: list[RunResult], args: argparse.Namespace, wall_s: float) -> str:
    """The markdown report: machine, set-up, the modes side by side with their ratio, every run."""
    import zmq

    by_mode = {m: [r for r in runs if r.mode == m] for m in MODES}
    rows: list[tuple[str, str, str, str]] = []

    def row(label: str, fmt: str, value: Any, ratio: bool = True) -> None:
        a, b = (value(by_mode[m]) for m in MODES)
        rat = f"{b / a:.2f}" if ratio and a else ""
        rows.append((label, format(a, fmt), format(b, fmt), rat))

    def lat(rs: list[RunResult], q: float) -> float:
        return _pct(sorted(v for r in rs for v in r.latencies_us), q) / 1000

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    def cpu(rs: list[RunResult], which: str = "collector_cpu") -> float:
        return mean([v for r in rs for v in getattr(r, which).values()])

    per_node_rate = args.rate * args.ranks_per_host
    row("events sent (logged by the ranks)", ",", lambda rs: sum(r.sent for r in rs), ratio=False)
    row("events received by the ops subscriber", ",", lambda rs: sum(r.received for r in rs), ratio=False)
    row("lost (sent - received)", ",", lambda rs: sum(r.sent - r.received for r in rs), ratio=False)
    row("duplicates received", ",", lambda rs: sum(r.duplicates for r in rs), ratio=False)
    row("times an event message found a subscriber's queue full", ",",
        lambda rs: sum(r.overflowed for r in rs), ratio=False)
    row("events dropped by the ranks' publishers (counted)", ",", lambda rs: sum(r.dropped for r in rs), ratio=False)
    row("events per message received (the ranks' publishers batch)", ".2f",
        lambda rs: sum(r.received for r in rs) / max(1, sum(r.messages for r in rs)))
    row("latency p50, ms (rank's log_event to the ops subscriber)", ".2f", lambda rs: lat(rs, 0.5))
    row("latency p99, ms", ".2f", lambda rs: lat(rs, 0.99))
    row("latency max, ms", ".2f", lambda rs: lat(rs, 1.0))
    row("node collector CPU s per wall s, idle (ranks attached, not sending)", ".3f",
        lambda rs: cpu(rs, "collector_idle_cpu"))
    row(f"node collector CPU s per wall s, {per_node_rate:,} events/s (mean over nodes and runs)", ".3f", cpu)
    row("of which its libzmq I/O threads (TCP, CURVE's encryption)", ".3f", lambda rs: cpu(rs, "collector_io_cpu"))
    row("node collector CPU per event above idle, us", ".1f",
        lambda rs: (cpu(rs) - cpu(rs, "collector_idle_cpu")) / per_node_rate * 1e6)
    row("node collector RSS, MiB (max)", ".1f", lambda rs: max(v for r in rs for v in r.collector_rss_mib.values()))
    row("ops subscriber CPU s per wall s (mean over runs)", ".3f", lambda rs: mean([r.subscriber_cpu for r in rs]))
    row("rank CPU s per wall s (mean over ranks and runs)", ".3f", lambda rs: mean([r.rank_cpu for r in rs]))
    out = [
        f"- date: {dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec='seconds')}",
        f"- machine: {_machine()}",
        f"- python {platform.python_version()}, pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}; load average "
        f"(1 min) {args.load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after (what else ran on the cores)",
        f"- set-up: {args.hosts} simulated hosts x {args.ranks_per_host} ranks, {args.rate:,} events/s per rank (and "
        f"as many Stat.add), {args.seconds:g} s per run, {args.rounds} round(s) of both modes (order: "
        + ", ".join(MODES[r.mode] for r in runs) + f"); whole run {wall_s:.0f} s",
        "",
        "| | plain TCP | CURVE | CURVE / plain |",
        "|---|---:|---:|---:|",
        *(f"| {label} | {a} | {b} | {rat} |" for label, a, b, rat in rows),
        "",
        "| run | mode | sent | received | p50 ms | p99 ms | max ms | collector CPU s/s per node (idle) "
        "| collector RSS MiB | subscriber CPU s/s | ranks' worst lateness ms |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in runs:
        lat_sorted = sorted(r.latencies_us)
        out.append(f"| {r.index + 1} | {MODES[r.mode]} | {r.sent:,} | {r.received:,} | "
                   f"{_pct(lat_sorted, 0.5) / 1000:.2f} | {_pct(lat_sorted, 0.99) / 1000:.2f} | "
                   f"{_pct(lat_sorted, 1.0) / 1000:.2f} | "
                   + " / ".join(f"{v:.3f} ({r.collector_idle_cpu[n]:.3f})" for n, v in r.collector_cpu.items())
                   + " | "
                   + " / ".join(f"{v:.1f}" for v in r.collector_rss_mib.values())
                   + f" | {r.subscriber_cpu:.3f} | {r.max_late_ms:.1f} |")
    return "\n".join(out)


# ================================================================================= main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="seconds the ranks send per run (default 10)")
    p.add_argument("--rate", type=int, default=1000, help="events (and Stat.add calls) per second per rank")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both modes, alternating order (default 2)")
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    p.add_argument("--ranks-per-host", type=int, default=2, help="rank processes per host (default 2)")
    p.add_argument("--idle", type=float, default=2.0,
                   help="seconds the collectors' CPU is read before the first event, every rank attached (default 2)")
    p.add_argument("--port", type=int, default=5600, help="first publish port (each run takes the next one)")
    p.add_argument("--status-interval", type=float, default=0, help=argparse.SUPPRESS)  # collectors', to debug
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs of every process)")
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    p.add_argument("--subscriber-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.rate <= 0 or args.rounds < 1 or args.hosts < 1 or args.ranks_per_host < 1:
        p.error("--seconds, --rate, --rounds, --hosts and --ranks-per-host must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return 0
    if args.subscriber_worker:
        subscriber_worker(json.loads(args.subscriber_worker))
        return 0
    from kit import cluster

    reason = cluster.unavailable_reason()
    if reason:
        print(f"multinode_bench: cannot simulate hosts here: {reason}", file=sys.stderr)
        return 2
    started, args.load_before = time.monotonic(), os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="mnbench-"))
    keys = str(work / "keys")
    runs: list[RunResult] = []
    try:
        subprocess.run([sys.executable, "-c", _SHMSTAT, "keys", keys], check=True, cwd=REPO, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=REPO))
        order = [m for r in range(args.rounds) for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1])]
        log(f"{len(order)} runs of {args.seconds:g} s ({', '.join(MODES[m] for m in order)}); work dir {work}")
        with cluster.simulated_cluster(work / "cluster", hosts=args.hosts) as c:
            for index, mode in enumerate(order):
                runs.append(run_mode(c, mode, index, args, work, keys))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report(runs, args, time.monotonic() - started))
    problems = [p for r in runs for p in r.problems]
    lost = sum(r.sent - r.received for r in runs)
    for p in problems:
        print(f"multinode_bench: problem: {p}", file=sys.stderr)
    if lost or problems or any(r.duplicates for r in runs):
        print(f"multinode_bench: FAILED: {lost} events lost, {len(problems)} problems", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
