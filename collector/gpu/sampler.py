"""GPU telemetry per rank: sample every GPU of the node, attribute GPUs to ranks, write the figures as stats.

:class:`GpuSampler` samples every GPU (:mod:`collector.gpu.nvml`) every ``interval_s`` in a thread of its own
(an NVML call that hangs on a GPU in trouble never stalls the collector's loop), keeping the newest
:class:`GpuSnapshot`; a node collector has one for every job it serves. :func:`collector.daemon.config.start_sampler`
starts one as a collector's configuration asks (``--gpu``, ``--gpu-interval``, ``--gpu-extra``), or says in one
line why not.

:class:`JobGpu` is one job's side, stepped by the job's collector: it attributes GPUs to the job's ranks
(:func:`attribute`: by the pids NVML lists on each GPU, a rank's own and its descendants'; where no pid of a rank
is on any GPU, by the rank's ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK``), says each attribution and how it was
made on ``event/shmstat.gpu``, and writes every figure (:mod:`collector.gpu.figures`) into the job's
segment as a sample of a *writer entry* of that rank (:meth:`shmstat.job.rank.RankAttachment.register_writer`,
the same kind of entry a rank's DataLoader worker takes), so the figures are stats like any other: scanned,
merged per rank and across ranks, emitted once to every handler, on ``/metrics``, in ``shmstat top``. Windows
are wall-clock aligned like every stat's, as long as the job's shortest stat window (or 1 s) rounded up to a
multiple that holds at least one sample. A sample is written with the loop's clock when the loop takes it (at
most one loop turn after NVML read it), so it always lands in a window still open. The writer entries are the
collector's (its pid) while their rank is active, then handed back (state exited, the rank's pid: no process but
the job's), and when the collector stops.

It also remembers, per rank, the last samples of its GPUs' utilisation and throttle reasons, so the straggler
report can say whether a slow rank's GPU was throttled or idle (:meth:`JobGpu.describe`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import psutil

from shmstat.aggregation import to_mask
from shmstat.errors import ConfigError, ShmstatError
from shmstat.job.rank import RankAttachment, SlotKey
from shmstat.shm import layout as L
from shmstat.shm.layout import RankState
from shmstat.shm.segment import pid_alive
from shmstat.writer._writer import SlotBinding, binding_for

from .figures import FIGURES, GPU_GROUP, NOT_THROTTLING, stat_name, throttle_names
from .nvml import GpuDevices

if TYPE_CHECKING:
    from shmstat.shm.layout_records import RankInfo
    from shmstat.shm.segment import Segment

__all__ = [
    "ATTRIBUTION_EVENT", "EXTRAS", "MIN_INTERVAL_S", "Attribution", "DeviceSample", "GpuSampler", "GpuSnapshot",
    "JobGpu", "attribute", "check_interval",
]

MIN_INTERVAL_S = 0.5
"""The shortest ``--gpu-interval``: NVML holds a driver lock while it samples, and polling it more often slows
every process that uses the GPU."""
MAX_INTERVAL_S = 3600.0
EXTRAS = ("energy", "pcie")
"""``--gpu-extra`` choices: NVML calls too slow to make unless asked (3.7 ms and 20.8 ms per GPU on an H200)."""
ATTRIBUTION_EVENT = "shmstat.gpu"
"""The event saying which GPUs a rank was given and how (``by``: ``pid``, ``CUDA_VISIBLE_DEVICES`` or
``LOCAL_RANK``), published when a rank's attribution changes."""
IDLE_UTIL = 5.0
"""A GPU at under this utilisation (%) counts as idle in a straggler report."""
_MIB = float(1 << 20)
_HISTORY = 4096  # samples of GPU state kept per rank for the straggler report (~1 h at 1 s)


def check_interval(seconds: float) -> float:
    """``seconds`` if it is a usable ``--gpu-interval``, else :class:`ConfigError` in one sentence."""
    if not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:
        raise ConfigError(f"--gpu-interval must be between {MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g} seconds (NVML "
                          f"holds a driver lock while it samples), got {seconds:g}")
    return seconds


# -- sampling ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSample:
    """One GPU at one sample: its device figures by name, and what NVML said of its processes."""

    index: int
    uuid: str
    figures: dict[str, float]
    memory: dict[int, int | None]
    """Bytes each compute process holds on the GPU (None: NVML cannot say), by pid."""
    sm_util: dict[int, int] | None
    """SM % of each process NVML sampled since the previous sample, by pid; None where NVML does not say."""

    @property
    def pids(self) -> set[int]:
        """Every pid NVML listed on the GPU."""
        return set(self.memory) | set(self.sm_util or ())


@dataclass(frozen=True)
class GpuSnapshot:
    """Every GPU at one sample."""

    seq: int
    """Bumped every sample (a job writes each snapshot once)."""
    taken_ns: int
    devices: tuple[DeviceSample, ...]


class GpuSampler:
    """Samples every GPU of ``devices`` every ``interval_s`` in a thread (:meth:`start`), keeping the newest
    snapshot (:meth:`latest`); ``extra`` names the expensive figures to sample too (:data:`EXTRAS`). An NVML error
    other than "not supported" is counted in :attr:`errors` and said once on ``err``."""

    def __init__(self, devices: GpuDevices, *, interval_s: float = 1.0, extra: tuple[str, ...] = (),
                 clock: Callable[[], int] = time.time_ns, err: IO[str] | None = None) -> None:
        self.devices = devices
        self.interval_s = check_interval(interval_s)
        unknown = sorted(set(extra) - set(EXTRAS))
        if unknown:
            raise ConfigError(f"--gpu-extra {unknown[0]!r} is not one of {', '.join(EXTRAS)}")
        self.extra = frozenset(extra)
        self.clock = clock
        self.err = err
        n = devices.count()
        self.uuids = tuple(devices.uuid(i) for i in range(n))
        self.names = tuple(devices.name(i) for i in range(n))
        self.samples = 0
        self.errors = 0
        self.sample_ns = 0
        """Nanoseconds spent sampling, all samples together (the cost per sample is this / :attr:`samples`)."""
        self._latest: GpuSnapshot | None = None
        self._said = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> GpuSnapshot:
        """Read every GPU once (the thread does this every interval) and keep it as the newest snapshot."""
        t0 = time.perf_counter_ns()
        devices = tuple(self._device(i) for i in range(len(self.uuids)))
        snap = GpuSnapshot(self.samples + 1, self.clock(), devices)
        self.sample_ns += time.perf_counter_ns() - t0
        self.samples += 1
        self._latest = snap
        return snap

    def _device(self, i: int) -> DeviceSample:
        d = self.devices
        fig: dict[str, float] = {}
        util = d.utilization(i)
        if util is not None:
            fig["util"], fig["mem_copy_util"] = float(util[0]), float(util[1])
        mem = d.memory(i)
        if mem is not None:
            fig["fb_used"], fig["fb_total"] = mem[0] / _MIB, mem[1] / _MIB
        for name, value in (("power_usage", d.power_mw(i)), ("temp", d.temperature_c(i)),
                            ("sm_clock", d.sm_clock_mhz(i))):
            if value is not None:
                fig[name] = value / 1000.0 if name == "power_usage" else float(value)
        reasons = d.throttle_reasons(i)
        if reasons is not None:
            fig["clock_throttle_reasons"] = float(reasons)
            fig["throttled"] = 1.0 if reasons & ~NOT_THROTTLING else 0.0
        if "energy" in self.extra:
            energy = d.energy_mj(i)
            if energy is not None:
                fig["total_energy"] = float(energy)
        if "pcie" in self.extra:
            pcie = d.pcie_kbps(i)
            if pcie is not None:
                fig["pcie_tx"], fig["pcie_rx"] = float(pcie[0]), float(pcie[1])
        memory = dict(d.processes(i))
        sm = d.process_utilization(i)
        return DeviceSample(i, self.uuids[i], fig, memory, None if sm is None else dict(sm))

    def latest(self) -> GpuSnapshot | None:
        """The newest snapshot (None before the first)."""
        return self._latest

    def start(self) -> None:
        """Sample now, then every ``interval_s`` in a daemon thread, until :meth:`close`."""
        self._thread = threading.Thread(target=self._run, name="shmstat-gpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as exc:  # a GPU lost, the driver gone: counted, said once, tried again next time
                self.errors += 1
                if not self._said:
                    self._said = True
                    print(f"shmstat collector: GPU sampling failed ({exc}); counted in collector.gpu_errors, "
                          "trying again every interval", file=self.err or sys.stderr, flush=True)
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        """Stop sampling and release NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        with contextlib.suppress(Exception):
            self.devices.close()


# -- attribution ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Attribution:
    """The GPUs one rank uses, and how that was found."""

    local_rank: int
    rank: int
    pid: int
    gpus: tuple[int, ...]
    by: str
    """``pid`` (its processes are on the GPUs), ``CUDA_VISIBLE_DEVICES`` (it sees one GPU) or ``LOCAL_RANK``
    (the LOCAL_RANK-th GPU it sees)."""
    pids: dict[int, frozenset[int]] = field(default_factory=dict)
    """By GPU: the rank's processes NVML lists on it (attributed by pid only)."""


EnvReader = Callable[[int], dict[str, str] | None]


def _environ(pid: int) -> dict[str, str] | None:
    try:
        return dict(psutil.Process(pid).environ())
    except (psutil.Error, OSError):
        return None


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def attribute(snapshot: GpuSnapshot, ranks: list[RankInfo], *, environ: EnvReader = _environ,
              parent: Callable[[int], int] = _parent) -> dict[int, Attribution]:
    """The GPUs of every active rank of ``ranks`` (by local rank) at ``snapshot``: those where NVML lists the
    rank's pid, a pid of one of its writers, or a descendant of either; for a rank none of whose processes NVML
    lists, the GPU its environment names (``CUDA_VISIBLE_DEVICES`` naming one GPU, else the ``LOCAL_RANK``-th
    GPU it sees, ``LOCAL_RANK`` from its environment or its entry). A rank that sees no GPU gets none."""
    me = os.getpid()
    roots = {r.local_rank: r for r in ranks if r.state == RankState.ACTIVE and not r.is_writer and r.pid > 0}
    owner: dict[int, int] = {r.pid: lr for lr, r in roots.items()}
    for r in ranks:
        if r.is_writer and r.pid > 0 and r.pid != me and r.writer_of - 1 in roots:
            owner.setdefault(r.pid, r.writer_of - 1)
    found: dict[int, dict[int, set[int]]] = {}
    resolved: dict[int, int | None] = {}
    for dev in snapshot.devices:
        for pid in dev.pids:
            lr = _owner_of(pid, owner, resolved, parent)
            if lr is not None:
                found.setdefault(lr, {}).setdefault(dev.index, set()).add(pid)
    n = len(snapshot.devices)
    out: dict[int, Attribution] = {}
    for lr, r in roots.items():
        on = found.get(lr)
        if on:
            out[lr] = Attribution(lr, r.rank, r.pid, tuple(sorted(on)), "pid",
                                  {g: frozenset(p) for g, p in on.items()})
            continue
        by_env = _from_environment(environ(r.pid), r.local_rank, snapshot, n)
        if by_env is not None:
            out[lr] = Attribution(lr, r.rank, r.pid, (by_env[0],), by_env[1])
    return out


def _owner_of(pid: int, owner: dict[int, int], resolved: dict[int, int | None],
              parent: Callable[[int], int]) -> int | None:
    """The local rank whose process ``pid`` is (itself, or a descendant of a rank's or writer's pid)."""
    if pid in resolved:
        return resolved[pid]
    chain, current, found = [], pid, None
    for _ in range(64):
        if current in owner:
            found = owner[current]
            break
        if current in resolved:
            found = resolved[current]
            break
        if current <= 1:
            break
        chain.append(current)
        current = parent(current)
    for p in chain:
        resolved[p] = found
    resolved[pid] = found
    return found


def _from_environment(env: dict[str, str] | None, entry_local_rank: int, snapshot: GpuSnapshot,
                      n: int) -> tuple[int, str] | None:
    """(GPU index, how) from a rank's environment, or None when it sees no GPU."""
    env = env or {}
    visible: list[int] = list(range(n))
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        visible = []
        for token in (t.strip() for t in cvd.split(",")):
            if token.isdigit():
                if int(token) >= n:
                    break  # CUDA stops at the first invalid entry
                visible.append(int(token))
            elif token.startswith("GPU-"):
                match = [d.index for d in snapshot.devices if d.uuid.startswith(token)]
                if len(match) != 1:
                    break
                visible.append(match[0])
            else:
                break
        if len(visible) == 1:
            return visible[0], "CUDA_VISIBLE_DEVICES"
    try:
        local_rank = int(env.get("LOCAL_RANK", entry_local_rank))
    except ValueError:
        local_rank = entry_local_rank
    if 0 <= local_rank < len(visible):
        return visible[local_rank], "LOCAL_RANK"
    return None


# -- one job's side ------------------------------------------------------------------------------------------------

@dataclass
class _RankWriter:
    """The collector's writer entry for one rank, and the writer of each GPU figure's slot in it."""

    att: RankAttachment
    owner_pid: int
    bindings: dict[str, SlotBinding] = field(default_factory=dict)


@dataclass(frozen=True)
class _State:
    """One rank's GPUs at one sample (for the straggler report)."""

    ts_ns: int
    util: float | None
    reasons: int


class JobGpu:
    """One job's GPU figures: attribution, the writer entries, the samples; stepped by the job's collector.
    ``publish_event`` publishes the collector's own events (:data:`ATTRIBUTION_EVENT`)."""

    def __init__(self, segment: Segment, sampler: GpuSampler, publish_event: Callable[..., None], *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.segment = segment
        self.sampler = sampler
        self.publish_event = publish_event
        self.clock = clock
        self.samples_written = 0
        """Figures written into the segment (each one sample of a stat of group ``gpu``)."""
        self.attributions: dict[int, Attribution] = {}
        """The newest attribution of every rank that has GPUs, by local rank."""
        self._seq = 0
        self._writers: dict[int, _RankWriter] = {}
        self._window_ms = 0
        self._ts = 0
        self._history: dict[int, deque[_State]] = {}
        self._said: set[tuple[int, int, tuple[int, ...], str]] = set()

    def step(self, ranks: list[RankInfo]) -> None:
        """Hand back the entries of ranks no longer active; write the newest snapshot if not written yet."""
        self._release_gone(ranks)
        snap = self.sampler.latest()
        if snap is None or snap.seq == self._seq:
            return
        self._seq = snap.seq
        attributions = attribute(snap, ranks)
        self.attributions = attributions
        now = self.clock()
        for a in attributions.values():
            self._say(a)
            self._remember(a, snap, now)
            self._write(a, snap, ranks, now)

    def _say(self, a: Attribution) -> None:
        key = (a.local_rank, a.pid, a.gpus, a.by)
        if key in self._said:
            return
        self._said = {k for k in self._said if k[:2] != key[:2]}
        self._said.add(key)
        self.publish_event(ATTRIBUTION_EVENT, self.clock(), {
            "job": self.segment.job, "rank": a.rank, "local_rank": a.local_rank, "pid": a.pid,
            "gpus": ",".join(map(str, a.gpus)), "uuids": ",".join(self.sampler.uuids[g] for g in a.gpus),
            "by": a.by})

    def _remember(self, a: Attribution, snap: GpuSnapshot, now: int) -> None:
        utils = [snap.devices[g].figures["util"] for g in a.gpus if "util" in snap.devices[g].figures]
        reasons = 0
        for g in a.gpus:
            reasons |= int(snap.devices[g].figures.get("clock_throttle_reasons", 0))
        history = self._history.setdefault(a.rank, deque(maxlen=_HISTORY))
        history.append(_State(now, sum(utils) / len(utils) if utils else None, reasons))

    def _write(self, a: Attribution, snap: GpuSnapshot, ranks: list[RankInfo], now: int) -> None:
        w = self._writer(a, ranks)
        if w is None:
            return
        self._ts = now
        for g in a.gpus:
            dev = snap.devices[g]
            figures = dict(dev.figures)
            if a.by == "pid":
                pids = a.pids.get(g, frozenset())
                held = [dev.memory.get(p) for p in pids if p in dev.memory]
                if held and all(b is not None for b in held):
                    figures["proc_fb_used"] = sum(b for b in held if b is not None) / _MIB
                if dev.sm_util is not None:
                    figures["proc_sm_util"] = float(sum(dev.sm_util.get(p, 0) for p in pids))
            for name, value in figures.items():
                self._binding(w, g, name).add(value)
                self.samples_written += 1

    def _writer(self, a: Attribution, ranks: list[RankInfo]) -> _RankWriter | None:
        w = self._writers.get(a.local_rank)
        if w is not None:
            return w
        if not self._window_ms:
            self._window_ms = self._choose_window(ranks)
        try:
            att = RankAttachment.register_writer(self.segment, owner_local_rank=a.local_rank)
        except (ShmstatError, OSError):
            return None
        w = self._writers[a.local_rank] = _RankWriter(att, a.pid)
        return w

    def _choose_window(self, ranks: list[RankInfo]) -> int:
        """The job's shortest stat window (1 s if it has none yet), times the least whole number that makes it
        at least the sampling interval; never under what the segment's banks allow."""
        windows = [d.window_ms for r in ranks if not r.is_writer
                   for d in self.segment.descriptors(r.local_rank) if d.group != GPU_GROUP]
        base = min(windows) if windows else 1000
        interval_ms = int(self.sampler.interval_s * 1000)
        window = base * max(1, -(-interval_ms // base))
        return max(window, L.min_window_ms(self.segment.geometry.banks))

    def _binding(self, w: _RankWriter, gpu: int, name: str) -> SlotBinding:
        key = stat_name(gpu, name)
        b = w.bindings.get(key)
        if b is None:
            fig = FIGURES[name]
            slot = SlotKey(key, GPU_GROUP, self._window_ms, 2**63 - 1, to_mask(fig.aggregations))
            b = w.bindings[key] = binding_for(w.att, slot, self._window_ms * 1_000_000, fig.latest, self._clock)
        return b

    def _clock(self) -> int:
        return self._ts

    def _release_gone(self, ranks: list[RankInfo]) -> None:
        by_local = {r.local_rank: r for r in ranks}
        for lr in list(self._writers):
            owner = by_local.get(lr)
            if owner is None or owner.state != RankState.ACTIVE or not pid_alive(owner.pid):
                self._release(lr)

    def _release(self, local_rank: int) -> None:
        w = self._writers.pop(local_rank)
        release_entry(w.att, w.owner_pid)

    def close(self) -> None:
        """Hand back every writer entry (the collector stops: its figures end with it)."""
        for lr in list(self._writers):
            with contextlib.suppress(Exception):
                self._release(lr)

    def describe(self, rank: int, start_ns: int, end_ns: int) -> dict[str, str | int | float | bool]:
        """What rank ``rank``'s GPUs did from ``start_ns`` to ``end_ns`` (for a straggler report): ``gpu_state``
        (``throttled`` when a throttle reason held the clocks down in half the samples or more, else ``idle``
        when the utilisation was under :data:`IDLE_UTIL` % in half or more, else ``busy``), ``gpu_util`` (mean
        %), ``gpu_throttled`` (share of samples throttled), ``gpu_throttle_reasons`` and ``gpu``/``gpu_by``;
        empty when no sample of its GPUs falls in the span."""
        history = self._history.get(rank)
        samples = [s for s in history or () if start_ns <= s.ts_ns < end_ns]
        if not samples:
            return {}
        throttled = [s for s in samples if s.reasons & ~NOT_THROTTLING]
        utils = [s.util for s in samples if s.util is not None]
        idle = [u for u in utils if u < IDLE_UTIL]
        reasons = 0
        for s in throttled:
            reasons |= s.reasons & ~NOT_THROTTLING
        state = ("throttled" if 2 * len(throttled) >= len(samples)
                 else "idle" if utils and 2 * len(idle) >= len(utils) else "busy")
        out: dict[str, str | int | float | bool] = {
            "gpu_state": state, "gpu_throttled": len(throttled) / len(samples),
            "gpu_throttle_reasons": ",".join(throttle_names(reasons)), "gpu_samples": len(samples)}
        if utils:
            out["gpu_util"] = sum(utils) / len(utils)
        a = next((a for a in self.attributions.values() if a.rank == rank), None)
        if a is not None:
            out["gpu"] = ",".join(map(str, a.gpus))
            out["gpu_by"] = a.by
        return out


def release_entry(att: RankAttachment, owner_pid: int) -> None:
    """Hand back a writer entry this process took for a rank while it lives on: marked exited and given the
    rank's pid (``owner_pid``), so the job's end and the removal of its segment wait for the rank's processes,
    as they would anyway, and never for this process."""
    seg = att.segment
    if att.local_rank < 0:
        return
    with seg.locked():
        if seg.rank(att.local_rank).pid != att.pid:
            return  # taken over meanwhile
        seg.set_rank_pid(att.local_rank, owner_pid)
        seg.set_rank_state(att.local_rank, RankState.EXITED)
