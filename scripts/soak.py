"""Soak: ranks, a collector and a subscriber run for N minutes while ranks are SIGKILLed and restarted and
the collector is restarted; at the end every sample and event is accounted for.

    python scripts/soak.py --minutes 10 [--ranks 4] [--seed 1]

Each rank adds 1.0 to Stat ``soak`` in a training-like loop from two threads sharing the Stat, logs an event
every few adds, and keeps a DataLoader-style worker running (spawned, inheriting the rank's environment,
re-created every few seconds) that adds through Stats it re-creates on every step, keeping only the bound
``add``. Every adder keeps, in a small file it maps, how many samples it added per window (and the rank what its
publisher did: logged, sent, dropped): the file outlives a SIGKILL, so the tally of a killed rank is known. The
collector writes every window to a jsonl file (one per collector run); the subscriber (a thread here) tracks
every event by its per-rank wire sequence number. At the end:

- samples: per (rank, window), emitted counts equal the added counts. ``lost`` counts samples added but never
  emitted; ``extra`` counts samples emitted but not tallied (at most the add in flight in each of a killed
  rank's two threads, so extra <= 2 * kills);
- events: per rank incarnation, every sequence number below the highest one received arrived, except the
  drops the rank's publisher counted. Events still queued inside a rank when it was killed die with it
  (counted as ``died with a rank``, not lost).

Progress is printed every 10 s. Exit status 0 only if nothing was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import psutil  # noqa: E402
import zmq  # noqa: E402

from shmstat import wire  # noqa: E402

WINDOW_MS = 100
GRACE_MS = 50  # the most a collector allows (shmstat.shm.layout.MAX_GRACE_MS)
ADDS_PER_EVENT = 32
# tally file: int64 words
T_ADDS, T_LOGGED, T_SENT, T_DROPPED, T_PID, T_DONE = range(6)
T_HEADER = 8


# ------------------------------------------------------------------------------------------------ rank worker


def _tally(path: str, slots: int) -> memoryview:
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), (T_HEADER + 2 * slots) * 8)
    return memoryview(mm).cast("q")


def _count(words: memoryview, wid: int, slots: int) -> None:
    i = T_HEADER + 2 * (wid % slots)
    if words[i] != wid:
        words[i + 1] = 0
        words[i] = wid
    words[i + 1] += 1
    words[T_ADDS] += 1


def _new_stat(clock: object) -> object:
    """What a training helper does: build the Stat again on every call (same name, same slot)."""
    import shmstat

    return shmstat.Stat("soak", [shmstat.Aggregation.COUNT, shmstat.Aggregation.SUM], WINDOW_MS / 1000,
                        group="soak", clock=clock)


def worker_main(tally_path: str, slots: int, stop_path: str, parent: int, seconds: float) -> None:
    """A DataLoader-style worker (spawned, inheriting the rank's environment): adds through Stats it re-creates,
    as a writer of its rank, for ``seconds`` or until its rank is gone (SIGKILLed) or the soak stops."""
    words = _tally(tally_path, slots)
    words[T_PID] = os.getpid()
    now = [0]
    wns = WINDOW_MS * 1_000_000
    rng = random.Random(os.getpid())
    end = time.monotonic() + seconds
    def clock() -> int:  # the real clock, read inside add (as Stat's own); the tally counts that reading
        now[0] = time.time_ns()
        return now[0]

    while time.monotonic() < end and os.getppid() == parent and not os.path.exists(stop_path):
        add = _new_stat(clock).add  # only the bound method is kept
        for _ in range(rng.randint(20, 200)):
            add(1.0)
            _count(words, now[0] // wns, slots)
        time.sleep(rng.uniform(0.001, 0.005))
    words[T_DONE] = 1


def rank_main(job: str, rank: int, world: int, tally_path: str, slots: int, stop_path: str) -> None:
    """One rank: the main thread and a second thread add to one Stat and log events, a DataLoader-style worker
    is (re)started every few seconds, until ``stop_path`` appears; every adder keeps its own tally file
    (``<tally>.t<n>`` for threads, ``<tally>.w<n>`` for workers) current."""
    import datetime

    import shmstat
    os.environ.update(SHMSTAT_JOB=job, SHMSTAT_RANK=str(rank), SHMSTAT_LOCAL_RANK=str(rank),
                      SHMSTAT_WORLD_SIZE=str(world))
    shmstat.init(job, rank=rank, local_rank=rank, world_size=world)
    words = _tally(tally_path, slots)
    words[T_PID] = os.getpid()
    local = threading.local()

    def clock() -> int:  # the real clock, read inside add; each thread tallies the window of its own reading
        local.t = time.time_ns()
        return local.t

    stat = _new_stat(clock)
    event = shmstat.Event("soak.step", datetime.datetime.now(datetime.timezone.utc), {"rank": rank})
    wns = WINDOW_MS * 1_000_000
    stopping = threading.Event()

    def second_thread() -> None:
        tw = _tally(_new_tally(f"{tally_path}.t1", slots), slots)
        tw[T_PID] = os.getpid()
        rng = random.Random(os.getpid() + 1)
        while not stopping.is_set():
            for _ in range(rng.randint(20, 200)):
                stat.add(1.0)
                _count(tw, local.t // wns, slots)
            time.sleep(rng.uniform(0.0005, 0.003))
        tw[T_DONE] = 1

    helper = threading.Thread(target=second_thread, daemon=True)
    helper.start()
    ctx = mp.get_context("spawn")
    workers = 0
    worker: mp.process.BaseProcess | None = None
    rng = random.Random(os.getpid())
    n = 0
    while not os.path.exists(stop_path):
        if worker is None or not worker.is_alive():
            if worker is not None:
                worker.join()
            workers += 1
            path = _new_tally(f"{tally_path}.w{workers}", slots)
            worker = ctx.Process(target=worker_main, args=(path, slots, stop_path, os.getpid(),
                                                           rng.uniform(1.0, 4.0)))
            worker.start()
        for _ in range(rng.randint(50, 400)):  # a step's worth of adds, then "compute"
            stat.add(1.0)
            _count(words, local.t // wns, slots)
            n += 1
            if n % ADDS_PER_EVENT == 0:
                shmstat.log_event(event)
                words[T_LOGGED] += 1
        st = shmstat.stats()
        words[T_SENT], words[T_DROPPED] = st.events_sent, st.events_dropped
        time.sleep(rng.uniform(0.0005, 0.003))
    stopping.set()
    helper.join()
    if worker is not None:
        worker.join(60)
    from shmstat.job import _state

    if _state.STATE.publisher is not None:
        _state.STATE.publisher.flush(30.0)
    st = shmstat.stats()
    words[T_SENT], words[T_DROPPED] = st.events_sent, st.events_dropped
    words[T_DONE] = 1
    shmstat.shutdown()


def _new_tally(path: str, slots: int) -> str:
    with open(path, "wb") as f:
        f.truncate((T_HEADER + 2 * slots) * 8)
    return path


@dataclass
class Incarnation:
    rank: int
    number: int
    tally_path: str
    proc: mp.process.BaseProcess
    killed: bool = False


def adder_tallies(path: str) -> list[str]:
    """The tally files of a rank incarnation's other adders (its second thread and its workers)."""
    d, base = os.path.split(path)
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith(base + ".t") or n.startswith(base + ".w"))


def read_tally(path: str, slots: int) -> tuple[list[int], dict[int, int]]:
    with open(path, "rb") as f:
        raw = f.read()
    words = memoryview(raw).cast("q")
    counts = {words[T_HEADER + 2 * i]: words[T_HEADER + 2 * i + 1] for i in range(slots)
              if words[T_HEADER + 2 * i + 1]}
    return list(words[:T_HEADER]), counts


# ------------------------------------------------------------------------------------------------ subscriber


class EventTracker:
    """Subscribes to ``event/`` on the collector's publish endpoint; records seq ranges per sender stream."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 20)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"event/")
        self.sock.connect(endpoint)
        self.ranges: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
        self.received = 0
        self.malformed = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = wire.decode(frames[0], frames[1])
                except (wire.WireError, IndexError):
                    self.malformed += 1
                    continue
                with self.lock:
                    self.ranges[(msg.rank, msg.pid, msg.incarnation)].append((msg.seq, len(msg.items)))
                    self.received += len(msg.items)

    def missing(self, pid: int) -> list[tuple[int, int]]:
        """The seq ranges ``[first, end)`` missing below the highest seq received from ``pid``."""
        with self.lock:
            spans = sorted(r for (_rank, p, _inc), rs in self.ranges.items() if p == pid for r in rs)
        out, top = [], 0
        for first, n in spans:
            if first > top:
                out.append((top, first))
            top = max(top, first + n)
        return out

    def stream(self, pid: int) -> tuple[int, int, int]:
        """(distinct seqs received, duplicates, one past the highest seq) of the stream sent by ``pid``."""
        with self.lock:
            spans = sorted(r for (_rank, p, _inc), rs in self.ranges.items() if p == pid for r in rs)
        distinct = dups = top = 0
        for first, n in spans:
            end = first + n
            overlap = max(0, min(end, top) - first)
            dups += overlap
            distinct += n - overlap
            top = max(top, end)
        return distinct, dups, top

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


# ------------------------------------------------------------------------------------------------ collector


@dataclass
class CollectorRuns:
    job: str
    workdir: str
    publish: str
    proc: subprocess.Popen | None = None
    outputs: list[str] = field(default_factory=list)
    peak_rss: int = 0

    def start(self) -> None:
        out = os.path.join(self.workdir, f"windows-{len(self.outputs)}.jsonl")
        ready = os.path.join(self.workdir, f"ready-{len(self.outputs)}.json")
        self.outputs.append(out)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collector", "collect", "--job", self.job, "--publish", self.publish,
             "--handler", f"*=jsonl:{out}", "--grace-ms", str(GRACE_MS), "--banks", "64", "--max-ranks", "32",
             "--max-stats", "16", "--status-interval", "0", "--ready-file", ready],
            cwd=REPO, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )
        deadline = time.monotonic() + 60  # its notes are on stderr; the ready file says it serves
        while not os.path.exists(ready) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not os.path.exists(ready):
            raise SystemExit(f"soak: the collector did not start (exit status {self.proc.poll()})")

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        if self.proc.stdout:
            self.proc.stdout.close()
        return code

    def sample_rss(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, psutil.Process(self.proc.pid).memory_info().rss)


# ------------------------------------------------------------------------------------------------ the run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    ap.add_argument("--ranks", type=int, default=4, help="rank processes (default 4)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="mean seconds between rank SIGKILLs")
    ap.add_argument("--restart-every", type=float, default=45.0, help="mean seconds between collector restarts")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.ranks < 1:
        ap.error("--minutes must be > 0 and --ranks >= 1")

    from shmstat.shm.runtime import runtime_dir
    from shmstat.shm.segment import Segment

    rng = random.Random(args.seed)
    job = f"soak-{os.getpid()}-{int(time.time())}"
    workdir = tempfile.mkdtemp(prefix="shmstat-soak-")
    os.chmod(workdir, 0o700)
    slots = int(args.minutes * 60 * 1000 / WINDOW_MS * 1.2) + 256
    publish = f"ipc://{runtime_dir()}/{job}.pub"
    coll = CollectorRuns(job, workdir, publish)
    coll.start()
    tracker = EventTracker(publish)
    stop_path = os.path.join(workdir, "stop")
    ctx = mp.get_context("spawn")
    incarnations: list[Incarnation] = []
    live: dict[int, Incarnation] = {}
    kills = restarts = 0

    def start_rank(rank: int) -> None:
        number = sum(1 for i in incarnations if i.rank == rank) + 1
        path = os.path.join(workdir, f"tally-{rank}-{number}.bin")
        with open(path, "wb") as f:
            f.truncate((T_HEADER + 2 * slots) * 8)
        p = ctx.Process(target=rank_main, args=(job, rank, args.ranks, path, slots, stop_path))
        p.start()
        inc = Incarnation(rank, number, path, p)
        incarnations.append(inc)
        live[rank] = inc

    print(f"soak: job {job}, {args.ranks} ranks, {args.minutes:g} min, windows {WINDOW_MS} ms, work dir {workdir}",
          flush=True)
    for r in range(args.ranks):
        start_rank(r)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_kill = t0 + rng.expovariate(1 / args.kill_every)
    next_restart = t0 + rng.expovariate(1 / args.restart_every)
    next_report = t0 + 10
    respawn: dict[int, float] = {}
    interrupted = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while time.monotonic() < end and not interrupted:
            now = time.monotonic()
            coll.sample_rss()
            if now >= next_kill and live:
                victim = live.pop(rng.choice(sorted(live)))
                os.kill(victim.proc.pid, signal.SIGKILL)
                victim.proc.join(10)
                victim.killed = True
                kills += 1
                respawn[victim.rank] = now + rng.uniform(0.5, 2.0)  # as an elastic agent restarts a worker
                next_kill = now + rng.expovariate(1 / args.kill_every)
            for rank, at in list(respawn.items()):
                if now >= at:
                    del respawn[rank]
                    start_rank(rank)
            if now >= next_restart:
                code = coll.stop()
                if code != 0:
                    raise SystemExit(f"soak: the collector exited {code} on SIGTERM")
                time.sleep(rng.uniform(0.1, 1.0))  # the outage
                coll.start()
                restarts += 1
                next_restart = now + rng.expovariate(1 / args.restart_every)
            if now >= next_report:
                adds = sum(read_tally(p, slots)[0][T_ADDS] for i in incarnations
                           for p in [i.tally_path, *adder_tallies(i.tally_path)])
                print(f"soak: {now - t0:6.0f} s  adds {adds:>11,}  events received {tracker.received:>9,}  "
                      f"rank kills {kills}  collector restarts {restarts}  collector peak RSS "
                      f"{coll.peak_rss / 2**20:.0f} MiB", flush=True)
                next_report = now + 10
            time.sleep(0.05)
        for rank in list(respawn):
            start_rank(rank)
        open(stop_path, "w").close()
        for inc in incarnations:
            if not inc.killed:
                inc.proc.join(120)
        # every event a rank sent is on its way to the subscriber; wait until the counts stop moving
        last, still = -1, 0
        while still < 10:
            time.sleep(0.1)
            still = still + 1 if tracker.received == last else 0
            last = tracker.received
        coll.sample_rss()
        code = coll.stop()
    finally:
        open(stop_path, "w").close()
        for inc in incarnations:
            if inc.proc.is_alive():
                inc.proc.kill()
        tracker.close()
        if coll.proc is not None and coll.proc.poll() is None:
            coll.proc.kill()
        Segment.unlink(job)
    return report(incarnations, coll, tracker, slots, kills, restarts, code, time.monotonic() - t0)


def report(incarnations: list[Incarnation], coll: CollectorRuns, tracker: EventTracker, slots: int, kills: int,
           restarts: int, collector_exit: int, seconds: float) -> int:
    # samples
    added: dict[tuple[int, int], int] = defaultdict(int)
    logged = sent = dropped = died_with_rank = ev_lost = ev_received = duplicates = 0
    unfinished = adders = 0
    for inc in incarnations:
        header, counts = read_tally(inc.tally_path, slots)
        for wid, n in counts.items():
            added[(inc.rank, wid)] += n
        for extra_path in adder_tallies(inc.tally_path):
            adders += 1
            for wid, n in read_tally(extra_path, slots)[1].items():
                added[(inc.rank, wid)] += n
        logged += header[T_LOGGED]
        dropped += header[T_DROPPED]
        distinct, dups, top = tracker.stream(header[T_PID])
        ev_received += distinct
        duplicates += dups
        if inc.killed:  # what it had not sent yet died with it; below the highest seq received, only drops
            died_with_rank += max(0, header[T_LOGGED] - top)
            sent += top - header[T_DROPPED]
            ev_lost += max(0, top - distinct - header[T_DROPPED])
            if top - distinct - header[T_DROPPED] > 0:
                print(f"  rank {inc.rank} incarnation {inc.number} (killed): missing seqs "
                      f"{tracker.missing(header[T_PID])[:5]}, dropped {header[T_DROPPED]}")
        else:
            unfinished += not header[T_DONE]
            sent += header[T_SENT]
            ev_lost += max(0, header[T_LOGGED] - header[T_DROPPED] - distinct)
            if header[T_LOGGED] - header[T_DROPPED] - distinct > 0:
                print(f"  rank {inc.rank} incarnation {inc.number}: logged {header[T_LOGGED]} received {distinct} "
                      f"top {top}, missing seqs {tracker.missing(header[T_PID])[:5]}, dropped {header[T_DROPPED]}")
    emitted: dict[tuple[int, int], int] = defaultdict(int)
    repeats = torn = 0
    wsec = WINDOW_MS / 1000
    for path in coll.outputs:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if row["group"] != "soak" or row["name"] != "soak.count" or row["rank"] is None:
                    continue
                key = (row["rank"], round(row["window_start"] / wsec))
                repeats += key in emitted
                emitted[key] += int(row["value"])
                torn += bool(row.get("torn"))
    lost = sum(max(0, n - emitted.get(k, 0)) for k, n in added.items())
    extra = sum(max(0, n - added.get(k, 0)) for k, n in emitted.items())
    total_added = sum(added.values())
    print(f"\nsoak done after {seconds / 60:.1f} min: {len(incarnations)} rank incarnations ({adders} more "
          f"adders: second threads and DataLoader-style workers), {kills} rank kills, "
          f"{restarts} collector restarts, collector exit {collector_exit}")
    print(f"  samples: added {total_added:,}  emitted {sum(emitted.values()):,}  lost {lost}  extra {extra} "
          f"(in flight at a kill, allowed <= {2 * kills})  windows emitted twice {repeats}  torn windows {torn}")
    print(f"  events:  logged {logged:,}  sent {sent:,}  received {ev_received:,}  dropped (counted) {dropped:,}  "
          f"died with a rank {died_with_rank:,}  lost {ev_lost}  duplicates {duplicates}")
    print(f"  collector peak RSS {coll.peak_rss / 2**20:.0f} MiB over {len(coll.outputs)} runs")
    ok = lost == 0 and ev_lost == 0 and extra <= 2 * kills and repeats == 0 and collector_exit == 0 and not unfinished
    print("soak: OK, nothing lost" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
