"""Hangs named while they happen: the collector watches every rank's phase word (:mod:`shmstat.shm.phase`).

At each look at the rank table (:meth:`HangWatcher.look`) every entry's phase word is read; an entry made progress
when its word changed (a section entered or left, a step counted). A rank's progress is its own entry's or that of
a live worker of it (a writer entry), and so is its section when it is itself outside every section. A job hangs
when at least one live rank is in a section and no live rank made progress for ``hang_after_s``: then, once per
episode, the event ``shmstat.hang`` is published (``publish_event``: subscribers and events sinks) and one console
line goes to the handler of the ``section`` group if it says straggler lines (the default output), e.g.
``hang: job 1f2e: ranks 0,1,3 in allreduce for 31 s; rank 2 in data for 31 s (pid 812, sleeping, 0% CPU)``.
The suspects are the ranks not in a wait section while another waits (every rank when none waits), every rank
whose process is gone and every rank whose process is stopped (SIGSTOP, a tracer), whatever its section: a rank
stopped inside a collective waits there as the others do, and only its state tells it from them. Each suspect is
named with its process state and its CPU since it went quiet (psutil). When every rank of the node waits in one
wait section (none stopped), the line says the rank holding the job is elsewhere (another node).
A suspect that opted in (:mod:`shmstat.job.hang_stacks`) is sent ``SIGUSR2`` and the event is published a moment
later (:data:`STACKS_WAIT_S`) with the innermost frames of its stacks. When progress resumes (or no live rank is
left in a section), ``shmstat.hang.resolved`` is published (no console line: one line per episode). A rank that
shows up (its first phase word) is progress. When the picture the line named changes while no rank makes progress
(a suspect died or was stopped, a waiting rank became a suspect, the holder is no longer elsewhere), the episode
resolves with reason ``changed`` and a new one is named at once on the new picture (its event and line).

The Prometheus exporter, when there is one, is handed the table at each look where it changed (and at least every
:data:`EXPORT_EVERY_S`): ``shmstat_rank_progress_age_seconds``, ``shmstat_job_hung`` and, while an episode lasts,
its suspects as the hang line named them (section, process state), ``shmstat_hang_suspect_age_seconds``, on which
``ShmstatHang`` fires whatever the suspect's section (docs/reference/prometheus-series.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import psutil

from shmstat.job.hang_stacks import SIGNAL, stacks_path
from shmstat.shm.layout import RankState
from shmstat.shm.phase import read_phase
from shmstat.shm.segment import pid_alive

from ..read.passes import Flag, Pass

if TYPE_CHECKING:
    from shmstat.shm.layout_records import RankInfo
    from shmstat.shm.segment import Segment

    from ..prometheus.exporter import PrometheusExporter
    from .fanout import FanOut

__all__ = ["HANG_EVENT", "RESOLVED_EVENT", "HangWatcher", "RankPhase", "innermost_frames"]

HANG_EVENT = "shmstat.hang"
RESOLVED_EVENT = "shmstat.hang.resolved"
LINE_GROUP = "section"
"""The group whose handler says the hang line (the flag's ``group``, as a straggler's is its stat's)."""
STACKS_WAIT_S = 0.3
"""After ``SIGUSR2``, how long the event waits for the suspects' stacks (faulthandler dumps at once when the
process runs; a stopped one dumps nothing)."""
MAX_STACK_CHARS = 2000
"""The innermost frames of one rank's stacks in the event, at most this many characters."""
FRAMES_PER_THREAD = 4
EXPORT_EVERY_S = 1.0
_QUIET_S = 1.0  # a rank quiet this long (or half of hang_after) has its CPU time noted: the episode's CPU from there
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
EventData = dict[str, str | int | float | bool]


class RankPhase(NamedTuple):
    """One rank as the watcher sees it at a look."""

    rank: int
    pid: int
    section: str
    """The innermost open section (its own, else a live worker's); "" outside every section."""
    wait: bool
    progress_ns: int
    """When its phase word (or a live worker's) last changed, on the collector's clock."""
    alive: bool
    gone: str
    """How its process went ("died", "exited", "zombie"); "" while it lives."""

    @property
    def waits(self) -> bool:
        """Whether it is in a wait section."""
        return bool(self.section) and self.wait


@dataclass
class _Entry:
    word: tuple[int, int, int]
    changed_ns: int
    section: str
    wait: bool


@dataclass
class _Episode:
    started_ns: int
    since_ns: int  # the newest progress of a live rank: when the job stopped
    data: EventData
    publish_at: float  # monotonic: once the suspects' stacks had time to arrive
    published: bool
    offsets: dict[int, tuple[str, int]]  # rank -> (stacks file, its size before SIGUSR2)
    suspects: list[tuple[int, str, str, int]]  # (rank, section, state, progress_ns) as the line names them
    picture: tuple[tuple[int, str, str], ...]  # what a changed picture is told by (see _picture)


class HangWatcher:
    """One job's hang detector on its collector's loop (see the module docstring). ``hang_after_s`` 0: off."""

    def __init__(self, job: str, segment: Segment, *, hang_after_s: float, fanout: FanOut,
                 publish: Callable[[str, int, EventData], None], exporter: PrometheusExporter | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.job = job
        self.segment = segment
        self.hang_after_ns = int(hang_after_s * 1e9)
        self.fanout = fanout
        self.publish = publish
        self.exporter = exporter
        self.clock = clock
        self.episodes = 0
        """Hangs published so far."""
        self.hung = False
        self.table: list[RankPhase] = []
        """The ranks as the last look saw them."""
        self._entries: dict[tuple[int, int, int], _Entry] = {}
        self._quiet: dict[tuple[int, int], tuple[int, float, float]] = {}  # (rank, pid) -> (progress, cpu s, mono)
        self._procs: dict[int, psutil.Process] = {}
        self._episode: _Episode | None = None
        self._exported: tuple[list[tuple[int, str, bool, int]], bool, list[tuple[int, str, str, int]]] | None = None
        self._exported_at = 0.0

    @property
    def on(self) -> bool:
        """Whether hangs are watched (``--hang-after`` above 0)."""
        return self.hang_after_ns > 0

    def look(self, ranks: list[RankInfo]) -> None:
        """Read every phase word of ``ranks`` (the rank table as the collector just read it), then start, publish
        or end a hang episode and hand the exporter the table."""
        if not self.on:
            return
        now, mono = self.clock(), time.monotonic()
        self.table = table = self._read(ranks, now)
        live = [r for r in table if r.alive]
        hung = bool(live) and any(r.section for r in live) and all(
            now - r.progress_ns >= self.hang_after_ns for r in live)
        ep = self._episode
        if hung and ep is not None and ep.published:
            picture = self._picture(table)
            if picture[1] != ep.picture:  # no progress, but the line would name other ranks or states now
                self._resolve(ep, table, now, "changed")
                ep = self._episode = None
        if hung and ep is None:
            self._episode = ep = self._start(table, now, mono)
        if ep is not None and not ep.published and (mono >= ep.publish_at or not hung):
            self._say(ep)
        if not hung and ep is not None:
            self._episode = None
            progressed = any(now - r.progress_ns < self.hang_after_ns for r in live)
            self._resolve(ep, table, now, "progress" if progressed else "ended")
        self.hung = hung
        self._export(table, hung, now, mono)

    # -- the table --------------------------------------------------------------------------------------------
    def _read(self, ranks: list[RankInfo], now: int) -> list[RankPhase]:
        entries, seen = self._entries, set()
        own: dict[int, tuple[RankInfo, _Entry]] = {}
        workers: dict[int, list[_Entry]] = {}
        for info in ranks:
            if info.state == RankState.FREE:
                continue
            phase = read_phase(self.segment, info.local_rank)
            if phase is None:
                continue
            key = (info.local_rank, info.pid, info.incarnation)
            seen.add(key)
            word = (phase.ident | phase.depth << 32, phase.since_ns, phase.step)
            entry = entries.get(key)
            if entry is None or entry.word != word:
                # the word's own time when it is the news (a section entered or left), else when we saw the step
                exact = (entry is None and phase.step == 0) or (entry is not None and entry.word[1] != phase.since_ns)
                section = (phase.section or "(unnamed)") if phase.depth else ""
                entry = entries[key] = _Entry(word, phase.since_ns if exact else now, section,
                                              phase.wait and bool(phase.depth))
            if info.is_writer:
                if info.state == RankState.ACTIVE and pid_alive(info.pid):
                    workers.setdefault(info.writer_of - 1, []).append(entry)
            else:
                own[info.local_rank] = (info, entry)
        for key in [k for k in entries if k not in seen]:
            del entries[key]
        table = []
        for local_rank, (info, entry) in sorted(own.items(), key=lambda kv: kv[1][0].rank):
            progress, section, wait = entry.changed_ns, entry.section, entry.wait
            for w in workers.get(local_rank, ()):
                progress = max(progress, w.changed_ns)
                if not section and w.section:
                    section, wait = w.section, w.wait
            gone = self._gone(info)
            table.append(RankPhase(info.rank, info.pid, section, wait, progress, not gone, gone))
        live_pids = {r.pid for r in table if r.alive}
        for pid in [p for p in self._procs if p not in live_pids]:
            del self._procs[pid]
        self._note_quiet(table, now)
        return table

    def _gone(self, info: RankInfo) -> str:
        """"" while the rank's process lives, else how it went."""
        if info.state == RankState.EXITED:
            return "exited"
        if info.state != RankState.ACTIVE or not pid_alive(info.pid):
            return "died"
        proc = self._proc(info.pid)
        try:
            status = proc.status() if proc is not None else psutil.STATUS_DEAD
        except psutil.Error:
            return "died"
        return "zombie" if status == psutil.STATUS_ZOMBIE else "died" if status == psutil.STATUS_DEAD else ""

    def _proc(self, pid: int) -> psutil.Process | None:
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = self._procs[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return proc

    def _note_quiet(self, table: list[RankPhase], now: int) -> None:
        """Note the CPU time of each rank once it went quiet (the CPU a hang line gives is from there)."""
        quiet_ns = min(_QUIET_S * 1e9, self.hang_after_ns / 2)
        kept = {}
        for r in table:
            key = (r.rank, r.pid)
            noted = self._quiet.get(key)
            if noted is not None and noted[0] == r.progress_ns:
                kept[key] = noted
            elif r.alive and now - r.progress_ns >= quiet_ns:
                cpu = _cpu_seconds(self._proc(r.pid))
                if cpu is not None:
                    kept[key] = (r.progress_ns, cpu, time.monotonic())
        self._quiet = kept

    # -- an episode -----------------------------------------------------------------------------------------------
    def _picture(self, table: list[RankPhase]) -> tuple[list[RankPhase], tuple[tuple[int, str, str], ...]]:
        """The suspects, and the picture a line on them names: every rank with its section and, for a suspect,
        ``gone``, ``stopped`` or ``suspect`` (a rank not suspected: ""). A live suspect's other states (sleeping,
        running) are not in it: they come and go while it stays stuck."""
        live = [r for r in table if r.alive]
        stopped = {r.rank for r in live if self._stopped(r)}
        waiting = [r for r in live if r.waits and r.rank not in stopped]
        suspects = [r for r in table if not r.alive or r.rank in stopped or (not r.waits if waiting else True)]
        kinds = {r.rank: "gone" if not r.alive else "stopped" if r.rank in stopped else "suspect" for r in suspects}
        return suspects, tuple((r.rank, r.section, kinds.get(r.rank, "")) for r in table)

    def _resolve(self, ep: _Episode, table: list[RankPhase], now: int, reason: str) -> None:
        """Publish the end of episode ``ep``: ``progress``, ``ended`` (no live rank in a section) or ``changed``
        (a new episode names the new picture)."""
        duration = (now - ep.since_ns) / 1e9
        how = {"progress": "progress", "ended": "no rank waits any more",
               "changed": "the picture changed, named again"}[reason]
        self.publish(RESOLVED_EVENT, now, {
            "group": LINE_GROUP, "ranks": _ranks(table), "duration_s": round(duration, 3), "reason": reason,
            "line": f"hang resolved: job {self.job}: {how} after {duration:.0f} s"})

    def _start(self, table: list[RankPhase], now: int, mono: float) -> _Episode:
        """The hang's event data and line, its suspects asked for their stacks."""
        live = [r for r in table if r.alive]
        suspects, picture = self._picture(table)
        data: EventData = {"group": LINE_GROUP, "ranks": _ranks(table), "suspects": _ranks(suspects),
                           "hang_after_s": self.hang_after_ns / 1e9}
        offsets: dict[int, tuple[str, int]] = {}
        clauses = []
        named: list[tuple[int, str, str, int]] = []
        for r in suspects:
            age = (now - r.progress_ns) / 1e9
            where = f"in {r.section}" if r.section else "outside every section"
            prefix = f"rank.{r.rank}."
            data.update({prefix + "section": r.section, prefix + "wait": r.wait, prefix + "age_s": round(age, 3),
                         prefix + "pid": r.pid})
            if r.alive:
                status, cpu = self._state(r, mono)
                data.update({prefix + "status": status, prefix + "cpu_percent": round(cpu, 1)})
                how = f"pid {r.pid}, {status}, {cpu:.0f}% CPU"
                stacks = self._ask_stacks(r, status)
                if stacks is not None:
                    offsets[r.rank] = stacks
                    how += f", stacks: {stacks[0]}"
            else:
                data[prefix + "status"] = r.gone
                how = f"pid {r.pid}, {r.gone}"
            clauses.append(f"rank {r.rank} {where} for {age:.0f} s ({how})")
            named.append((r.rank, r.section, str(data[prefix + "status"]), r.progress_ns))
        others = [r for r in table if r not in suspects]
        groups: dict[str, list[RankPhase]] = {}
        for r in others:
            groups.setdefault(r.section, []).append(r)
        parts = [f"rank{'s' if len(g) > 1 else ''} {','.join(str(r.rank) for r in g)} "
                 f"{'in ' + section if section else 'outside every section'} for "
                 f"{min(now - r.progress_ns for r in g) / 1e9:.0f} s" for section, g in groups.items()]
        elsewhere = not suspects and len(groups) == 1
        data["elsewhere"] = elsewhere
        if elsewhere:
            clauses.append("the rank holding the job is elsewhere (another node)")
        elif not suspects:
            clauses.append("every rank of this node waits, in different wait sections")
        data["line"] = f"hang: job {self.job}: " + "; ".join(parts + clauses)
        since = max(r.progress_ns for r in live)
        return _Episode(now, since, data, mono + (STACKS_WAIT_S if offsets else 0.0), False, offsets, named,
                        picture)

    def _stopped(self, r: RankPhase) -> bool:
        """Whether a live rank's process is stopped (it runs none of its code, whatever its phase word says)."""
        proc = self._proc(r.pid)
        try:
            return proc is not None and proc.status() in _STOPPED
        except psutil.Error:
            return False

    def _state(self, r: RankPhase, mono: float) -> tuple[str, float]:
        """A live suspect's process state (psutil's: sleeping, stopped, running, disk-sleep, ...) and its CPU
        percent since it went quiet."""
        proc = self._proc(r.pid)
        try:
            status = proc.status() if proc is not None else "died"
        except psutil.Error:
            return "died", 0.0
        noted, cpu = self._quiet.get((r.rank, r.pid)), _cpu_seconds(proc)
        if noted is None or cpu is None or mono <= noted[2]:
            return status, 0.0
        return status, max(0.0, 100.0 * (cpu - noted[1]) / (mono - noted[2]))

    def _ask_stacks(self, r: RankPhase, status: str) -> tuple[str, int] | None:
        """Send a suspect that opted in (its stacks file, ours, made after its process started) ``SIGUSR2``;
        its file and size before, or None."""
        if status in (*_STOPPED, psutil.STATUS_ZOMBIE):
            return None  # it would dump only once it runs again
        try:
            path = stacks_path(self.job, r.pid)
            st = os.stat(path, follow_symlinks=False)
            proc = self._proc(r.pid)
            if proc is None or st.st_uid != os.getuid() or proc.create_time() > st.st_mtime + 1:
                return None  # not that process's file (its pid was used again): the signal could end it
            os.kill(r.pid, SIGNAL)
        except (OSError, psutil.Error, ValueError):
            return None
        return path, st.st_size

    def _say(self, ep: _Episode) -> None:
        """Publish the episode's event and queue its console line (once)."""
        ep.published = True
        for rank, (path, offset) in ep.offsets.items():
            ep.data[f"rank.{rank}.stacks"] = innermost_frames(_read_from(path, offset))
            ep.data[f"rank.{rank}.stacks_file"] = path
        self.episodes += 1
        self.publish(HANG_EVENT, ep.started_ns, ep.data)
        self.fanout.take(Pass(self.job, ep.started_ns, flags=[Flag(HANG_EVENT, ep.data)]))

    # -- the exporter -------------------------------------------------------------------------------------------
    def _export(self, table: list[RankPhase], hung: bool, now: int, mono: float) -> None:
        if self.exporter is None:
            return
        rows = [(r.rank, r.section, r.waits, r.progress_ns) for r in table if r.alive or r.gone == "died"]
        suspects = self._episode.suspects if self._episode is not None else []
        if (rows, hung, suspects) == self._exported and mono - self._exported_at < EXPORT_EVERY_S:
            return
        self._exported, self._exported_at = (rows, hung, suspects), mono
        self.exporter.set_progress(self.job, [(rank, section, wait, (now - at) / 1e9)
                                              for rank, section, wait, at in rows], hung,
                                   [(rank, section, state, (now - at) / 1e9) for rank, section, state, at in suspects])


def innermost_frames(dump: str, per_thread: int = FRAMES_PER_THREAD, limit: int = MAX_STACK_CHARS) -> str:
    """The innermost ``per_thread`` frames of each thread of a faulthandler dump (its thread lines kept), at most
    ``limit`` characters."""
    out: list[str] = []
    frames = 0
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            out.append(line)
            frames = 0
        elif line.startswith("  File ") and frames < per_thread:
            out.append(line)
            frames += 1
    text = "\n".join(out)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _read_from(path: str, offset: int, most: int = 1 << 16) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(most).decode("utf-8", "replace")
    except OSError:
        return ""


def _cpu_seconds(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return None
    return float(t.user + t.system)


def _ranks(table: list[RankPhase]) -> str:
    return ",".join(str(r.rank) for r in table)
