"""Soak: ranks and a collector run for N minutes while ranks are SIGKILLed and restarted and the collector is
SIGKILLed or SIGTERMed and restarted; at the end every sample and event is accounted for.

    python scripts/soak.py --minutes 10 [--ranks 4] [--seed 1] [--collector-kill {term,kill,mixed}]

Each rank adds 1.0 to Stat ``soak`` in a training-like loop from two threads sharing the Stat, logs an event
every few adds, and keeps a DataLoader-style worker running (spawned, inheriting the rank's environment,
re-created every few seconds) that adds through Stats it re-creates on every step, keeping only the bound
``add``. Every adder keeps, in a small file it maps, how many samples it added per window (and the rank what its
publisher did: logged, sent, dropped): the file outlives a SIGKILL, so the tally of a killed rank is known. Every
collector run writes every window to one metrics jsonl file (``--handler *=jsonl:``, which skips the windows the
file already holds, so a window is written once across collector SIGKILLs) and every event to one events jsonl
file (``--events jsonl:``, appended; ranks re-send what no collector acknowledged). A collector restart is a
SIGKILL or a SIGTERM (``--collector-kill``; ``mixed`` picks one at random with the seed); a SIGKILLed collector is
simply started again. At the end:

- samples: per (rank, window), emitted counts equal the added counts. ``lost`` counts samples added but never
  emitted; ``extra`` counts samples emitted but not tallied (at most the add in flight in each of a killed
  rank's two threads, so extra <= 2 * kills); ``doubled`` counts (rank, window) rows written more than once;
- events: per sender (rank, pid, incarnation), every sequence number the rank's publisher sent is in the events
  file exactly once or covered by a gap record (``gap-recorded``); ``lost`` counts those neither in the file
  nor in a gap record, ``doubled`` the extra copies of a sequence number. A rank that exited sent every event
  it logged; a killed rank sent at least those up to the highest sequence number in the file (or in a gap
  record): events logged after it died with it (``died with a rank``, not lost).

Progress is printed every 10 s. Exit status 0 only if nothing was lost and nothing doubled, and every gap record
covers events a rank itself dropped (a bounded backlog full): a gap for events the ranks still held is a failure.
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

WINDOW_MS = 100
BANKS = 64  # the most a collector allows: the segment holds BANKS windows of each stat
SEGMENT_S = BANKS * WINDOW_MS / 1000
GRACE_MS = 50  # the most a collector allows (shmstat.shm.layout.MAX_GRACE_MS)
ADDS_PER_EVENT = 32
# tally file: int64 words
T_ADDS, T_LOGGED, T_SENT, T_DROPPED, T_PID, T_DONE, T_EVICTED = range(7)
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
        words[T_EVICTED] = _evicted()
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
    words[T_EVICTED] = _evicted()
    words[T_DONE] = 1
    shmstat.shutdown()


def _evicted() -> int:
    """Messages the rank's publisher sent and gave up unacknowledged to stay within its backlog bound (not in
    ``shmstat.stats()``: read from the publisher's sender, for the report only)."""
    from shmstat.job import _state

    pub = _state.STATE.publisher
    return int(getattr(getattr(pub, "_sender", None), "kept_evicted", 0)) if pub is not None else 0


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


# ------------------------------------------------------------------------------------------------ collector


@dataclass
class CollectorRuns:
    """The collector, started again after each SIGKILL or SIGTERM; every run writes the same two jsonl files."""

    job: str
    workdir: str
    publish: str
    proc: subprocess.Popen | None = None
    runs: int = 0
    sigkills: int = 0
    sigterms: int = 0
    peak_rss: int = 0
    outages: list[tuple[str, float, float]] = field(default_factory=list)  # (signal, s to exit, s until ready again)

    per_run_windows: bool = False  # a windows file per collector run (diagnosis) instead of one for all runs

    @property
    def windows(self) -> str:
        return os.path.join(self.workdir, f"windows-{self.runs}.jsonl" if self.per_run_windows else "windows.jsonl")

    @property
    def window_files(self) -> list[str]:
        if not self.per_run_windows:
            return [os.path.join(self.workdir, "windows.jsonl")]
        return [os.path.join(self.workdir, f"windows-{n}.jsonl") for n in range(self.runs + 1)]

    @property
    def own(self) -> str:
        """The collectors' own figures (the ``shmstat`` group: usage and counters), one file for all runs."""
        return os.path.join(self.workdir, "collector.jsonl")

    @property
    def events(self) -> str:
        return os.path.join(self.workdir, "events.jsonl")

    def start(self) -> None:
        ready = os.path.join(self.workdir, f"ready-{self.runs}.json")
        self.runs += 1
        with open(os.path.join(self.workdir, f"collector-{self.runs - 1}.log"), "wb") as log:  # its notes, counters
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "collector", "collect", "--job", self.job, "--publish", self.publish,
                 "--handler", f"*=jsonl:{self.windows}", "--handler", f"shmstat=jsonl:{self.own}",
                 "--events", f"jsonl:{self.events}",
                 "--grace-ms", str(GRACE_MS), "--banks", str(BANKS), "--max-ranks", "32",
                 "--max-stats", "16", "--status-interval", "0", "--ready-file", ready],
                cwd=REPO, stdout=log, stderr=log,
                env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
            )
        deadline = time.monotonic() + 60  # its notes are on stderr; the ready file says it serves
        while not os.path.exists(ready) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not os.path.exists(ready):
            raise SystemExit(f"soak: the collector did not start (exit status {self.proc.poll()})")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the collector to end; its exit status (-9 after a SIGKILL)."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.sigkills += 1
        else:
            self.sigterms += 1
        return self.proc.wait(60)

    def sample_rss(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, psutil.Process(self.proc.pid).memory_info().rss)


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


# ------------------------------------------------------------------------------------------------ the run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    ap.add_argument("--ranks", type=int, default=4, help="rank processes (default 4)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="mean seconds between rank SIGKILLs")
    ap.add_argument("--restart-every", type=float, default=45.0, help="mean seconds between collector restarts")
    ap.add_argument("--collector-kill", choices=["term", "kill", "mixed"], default="mixed",
                    help="how the collector is stopped at a restart: SIGTERM, SIGKILL, or either at random "
                         "(default mixed)")
    ap.add_argument("--windows-per-run", action="store_true",
                    help="a windows jsonl file per collector run instead of one shared by all runs (diagnosis: "
                         "without the jsonl handler's skipping of windows already written)")
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
    coll = CollectorRuns(job, workdir, publish, per_run_windows=args.windows_per_run)
    coll.start()
    stop_path = os.path.join(workdir, "stop")
    ctx = mp.get_context("spawn")
    incarnations: list[Incarnation] = []
    live: dict[int, Incarnation] = {}
    kills = 0

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

    print(f"soak: job {job}, {args.ranks} ranks, {args.minutes:g} min, windows {WINDOW_MS} ms, collector "
          f"restarts by {args.collector_kill}, seed {args.seed}, work dir {workdir}", flush=True)
    for r in range(args.ranks):
        start_rank(r)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_kill = t0 + rng.expovariate(1 / args.kill_every)
    next_restart = t0 + rng.expovariate(1 / args.restart_every)
    next_report = t0 + 10
    respawn: dict[int, float] = {}
    interrupted = False
    stalls: list[tuple[float, float]] = []  # (seconds into the run, how long) of each starvation of this process

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = -1
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
                kill = args.collector_kill == "kill" or (args.collector_kill == "mixed" and rng.random() < 0.5)
                sig = signal.SIGKILL if kill else signal.SIGTERM
                stopping = time.monotonic()
                code = coll.stop(sig)
                stopped = time.monotonic()
                if code != (-signal.SIGKILL if kill else 0):
                    raise SystemExit(f"soak: the collector exited {code} on {sig.name}")
                time.sleep(rng.uniform(0.1, 1.0))  # the outage
                coll.start()
                coll.outages.append((sig.name, stopped - stopping, time.monotonic() - stopping))
                next_restart = now + rng.expovariate(1 / args.restart_every)
            if now >= next_report:
                adds = sum(read_tally(p, slots)[0][T_ADDS] for i in incarnations
                           for p in [i.tally_path, *adder_tallies(i.tally_path)])
                print(f"soak: {now - t0:6.0f} s  adds {adds:>11,}  events file {_file_size(coll.events) / 2**20:7.1f} "
                      f"MiB  rank kills {kills}  collector SIGKILLs {coll.sigkills} SIGTERMs {coll.sigterms}  "
                      f"collector peak RSS {coll.peak_rss / 2**20:.0f} MiB", flush=True)
                next_report = now + 10
            before = time.monotonic()
            time.sleep(0.05)
            if time.monotonic() - before > 1.0:  # a 50 ms sleep that took over 1 s: the machine starved this process
                stalls.append((before - t0, time.monotonic() - before))
                print(f"soak: {before - t0:6.0f} s  this process was starved: a 50 ms sleep took "
                      f"{time.monotonic() - before:.1f} s (the segment keeps {SEGMENT_S:g} s of windows)", flush=True)
        for rank in list(respawn):
            start_rank(rank)
        open(stop_path, "w").close()
        for inc in incarnations:
            if not inc.killed:
                inc.proc.join(120)
        # every event a rank sent is on its way to the events file; wait until it stops growing
        last, still = -1, 0
        while still < 20:
            time.sleep(0.1)
            size = _file_size(coll.events)
            still = still + 1 if size == last else 0
            last = size
        coll.sample_rss()
        code = coll.stop()
        coll.sigterms -= 1  # the final stop is no restart
    finally:
        open(stop_path, "w").close()
        for inc in incarnations:
            if inc.proc.is_alive():
                inc.proc.kill()
        if coll.proc is not None and coll.proc.poll() is None:
            coll.proc.kill()
        Segment.unlink(job)
    if stalls:
        print(f"soak: this process was starved {len(stalls)} times (a 50 ms sleep over 1 s), the longest "
              f"{max(d for _, d in stalls):.1f} s at {max(stalls, key=lambda st: st[1])[0]:.0f} s; a collector starved "
              f"longer than {SEGMENT_S:g} s loses the windows the ranks overwrite meanwhile")
    return report(incarnations, coll, slots, kills, code, time.monotonic() - t0)


@dataclass
class Sender:
    """What the events file holds of one sender (rank, pid, incarnation): seq -> copies, and gap-recorded seqs."""

    seqs: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    gaps: set[int] = field(default_factory=set)
    top: int = 0  # one past the highest seq in the file, kept or gap-recorded


def read_events(path: str) -> tuple[dict[tuple[int, int], Sender], int]:
    """The events file's soak events and rank gap records by sender (rank, pid) (a rank incarnation is one pid);
    and how many lines did not parse."""
    senders: dict[tuple[int, int], Sender] = defaultdict(Sender)
    bad = 0
    if not os.path.exists(path):
        return senders, bad
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if row.get("rank") is None:
                continue  # the collector's own events (rank/joined, rank/died, ...)
            s = senders[(row["rank"], row["pid"])]
            if "gap" in row:
                s.gaps.update(range(row["from_seq"], row["to_seq"] + 1))
                s.top = max(s.top, row["to_seq"] + 1)
            elif row.get("name") == "soak.step":
                s.seqs[row["seq"]] += 1
                s.top = max(s.top, row["seq"] + 1)
    return senders, bad


def collector_counter(path: str, name: str) -> int:
    """A collector counter (``collector.<name>`` rows of the ``shmstat`` group) summed over the collector runs
    that wrote ``path``: each run counts from 0, so a value below the last one starts a new run."""
    total = last = 0
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if f'"collector.{name}"' not in line:
                continue
            value = int(json.loads(line)["value"])
            total += value - last if value >= last else value
            last = value
    return total


def report(incarnations: list[Incarnation], coll: CollectorRuns, slots: int, kills: int, collector_exit: int,
           seconds: float) -> int:
    # samples
    added: dict[tuple[int, int], int] = defaultdict(int)
    evicted = 0
    logged = sent = dropped = died_with_rank = ev_lost = ev_kept = ev_doubled = ev_gaps = 0
    unfinished = adders = 0
    senders, bad_lines = read_events(coll.events)
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
        evicted += header[T_EVICTED]
        s = senders.get((inc.rank, header[T_PID]), Sender())
        if inc.killed:  # it sent at least up to the highest seq the file holds; what it logged after died with it
            expected = s.top
            died_with_rank += max(0, header[T_LOGGED] - s.top)
        else:
            unfinished += not header[T_DONE]
            expected = header[T_LOGGED]
        sent += expected
        kept = sum(1 for q in range(expected) if q in s.seqs)
        gapped = sum(1 for q in range(expected) if q not in s.seqs and q in s.gaps)
        missing = [q for q in range(expected) if q not in s.seqs and q not in s.gaps]
        doubled = sum(n - 1 for n in s.seqs.values())
        beyond = sum(1 for q in s.seqs if q >= expected)  # in the file, but never logged: counted as doubled
        ev_kept += kept
        ev_gaps += gapped
        ev_lost += len(missing)
        ev_doubled += doubled + beyond
        if missing or doubled or beyond:
            twice = sorted(q for q, n in s.seqs.items() if n > 1)
            print(f"  rank {inc.rank} incarnation {inc.number} pid {header[T_PID]}"
                  f"{' (killed)' if inc.killed else ''}: logged {header[T_LOGGED]} expected {expected} kept {kept} "
                  f"gap-recorded {gapped}; missing seqs {_spans(missing)[:5]}, doubled seqs {_spans(twice)[:5]}, "
                  f"beyond what it logged {beyond}; messages evicted from its backlog {header[T_EVICTED]}")
    emitted: dict[tuple[int, int], int] = defaultdict(int)
    doubled_windows = torn = 0
    wsec = WINDOW_MS / 1000
    for path in coll.window_files:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if row["group"] != "soak" or row["name"] != "soak.count" or row["rank"] is None:
                    continue
                key = (row["rank"], round(row["window_start"] / wsec))
                doubled_windows += key in emitted
                emitted[key] += int(row["value"])
                torn += bool(row.get("torn"))
    lost = sum(max(0, n - emitted.get(k, 0)) for k, n in added.items())
    extra = sum(max(0, n - added.get(k, 0)) for k, n in emitted.items())
    total_added = sum(added.values())
    print(f"\nsoak done after {seconds / 60:.1f} min: {len(incarnations)} rank incarnations ({adders} more "
          f"adders: second threads and DataLoader-style workers), {kills} rank kills, collector SIGKILLs "
          f"{coll.sigkills}, SIGTERMs {coll.sigterms} ({coll.runs} collector runs), final collector exit "
          f"{collector_exit}")
    print(f"  samples: added {total_added:,}  emitted {sum(emitted.values()):,}  lost {lost}  extra {extra} "
          f"(in flight at a kill, allowed <= {2 * kills})  doubled windows {doubled_windows}  torn windows {torn}")
    print(f"  events:  logged {logged:,}  sent {sent:,}  kept {ev_kept:,}  gap-recorded {ev_gaps:,}  "
          f"dropped (counted by ranks) {dropped:,}  backlog messages evicted {evicted:,}  "
          f"died with a rank {died_with_rank:,}  lost {ev_lost}  "
          f"doubled {ev_doubled}  unparsable lines {bad_lines}")
    print(f"  collector counters summed over its runs: windows_overwritten "
          f"{collector_counter(coll.own, 'windows_overwritten')} (windows lost to a bank overwritten before a "
          f"collector read it), seq_gaps {collector_counter(coll.own, 'seq_gaps')}, events_dropped "
          f"{collector_counter(coll.own, 'events_dropped')}")
    print(f"  collector peak RSS {coll.peak_rss / 2**20:.0f} MiB over {coll.runs} runs")
    if coll.outages:
        worst = max(coll.outages, key=lambda o: o[2])
        print(f"  collector restarts: longest outage {worst[2]:.1f} s (a {worst[0]}: {worst[1]:.1f} s to exit); "
              f"the ring holds {BANKS * WINDOW_MS / 1000:.1f} s; each: "
              + ", ".join(f"{sig[3:]} {down:.1f}/{total:.1f}" for sig, down, total in coll.outages))
    # a gap record is a loss counted, not a loss avoided: only what the ranks themselves dropped may be one
    gaps_unexplained = max(0, ev_gaps - dropped - evicted)
    if gaps_unexplained:
        print(f"  events gap-recorded that no rank dropped: {gaps_unexplained:,}")
    ok = (lost == 0 and ev_lost == 0 and extra <= 2 * kills and doubled_windows == 0 and ev_doubled == 0
          and gaps_unexplained == 0 and collector_exit == 0 and not unfinished and bad_lines == 0)
    print("soak: OK, nothing lost, nothing doubled" if ok else "soak: FAILED")
    return 0 if ok else 1


def _spans(seqs: list[int]) -> list[tuple[int, int]]:
    """Sorted seqs as ``[first, last]`` runs."""
    out: list[tuple[int, int]] = []
    for q in seqs:
        if out and q == out[-1][1] + 1:
            out[-1] = (out[-1][0], q)
        else:
            out.append((q, q))
    return out


if __name__ == "__main__":
    sys.exit(main())
