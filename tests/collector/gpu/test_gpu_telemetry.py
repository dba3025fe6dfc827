"""GPU telemetry per rank in the collector, end to end: real ranks (processes, one with a child on a GPU), a real
collector sampling a recorded H200 pair (``SHMSTAT_GPU_RECORDING``; CI has no GPU) whose process lists name the
real pids, and what reaches jsonl, the events sink and ``/metrics``. Then what happens without NVML, a refused
interval, and tests marked ``gpu`` against a real GPU (skipped with the reason where NVML finds none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from kit.gpu import recording
from kit.procs import REPO, read_jsonl, start_collector
from kit.support import wait_for

from collector.gpu.nvml import RECORDING_ENV
from shmstat.shm.segment import Segment

KIT = str(Path(__file__).resolve().parents[2] / "kit" / "gpu.py")


def _rank(job: str, rank: int, out: Path, value: float, *, child: bool = False, **env: str | None) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", RECORDING_ENV)}
    environ["PYTHONPATH"] = REPO
    environ.update({k: v for k, v in env.items() if v is not None})
    args = [sys.executable, KIT, job, str(rank), "4", str(out), str(value), *(["child"] if child else [])]
    return subprocess.Popen(args, env=environ, cwd=REPO)


def _pid(out: Path, name: str) -> int:
    path = out / name
    wait_for(path.exists, 30, what=str(path))
    return int(path.read_text())


def _families(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def _gpu_samples(fams: dict, family: str) -> dict[tuple[str, str | None], float]:
    """``{(gpu, rank or None): value}`` of one GPU family."""
    fam = fams.get(family)
    return {} if fam is None else {(s.labels["gpu"], s.labels.get("rank")): s.value for s in fam.samples}


def test_gpu_figures_of_real_ranks_reach_jsonl_events_and_metrics_attributed_per_rank(job, tmp_path, monkeypatch):
    out = tmp_path / "ranks"
    out.mkdir()
    # rank 0: a child of it is on GPU 0; rank 2: itself on GPU 1 (capped by power), slowed once the GPUs are
    # sampled; rank 1 and 3 are on no GPU's process list: LOCAL_RANK=1 of all GPUs, CUDA_VISIBLE_DEVICES naming GPU 0
    ranks = [_rank(job, 0, out, 1.0, child=True, LOCAL_RANK="0"), _rank(job, 1, out, 1.0, LOCAL_RANK="1"),
             _rank(job, 2, out, 1.0, LOCAL_RANK="2"),
             _rank(job, 3, out, 1.0, LOCAL_RANK="3", CUDA_VISIBLE_DEVICES="0")]
    coll = None
    try:
        child0, pid2 = _pid(out, "child0"), _pid(out, "pid2")
        pids = {r: _pid(out, f"pid{r}") for r in range(4)}
        doc = recording(tmp_path / "h200.json", {0: [child0], 1: [pid2]})
        uuids = [d["uuid"] for d in doc["devices"]]
        monkeypatch.setenv(RECORDING_ENV, str(tmp_path / "h200.json"))
        rows_path, events_path = tmp_path / "gpu.jsonl", tmp_path / "events.jsonl"
        coll = start_collector(job, "--gpu", "on", "--gpu-interval", "0.5", "--handler", f"gpu=jsonl:{rows_path}",
                               "--handler", "*=null", "--events", f"jsonl:{events_path}", "--prometheus",
                               "127.0.0.1:0", "--grace-ms", "10", "--status-interval", "0")
        assert "GPU telemetry: 2 GPUs (NVIDIA H200; driver 580.159.04)" in coll.lines_seen("GPU telemetry")
        url = coll.prometheus

        def attributed() -> dict | None:
            got = {e["data"]["rank"]: e["data"] for e in read_jsonl(str(events_path)) if e["name"] == "shmstat.gpu"}
            return got if len(got) == 4 else None

        said = wait_for(attributed, 30, what="an attribution event per rank")
        assert {r: (d["gpus"], d["by"], d["pid"]) for r, d in said.items()} == {
            0: ("0", "pid", pids[0]), 1: ("1", "LOCAL_RANK", pids[1]), 2: ("1", "pid", pids[2]),
            3: ("0", "CUDA_VISIBLE_DEVICES", pids[3])}
        assert said[0]["uuids"] == uuids[0] and said[1]["uuids"] == uuids[1]
        (out / "slow2").touch()

        def straggler() -> dict | None:
            return next((e["data"] for e in read_jsonl(str(events_path)) if e["name"] == "shmstat.straggler"), None)

        slow = wait_for(straggler, 30, what="rank 2 reported a straggler")
        assert slow["rank"] == 2 and slow["stat"] == "step_ms"
        assert slow["gpu"] == "1" and slow["gpu_by"] == "pid" and slow["gpu_state"] == "throttled"
        assert slow["gpu_throttle_reasons"] == "sw_power_cap" and slow["gpu_throttled"] == 1.0
        assert slow["gpu_samples"] >= 1 and 88 <= slow["gpu_util"] <= 90

        def exported() -> dict | None:
            fams = _families(url)
            used = _gpu_samples(fams, "shmstat_gpu_fb_used")
            return fams if {("0", "0"), ("0", "3"), ("1", "1"), ("1", "2"), ("0", None), ("1", None)} <= set(used) \
                else None

        fams = wait_for(exported, 30, what="every rank's GPU on /metrics")
        used = _gpu_samples(fams, "shmstat_gpu_fb_used")
        assert set(used) == {("0", "0"), ("0", "3"), ("1", "1"), ("1", "2"), ("0", None), ("1", None)}
        assert used[("0", "0")] == used[("0", None)] == 3800.0 and used[("1", None)] == 1300.0  # MiB, as DCGM
        assert _gpu_samples(fams, "shmstat_gpu_fb_total")[("1", "2")] == 143771.0
        for s in fams["shmstat_gpu_util"].samples:
            assert s.labels["uuid"] == uuids[int(s.labels["gpu"])] and s.labels["job"] == job
        # the rank's own processes: only where NVML lists them (ranks 0 and 2), the child's 810 MiB for rank 0
        proc = _gpu_samples(fams, "shmstat_gpu_proc_fb_used")
        assert proc[("0", "0")] == 810.0 and proc[("1", "2")] == 810.0
        assert ("1", "1") not in proc and ("0", "3") not in proc
        assert _gpu_samples(fams, "shmstat_gpu_throttled")[("1", "2")] == 1.0
        assert "shmstat_gpu_total_energy" not in fams and "shmstat_gpu_pcie_tx" not in fams  # not asked for
        assert fams["shmstat_collector_gpu_samples"].samples[0].value >= 1

        rows = read_jsonl(str(rows_path))
        per_rank = {(r["name"], r["rank"]) for r in rows if r["rank"] is not None}
        assert {("gpu0.util.mean", 0), ("gpu0.util.mean", 3), ("gpu1.util.mean", 1),
                ("gpu1.util.mean", 2)} <= per_rank
        assert not {("gpu1.util.mean", 0), ("gpu0.util.mean", 2), ("gpu1.util.mean", 3)} & per_rank
        merged = [r for r in rows if r["name"] == "gpu0.util.mean" and r["rank"] is None]
        assert merged and all(96 <= r["value"] <= 98 and r["group"] == "gpu" and r["job"] == job for r in merged)
    finally:
        (out / "stop").touch()
        for p in ranks:
            p.wait(60)
        if coll is not None:
            assert coll.stop() == 0
    # the collector's GPU entries were handed back: the job's segment went with its ranks
    assert job not in Segment.list_jobs()


def _tensorboard_scalars(logdir: str) -> dict[str, list[float]]:
    """``{tag: [value, ...]}`` of every scalar in ``logdir``, as TensorBoard's EventAccumulator reads them."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(logdir, size_guidance={TENSORS: 0})
    acc.Reload()
    return {tag: [tensor_util.make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)]
            for tag in acc.Tags()[TENSORS]}


def test_gpu_figures_reach_tensorboard_per_rank_and_merged(job, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    out = tmp_path / "ranks"
    out.mkdir()
    rank = _rank(job, 0, out, 1.0, LOCAL_RANK="0")
    coll = None
    try:
        recording(tmp_path / "h200.json", {1: [_pid(out, "pid0")]})
        monkeypatch.setenv(RECORDING_ENV, str(tmp_path / "h200.json"))
        logdir = str(tmp_path / "tb")
        coll = start_collector(job, "--gpu", "on", "--gpu-interval", "0.5", "--handler", f"gpu=tensorboard:{logdir}",
                               "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0")
        tags = ("gpu/gpu1.power_usage.mean", "rank0/gpu/gpu1.power_usage.mean")

        def written() -> dict | None:
            run = os.path.join(logdir, job)  # the job's run
            scalars = _tensorboard_scalars(run) if os.path.isdir(run) else {}
            return scalars if all(scalars.get(t) for t in tags) else None

        scalars = wait_for(written, 30, what="rank 0's GPU 1 in TensorBoard")
        for tag in tags:  # W (recorded in mW), as float32
            assert all(699.59 <= v <= 700.01 for v in scalars[tag]), (tag, scalars[tag])  # float32
        assert not [t for t in scalars if "gpu0." in t]  # rank 0 is on GPU 1 only
    finally:
        (out / "stop").touch()
        rank.wait(60)
        if coll is not None:
            coll.stop()


def test_a_node_collector_samples_every_job_and_lets_a_finished_one_go(tmp_path):
    from kit.support import run_with_private_dev_shm

    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO)
    env.pop(RECORDING_ENV, None)
    script = 'mount -t tmpfs -o size=160m tmpfs /dev/shm && exec "$PY" tests/kit/gpu.py node "$WORK"'
    done = run_with_private_dev_shm(script, env, REPO, 300)
    assert done.returncode == 0, done.stderr
    result = json.loads((work / "result.json").read_text())
    job, lines = result["job"], result["lines"]
    assert not [line for line in lines if "TIMED OUT" in line], lines
    assert any("GPU telemetry: 2 GPUs" in line for line in lines)
    ranks = {r["rank"] for r in result["rows"] if r["name"] == "gpu0.util.mean"}
    assert ranks == {0, None} and all(r["job"] == job for r in result["rows"])
    # the collector's GPU entry did not keep the job alive: let go, and its segment removed while it served
    assert f"shmstat collector: job {job} done (its ranks exited, windows emitted)" in lines
    assert f"shmstat collector: job {job}'s segment removed" in lines
    assert result["left"] == [] and result["status"] == 0


def _collect_briefly(job: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a collector for ``job`` with ``args`` until it served, then SIGTERM it; its output, the line saying where
    it serves left out of its stderr (its notes are on stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != RECORDING_ENV}
    environ.update(env or {})
    coll = start_collector(job, "--status-interval", "0", *args, env=environ)
    code, stdout = coll.finish(timeout=60)
    return subprocess.CompletedProcess(coll.proc.args, code, stdout, "".join(f"{line}\n" for line in coll.notes))


def _nvml_finds_a_gpu() -> str:
    """"" when NVML finds a GPU here, else why not."""
    from collector.gpu.nvml import NvmlDevices
    from shmstat.errors import ConfigError

    try:
        NvmlDevices().close()
    except ConfigError as exc:
        return str(exc)
    return ""


def test_without_nvml_gpu_on_is_one_line_and_nothing_else(job):
    why = _nvml_finds_a_gpu()
    if not why:
        pytest.skip("NVML finds a GPU here: the path without one is not this machine's")
    r = _collect_briefly(job, "--gpu", "on")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"shmstat collector: GPU telemetry off: {why}"]
    assert "GPU" not in r.stdout
    auto = _collect_briefly(job, "--gpu", "auto")  # the default: no driver here, so not a word
    assert auto.returncode == 0 and auto.stderr == "" and "GPU" not in auto.stdout


def test_a_gpu_interval_under_half_a_second_is_refused_in_one_sentence(job):
    r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--gpu-interval", "0.2"],
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == ["shmstat: error: --gpu-interval must be between 0.5 and 3600 seconds (NVML holds "
                                     "a driver lock while it samples), got 0.2"]
    assert job not in Segment.list_jobs()


@pytest.fixture
def real_gpu() -> None:
    """Skip (with the reason) unless NVML finds a GPU on this machine."""
    why = _nvml_finds_a_gpu()
    if why:
        pytest.skip(f"needs a GPU NVML finds: {why}")


@pytest.mark.gpu
def test_a_real_gpu_is_sampled_in_nvml_units(real_gpu):
    from collector.gpu.nvml import NvmlDevices
    from collector.gpu.sampler import GpuSampler

    sampler = GpuSampler(NvmlDevices(), interval_s=0.5, extra=("energy", "pcie"))
    try:
        snap = sampler.sample()
        assert len(snap.devices) >= 1
        for dev in snap.devices:
            f = dev.figures
            assert dev.uuid.startswith(("GPU-", "MIG-"))
            assert 0 <= f["util"] <= 100 and 0 <= f["fb_used"] <= f["fb_total"] and f["fb_total"] > 0
            # what a GPU may not support (a MIG slice, a virtual GPU) is absent, never wrong
            assert 0 < f.get("power_usage", 1) < 2000 and 0 < f.get("temp", 1) < 120 and f.get("sm_clock", 0) >= 0
            assert f.get("throttled", 0.0) in (0.0, 1.0)
    finally:
        sampler.close()


@pytest.mark.gpu
def test_a_real_gpu_reaches_jsonl_for_a_real_rank(real_gpu, job, tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    rank = _rank(job, 0, out, 1.0, LOCAL_RANK="0")
    coll = None
    try:
        _pid(out, "pid0")
        rows_path = tmp_path / "gpu.jsonl"
        coll = start_collector(job, "--gpu", "on", "--gpu-interval", "0.5", "--handler", f"gpu=jsonl:{rows_path}",
                               "--handler", "*=null", "--grace-ms", "10", "--status-interval", "0")

        def util_rows() -> list:
            return [r for r in read_jsonl(str(rows_path)) if r["name"].endswith(".util.mean") and r["rank"] == 0]

        rows = wait_for(util_rows, 30, what="rank 0's GPU utilisation in jsonl")
        assert all(0 <= r["value"] <= 100 for r in rows)
    finally:
        (out / "stop").touch()
        rank.wait(60)
        if coll is not None:
            coll.stop()


def test_top_shows_a_gpu_column_per_rank_and_scores_no_gpu_figure(job, tmp_path):
    from kit.support import FakeClock
    from rich.console import Console

    from collector.cli.top import render, snapshot
    from collector.gpu.nvml import RecordedDevices
    from collector.gpu.sampler import GpuSampler, JobGpu
    from shmstat.job.rank import RankAttachment

    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    seg = Segment.open(job)
    try:
        for r, p in enumerate(sleepers):
            RankAttachment.register(seg, rank=r, local_rank=r, world_size=2, pid=p.pid)
        doc = recording(tmp_path / "h200.json", {0: [p.pid for p in sleepers]})
        for frame in doc["devices"][0]["frames"]:  # rank 1 holds ten times rank 0's memory on GPU 0
            frame["processes"][1][1] *= 10
        (tmp_path / "h200.json").write_text(json.dumps(doc))
        clock = FakeClock()
        clock.to_window(1000)
        sampler = GpuSampler(RecordedDevices(str(tmp_path / "h200.json")), interval_s=1.0, clock=clock)
        said: list[tuple] = []
        gpu = JobGpu(seg, sampler, lambda *event: said.append(event), clock=clock)
        for i in range(2):  # one sample in a window, then one in the next: the first window is closed
            clock.advance_ms(1000 * i)
            sampler.sample()
            gpu.step(seg.ranks())
        assert [(e[0], e[2]["rank"], e[2]["gpus"], e[2]["by"]) for e in said] == [
            ("shmstat.gpu", 0, "0", "pid"), ("shmstat.gpu", 1, "0", "pid")]
        snap = snapshot(seg, clock.now)
        (view,) = snap.jobs
        g0, g1 = view.gpu_of(0), view.gpu_of(1)
        assert g0 is not None and g1 is not None
        assert (g0.gpus, g0.util, g0.memory_mib) == ((0,), 97.0, 810.0)
        assert (g1.gpus, g1.util, g1.memory_mib) == ((0,), 97.0, 8100.0)
        assert not [s.key for s in view.stats if s.stragglers], "a GPU figure was scored"
        console = Console(width=100, record=True, color_system=None)
        console.print(render(snap, view="ranks", stat="gpu/gpu0.proc_fb_used", width=100))
        text = console.export_text()
        assert "GPU" in text and "0:97% 849M" in text and "0:97% 8.49G" in text and "SLOW" not in text
        # nor does the collector's straggler detector score them (rank 1 would be 0.55 of the median)
        from collector.daemon.straggler import StragglerDetector
        from collector.read.scanner import Scanner

        cols = Scanner(seg, 0).scan(clock.now, final=True).columns
        assert "gpu0.proc_fb_used" in set(cols.stat.tolist())
        found = StragglerDetector(job, windows=1).update_columns(cols)
        assert found.scores == [] and found.events == []
        gpu.close()
        sampler.close()
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
        seg.close()


def test_the_expensive_figures_are_sampled_only_when_asked(tmp_path):
    from collector.gpu.nvml import RecordedDevices
    from collector.gpu.sampler import GpuSampler
    from shmstat.errors import ConfigError

    recording(tmp_path / "h200.json", {})
    plain = GpuSampler(RecordedDevices(str(tmp_path / "h200.json"))).sample().devices[0].figures
    asked = GpuSampler(RecordedDevices(str(tmp_path / "h200.json")), extra=("energy", "pcie")).sample().devices[0]
    assert not {"total_energy", "pcie_tx", "pcie_rx"} & set(plain)
    assert (asked.figures["total_energy"], asked.figures["pcie_tx"], asked.figures["pcie_rx"]) == (
        918_233_114.0, 120_400.0, 98_700.0)  # mJ and KB/s, as NVML gives them
    assert plain["power_usage"] == 612.4 and plain["fb_used"] == 3800.0 and plain["throttled"] == 0.0  # W, MiB
    with pytest.raises(ConfigError, match="--gpu-extra 'power' is not one of energy, pcie"):
        GpuSampler(RecordedDevices(str(tmp_path / "h200.json")), extra=("power",))
    with pytest.raises(ConfigError, match=r"--gpu-interval must be between 0\.5 and 3600 seconds"):
        GpuSampler(RecordedDevices(str(tmp_path / "h200.json")), interval_s=0.1)
