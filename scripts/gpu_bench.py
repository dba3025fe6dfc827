"""What GPU telemetry costs the collector, per GPU sample: ``python scripts/gpu_bench.py [--gpus 8] [--ranks 8]``.

Two figures, each the median of repeated rounds:

- *sampling*: :meth:`collector.gpu.sampler.GpuSampler.sample` over every GPU, divided by the GPUs: the
  collector's own work around the NVML calls (turning them into figures), against a recorded device
  (``tests/kit/gpu_h200_recording.json``, the H200's shape, repeated to ``--gpus`` devices) so it runs
  anywhere; with ``--nvml`` against the real GPUs (then it includes NVML's own cost, which the issue measured on
  an H200: 1-6 µs per device call, 56 µs for the process list, 1.9 ms for per-process utilisation);
- *writing*: :meth:`collector.gpu.sampler.JobGpu.step` taking one new snapshot: attributing every GPU to ``--ranks``
  real processes by pid (each registered as a rank of a real segment) and writing every figure into their writer
  entries, divided by the GPUs; the collector's loop thread pays this.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from collector.gpu.nvml import NvmlDevices, RecordedDevices  # noqa: E402
from collector.gpu.sampler import GpuSampler, JobGpu  # noqa: E402
from shmstat.job.rank import RankAttachment  # noqa: E402
from shmstat.shm.segment import Segment  # noqa: E402

STORED = os.path.join(REPO, "tests", "kit", "gpu_h200_recording.json")


def _recording(path: str, gpus: int, pids: list[int]) -> None:
    """The stored recording repeated to ``gpus`` devices, the ``pids`` spread over them (810 MiB each)."""
    with open(STORED, encoding="utf-8") as f:
        doc = json.load(f)
    base = doc["devices"]
    devices = []
    for i in range(gpus):
        d = copy.deepcopy(base[i % len(base)])
        d["uuid"] = f"GPU-{uuid.UUID(int=i + 1)}"
        on = [p for j, p in enumerate(pids) if j % gpus == i]
        for frame in d["frames"]:
            frame["processes"] = [[p, 810 << 20] for p in on]
            frame["process_utilization"] = [[p, 24] for p in on]
        devices.append(d)
    doc["devices"] = devices
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def _median_us(fn, rounds: int, per: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000 / per)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--nvml", action="store_true", help="sample the real GPUs (NVML) instead of the recording")
    args = ap.parse_args()
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]) for _ in range(args.ranks)]
    job = f"gpubench-{uuid.uuid4().hex[:8]}"
    seg = Segment.open(job)
    try:
        for r, p in enumerate(sleepers):
            RankAttachment.register(seg, rank=r, local_rank=r, world_size=args.ranks, pid=p.pid)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rec.json")
            _recording(path, args.gpus, [p.pid for p in sleepers])
            devices = NvmlDevices() if args.nvml else RecordedDevices(path)
            sampler = GpuSampler(devices, interval_s=1.0)
            n = len(sampler.uuids)
            sample_us = _median_us(sampler.sample, args.rounds, n)
            job_gpu = JobGpu(seg, sampler, lambda *a: None)
            ranks = seg.ranks()
            job_gpu.step(ranks)  # the writer entries and slots are taken once: not what a sample costs

            def one() -> None:
                sampler.sample()
                job_gpu.step(ranks)

            both_us = _median_us(one, args.rounds, n)
            job_gpu.close()
            sampler.close()
        gpus = f"{n} GPU{'s' if n != 1 else ''}"
        source = f"NVML, {gpus} ({', '.join(sorted(set(sampler.names)))})" if args.nvml else f"recorded H200, {gpus}"
        print(f"GPU telemetry ({source}; {args.ranks} ranks, median of {args.rounds} rounds, "
              f"{sys.implementation.name} {sys.version.split()[0]})")
        print(f"  sampling, per GPU:                 {sample_us:8.1f} us")
        print(f"  attributing and writing, per GPU:  {both_us - sample_us:8.1f} us "
              f"({job_gpu.samples_written // max(1, args.rounds + 1) // max(1, n)} figures each)")
        print(f"  one sample of every GPU in all:    {both_us * n / 1000:8.2f} ms")
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
        seg.close()
        Segment.unlink(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
