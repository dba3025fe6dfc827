"""shmstat side by side with its anchors: per-call costs, event throughput, collector cost. One command.

Usage::

    python scripts/bench.py            # the full run (about 20 minutes on 2 cores)
    python scripts/bench.py --quick    # the same tables in about 3 minutes (fewer rounds, shorter runs)
    python scripts/bench.py --md BENCHMARKS.md   # also write the printed report into BENCHMARKS.md
    python scripts/bench.py --only node --only sections --only ddp --only scale   # issue 45's rows

Everything is measured in this one run, on this machine, with this interpreter. Per-call figures are the
median of repeated ``timeit`` rounds (ns per call, the loop of timeit included, GC off during a round, as
timeit does). Each group of measurements runs in a fresh subprocess of the same interpreter so that imports
and global state do not leak between them: the calls (ours, torch.monitor, torchelastic and the empty method
call, in one process), prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before it is
imported), the collector, and every rank. Anchors that cannot be imported are reported as ``missing``.

Calls that hand work to the rank's publisher thread (``log_event``/``put_metric``/``prof`` with a collector)
are timed as N calls *plus* the flush that hands the last item to ZeroMQ, divided by N: the thread's
encoding is part of what the rank pays (it runs under the same GIL), so it is counted. Each of them is measured
against its anchor a round of each in turn (the anchor's rounds run while the publisher is idle), so that the
machine's other work weighs on both sides alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import uuid
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

AGGS_NAMES = ("MEAN", "COUNT", "SUM", "MAX", "MIN")
EVENT_DATA = {"step": 7, "loss": 0.25, "phase": "train"}
_SCRUB = ("SHMSTAT_JOB", "SHMSTAT_RANK", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE",
          "LOCAL_WORLD_SIZE", "PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir", "SHMSTAT_PURE_PYTHON")


# ============================================================================================ helpers


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any job identity (so nothing auto-attaches), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


TIMER = [time.perf_counter]
"""The clock of the per-call figures: wall time, or with ``--cpu`` this process's CPU time (every thread: the
publisher's and libzmq's count, time the machine gave to other processes does not)."""


def median_ns(stmt: str, env: dict[str, Any], number: int, repeat: int) -> float:
    """Median over ``repeat`` timeit rounds of ``number`` calls, in ns per call."""
    rounds = timeit.Timer(stmt, timer=TIMER[0], globals=env).repeat(repeat=repeat, number=number)
    return statistics.median(rounds) / number * 1e9


def interleaved_ns(ours: str, ours_n: int, flush: Any, theirs: str | None, theirs_n: int, env: dict[str, Any],
                   repeat: int) -> tuple[float, float, float | None]:
    """Ours and an anchor's statement (None: no anchor), a round of each in turn; ours ends each round with
    ``flush()``. Returns medians in ns per call: ours with the flush (the publisher thread's work counts: it runs
    under the same GIL, and ``--cpu`` counts every thread), ours without (what the caller's loop alone took while
    the thread worked next to it), the anchor's (None without one). What else the machine runs then weighs on
    both alike (measured one block after the other, a loaded machine moved one side and not the other)."""
    clock = TIMER[0]
    mine = timeit.Timer(ours, timer=clock, globals=env)
    other = timeit.Timer(theirs, timer=clock, globals=env) if theirs is not None else None
    flush()
    with_flush, caller, anchor = [], [], []
    for _ in range(repeat):
        inner = mine.timeit(ours_n)
        t1 = clock()
        flush()
        with_flush.append(inner + clock() - t1)
        caller.append(inner)
        if other is not None:
            anchor.append(other.timeit(theirs_n))
    med = statistics.median
    return (med(with_flush) / ours_n * 1e9, med(caller) / ours_n * 1e9,
            med(anchor) / theirs_n * 1e9 if anchor else None)


def worker_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", *args]


def start_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(worker_cmd(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env or clean_env(), cwd=REPO)


def expect_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float = 60.0) -> str:
    """Read lines from a worker until one starts with ``prefix`` (or fail after ``timeout_s``)."""
    assert proc.stdout is not None
    out: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                out.append(line[len(prefix):].strip())
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s)
    if not out:
        proc.kill()
        raise RuntimeError(f"worker {proc.args[3:]} did not print {prefix!r} within {timeout_s:.0f} s")
    return out[0]


def tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def finish(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    with contextlib.suppress(Exception):
        if proc.stdin:
            proc.stdin.close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def unlink_job(job: str) -> None:
    from shmstat.shm.segment import Segment

    with contextlib.suppress(Exception):
        Segment.unlink(job)


def new_job(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}"


def machine_lines() -> list[str]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from importlib import metadata

    versions = []
    for dist in ("torch", "prometheus_client", "pyzmq", "msgpack", "numpy"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} missing")
    from shmstat._backend import backend

    fast = "built" if backend().SlotWriter is not None else "not built (pure Python Stat.add)"
    return [
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {model}, {os.cpu_count()} cores ({platform.machine()}, {platform.system()} "
        f"{platform.release()})",
        f"- python: {platform.python_version()} ({platform.python_implementation()}) {sys.executable}",
        f"- packages: {', '.join(versions)}; shmstat C fast path: {fast}",
    ]


# ============================================================================================ workers


def worker_collector(job: str, args: argparse.Namespace) -> None:
    """A collector in this process (the same step loop as ``shmstat collect``), driven over stdin.

    Commands: ``go SECONDS`` measures CPU and latency for that long and reports; ``count N TIMEOUT`` waits
    until N events were relayed and reports the time; EOF shuts the collector down and reports counters.
    """
    import numpy

    from collector import Collector, CollectorConfig
    from elastic.metrics import MetricHandler, NullMetricHandler
    from shmstat.shm.layout import Geometry

    lat: list[float] = []
    measuring = [False]

    class Probe(MetricHandler):
        def emit(self, metric_data: Any) -> None:
            if measuring[0] and getattr(metric_data, "rank", 0) is None and metric_data.name.endswith(".count"):
                lat.append(time.time() - metric_data.window_end)

    class Counting(MetricHandler):  # a consumer: every row is built and dispatched (the least a real one costs)
        n = 0

        def emit(self, metric_data: Any) -> None:
            self.n += 1

    class ColumnCounting(MetricHandler):  # a columnar consumer: touches every figure of every pass it gets
        n = 0
        total = 0.0

        def emit(self, metric_data: Any) -> None:
            self.n += 1

        def emit_columns(self, columns: Any) -> None:
            if measuring[0] and len(columns):
                lat.append(time.time() - float(columns.window_end.max()))
            self.n += int(columns.count.sum())
            self.total += float(columns.sum.sum() + columns.min.sum() + columns.max.sum() + columns.value.sum()
                                + columns.mean.sum() + sum(numpy.nansum(getattr(columns, p))
                                                           for p in ("p50", "p90", "p99", "p999")))

    geometry = Geometry(args.ranks, args.stats, 4, args.stats if args.percentiles else 16) if args.stats else None
    config = CollectorConfig(job=job, geometry=geometry, status_interval_s=0, grace_ms=args.grace_ms)
    if args.columns:  # one columnar handler for every group (the probe stat's too): it records the latency itself
        handlers: dict[str, MetricHandler] = {"*": ColumnCounting()}
    else:
        handlers = {"*": Counting() if args.consume else NullMetricHandler(), "zz_probe": Probe()}
    col = Collector(config, handler_objects=handlers, out=open(os.devnull, "w"))  # noqa: SIM115
    commands: list[str] = []
    done = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.append(line.strip())
        done.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    print("ready", col.segment.geometry.total_size if col.segment else 0, flush=True)
    step = col.step
    while not done.is_set() or commands:
        if commands:
            cmd = commands.pop(0).split()
            if cmd[0] == "go":
                seconds = float(cmd[1])
                ru0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                rows0, win0 = col.passes.rows_emitted, col.passes.windows_emitted
                measuring[0] = True
                while time.monotonic() - w0 < seconds:
                    step(col.loop.poll_timeout_ms())
                measuring[0] = False
                ru1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                import psutil

                cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
                print("result", json.dumps({
                    "cpu_per_s": cpu / (w1 - w0), "wall": w1 - w0, "rows": col.passes.rows_emitted - rows0,
                    "windows": col.passes.windows_emitted - win0, "rss": psutil.Process().memory_info().rss,
                    "maxrss": ru1.ru_maxrss * 1024, "lat": lat, "overwritten": col.passes.overwritten,
                }), flush=True)
            elif cmd[0] == "count":
                want, timeout = int(cmd[1]), float(cmd[2])
                deadline = time.monotonic() + timeout
                c = col.relay_counters
                while c.events < want and time.monotonic() < deadline:
                    step(1)
                print("result", json.dumps({"t_done": time.time(), "events": c.events, "gaps": c.gaps,
                                            "rejected": c.rejected}), flush=True)
            continue
        step(col.loop.poll_timeout_ms())
    col.close()
    c = col.relay_counters
    print("final", json.dumps({"events": c.events, "metrics": c.metrics, "gaps": c.gaps, "rejected": c.rejected}),
          flush=True)


def worker_load_rank(job: str, args: argparse.Namespace) -> None:
    """A rank with ``--stats`` stats of 1 s windows (group ``load``) plus one probe stat; every stat gets a
    sample every 250 ms until stdin closes."""
    import shmstat
    from shmstat import Aggregation

    aggs = [getattr(Aggregation, a) for a in AGGS_NAMES]
    if args.percentiles:
        aggs += [Aggregation.P50, Aggregation.P99]
    shmstat.init(job, rank=args.rank, local_rank=args.rank, world_size=args.ranks, publish=False)
    stats = [shmstat.Stat(f"load.s{i}", aggs, 1.0, group="load") for i in range(args.stats - 1)]
    stats.append(shmstat.Stat("probe", aggs, 1.0, group="zz_probe"))
    adds = [s.add for s in stats]
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("ready", flush=True)
    v = 0.0
    while not done.wait(0.25):
        v += 1.0
        for add in adds:
            add(v)
    shmstat.shutdown()


def worker_event_rank(job: str, args: argparse.Namespace) -> None:
    """A rank that logs ``--events`` events as fast as it can on ``go``, then flushes and reports."""
    import shmstat
    from shmstat.job import _state

    shmstat.init(job, rank=args.rank, local_rank=args.rank, world_size=args.ranks)
    event = shmstat.Event("bench", dt.datetime.now(), EVENT_DATA)
    log_event = shmstat.log_event
    pub = _state.STATE.publisher
    assert pub is not None
    log_event(event)  # starts the publisher thread; wait for the collector's subscription
    deadline = time.monotonic() + 20
    while not pub.stats().subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    pub.flush(10)
    print("ready", flush=True)
    sys.stdin.readline()
    n = args.events
    t0 = time.time()
    for _ in itertools.repeat(None, n):
        log_event(event)
    t1 = time.time()
    pub.flush(60)
    t2 = time.time()
    st = pub.stats()
    print("result", json.dumps({"t0": t0, "t_called": t1, "t_flushed": t2, "queued": st.queued,
                                "dropped": st.dropped, "sent": st.sent_items, "messages": st.sent_messages}),
          flush=True)
    sys.stdin.read()
    shmstat.shutdown()


def worker_calls(job: str, args: argparse.Namespace) -> None:
    """Every per-call figure that runs in one process: ours, torch.monitor, torchelastic, the floor."""
    number, repeat = args.number, args.repeat
    res: dict[str, Any] = {}

    class Floor:
        def f(self, v: float) -> None:
            pass

    floor = Floor()
    env: dict[str, Any] = {"floor": floor}
    res["floor"] = median_ns("floor.f(1.5)", env, number, repeat)

    import shmstat
    from elastic import metrics as em
    from shmstat import Aggregation as A

    aggs = [getattr(A, a) for a in AGGS_NAMES]
    window = dt.timedelta(seconds=3600)  # no roll-over inside a round
    ours_event = shmstat.Event("bench", dt.datetime.now(), EVENT_DATA)
    env.update(shmstat=shmstat, ev=ours_event, put_metric=em.put_metric, datetime=dt.datetime, data=EVENT_DATA)
    env["local"] = shmstat.Stat("local", aggs, window)
    res["ours.add.local"] = median_ns("local.add(1.5)", env, number, repeat)
    res["ours.log_event.none"] = median_ns("shmstat.log_event(ev)", env, number, repeat)
    res["ours.put_metric.null"] = median_ns("put_metric('bench.m', 1, 'bench')", env, number, repeat)

    @em.prof(group="bench")
    def ours_empty() -> None:
        pass

    env["ours_empty"] = ours_empty
    res["ours.prof.null"] = median_ns("ours_empty()", env, number // 4, repeat)
    # the parts of log_event(Event(name, datetime.now(), data)): what building the Python objects costs
    env["ts"] = dt.datetime.now()
    res["py.datetime_now"] = median_ns("datetime.now()", env, number // 10, repeat)
    res["ours.event_only"] = median_ns("shmstat.Event('bench', ts, data)", env, number // 10, repeat)
    res["ours.event_build"] = median_ns("shmstat.Event('bench', datetime.now(), data)", env, number // 10, repeat)
    h = shmstat.register_event_handler(lambda e: None)
    res["ours.log_event.handler"] = median_ns("shmstat.log_event(ev)", env, number, repeat)
    res["ours.log_event.fresh_handler"] = median_ns("shmstat.log_event(shmstat.Event('bench', datetime.now(), data))",
                                                    env, number // 10, repeat)
    shmstat.unregister_event_handler(h)

    # attached: this process is rank 0 of the job whose collector the parent started
    from shmstat.job import _state

    shmstat.init(job, rank=0)
    pub = _state.STATE.publisher
    assert pub is not None
    env["shared"] = shmstat.Stat("shared", aggs, window)
    env["pct"] = shmstat.Stat("pct", [*aggs, A.P50, A.P99], window)
    import itertools
    import random

    rnd = random.Random(3)
    env["vals"] = itertools.cycle([rnd.lognormvariate(3.0, 1.0) for _ in range(4096)])  # step times, ms
    from shmstat._backend import use

    with use("python"):  # this Stat's writer is the pure-Python twin (it keeps the backend it was built on)
        env["shared_py"] = shmstat.Stat("shared_py", aggs, window)
    res["ours.add.attached"] = median_ns("shared.add(1.5)", env, number, repeat)
    res["ours.add.attached_py"] = median_ns("shared_py.add(1.5)", env, number, repeat)
    res["ours.add.c_path"] = type(env["shared"]._core.binding._writer).__name__ == "SlotWriter"
    res["ours.add.attached_varied"] = median_ns("shared.add(next(vals))", env, number, repeat)
    res["ours.add.percentiles_varied"] = median_ns("pct.add(next(vals))", env, number, repeat)
    res["ours.add.percentiles"] = median_ns("pct.add(1.5)", env, number, repeat)
    env["sec"] = shmstat.section("bench")  # enter + exit, attached: the section's Stat and the phase word
    res["ours.section.attached"] = median_ns("with sec:\n    pass", env, number // 4, repeat)
    with contextlib.suppress(ImportError):
        from torch.profiler import record_function

        env["record_function"] = record_function  # no profiler running: what an unprofiled range costs torch
        res["torch.record_function"] = median_ns("with record_function('bench'):\n    pass", env, number // 4,
                                                 repeat)
    shmstat.log_event(ours_event)
    deadline = time.monotonic() + 20
    while not pub.stats().subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    flush = pub.flush
    pub_n = min(number, 50_000)  # stays within the publisher's backlog bound
    # each of these against its anchor, a round of each in turn (interleaved_ns)
    tm, tem = anchor_modules(res)
    if tm is not None:
        env.update(tm=tm, tev=tm.Event("bench", dt.datetime.now(), EVENT_DATA))
    if tem is not None:
        tem.configure(tem.NullMetricHandler())

        @tem.prof(group="bench")
        def their_empty() -> None:
            pass

        env.update(tem=tem, their_empty=their_empty)
    res["ours.log_event.collector"], res["ours.log_event.collector_caller"], res["torch.log_event.none"] = (
        interleaved_ns("shmstat.log_event(ev)", pub_n, flush, "tm.log_event(tev)" if tm is not None else None,
                       number, env, repeat))
    th = tm.register_event_handler(lambda e: None) if tm is not None else None
    (res["ours.log_event.fresh_collector"], res["ours.log_event.fresh_collector_caller"],
     res["torch.log_event.fresh_handler"]) = interleaved_ns(
        "shmstat.log_event(shmstat.Event('bench', datetime.now(), data))", pub_n // 4, flush,
        "tm.log_event(tm.Event('bench', datetime.now(), data))" if tm is not None else None, number // 10, env, repeat)
    if tm is not None:
        tm.unregister_event_handler(th)
    res["ours.put_metric.collector"], res["ours.put_metric.collector_caller"], res["te.put_metric"] = (
        interleaved_ns("put_metric('bench.m', 1, 'bench')", pub_n, flush,
                       "tem.put_metric('bench.m', 1, 'bench')" if tem is not None else None, number, env, repeat))
    res["ours.prof.collector"], res["ours.prof.collector_caller"], res["te.prof"] = interleaved_ns(
        "ours_empty()", pub_n // 2, flush, "their_empty()" if tem is not None else None, number // 4, env, repeat)
    flush()
    for key in ("torch.log_event.none", "torch.log_event.fresh_handler", "te.put_metric", "te.prof"):
        if res[key] is None:  # the anchor is missing
            del res[key]
    st = pub.stats()
    res["ours.publisher"] = {"queued": st.queued, "dropped": st.dropped, "sent": st.sent_items}
    shmstat.shutdown()
    res["ours.ack.keep_forget"] = ack_cost_ns(number, repeat)

    # the other anchors (those of the calls to the collector were measured with them, above)
    if tm is not None:
        taggs = [getattr(tm.Aggregation, a) for a in AGGS_NAMES]
        tstat = tm.Stat("anchor", taggs, window)
        tev = tm.Event("bench", dt.datetime.now(), EVENT_DATA)
        env.update(tstat=tstat, tm=tm, tev=tev)
        res["torch.add"] = median_ns("tstat.add(1.5)", env, number, repeat)
        th = tm.register_event_handler(lambda e: None)
        res["torch.log_event.handler"] = median_ns("tm.log_event(tev)", env, number, repeat)
        tm.unregister_event_handler(th)
        res["torch.event_build"] = median_ns("tm.Event('bench', datetime.now(), data)",
                                             {"tm": tm, "datetime": dt.datetime, "data": EVENT_DATA},
                                             number // 10, repeat)
        del env["tstat"], tstat
    print("result", json.dumps(res), flush=True)


def anchor_modules(res: dict[str, Any]) -> tuple[Any, Any]:
    """torch.monitor and torchelastic's metrics, each None (and said so in ``res``) if it cannot be imported."""
    tm = tem = None
    try:
        import torch.monitor as tm
    except Exception as exc:  # not installed, or broken: reported as missing
        res["torch"] = f"missing ({type(exc).__name__})"
    else:
        res["torch"] = __import__("torch").__version__
    try:
        import torch.distributed.elastic.metrics as tem
    except Exception as exc:
        res["torchelastic"] = f"missing ({type(exc).__name__})"
    else:
        res["torchelastic"] = "ok"
    return tm, tem


def ack_cost_ns(number: int, repeat: int, per_ack: int = 16) -> float:
    """What the acknowledgement adds to a rank's event path, per message sent: the publisher's thread keeps the
    message until a collector acknowledges it, then forgets it (one acknowledgement per ``per_ack`` messages, as
    the collector's ~20 ms batching gives at a few hundred messages a second). The publisher's own sender, off its
    thread (no socket: only the keeping)."""
    from shmstat.publish.sender import _Sender
    from shmstat.wire.delivered import encode_delivered

    sender = _Sender.__new__(_Sender)
    sender._pid, sender._rank, sender._incarnation, sender._kept_limit = 4242, 0, 0, 64 << 20
    sender._reset_state()
    frames = (b"event/bench", b"x" * 120)
    acks = [encode_delivered([(4242, 0, 0, end)])[0] for end in range(per_ack, 1001, per_ack)]

    def keep_and_forget() -> None:
        ack = iter(acks)
        for seq in range(1, 1001):
            sender._keep(frames, seq)
            if seq % per_ack == 0:
                sender._acknowledged(next(ack))
        sender._kept.clear()
        sender._kept_held = 0

    return median_ns("keep_and_forget()", {"keep_and_forget": keep_and_forget}, max(1, number // 1000),
                     repeat) / 1000


def worker_prometheus(args: argparse.Namespace) -> None:
    """prometheus_client in multiprocess mode: the directory is set before the import, as its docs require."""
    res: dict[str, Any] = {}
    try:
        import prometheus_client as pc
        from prometheus_client import CollectorRegistry, multiprocess
    except Exception as exc:
        print("result", json.dumps({"prometheus": f"missing ({type(exc).__name__})"}), flush=True)
        return
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    counter = pc.Counter("bench_c", "a counter")
    hist = pc.Histogram("bench_h", "a histogram")
    env = {"counter": counter, "hist": hist}
    res["prom.inc"] = median_ns("counter.inc()", env, args.number // 4, args.repeat)
    res["prom.observe"] = median_ns("hist.observe(0.5)", env, args.number // 4, args.repeat)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    res["prom.scrape_ms"] = median_ns("pc.generate_latest(registry)", {"pc": pc, "registry": registry},
                                      20, max(3, args.repeat // 2)) / 1e6
    res["prometheus"] = pc.__version__ if hasattr(pc, "__version__") else "ok"
    print("result", json.dumps(res), flush=True)


def worker_scrape(args: argparse.Namespace) -> None:
    """Our /metrics over ``--ranks`` x ``--stats`` stats (merged and per-rank series of one window each): folding
    the rows in, the rendering (prometheus_client's generate_latest of our collector, done off the scrape path)
    and what a scrape over HTTP then takes."""
    import urllib.request

    from collector.prometheus.exporter import PrometheusExporter
    from collector.read.columns import Columns
    from collector.read.rows import WindowRow
    from shmstat.shm.layout_records import WindowFigures

    ex = PrometheusExporter("127.0.0.1:0")
    url = ex.start()
    rows = []
    mask = 0b1111100  # COUNT SUM MEAN MAX MIN
    for i in range(args.stats):
        rows.append(WindowRow("load", f"load.s{i}", 1, 1000, mask, None,
                              WindowFigures(args.ranks, 1.0, 1.0, 1.0, 1.0, 1)))
        rows.extend(WindowRow("load", f"load.s{i}", 1, 1000, mask, r, WindowFigures(1, 1.0, 1.0, 1.0, 1.0, 1))
                    for r in range(args.ranks))
    cols = Columns.from_rows("bench", rows)
    t0 = time.perf_counter()
    ex.observe_columns(cols)
    t1 = time.perf_counter()
    cache = ex._cache
    assert cache is not None and cache.wait_rendered(600)
    times = []
    for _ in range(5):
        t2 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as r:
            out = r.read()
        times.append(time.perf_counter() - t2)
    ex.close()
    print("result", json.dumps({"observe_s": t1 - t0, "scrape_s": statistics.median(times),
                                "render_s": cache.last_cost_s, "lines": out.count(b"\n"), "bytes": len(out)}),
          flush=True)


def worker_scrape_prom(args: argparse.Namespace) -> None:
    """prometheus_client multiprocess mode over the same series: one labelled Counter (count) and one Gauge (mean)
    child per (stat, rank) and merged row, written by this process, then MultiProcessCollector's collect and the
    text format (what its scrape costs)."""
    import prometheus_client as pc
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    labels = ["job", "node", "group", "stat", "rank"]
    count = pc.Counter("bench_count", "count", labels)
    total = pc.Counter("bench_sum", "sum", labels)
    mean = pc.Gauge("bench_mean", "mean", labels, multiprocess_mode="liveall")
    for i in range(args.stats):
        for r in [*(str(r) for r in range(args.ranks)), ""]:
            lv = ("bench", "node", "load", f"load.s{i}", r)
            count.labels(*lv).inc()
            total.labels(*lv).inc()
            mean.labels(*lv).set(1.0)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = generate_latest(registry)
        times.append(time.perf_counter() - t0)
    print("result", json.dumps({"scrape_s": statistics.median(times), "lines": out.count(b"\n")}), flush=True)


def worker_create_rank(job: str, args: argparse.Namespace) -> None:
    """Create ``--stats`` distinct Stats, then create them all again (what a helper building Stats per call
    does), timing both; the segment holds ``--ranks`` x 8192 stats."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=args.rank, local_rank=args.rank, world_size=args.ranks, max_ranks=args.ranks,
                 max_stats=8192, publish=False)
    print("ready", flush=True)
    sys.stdin.readline()
    aggs = [A.COUNT, A.SUM, A.MEAN]
    t0 = time.perf_counter()
    kept = [shmstat.Stat(f"stat.{i}", aggs, 1.0, group="bench") for i in range(args.stats)]
    t1 = time.perf_counter()
    for i in range(args.stats):
        shmstat.Stat(f"stat.{i}", aggs, 1.0, group="bench").add(1.0)
    t2 = time.perf_counter()
    print("result " + json.dumps({"create_s": t1 - t0, "recreate_s": t2 - t1, "stats": len(kept)}), flush=True)
    shmstat.shutdown()


def worker_node_collector(job: str, args: argparse.Namespace) -> None:
    """A node collector (the loop of ``shmstat collect`` with no ``--job``) serving only ``job`` (the machine may
    hold other jobs' segments), publishing every job on ``--endpoint``, null handlers; stops at stdin's EOF."""
    from collector import CollectorConfig
    from collector.daemon.node import NodeCollector

    config = CollectorConfig(job="", publish=args.endpoint, handlers={"*": "null"}, status_interval_s=0,
                             **({"publish_queue": args.publish_queue} if args.publish_queue else {}))
    node = NodeCollector(config, jobs=[job], out=open(os.devnull, "w"))  # noqa: SIM115
    threading.Thread(target=lambda: (sys.stdin.read(), node.loop.request_stop()), daemon=True).start()
    node.loop.step(0)  # the job picked up now: its segment made and held before any rank attaches
    print("ready", os.getpid(), flush=True)
    node.run()


def worker_node_proxy(job: str, args: argparse.Namespace) -> None:
    """The floor of the relay's design, the anchor of the node collector's rows: ``job``'s ingest endpoint bound by
    an ``XSUB`` that asks the ranks for everything (as the collector's relay does), relayed to an ``XPUB`` on
    ``--endpoint`` by libzmq's own ``zmq_proxy`` (C: no checks, sequence tracking, acknowledgements, handlers or
    chores); stops at stdin's EOF."""
    import zmq

    from collector.relay.subscriptions import bind_owner_only, remove_ipc_file
    from shmstat.shm.runtime import ingest_endpoint

    ctx = zmq.Context()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    ingest = ingest_endpoint(job)
    bind_owner_only(xsub, ingest)
    bind_owner_only(xpub, args.endpoint)
    xsub.send(b"\x01")
    threading.Thread(target=zmq.proxy, args=(xsub, xpub), daemon=True).start()
    print("ready", os.getpid(), flush=True)
    sys.stdin.read()
    remove_ipc_file(ingest)  # (a collector removes its socket file as it exits; this stand-in leaves none either)
    os._exit(0)  # zmq.proxy returns only when the context ends; nothing here needs flushing


def worker_node_rank(job: str, args: argparse.Namespace) -> None:
    """A rank with ``--stats`` stats of 1 s windows, each getting a sample every ``--tick-ms`` (5: 200/s), that logs
    events at the rate last
    read on stdin (``rate R``: R events/s, each carrying ``time.time_ns()`` and its index), on a fixed schedule;
    ``report`` prints what it logged; EOF ends it."""
    import shmstat
    from shmstat.job import _state

    shmstat.init(job, rank=args.rank, local_rank=args.rank, world_size=args.ranks)
    aggs = [getattr(shmstat.Aggregation, a) for a in AGGS_NAMES]
    adds = [shmstat.Stat(f"node.s{i}", aggs, 1.0, group="load").add for i in range(args.stats)]
    state = {"rate": 0.0, "done": False, "report": False}

    def read() -> None:
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "rate":
                state["rate"] = float(cmd[1])
            elif cmd and cmd[0] == "report":
                state["report"] = True
        state["done"] = True

    threading.Thread(target=read, daemon=True).start()
    print("ready", flush=True)
    event, now, log_event, time_ns = shmstat.Event, dt.datetime.now, shmstat.log_event, time.time_ns
    logged, rate, since, base = 0, 0.0, time.monotonic(), 0
    tick = args.tick_ms / 1000  # 200 samples/s per stat by default
    next_tick = time.monotonic()
    v = 0.0
    while not state["done"]:
        next_tick += tick
        v += 1.0
        for add in adds:
            add(v)
        t = time.monotonic()
        if state["rate"] != rate:
            rate, since, base = state["rate"], t, logged
        due = base + int(rate * (t - since))
        while logged < due:
            log_event(event("node", now(), {"t": time_ns(), "i": logged}))
            logged += 1
        if state["report"]:
            state["report"] = False
            pub = _state.STATE.publisher
            dropped = pub.stats().dropped if pub is not None else 0
            print("result", json.dumps({"logged": logged, "dropped": dropped}), flush=True)
        rest = next_tick - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        else:
            next_tick = time.monotonic()
    shmstat.shutdown()


def worker_node_subscriber(args: argparse.Namespace) -> None:
    """A subscriber of the node endpoint ``--endpoint`` (the ranks' ``event/node`` and heartbeats): ``ready`` at the
    first heartbeat; on ``mark`` prints the events received since the last mark, the sequence gaps seen and the
    latency from ``log_event`` (receive time minus the time the rank put in the event) of every item of one message
    in 8 (each message is checked and counted from its header; decoding every item would make this instrument, not
    the collector, the bottleneck at 100,000 events/s)."""
    import zmq

    from collector.relay.intake import inspect

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.rcvhwm = 0  # the instrument must not lose what the collector sent
    sock.subscribe(b"event/node")
    sock.subscribe(b"heartbeat/")
    sock.connect(args.endpoint)
    marks: list[bool] = []
    done = threading.Event()

    def read() -> None:
        for line in sys.stdin:
            if line.strip() == "mark":
                marks.append(True)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    ready = args.ready_at_once  # (a proxy sends no heartbeats)
    if ready:
        print("ready", flush=True)
    got, total, messages, counted = 0, 0, 0, 0
    lat: list[int] = []
    next_seq: dict[tuple[int, int, int], int] = {}
    gaps = 0
    while not done.is_set():
        if sock.poll(20):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t_recv = time.time_ns()
                if frames[0].startswith(b"heartbeat/"):
                    if not ready:
                        ready = True
                        print("ready", flush=True)
                    continue
                msg = inspect(frames[0], frames[1])
                sender = (msg.rank, msg.pid, msg.incarnation)
                if sender in next_seq and msg.seq != next_seq[sender]:
                    gaps += msg.seq - next_seq[sender]
                next_seq[sender] = msg.seq + msg.n_items
                got += msg.n_items
                messages += 1
                counted += 1
                if messages % 8 == 1:
                    lat.extend(t_recv - data["t"] for _name, _ts, data in msg.items)
        while marks:
            marks.pop()
            total += got
            lat.sort()
            print("result", json.dumps({"events": got, "total": total, "gaps": gaps, "messages": counted,
                                        "lat_median_ms": lat[len(lat) // 2] / 1e6 if lat else None,
                                        "lat_p99_ms": lat[int(len(lat) * 0.99)] / 1e6 if lat else None}),
                  flush=True)
            got, lat, counted = 0, [], 0
    sock.close(linger=0)
    ctx.term()


# ============================================================================================ issue 45: the price of
# instrumentation (sections beside their anchors, a DDP step with instrument() on and off) and the collector's cost
# as the job grows (the pass and the relay at 8, 32 and 128 ranks)


def worker_sections(job: str, args: argparse.Namespace) -> None:
    """A section's enter + exit (a ``with``, and what ``@section`` adds to a call of an empty function: the
    decorated call minus the bare one, round by round) beside torch.profiler.record_function (no profiler
    running), a hand-written perf_counter pair plus ``Stat.add``, and the floors: an empty method call (issue
    42's unit), a ``with`` on a C context manager that does nothing, and one that only reads the monotonic clock
    at enter and exit (both ``shmstat._fastpath.NullContext`` under a Python subclass with slots, as ``section``
    is over ``SectionCore``); a round of each in turn, on this process's backend (the C path, or the pure-Python
    one with ``SHMSTAT_PURE_PYTHON=1``)."""
    import shmstat
    from shmstat import Aggregation as A
    from shmstat._backend import backend

    class Floor:
        def f(self, v: float) -> None:
            pass

    def bare() -> None:
        pass

    shmstat.init(job, rank=0, publish=False)
    env: dict[str, Any] = {"sec": shmstat.section("bench"), "pc": time.perf_counter, "floor": Floor(),
                           "add": shmstat.Stat("bench.pair", [getattr(A, a) for a in AGGS_NAMES], 3600.0).add,
                           "bare": bare, "decorated": shmstat.section("bench.decorated")(bare)}
    stmts = {"floor": "floor.f(1.5)", "section": "with sec:\n    pass", "pair": "t0 = pc()\nadd(pc() - t0)",
             "bare": "bare()", "decorated": "decorated()"}
    with contextlib.suppress(ImportError):
        from shmstat._fastpath import NullContext

        class Null(NullContext):  # type: ignore[misc]
            __slots__ = ("_name",)

        env.update(null=Null(), null_timed=Null(timed=True))
        stmts["with_null"] = "with null:\n    pass"
        stmts["with_clocks"] = "with null_timed:\n    pass"
    with contextlib.suppress(ImportError):
        from torch.profiler import record_function

        env["rf"] = record_function
        stmts["record_function"] = "with rf('bench'):\n    pass"
    timers = {k: timeit.Timer(s, timer=TIMER[0], globals=env) for k, s in stmts.items()}
    rounds: dict[str, list[float]] = {k: [] for k in stmts}
    for _ in range(args.repeat):
        for k, t in timers.items():
            rounds[k].append(t.timeit(args.number) / args.number * 1e9)
    res: dict[str, Any] = {k: statistics.median(v) for k, v in rounds.items()}
    # what the decorator adds to a call: each round's decorated call minus the bare call timed beside it
    res["decorated_added"] = statistics.median(d - b for d, b in zip(rounds["decorated"], rounds["bare"], strict=True))
    res["backend"] = backend().name
    res["c_path"] = type(env["sec"]).__mro__[1].__name__ == "SectionCore"
    res["c_decorator"] = type(env["decorated"]).__name__ == "SectionFunction"
    print("result", json.dumps(res), flush=True)
    shmstat.shutdown()


def run_sections(quick: bool) -> list[dict[str, Any]]:
    """The section rows on the C path and on the pure-Python one, each beside its anchors in one process."""
    number, repeat = (20_000, 5) if quick else (100_000, 9)
    out = []
    for pure in (False, True):
        job = new_job("sections")
        env = clean_env(**({"SHMSTAT_PURE_PYTHON": "1"} if pure else {}))
        try:
            p = start_worker("sections", "--job", job, "--number", str(number), "--repeat", str(repeat),
                             *(["--cpu"] if TIMER[0] is time.process_time else []), env=env)
            out.append(json.loads(expect_line(p, "result", 300)))
            finish(p)
        finally:
            unlink_job(job)
    return out


def section_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The report's table for :func:`run_sections`."""
    out = ["", "## Instrumentation priced: a section's enter + exit beside its anchors (ns per call, lower is "
           "better)", "",
           "One process per path, a round of each statement in turn (median of the rounds); attached to a job "
           "(the section's Stat in shared memory, its phase word written). The floors: an empty method call (issue "
           "42's target: a section at most 3x it), a `with` on a C context manager doing nothing, and one reading "
           "the monotonic clock at enter and exit (what any timed `with` pays). `@shmstat.section` on an empty "
           "function: its call minus the bare call of the same round (what a section adds to a call; no `with` on "
           "the C path).", "",
           "| path | `with shmstat.section(...)` | x empty call | `@shmstat.section` on an empty function: "
           "decorated call minus bare call | x empty call | bare call | empty method call | `with` C no-op | "
           "`with` C, 2 clock reads | `torch.profiler.record_function`, no profiler | `perf_counter` pair + "
           "`Stat.add` |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def times(v: Any, floor: Any) -> str:
        return f"{v / floor:.1f}x" if isinstance(v, float) and isinstance(floor, float) and floor > 0 else "?"

    for r in runs:
        path = "C (SectionCore)" if r.get("c_path") else f"pure Python ({r.get('backend')} backend)"
        if r.get("c_path") and r.get("c_decorator"):
            path = "C (SectionCore; decorator: SectionFunction)"
        sec, floor, added = r.get("section"), r.get("floor"), r.get("decorated_added")
        out.append(f"| {path} | {fmt_ns(sec)} | {times(sec, floor)} | {fmt_ns(added)} | {times(added, floor)} | "
                   f"{fmt_ns(r.get('bare'))} | {fmt_ns(floor)} | {fmt_ns(r.get('with_null'))} | "
                   f"{fmt_ns(r.get('with_clocks'))} | {fmt_ns(r.get('record_function'))} | {fmt_ns(r.get('pair'))} |")
    return out


def worker_ddp_rank(job: str, args: argparse.Namespace) -> None:
    """One rank of a 2-rank DDP job (CPU, gloo, a small MLP): ``--repeat`` rounds of ``--number`` steps, a fresh
    model (same seed) each round, ``shmstat.torch.instrument()`` on in rounds 0, 3, 4, 7, 8, ... (ABBA: a drift
    weighs on both alike); rank 0 prints every round's median step time."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shmstat
    from shmstat.torch import instrument

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    shmstat.init(job, rank=args.rank, local_rank=args.rank, world_size=2, publish=False)
    gen = torch.Generator().manual_seed(args.rank)
    x, y = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    rounds: list[tuple[bool, float]] = []
    for r in range(args.repeat):
        on = r % 4 in (0, 3)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                        torch.nn.ReLU(), torch.nn.Linear(256, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        handle = instrument(model, opt) if on else None
        times = []
        for i in range(args.number + 5):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if i >= 5:  # (the first steps build DDP's buckets)
                times.append(time.perf_counter() - t0)
        if handle is not None:
            handle.remove()
        rounds.append((on, statistics.median(times)))
        dist.barrier()
    if args.rank == 0:
        print("result", json.dumps({"rounds": rounds, "steps": args.number}), flush=True)
    dist.destroy_process_group()
    shmstat.shutdown()


def run_ddp(quick: bool) -> dict[str, Any]:
    """A DDP step with instrument() on and off, alternating rounds in one run of 2 rank processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    steps, rounds = (100, 8) if quick else (300, 16)
    job = new_job("ddp")
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = [start_worker("ddp-rank", "--job", job, "--rank", str(r), "--number", str(steps), "--repeat",
                          str(rounds), env=env) for r in range(2)]
    try:
        got = json.loads(expect_line(ranks[0], "result", 900))
    finally:
        for p in ranks:
            finish(p, 60)
        unlink_job(job)
    on = [t for flag, t in got["rounds"] if flag]
    off = [t for flag, t in got["rounds"] if not flag]
    mean = statistics.mean
    sd = ((statistics.variance(on) * (len(on) - 1) + statistics.variance(off) * (len(off) - 1))
          / (len(on) + len(off) - 2)) ** 0.5
    se = sd * (1 / len(on) + 1 / len(off)) ** 0.5
    return {"steps": got["steps"], "rounds": len(on) + len(off), "on_ms": mean(on) * 1e3, "off_ms": mean(off) * 1e3,
            "diff_ms": (mean(on) - mean(off)) * 1e3, "sd_ms": sd * 1e3, "se_ms": se * 1e3}


def ddp_lines(res: dict[str, Any]) -> list[str]:
    """The report's table for :func:`run_ddp`."""
    within = abs(res["diff_ms"]) <= 2 * res["se_ms"]
    return ["", "## A DDP step with `shmstat.torch.instrument()` on and off (CPU, gloo, 2 ranks)", "",
            f"A 256-256-256-10 MLP, batch 64, one torch thread per rank; {res['rounds']} rounds of {res['steps']} "
            "steps, a fresh model (same seed) each round, instrument() on in rounds 0, 3, 4, 7, 8, ... (ABBA); a "
            "round's figure is its median step on rank 0. Noise: the pooled standard deviation of the rounds, and "
            "the standard error of the difference.", "",
            "| instrument() | step (mean of rounds) |", "|---|---:|",
            f"| on | {res['on_ms']:.3f} ms |", f"| off | {res['off_ms']:.3f} ms |",
            f"| difference (on - off) | {res['diff_ms']:+.3f} ms ({res['diff_ms'] / res['off_ms'] * 100:+.1f}%) |",
            f"| noise: round-to-round sd / se of the difference | {res['sd_ms']:.3f} ms / {res['se_ms']:.3f} ms |",
            "", f"- the difference is {'within' if within else 'outside'} the run's noise (|difference| "
            f"{'<=' if within else '>'} 2 standard errors)"]


def worker_node_ranks(job: str, args: argparse.Namespace) -> None:
    """``--ranks`` ranks forked from this one process (shmstat imported once, shared copy-on-write: 128 ranks fit a
    small machine), each running :func:`worker_node_rank`'s loop with ``--tick-ms`` ticks; stdin's lines go to every
    rank; ``ready`` once all are, and ``result`` with their sums."""
    import shmstat  # noqa: F401  (imported before the forks: the ranks share it)

    cmds, results = [], []
    for r in range(args.ranks):
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in (*cmds, *results, cmd_w, res_r):  # the pipes of the ranks before: their EOF is theirs
                os.close(fd)
            sys.stdin = os.fdopen(cmd_r)
            sys.stdout = os.fdopen(res_w, "w")
            args.rank = r
            try:
                worker_node_rank(job, args)
            finally:
                os._exit(0)
        os.close(cmd_r)
        os.close(res_w)
        cmds.append(cmd_w)
        results.append(res_r)
    readers = [os.fdopen(fd) for fd in results]

    def gather(prefix: str) -> list[str]:
        out = []
        for f in readers:
            for line in f:
                if line.startswith(prefix):
                    out.append(line[len(prefix):].strip())
                    break
        return out

    gather("ready")
    print("ready", flush=True)
    for line in sys.stdin:
        for fd in cmds:
            os.write(fd, line.encode())
        if line.split()[:1] == ["report"]:
            got = [json.loads(x) for x in gather("result")]
            print("result", json.dumps({k: sum(g[k] for g in got) for k in ("logged", "dropped")}), flush=True)
    for fd in cmds:
        os.close(fd)
    for _ in range(args.ranks):
        os.wait()


def run_worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--job", default="")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--stats", type=int, default=0)
    ap.add_argument("--events", type=int, default=0)
    ap.add_argument("--number", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--grace-ms", type=int, default=20)
    ap.add_argument("--consume", action="store_true")
    ap.add_argument("--ready-at-once", action="store_true")
    ap.add_argument("--columns", action="store_true")
    ap.add_argument("--percentiles", action="store_true")
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tick-ms", type=float, default=5.0)
    ap.add_argument("--publish-queue", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cpu:
        TIMER[0] = time.process_time
    kind = args.worker
    if kind == "collector":
        worker_collector(args.job, args)
    elif kind == "load-rank":
        worker_load_rank(args.job, args)
    elif kind == "event-rank":
        worker_event_rank(args.job, args)
    elif kind == "calls":
        worker_calls(args.job, args)
    elif kind == "prometheus":
        worker_prometheus(args)
    elif kind == "create-rank":
        worker_create_rank(args.job, args)
    elif kind == "scrape":
        worker_scrape(args)
    elif kind == "scrape-prom":
        worker_scrape_prom(args)
    elif kind == "node-collector":
        worker_node_collector(args.job, args)
    elif kind == "node-proxy":
        worker_node_proxy(args.job, args)
    elif kind == "node-rank":
        worker_node_rank(args.job, args)
    elif kind == "node-subscriber":
        worker_node_subscriber(args)
    elif kind == "node-ranks":
        worker_node_ranks(args.job, args)
    elif kind == "sections":
        worker_sections(args.job, args)
    elif kind == "ddp-rank":
        worker_ddp_rank(args.job, args)
    else:
        raise SystemExit(f"unknown worker {kind}")


# ============================================================================================ the runs


def run_calls(quick: bool) -> dict[str, Any]:
    number, repeat = (40_000, 5) if quick else (200_000, 9)
    job = new_job("calls")
    col = start_worker("collector", "--job", job)
    try:
        expect_line(col, "ready")
        calls = start_worker("calls", "--job", job, "--number", str(number), "--repeat", str(repeat),
                             *(["--cpu"] if TIMER[0] is time.process_time else []))
        res = json.loads(expect_line(calls, "result", 300))
        finish(calls)
    finally:
        finish(col)
        unlink_job(job)
    tmp = tempfile.mkdtemp(prefix="bench-prom-")
    try:
        prom = start_worker("prometheus", "--number", str(number), "--repeat", str(repeat),
                            *(["--cpu"] if TIMER[0] is time.process_time else []),
                            env=clean_env(PROMETHEUS_MULTIPROC_DIR=tmp))
        res.update(json.loads(expect_line(prom, "result", 300)))
        finish(prom)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["number"], res["repeat"] = number, repeat
    return res


def run_throughput(nranks: int, events: int) -> dict[str, Any]:
    job = new_job(f"tput{nranks}")
    col = start_worker("collector", "--job", job, "--ranks", str(max(nranks, 1)))
    ranks: list[subprocess.Popen[str]] = []
    try:
        expect_line(col, "ready")
        for r in range(nranks):
            ranks.append(start_worker("event-rank", "--job", job, "--rank", str(r), "--ranks", str(nranks),
                                      "--events", str(events)))
        for p in ranks:
            expect_line(p, "ready")
        total = nranks * (events + 1)
        tell(col, f"count {total} 120")
        for p in ranks:
            tell(p, "go")
        got = json.loads(expect_line(col, "result", 180))
        per = [json.loads(expect_line(p, "result", 180)) for p in ranks]
    finally:
        for p in ranks:
            finish(p)
        finish(col)
        unlink_job(job)
    t0 = min(p["t0"] for p in per)
    sent = sum(p["queued"] for p in per)
    dropped = sum(p["dropped"] for p in per)
    return {
        "ranks": nranks, "events": events * nranks, "rate": events * nranks / (got["t_done"] - t0),
        "caller_rate": events * nranks / max(p["t_called"] - p["t0"] for p in per),
        "sent": sent, "received": got["events"], "dropped": dropped, "lost": sent - got["events"] - dropped,
        "gaps": got["gaps"], "messages": sum(p["messages"] for p in per),
    }


def run_collector_cost(nranks: int, stats: int, seconds: float, warmup: float, consume: bool = False,
                       percentiles: bool = False, columns: bool = False) -> dict[str, Any]:
    job = new_job(f"cost{nranks * stats}")
    pct = ["--percentiles"] if percentiles else []
    col = start_worker("collector", "--job", job, "--ranks", str(nranks), "--stats", str(stats),
                       *(["--consume"] if consume else []), *(["--columns"] if columns else []), *pct)
    ranks: list[subprocess.Popen[str]] = []
    try:
        seg_size = int(expect_line(col, "ready"))
        for r in range(nranks):
            ranks.append(start_worker("load-rank", "--job", job, "--rank", str(r), "--ranks", str(nranks),
                                      "--stats", str(stats), *pct))
        for p in ranks:
            expect_line(p, "ready", 120)
        # start measuring just after a window boundary plus warm-up whole windows
        now = time.time()
        time.sleep(warmup + (1.0 - now % 1.0) + 0.1)
        tell(col, f"go {seconds}")
        got = json.loads(expect_line(col, "result", seconds + 120))
    finally:
        for p in ranks:
            finish(p)
        finish(col)
        unlink_job(job)
    lat = sorted(got["lat"])
    got.update(slots=nranks * stats, ranks=nranks, stats=stats, segment=seg_size, consume=consume,
               percentiles=percentiles, columns=columns,
               lat_median=statistics.median(lat) if lat else None, lat_max=lat[-1] if lat else None)
    return got


def run_scrape(nranks: int, stats: int) -> dict[str, Any]:
    ours_p = start_worker("scrape", "--ranks", str(nranks), "--stats", str(stats))
    ours = json.loads(expect_line(ours_p, "result", 600))
    finish(ours_p)
    tmp = tempfile.mkdtemp(prefix="bench-prom-")
    try:
        prom_p = start_worker("scrape-prom", "--ranks", str(nranks), "--stats", str(stats),
                              env=clean_env(PROMETHEUS_MULTIPROC_DIR=tmp))
        prom = json.loads(expect_line(prom_p, "result", 900))
        finish(prom_p)
    except Exception as exc:  # prometheus_client missing or failing: reported as such
        prom = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ranks": nranks, "stats": stats, "ours": ours, "prom": prom}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` used so far."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_node(nranks: int, stats: int, phases: list[tuple[float, float]], warmup: float,
             relay: str = "node-collector", forked: bool = False, tick_ms: float = 5.0) -> dict[str, Any]:
    """A node collector serving one job of ``nranks`` ranks x ``stats`` stats (1 s windows, 200 samples/s each),
    with a subscriber on its node endpoint: per phase ``(events/s from all ranks, seconds)`` its CPU per wall
    second, the events and rank messages the subscriber received and their latency from ``log_event``; then sent
    vs received. ``relay="node-proxy"``: the same with libzmq's ``zmq_proxy`` in the collector's place
    (:func:`worker_node_proxy`). ``forked``: the ranks are forked from one process (:func:`worker_node_ranks`),
    each stat sampled every ``tick_ms``."""
    job = new_job(f"node{nranks}")
    tmp = tempfile.mkdtemp(prefix="bench-node-")
    os.chmod(tmp, 0o700)
    endpoint = f"ipc://{tmp}/node.ipc"
    ranks: list[subprocess.Popen[str]] = []
    col = sub = None
    try:
        # the collector first: it holds the job's segment before any rank attaches, so that a node collector
        # already running on the machine (serving every job of this user) leaves the job to it
        # (forked: as many rank messages as events; a subscriber that falls behind on a loaded machine loses past the
        # default queue of 128 messages, counted by the collector: the instrument must not lose them)
        col = start_worker(relay, "--job", job, "--endpoint", endpoint,
                           *(["--publish-queue", "100000"] if forked else []))
        pid = int(expect_line(col, "ready", 60))
        if forked:
            ranks.append(start_worker("node-ranks", "--job", job, "--ranks", str(nranks), "--stats", str(stats),
                                      "--tick-ms", str(tick_ms)))
        for r in range(0 if forked else nranks):
            ranks.append(start_worker("node-rank", "--job", job, "--rank", str(r), "--ranks", str(nranks),
                                      "--stats", str(stats), "--tick-ms", str(tick_ms)))
        for p in ranks:
            expect_line(p, "ready", 300)
        sub = start_worker("node-subscriber", "--endpoint", endpoint,
                           *(["--ready-at-once"] if relay == "node-proxy" else []))
        expect_line(sub, "ready", 60)
        time.sleep(warmup)
        rows = []
        for rate, seconds in phases:
            for p in ranks:
                tell(p, f"rate {rate / nranks}")
            time.sleep(warmup)
            tell(sub, "mark")
            expect_line(sub, "result")
            c0, w0 = _cpu_s(pid), time.monotonic()
            time.sleep(seconds)
            c1, w1 = _cpu_s(pid), time.monotonic()
            tell(sub, "mark")
            got = json.loads(expect_line(sub, "result"))
            rows.append({"rate": rate, "cpu_per_s": (c1 - c0) / (w1 - w0), "events_per_s": got["events"] / (w1 - w0),
                         "messages_per_s": got["messages"] / (w1 - w0),
                         "lat_median_ms": got["lat_median_ms"], "lat_p99_ms": got["lat_p99_ms"]})
        for p in ranks:
            tell(p, "rate 0")
        time.sleep(max(1.0, warmup))
        logged = dropped = 0
        for p in ranks:
            tell(p, "report")
            r = json.loads(expect_line(p, "result", 60))
            logged += r["logged"]
            dropped += r["dropped"]
        tell(sub, "mark")
        final = json.loads(expect_line(sub, "result"))
    finally:
        for p in [*ranks, *(x for x in (sub, col) if x is not None)]:
            finish(p)
        unlink_job(job)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ranks": nranks, "stats": stats, "relay": relay, "phases": rows, "logged": logged, "dropped": dropped,
            "received": final["total"], "gaps": final["gaps"], "tick_ms": tick_ms}


_RELAY_NAMES = {"node-collector": "shmstat node collector", "node-proxy": "libzmq `zmq_proxy` (the floor)"}


def node_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The report's table for :func:`run_node` (the collector's runs and their ``zmq_proxy`` anchors)."""
    out = ["", "## Node collector cost (`shmstat collect` loop serving one job, null handlers, a subscriber on the "
           "node endpoint)", "",
           "Each rank has its stats get 200 samples/s (1 s windows) and logs `Event(name, datetime.now(), data)` "
           "at the phase's rate; CPU is the relaying process's (every thread, libzmq's included) per wall second; "
           "latency is from `log_event` to the subscriber's receive. The anchor is the floor of the design (ranks' "
           "messages over ZeroMQ, re-published for subscribers): the same ranks and subscriber with libzmq's own "
           "`zmq_proxy` (C) relaying, which checks, tracks, acknowledges and counts nothing.", "",
           "| relay | ranks x stats | events/s asked | events/s received | rank messages/s | CPU s per s | CPU per "
           "relayed event (over idle) | CPU per rank message | latency median | p99 |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        idle = next((p["cpu_per_s"] for p in run["phases"] if p["rate"] == 0), None)
        for p in run["phases"]:
            flowing = p["rate"] != 0 and idle is not None and p["events_per_s"]
            per = f"{(p['cpu_per_s'] - idle) / p['events_per_s'] * 1e6:,.1f} us" if flowing else "-"
            per_msg = (f"{(p['cpu_per_s'] - idle) / p['messages_per_s'] * 1e6:,.1f} us"
                       if flowing and p.get("messages_per_s") else "-")
            lm = f"{p['lat_median_ms']:.2f} ms" if p["lat_median_ms"] is not None else "-"
            lx = f"{p['lat_p99_ms']:.2f} ms" if p["lat_p99_ms"] is not None else "-"
            out.append(f"| {_RELAY_NAMES.get(run.get('relay', ''), 'shmstat node collector')} | {run['ranks']} x "
                       f"{run['stats']} | {p['rate']:,.0f} | {p['events_per_s']:,.0f} | "
                       f"{p.get('messages_per_s', 0):,.0f} | {p['cpu_per_s']:.4f} | {per} | {per_msg} | {lm} | {lx} |")
    out.append("")
    for run in runs:
        lost = run["logged"] - run["dropped"] - run["received"]
        out.append(f"- {_RELAY_NAMES.get(run.get('relay', ''), 'shmstat node collector')}, {run['ranks']} ranks: "
                   f"{run['logged']:,} events logged, {run['received']:,} received by the subscriber, "
                   f"{run['dropped']:,} dropped (counted), {lost:,} lost, {run['gaps']:,} in sequence gaps")
    return out


def target_lines(runs: list[dict[str, Any]], budget_ms: float) -> list[str]:
    """The event path's targets (issue 45) read off :func:`run_node`'s runs of the node collector."""
    out = ["", f"Targets, with the ranks' latency budget at {budget_ms:g} ms (`SHMSTAT_EVENT_LATENCY_MS`):", ""]
    for run in runs:
        if run.get("relay") != "node-collector" or run.get("tick_ms", 5.0) != 5.0:
            continue
        idle = next((p["cpu_per_s"] for p in run["phases"] if p["rate"] == 0), None)
        for p in run["phases"]:
            if p["rate"] == 0:
                out.append(f"- idle collector, {run['ranks']} ranks: {p['cpu_per_s']:.4f} CPU-s/s (target <= 0.01)")
            elif p["rate"] <= 10_000 and idle is not None and p["events_per_s"]:
                per = (p["cpu_per_s"] - idle) / p["events_per_s"] * 1e6
                lm, lx = p["lat_median_ms"], p["lat_p99_ms"]
                out.append(f"- {p['rate']:,.0f} events/s from {run['ranks']} ranks: {per:.1f} us of collector CPU per "
                           f"relayed event (target <= 10); latency median {lm:.1f} ms (target <= {budget_ms + 5:g}), "
                           f"p99 {lx:.1f} ms (target < {4 * budget_ms:g})")
            else:
                out.append(f"- {p['rate']:,.0f} events/s from {run['ranks']} ranks: {p['events_per_s']:,.0f} "
                           f"received per s with {p['cpu_per_s']:.2f} CPU-s/s (target: within one core)")
    return out


def scale_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The report's table for the collector's cost as the job grows (:func:`run_node` with forked ranks)."""
    out = ["", "## The node collector's cost as the job grows (the pass and the relay at 8, 32 and 128 ranks)", "",
           "One node collector serving one job; the ranks are processes forked from one (so that 128 fit this "
           "machine), each with 8 stats of 1 s windows sampled every 50 ms; then 2,000 events/s from all the ranks. "
           "The pass's cost is the idle phase's CPU per rank-stat window (every window of every stat of every rank "
           "is read, merged and handed to the null handlers); the relay's is the CPU over idle per relayed event. "
           "At 2,000 events/s a rank of 128 logs one event every 64 ms: each goes in a message of its own, so the "
           "relay's cost there is the cost per message. The subscriber's queue is 100,000 messages (a loaded "
           "machine's subscriber falls behind).",
           "", "| ranks | windows/s | idle CPU s/s | per window | events/s received | CPU s/s | per relayed event | "
           "latency median | p99 |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        idle = next((p["cpu_per_s"] for p in run["phases"] if p["rate"] == 0), 0.0)
        windows = run["ranks"] * run["stats"]
        for p in run["phases"]:
            if p["rate"] == 0:
                continue
            per = f"{(p['cpu_per_s'] - idle) / p['events_per_s'] * 1e6:.1f} us" if p["events_per_s"] else "-"
            lm = f"{p['lat_median_ms']:.1f} ms" if p["lat_median_ms"] is not None else "-"
            lx = f"{p['lat_p99_ms']:.1f} ms" if p["lat_p99_ms"] is not None else "-"
            out.append(f"| {run['ranks']} | {windows:,} | {idle:.4f} | {idle / windows * 1e6:.1f} us | "
                       f"{p['events_per_s']:,.0f} | {p['cpu_per_s']:.4f} | {per} | {lm} | {lx} |")
    out.append("")
    for run in runs:
        lost = run["logged"] - run["dropped"] - run["received"]
        out.append(f"- {run['ranks']} ranks: {run['logged']:,} events logged, {run['received']:,} received, "
                   f"{run['dropped']:,} dropped (counted), {lost:,} lost, {run['gaps']:,} in sequence gaps")
    return out


IMPORTS = ("shmstat", "elastic.metrics", "collector", "torch.monitor", "torch.distributed.elastic.metrics",
           "prometheus_client")


def run_imports(rounds: int) -> dict[str, float | None]:
    """Wall time of ``import M`` in a fresh interpreter, minus a bare interpreter's start (median of ``rounds``
    each, interleaved so load affects all alike); None for a module that cannot be imported."""
    def once(code: str) -> float:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True)
        if r.returncode:
            raise ImportError(code)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {m: [] for m in ("", *IMPORTS)}
    missing: set[str] = set()
    for _ in range(rounds):
        for m in times:
            if m in missing:
                continue
            try:
                times[m].append(once(f"import {m}" if m else "pass"))
            except ImportError:
                missing.add(m)
    bare = statistics.median(times[""])
    return {m: None if m in missing else max(0.0, statistics.median(times[m]) - bare) for m in IMPORTS}


def import_lines(res: dict[str, float | None]) -> list[str]:
    out = ["", "## Import time (fresh interpreter, minus a bare interpreter's start; median)", "",
           "| import | ms |", "|---|---:|"]
    for m, t in res.items():
        out.append(f"| `import {m}` | {'missing' if t is None else f'{t * 1000:,.0f}'} |")
    return out


def scrape_lines(res: dict[str, Any]) -> list[str]:
    ours, prom = res["ours"], res["prom"]
    out = ["", f"## Prometheus scrape ({res['ranks']} ranks x {res['stats']:,} stats: merged and per-rank series, "
           "one window)", "",
           "| exporter | series lines | scrape | rendering the text format |", "|---|---:|---:|---:|",
           f"| shmstat /metrics (prometheus_client custom collector, cached rendering), HTTP GET median of 5 | "
           f"{ours['lines']:,} | {ours['scrape_s'] * 1000:,.0f} ms | {ours['render_s'] * 1000:,.0f} ms, "
           "in the background |"]
    if "scrape_s" in prom:
        out.append(f"| prometheus_client multiprocess collect + text format (median of 3), same series as count, "
                   f"sum, mean | {prom['lines']:,} | {prom['scrape_s'] * 1000:,.0f} ms | (in the scrape) |")
    else:
        out.append(f"| prometheus_client multiprocess | - | {prom.get('error', 'missing')} | - |")
    out += ["", f"Folding the {res['stats'] * (res['ranks'] + 1):,} rows of a pass into the exporter: "
            f"{ours['observe_s'] * 1000:,.0f} ms. The rendering is prometheus_client's text format, about "
            "20 us per line here (each label name validated and escaped per line): it runs in a background thread "
            "after each pass, capped at a fifth of a core, and a scrape sends the newest complete rendering "
            "(collector/prometheus/server.py)."]
    return out


def run_create(nranks: int, stats: int) -> dict[str, Any]:
    """``nranks`` processes each create ``stats`` Stats at once (wall time until the last is done)."""
    job = new_job("create")
    ranks: list[subprocess.Popen[str]] = []
    try:
        for r in range(nranks):
            ranks.append(start_worker("create-rank", "--job", job, "--rank", str(r), "--ranks", str(nranks),
                                      "--stats", str(stats)))
        for p in ranks:
            expect_line(p, "ready", 120)
        start = time.perf_counter()
        for p in ranks:
            tell(p, "go")
        per = [json.loads(expect_line(p, "result", 600)) for p in ranks]
        wall = time.perf_counter() - start
    finally:
        for p in ranks:
            finish(p)
        unlink_job(job)
    return {"ranks": nranks, "stats": stats, "wall_s": wall, "create_max_s": max(p["create_s"] for p in per),
            "recreate_max_s": max(p["recreate_s"] for p in per)}


def create_lines(res: dict[str, Any]) -> list[str]:
    """The report's table for :func:`run_create`."""
    return [
        "",
        "### Creating stats (seconds; lower is better)",
        "",
        f"{res['ranks']} rank processes at once, each creating {res['stats']:,} distinct Stats, then creating "
        "every one of them again (a helper that builds its Stat on every call).",
        "",
        "| what | seconds |",
        "|---|---:|",
        f"| all {res['ranks']} x {res['stats']:,} created (wall, slowest rank) | {res['create_max_s']:.2f} |",
        f"| all re-created (slowest rank) | {res['recreate_max_s']:.2f} |",
        f"| whole phase, wall clock | {res['wall_s']:.2f} |",
    ]


# ============================================================================================ report


def fmt_ns(v: Any) -> str:
    if isinstance(v, (int, float)):
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return "missing"


def ratio(anchor: Any, ours: Any) -> str:
    if isinstance(anchor, (int, float)) and isinstance(ours, (int, float)) and ours > 0:
        return f"{anchor / ours:.2f}x"
    return "missing"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(calls: dict[str, Any], tput: list[dict[str, Any]], cost: list[dict[str, Any]], grace_ms: int,
           quick: bool) -> list[str]:
    out = ["# shmstat benchmarks", ""]
    out += machine_lines()
    out.append(f"- mode: {'--quick' if quick else 'full'}; per-call figures: median of {calls['repeat']} timeit "
               f"rounds of up to {calls['number']:,} calls, "
               f"{'process CPU time (--cpu)' if TIMER[0] is time.process_time else 'wall time'}")
    out.append("")
    missing = {name: calls.get(key) for name, key in (("torch.monitor", "torch"), ("torchelastic", "torchelastic"),
                                                       ("prometheus_client", "prometheus"))}
    for name, state in missing.items():
        if not isinstance(state, str) or state.startswith("missing"):
            out.append(f"- anchor {name}: {state or 'missing'}")
    floor = calls.get("floor")
    out += ["## Per-call cost (ns per call; lower is better)", "",
            "| call | ns/call | x empty call |", "|---|---:|---:|"]
    rows = [
        ("empty Python method call (the floor)", "floor"),
        ("shmstat Stat.add, in-process", "ours.add.local"),
        ("shmstat Stat.add, attached (C fast path)" if calls.get("ours.add.c_path")
         else "shmstat Stat.add, attached (C path not built: Python)", "ours.add.attached"),
        ("shmstat Stat.add, attached, SHMSTAT_PURE_PYTHON=1", "ours.add.attached_py"),
        ("shmstat Stat.add, attached, varying values (next(it) in the loop)", "ours.add.attached_varied"),
        ("shmstat Stat.add with P50/P99, attached, varying values (next(it) in the loop)",
         "ours.add.percentiles_varied"),
        ("shmstat Stat.add with P50/P99, attached", "ours.add.percentiles"),
        ("torch.monitor Stat.add", "torch.add"),
        ("shmstat section enter + exit, attached (Stat and phase word; C path)" if calls.get("ours.add.c_path")
         else "shmstat section enter + exit, attached (Stat and phase word; C path not built: Python)",
         "ours.section.attached"),
        ("torch.profiler.record_function enter + exit, no profiler running", "torch.record_function"),
        ("prometheus_client multiprocess Counter.inc", "prom.inc"),
        ("prometheus_client multiprocess Histogram.observe", "prom.observe"),
        ("shmstat log_event, no handler, not attached", "ours.log_event.none"),
        ("torch.monitor log_event, no handler", "torch.log_event.none"),
        ("shmstat log_event, one no-op handler, not attached", "ours.log_event.handler"),
        ("torch.monitor log_event, one no-op handler", "torch.log_event.handler"),
        ("shmstat log_event to a running collector (incl. publisher thread)", "ours.log_event.collector"),
        ("shmstat log_event to a running collector (caller side only)", "ours.log_event.collector_caller"),
        ("  of which the acknowledgement: the publisher keeps a sent message, forgets it when acknowledged "
         "(per message, 16 per acknowledgement)", "ours.ack.keep_forget"),
        ("shmstat log_event(Event(..., datetime.now(), data)), one no-op handler", "ours.log_event.fresh_handler"),
        ("shmstat log_event(Event(..., datetime.now(), data)) to a running collector",
         "ours.log_event.fresh_collector"),
        ("shmstat log_event(Event(..., datetime.now(), data)) to a running collector (caller side only)",
         "ours.log_event.fresh_collector_caller"),
        ("torch.monitor log_event(Event(..., datetime.now(), data)), one no-op handler",
         "torch.log_event.fresh_handler"),
        ("torch.monitor building an Event with datetime.now()", "torch.event_build"),
        ("datetime.now() alone", "py.datetime_now"),
        ("shmstat building an Event with a datetime made before", "ours.event_only"),
        ("shmstat building an Event with datetime.now()", "ours.event_build"),
        ("shmstat put_metric, not attached (null)", "ours.put_metric.null"),
        ("shmstat put_metric routed to the collector (incl. publisher thread)", "ours.put_metric.collector"),
        ("shmstat put_metric routed to the collector (caller side only)", "ours.put_metric.collector_caller"),
        ("torchelastic put_metric, NullMetricHandler", "te.put_metric"),
        ("shmstat @prof on an empty function, not attached (null)", "ours.prof.null"),
        ("shmstat @prof on an empty function, routed to the collector (incl. publisher thread)",
         "ours.prof.collector"),
        ("shmstat @prof on an empty function, routed to the collector (caller side only)",
         "ours.prof.collector_caller"),
        ("torchelastic @prof on an empty function, NullMetricHandler", "te.prof"),
    ]
    for label, key in rows:
        v = calls.get(key)
        out.append(f"| {label} | {fmt_ns(v)} | {_xfloor(v, floor)} |")
    scrape = calls.get("prom.scrape_ms")
    out.append("")
    out.append(f"prometheus_client multiprocess scrape of this one process's files: "
               f"{f'{scrape:.2f} ms' if isinstance(scrape, float) else 'missing'}.")
    pub = calls.get("ours.publisher", {})
    out.append(f"Publisher during the collector rows: {pub.get('queued', 0):,} items queued, "
               f"{pub.get('sent', 0):,} sent, {pub.get('dropped', 0):,} dropped.")
    out += ["", "## Against the anchors (anchor time / shmstat time: above 1 means shmstat is faster)", "",
            "| shmstat | anchor | shmstat ns | anchor ns | ratio | target | met |", "|---|---|---:|---:|---:|---|---|"]
    comparisons = [
        ("Stat.add attached", "ours.add.attached", "torch.monitor Stat.add", "torch.add", 1.0, "faster"),
        ("Stat.add attached", "ours.add.attached", "prometheus Counter.inc", "prom.inc", 5.0, ">= 5x"),
        ("Stat.add attached", "ours.add.attached", "prometheus Histogram.observe", "prom.observe", None, ""),
        ("Stat.add with P50/P99, varying values", "ours.add.percentiles_varied",
         "shmstat Stat.add attached, varying values", "ours.add.attached_varied", 0.5, "<= 2x (ratio >= 0.5)"),
        ("Stat.add with P50/P99", "ours.add.percentiles", "torch.monitor Stat.add (no percentiles)", "torch.add",
         1.0, "faster"),
        ("Stat.add with P50/P99", "ours.add.percentiles", "prometheus Histogram.observe", "prom.observe", 10.0,
         ">= 10x"),
        ("Stat.add attached, pure Python", "ours.add.attached_py", "torch.monitor Stat.add", "torch.add", 1.0,
         "(faster)"),
        ("Stat.add attached, pure Python", "ours.add.attached_py", "prometheus Counter.inc", "prom.inc", 5.0,
         "(>= 5x)"),
        ("Stat.add in-process", "ours.add.local", "torch.monitor Stat.add", "torch.add", None, ""),
        # issue 14's target is the Event(now) row below; a prebuilt Event costs torch.monitor no conversion at all
        ("log_event to the collector", "ours.log_event.collector", "torch.monitor log_event, one handler",
         "torch.log_event.handler", None, ""),
        ("log_event to the collector", "ours.log_event.collector", "torch.monitor log_event, no handler",
         "torch.log_event.none", None, ""),
        ("Event(now) built + logged to the collector", "ours.log_event.fresh_collector",
         "torch.monitor Event(now) built + logged, one handler", "torch.log_event.fresh_handler", 3.0, ">= 3x"),
        ("Event(now) built + logged, one handler", "ours.log_event.fresh_handler",
         "torch.monitor Event(now) built + logged, one handler", "torch.log_event.fresh_handler", None, ""),
        ("log_event, one handler", "ours.log_event.handler", "torch.monitor log_event, one handler",
         "torch.log_event.handler", None, ""),
        ("log_event, no handler", "ours.log_event.none", "torch.monitor log_event, no handler",
         "torch.log_event.none", None, ""),
        ("put_metric to the collector", "ours.put_metric.collector", "torchelastic put_metric (null)",
         "te.put_metric", 1.0, "cheaper"),
        ("put_metric, null", "ours.put_metric.null", "torchelastic put_metric (null)", "te.put_metric", 1.0,
         "cheaper"),
        ("@prof to the collector", "ours.prof.collector", "torchelastic @prof (null)", "te.prof", 1.0, "cheaper"),
        ("@prof, null", "ours.prof.null", "torchelastic @prof (null)", "te.prof", 1.0, "cheaper"),
        ("section enter + exit, attached", "ours.section.attached",
         "torch.profiler.record_function, no profiler", "torch.record_function", 1.0, "cheaper"),
    ]
    for ours_label, ok, anchor_label, ak, need, target in comparisons:
        o, a = calls.get(ok), calls.get(ak)
        met = ""
        if need is not None and isinstance(o, (int, float)) and isinstance(a, (int, float)):
            met = "yes" if a / o >= need and (need != 1.0 or a > o) else "NO"
        elif need is not None:
            met = "missing"
        out.append(f"| {ours_label} | {anchor_label} | {fmt_ns(o)} | {fmt_ns(a)} | {ratio(a, o)} | {target} "
                   f"| {met} |")
    o = calls.get("ours.add.attached")
    if isinstance(o, float) and isinstance(floor, float):
        out.append(f"| Stat.add attached | empty method call | {fmt_ns(o)} | {fmt_ns(floor)} | "
                   f"{o / floor:.2f}x the floor | within 6x | {'yes' if o <= 6 * floor else 'NO'} |")
    o = calls.get("ours.section.attached")
    if isinstance(o, float) and isinstance(floor, float):
        out.append(f"| section enter + exit, attached | empty method call | {fmt_ns(o)} | {fmt_ns(floor)} | "
                   f"{o / floor:.2f}x the floor | within 3x | {'yes' if o <= 3 * floor else 'NO'} |")
    o = calls.get("ours.add.attached_py")
    if isinstance(o, float) and isinstance(floor, float):
        out.append(f"| Stat.add attached, pure Python | empty method call | {fmt_ns(o)} | {fmt_ns(floor)} | "
                   f"{o / floor:.2f}x the floor | (within 6x) | {'yes' if o <= 6 * floor else 'NO'} |")

    out += ["", "## Event throughput into the collector (log_event as fast as possible, prebuilt Event)", "",
            "| ranks | events | events/s into the collector | caller loop events/s | messages | sent | "
            "received | dropped (counted) | lost (sent - received - dropped) | seq gaps |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in tput:
        out.append(f"| {t['ranks']} | {t['events']:,} | {t['rate']:,.0f} | {t['caller_rate']:,.0f} | "
                   f"{t['messages']:,} | {t['sent']:,} | {t['received']:,} | {t['dropped']:,} | {t['lost']:,} | "
                   f"{t['gaps']:,} |")
    out.append("")
    out.append("`sent` counts every item the ranks' publishers accepted (one warm-up event per rank included), "
               "`received` the events the collector relayed; the events per rank stay within the publisher's "
               "backlog bound (100,000).")
    out += ["", f"## Collector cost (1 s windows, every stat gets a sample every 250 ms, grace {grace_ms} ms, "
            "no subscriber)", "",
            "| ranks x stats | handler | slots | segment | collector CPU s per wall s | windows/s (merged) | rows/s "
            "| collector RSS | window end to handler, median | max |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cost:
        lm = f"{c['lat_median'] * 1000:.1f} ms" if c["lat_median"] is not None else "n/a"
        lx = f"{c['lat_max'] * 1000:.1f} ms" if c["lat_max"] is not None else "n/a"
        handler = ("columnar (emit_columns, every figure touched)" if c.get("columns")
                   else "counting (every row built)" if c.get("consume") else "null")
        if c.get("percentiles"):
            handler += ", stats with P50/P99"
        out.append(f"| {c['ranks']} x {c['stats']:,} | {handler} | {c['slots']:,} | {mib(c['segment'])} | "
                   f"{c['cpu_per_s']:.3f} | {c['windows'] / c['wall']:,.0f} | {c['rows'] / c['wall']:,.0f} | "
                   f"{mib(c['rss'])} | {lm} | {lx} |")
    out.append("")
    out.append("Latency is measured by a handler on the probe stat's group, which sorts after every other group, "
               "so it is the time from a window's end to the end of the pass that emits it. With the null handler "
               "(and no subscriber) the collector reads, checks and counts every window but builds no row for "
               "it; the counting handler shows what building and dispatching every row (one MetricData per "
               "aggregation, merged and per rank) costs, the least any real handler adds. The columnar handler serves "
               "every group (the probe's too) and takes each pass whole as arrays (`emit_columns`); it sums every "
               "figure of every pass and measures the latency itself (window end to its call).")
    out += spread_lines(tput)
    out += ["", "## Targets", ""]
    one = [t for t in tput if t["ranks"] == 1]
    if one:
        rates = sorted(t["rate"] for t in one)
        clean = all(t["lost"] == 0 and t["dropped"] == 0 for t in one)
        for need in (200_000, 1_000_000):
            out.append(f"- >= {need:,} events/s from one rank with zero loss (median of {len(one)} runs): "
                       f"{statistics.median(rates):,.0f} events/s (min {rates[0]:,.0f}), lost "
                       f"{sum(t['lost'] for t in one)}, dropped {sum(t['dropped'] for t in one)} -> "
                       f"{'met' if statistics.median(rates) >= need and clean else 'NOT met'}")
    four = [t for t in tput if t["ranks"] == 4]
    if four:
        clean = all(t["lost"] == 0 and t["dropped"] == 0 for t in four)
        out.append(f"- 4 ranks, the collector keeps up with zero loss: lost {sum(t['lost'] for t in four)}, dropped "
                   f"{sum(t['dropped'] for t in four)} over {len(four)} runs -> {'met' if clean else 'NOT met'}")
    big = [c for c in cost if c["slots"] >= 64_000 and not c.get("consume")]
    for c in big:
        out.append(f"- collector at {c['slots']:,} slots under 10% of one core: {c['cpu_per_s'] * 100:.1f}% -> "
                   f"{'met' if c['cpu_per_s'] < 0.10 else 'NOT met'}")
    for c in cost:
        if c.get("columns"):
            out.append(f"- columnar handler at {c['slots']:,} slots{' (P50/P99)' if c.get('percentiles') else ''} "
                       f"under 10% of one core: {c['cpu_per_s'] * 100:.1f}% -> "
                       f"{'met' if c['cpu_per_s'] < 0.10 else 'NOT met'}")
    for c in cost:
        if c["lat_max"] is not None:
            out.append(f"- window-to-handler latency under grace + 50 ms ({grace_ms + 50} ms) at {c['slots']:,} "
                       f"slots{' (counting handler)' if c.get('consume') else ''}"
                       f"{' (columnar handler)' if c.get('columns') else ''}"
                       f"{' (P50/P99)' if c.get('percentiles') else ''}: max {c['lat_max'] * 1000:.1f} ms -> "
                       f"{'met' if c['lat_max'] * 1000 < grace_ms + 50 else 'NOT met'}")
    return out


def spread_lines(tput: list[dict[str, Any]]) -> list[str]:
    """Events/s into the collector per rank count over the runs: min / median / max (never just the best)."""
    out = ["", "Events/s into the collector over the runs (min / median / max):", "",
           "| ranks | runs | min | median | max | lost (all runs) | dropped (all runs) |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({t["ranks"] for t in tput}):
        runs = [t for t in tput if t["ranks"] == n]
        rates = sorted(t["rate"] for t in runs)
        out.append(f"| {n} | {len(runs)} | {rates[0]:,.0f} | {statistics.median(rates):,.0f} | {rates[-1]:,.0f} | "
                   f"{sum(t['lost'] for t in runs):,} | {sum(t['dropped'] for t in runs):,} |")
    return out


def _xfloor(v: Any, floor: Any) -> str:
    if isinstance(v, (int, float)) and isinstance(floor, (int, float)) and floor > 0:
        return f"{v / floor:.1f}"
    return "missing" if not isinstance(v, (int, float)) else ""


def write_md(path: str, lines: list[str]) -> None:
    """Replace the block between the bench markers in ``path`` (or append one) with ``lines``."""
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    body = ["## Latest run" if line == "# shmstat benchmarks" else "#" + line if line.startswith("## ") else line
            for line in lines]
    block = "\n".join([begin, *body, end])
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = (text.rstrip() + "\n\n" if text else "") + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _budget_ms() -> float:
    """The ranks' latency budget in this run (they inherit ``SHMSTAT_EVENT_LATENCY_MS``)."""
    from shmstat.publish.sender import event_latency_ms

    return event_latency_ms()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        run_worker(argv)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and shorter runs (about 3 minutes on 2 cores)")
    ap.add_argument("--md", metavar="PATH", help="also write the report into PATH (between bench markers)")
    kinds = ("calls", "throughput", "collector", "node", "sections", "ddp", "scale", "create", "scrape", "imports")
    ap.add_argument("--only", choices=kinds, action="append",
                    help="run only these parts (repeatable; the default is everything)")
    ap.add_argument("--cpu", action="store_true",
                    help="per-call figures in this process's CPU time, not wall time (for a loaded machine)")
    args = ap.parse_args(argv)
    if args.cpu:
        TIMER[0] = time.process_time
    parts = set(args.only or kinds)
    quick = args.quick
    started = time.monotonic()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("measuring (the report is printed at the end)...", file=sys.stderr, flush=True)
    calls = run_calls(quick) if "calls" in parts else {"repeat": 0, "number": 0}
    print(f"  calls done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    tput: list[dict[str, Any]] = []
    if "throughput" in parts:
        events = 50_000 if quick else 100_000
        for _run in range(3):  # three runs of each: the report gives the spread, not the best
            for n in (1, 2, 4):
                tput.append(run_throughput(n, events))
                print(f"  throughput {n} done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    cost: list[dict[str, Any]] = []
    if "collector" in parts:
        seconds, warmup = (3.0, 1.0) if quick else (10.0, 2.0)
        for stats, consume, pct, columnar in ((125, False, False, False), (1000, False, False, False),
                                              (8000, False, False, False), (1000, True, False, False),
                                              (1000, False, False, True), (1000, False, True, False),
                                              (1000, True, True, False), (1000, False, True, True)):
            cost.append(run_collector_cost(8, stats, seconds, warmup, consume, pct, columnar))
            print(f"  collector {8 * stats} slots done ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                  flush=True)
    nodes: list[dict[str, Any]] = []
    if "node" in parts:
        seconds, warmup = (3.0, 1.0) if quick else (10.0, 2.0)
        for nranks, rate in ((4, 2000.0), (8, 100_000.0)):
            for relay in ("node-collector", "node-proxy"):  # ours, then its anchor, one after the other
                nodes.append(run_node(nranks, 8, [(0, seconds), (rate, seconds)], warmup, relay))
                print(f"  node {nranks} ranks, {relay} done ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                      flush=True)
    budget_ms = _budget_ms()
    secs = run_sections(quick) if "sections" in parts else []
    if secs:
        print(f"  sections done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    ddp = run_ddp(quick) if "ddp" in parts else None
    if ddp is not None:
        print(f"  ddp done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    scaled: list[dict[str, Any]] = []
    if "scale" in parts:
        seconds, warmup = (3.0, 2.0) if quick else (10.0, 3.0)
        for nranks in (8, 32, 128):
            scaled.append(run_node(nranks, 8, [(0, seconds), (2000.0, seconds)], warmup, forked=True, tick_ms=50.0))
            print(f"  scale {nranks} ranks done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    created = None
    if "create" in parts:
        created = run_create(8, 2000 if quick else 8000)
        print(f"  create done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    scraped = None
    if "scrape" in parts:
        scraped = run_scrape(8, 1000 if quick else 8000)
        print(f"  scrape done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    imported = None
    if "imports" in parts:
        imported = run_imports(3 if quick else 7)
        print(f"  imports done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    if parts & {"calls", "throughput", "collector"}:
        lines = report(calls, tput, cost, 20, quick)
    else:  # (the per-call tables and targets would be rows of "missing")
        lines = ["# shmstat benchmarks", "", *machine_lines(),
                 f"- mode: {'--quick' if quick else 'full'}; parts: {', '.join(sorted(parts))}"]
    if nodes:
        lines.extend(node_lines(nodes))
        lines.extend(target_lines(nodes, budget_ms))
    if secs:
        lines.extend(section_lines(secs))
    if ddp is not None:
        lines.extend(ddp_lines(ddp))
    if scaled:
        lines.extend(scale_lines(scaled))
    if imported is not None:
        lines.extend(import_lines(imported))
    if created is not None:
        lines.extend(create_lines(created))
    if scraped is not None:
        lines.extend(scrape_lines(scraped))
    lines.append("")
    lines.append(f"(whole run: {time.monotonic() - started:.0f} s)")
    print("\n".join(lines))
    if args.md:
        write_md(args.md, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
