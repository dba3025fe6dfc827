"""Helpers for the fault, load, fuzz and security tests: a subscriber that accounts for every item, rank workers
(spawn-safe, importable by child processes) and a memory sampler. Real processes, sockets and shared memory only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import defaultdict
from typing import Any

import msgpack
import psutil
import zmq

from shmstat import wire

_STOP_FILE_POLL_S = 0.005


# ------------------------------------------------------------------------------------------- subscriber


class StreamLog:
    """What a subscriber saw of one sender stream (kind, rank, pid, incarnation): the seq ranges received."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self.ranges: list[tuple[int, int]] = ranges if ranges is not None else []  # (first seq, item count)

    def add(self, first: int, n: int) -> None:
        self.ranges.append((first, n))

    def _merged(self) -> tuple[int, int, int]:
        """(distinct seqs received, duplicates, one past the highest seq)."""
        distinct = dups = 0
        hi = 0
        for first, n in sorted(self.ranges):
            end = first + n
            if first < hi:
                overlap = min(end, hi) - first
                dups += overlap
                distinct += n - overlap
            else:
                distinct += n
            hi = max(hi, end)
        return distinct, dups, hi

    @property
    def received(self) -> int:
        return self._merged()[0]

    @property
    def duplicates(self) -> int:
        return self._merged()[1]

    @property
    def top(self) -> int:
        """One past the highest seq received (0 if none)."""
        return self._merged()[2]

    @property
    def gaps(self) -> int:
        """Seqs below the highest one received that never arrived."""
        distinct, _, hi = self._merged()
        return hi - distinct


class Subscriber:
    """A SUB socket on a collector's publish endpoint, read by a thread; everything is recorded under a lock.

    ``streams[(kind, rank, pid, incarnation)]`` accounts for events and metrics by wire seq; ``stat_rows`` holds
    the stat items; ``lifecycle`` the rank items; ``usage`` the latest platform counter values by name.
    """

    def __init__(self, endpoint: str, topics: tuple[bytes, ...] = (b"",), *, rcvhwm: int = 0,
                 reconnect_ivl_ms: int = 10, keep_items: bool = False) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1)
        for t in topics:
            self.sock.setsockopt(zmq.SUBSCRIBE, t)
        self.sock.connect(endpoint)
        self.lock = threading.Lock()
        self.streams: dict[tuple[str, int, int, int], StreamLog] = defaultdict(StreamLog)
        self.items: list[tuple[str, Any]] = []
        self.keep_items = keep_items
        self.stat_rows: list[dict] = []
        self.lifecycle: list[dict] = []
        self.usage: dict[str, float] = {}
        self.usage_updates = 0
        self.messages = 0
        self.malformed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-subscriber", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self.sock
        while not self._stop.is_set():
            if not sock.poll(20):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._record(frames)

    def _record(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode_frames(frames)
        except wire.WireError:
            msg = None
        with self.lock:
            self.messages += 1
            if msg is None:
                self.malformed += 1
                return
            if msg.kind in ("event", "metric"):
                self.streams[(msg.kind, msg.rank, msg.pid, msg.incarnation)].add(msg.seq, len(msg.items))
                if self.keep_items:
                    self.items.extend((msg.topic, it) for it in msg.items)
            elif msg.kind == "rank":
                self.lifecycle.extend(msg.items)
            elif msg.topic == "stat/shmstat/usage":
                for it in msg.items:
                    if it.get("rank") is None:
                        self.usage[str(it["name"])] = it["value"]  # type: ignore[assignment]
                self.usage_updates += 1
            else:
                self.stat_rows.extend(msg.items)

    def wait_flowing(self, timeout_s: float = 15.0) -> None:
        """Wait until the subscription took effect (the collector publishes its usage every second)."""
        from kit.support import wait_for

        wait_for(lambda: self.messages > 0, timeout_s, what=f"first message from {self.endpoint}")

    def received(self, kind: str, rank: int | None = None) -> int:
        with self.lock:
            return sum(s.received for k, s in self.streams.items() if k[0] == kind and (rank is None or k[1] == rank))

    def snapshot_streams(self) -> dict[tuple[str, int, int, int], StreamLog]:
        with self.lock:
            return {k: StreamLog(list(v.ranges)) for k, v in self.streams.items()}

    def counter(self, name: str) -> float | None:
        with self.lock:
            return self.usage.get(name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


# ------------------------------------------------------------------------------------------- ingest sender


class IngestSender:
    """An XPUB connected to a collector's ipc ingest endpoint, sending whatever frames it is given.

    The collector's XSUB subscribes to everything; :meth:`wait_subscribed` waits for that frame, so nothing sent
    afterwards is discarded by our own socket.
    """

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.sock.connect(endpoint)

    def wait_subscribed(self, timeout_s: float = 15.0) -> None:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError("the collector's subscription never arrived")
        while self.sock.poll(0):
            frame = self.sock.recv()
            if frame == b"\x01":
                return
        raise AssertionError("no subscribe-all frame from the collector")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(2000)
        self.ctx.term()


def valid_event_frames(rank: int, seq: int, n: int = 1, *, name: str = "fuzz.ok", pid: int = 1,
                       incarnation: int = 1) -> list[bytes]:
    """A well-formed event message of ``n`` items."""
    items = [[name, time.time_ns(), {"i": seq + j}] for j in range(n)]
    return [wire.event_topic(name).encode(), wire.encode("event", rank, pid, incarnation, seq, items)]


def raw_payload(body: Any) -> bytes:
    """msgpack of an arbitrary body (for building wrong-but-msgpack payloads)."""
    return msgpack.packb(body, use_bin_type=True)


# ------------------------------------------------------------------------------------------- memory


class RssSampler:
    """Samples the resident memory of a pid in a thread; ``peak`` and ``samples`` in bytes."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(self._interval)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ------------------------------------------------------------------------------------------- rank workers


def _write_json(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _publisher_stats() -> dict[str, Any]:
    from shmstat.job import _state

    pub = _state.STATE.publisher
    if pub is None:
        return {}
    s = pub.stats()
    return {"queued": s.queued, "sent": s.sent_items, "dropped": s.dropped, "backlog": s.backlog,
            "subscribed": s.subscribed, "pid": os.getpid()}


def load_worker(job: str, rank: int, world: int, seconds: float, window_ms: int, out_path: str,
                event_every: int = 8, start_path: str | None = None, endpoint: str | None = None,
                stop_path: str | None = None, pause_every: int = 0) -> None:
    """Add 1.0 to Stat ``load`` as fast as possible, logging an event every ``event_every`` adds.

    Writes ``{"counts": {wid: n}, "adds": n, "events": k, "pub": publisher stats}`` to ``out_path`` when done
    (after flushing its publisher). The Stat's clock remembers its last reading (inside add, as the real clock
    is read), so the worker knows the window of every sample it adds. ``start_path``: wait for that file first
    (so all ranks start together).
    ``stop_path``: stop early when that file appears. ``pause_every``: sleep 0.5 ms every that many adds
    (a rank that is mostly idle).
    """
    import shmstat
    from shmstat import Aggregation as A
    from shmstat.job import _state

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world, endpoint=endpoint)
    cur = [0]

    def clock() -> int:  # the real clock, read inside add (after the bank is marked), remembered for the tally
        cur[0] = time.time_ns()
        return cur[0]

    stat = shmstat.Stat("load", [A.COUNT, A.SUM, A.MIN, A.MAX], window_ms / 1000, group="load", clock=clock)
    import datetime

    ev = shmstat.Event("load.tick", datetime.datetime.now(datetime.timezone.utc), {"rank": rank, "payload": "x" * 32})
    if start_path:
        while not os.path.exists(start_path):
            time.sleep(_STOP_FILE_POLL_S)
    wns = window_ms * 1_000_000
    counts: dict[int, int] = defaultdict(int)
    n = events = 0
    slowest_log = 0.0
    end = time.monotonic() + seconds
    log_event, add, perf = shmstat.log_event, stat.add, time.perf_counter
    while True:
        add(1.0)
        counts[cur[0] // wns] += 1
        n += 1
        if event_every and n % event_every == 0:
            t = perf()
            log_event(ev)
            slowest_log = max(slowest_log, perf() - t)
            events += 1
        if n % 256 == 0 and (time.monotonic() >= end or (stop_path and os.path.exists(stop_path))):
            break
        if pause_every and n % pause_every == 0:
            time.sleep(0.0005)
    pub = _state.STATE.publisher
    flushed = pub.flush(20.0) if pub is not None else True
    _write_json(out_path, {"counts": {str(k): v for k, v in counts.items()}, "adds": n, "events": events,
                           "pub": _publisher_stats(), "flushed": flushed, "pid": os.getpid(),
                           "slowest_log_s": slowest_log})
    # flushed means handed to zmq: up to SNDHWM messages may still wait in its pipe for a collector that is
    # busy with the other ranks' floods; give the close the time to have them acknowledged (default 2 s)
    shmstat.shutdown(flush_timeout_s=30.0)


def idle_adder(job: str, rank: int, window_ms: int, out_path: str, stop_path: str, report_path: str | None = None,
               hang_after_report: bool = False, metrics: bool = False) -> None:
    """A rank that adds 1.0 then sleeps ~1 ms, over and over, until ``stop_path`` appears (most of its time is
    spent outside ``add``, like a training step). Writes its per-window counts to ``out_path``; with
    ``hang_after_report`` it then waits forever (to be SIGKILLed after its counts are known). With ``metrics``
    it also puts one metric per add (``faults/seq`` = n) for the collector's handlers."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=8)
    cur = [0]

    def clock() -> int:  # the real clock, read inside add (after the bank is marked), remembered for the tally: a
        cur[0] = time.time_ns()  # reading taken before add could fall in a window closed while this rank waited
        return cur[0]

    stat = shmstat.Stat("steps", [A.COUNT, A.SUM, A.MIN, A.MAX], window_ms / 1000, group="faults", clock=clock)
    put = None
    if metrics:
        from elastic import metrics as em

        put = em.put_metric
    wns = window_ms * 1_000_000
    counts: dict[int, int] = defaultdict(int)
    n = 0
    while not os.path.exists(stop_path):
        stat.add(1.0)
        counts[cur[0] // wns] += 1
        n += 1
        if put is not None:
            put("seq", n, "faults")
        time.sleep(0.001)
    from shmstat.job import _state

    pub = _state.STATE.publisher
    if pub is not None:
        pub.flush(20.0)
    _write_json(out_path, {"counts": {str(k): v for k, v in counts.items()}, "adds": n, "pub": _publisher_stats(),
                           "pid": os.getpid()})
    if hang_after_report:
        while True:
            time.sleep(1)
    shmstat.shutdown()


def sigkill_victim(job: str, rank: int, window_ms: int, ready_path: str, pure_python: bool = False) -> None:
    """Add 1.0 in a tight loop forever (until SIGKILLed); touches ``ready_path`` after two windows.
    ``pure_python``: use the Python hot path instead of the C one (a longer write, so a kill tears more often)."""
    import shmstat
    from shmstat import Aggregation as A
    from shmstat._backend import use

    shmstat.init(job, rank=rank, local_rank=rank, world_size=8, publish=False)
    with use("python" if pure_python else "c"):  # the writer keeps the backend it was built on
        stat = shmstat.Stat("steps", [A.COUNT, A.SUM, A.MIN, A.MAX], window_ms / 1000, group="faults")
    add = stat.add
    first = time.monotonic()
    while time.monotonic() - first < 2 * window_ms / 1000:
        for _ in range(1000):
            add(1.0)
    open(ready_path, "w").close()
    while True:
        for _ in range(1000):
            add(1.0)


def counts_from(report: dict) -> dict[int, int]:
    return {int(k): v for k, v in report["counts"].items()}


def rows_by_rank_window(
    rows: list[dict], name: str, window_ms: int
) -> tuple[dict[int, float], dict[tuple[int, int], float], int]:
    """From jsonl rows of ``<name>.count``: merged ``{wid: count}``, per-rank ``{(rank, wid): count}`` and how many
    (rank, window) rows were emitted more than once."""
    merged: dict[int, float] = defaultdict(float)
    per_rank: dict[tuple[int, int], float] = defaultdict(float)
    seen: set[tuple[Any, int]] = set()
    repeats = 0
    for r in rows:
        if r["name"] != f"{name}.count":
            continue
        wid = round(r["window_start"] * 1000 / window_ms)
        key = (r["rank"], wid)
        if key in seen:
            repeats += 1
        seen.add(key)
        if r["rank"] is None:
            merged[wid] += r["value"]
        else:
            per_rank[(r["rank"], wid)] += r["value"]
    return dict(merged), dict(per_rank), repeats


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def late_writer(job: str, rank: int, window_ms: int, out_path: str, stop_path: str, trigger_path: str,
                stall_s: float) -> None:
    """Like :func:`idle_adder`, but once ``trigger_path`` exists the next ``add`` is descheduled for ``stall_s``
    right after reading the clock (what a preemption or SIGSTOP at that instant does)."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=8, publish=False)
    stalled = [False]
    last = [0]

    def clock() -> int:
        t = time.time_ns()
        last[0] = t
        if not stalled[0] and os.path.exists(trigger_path):
            stalled[0] = True
            time.sleep(stall_s)
        return t

    stat = shmstat.Stat("steps", [A.COUNT, A.SUM, A.MIN, A.MAX], window_ms / 1000, group="faults", clock=clock)
    wns = window_ms * 1_000_000
    counts: dict[int, int] = defaultdict(int)
    n = 0
    while not os.path.exists(stop_path):
        stat.add(1.0)
        counts[last[0] // wns] += 1
        n += 1
        time.sleep(0.001)
    _write_json(out_path, {"counts": {str(k): v for k, v in counts.items()}, "adds": n, "pid": os.getpid()})
    shmstat.shutdown()


def percentile_adder(job: str, rank: int, window_ms: int, nstats: int, out_path: str, stop_path: str) -> None:
    """A rank adding to ``nstats`` Stats that keep percentiles (COUNT, P50, P99), one add to each every ~1 ms,
    until ``stop_path`` appears. The clock is read inside ``add`` (after the bank is marked) and remembered, so the
    per-window counts it writes to ``out_path`` (``{"counts": {stat: {wid: n}}}``) are exactly what each window of
    each Stat holds."""
    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=rank, local_rank=rank, world_size=8, publish=False)
    cur = [0]

    def clock() -> int:
        cur[0] = time.time_ns()
        return cur[0]

    names = [f"p{i:02d}" for i in range(nstats)]
    stats = [shmstat.Stat(name, [A.COUNT, A.P50, A.P99], window_ms / 1000, group="kills", clock=clock)
             for name in names]
    wns = window_ms * 1_000_000
    counts: dict[str, dict[int, int]] = {name: defaultdict(int) for name in names}
    n = 0
    while not os.path.exists(stop_path):
        n += 1
        for name, s in zip(names, stats, strict=True):
            s.add(float(n % 97 + 1))
            counts[name][cur[0] // wns] += 1
        time.sleep(0.001)
    _write_json(out_path, {"counts": {name: {str(k): v for k, v in c.items()} for name, c in counts.items()},
                           "pid": os.getpid()})
    shmstat.shutdown()


def overwritten_total(rows: list[dict]) -> float:
    """Windows the collectors writing ``rows`` counted as overwritten: the job's count, which a restarted collector
    goes on from, so the last value (a value below the one before would start a new count, as of a new segment:
    the counts then add up)."""
    total = last = 0.0
    for r in rows:
        if r["name"] == "collector.windows_overwritten":
            if r["value"] < last:
                total += last
            last = r["value"]
    return total + last
