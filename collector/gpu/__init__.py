"""GPU telemetry per rank: what the collector samples of every GPU of the node and writes, per rank, as stats.

- :mod:`~collector.gpu.figures`: the figures, written as stats of group ``gpu`` (names, units, dcgm-exporter
  twins);
- :mod:`~collector.gpu.sampler`: ``GpuSampler``, every GPU sampled in a thread of its own, and ``JobGpu``, one
  job's side: GPUs attributed to ranks, each rank's figures written into the job's segment;
- :mod:`~collector.gpu.nvml`: the few NVML calls the collector makes, behind one small interface (``GpuDevices``),
  and a recorded device for tests.

The modules are imported by name.
"""

from __future__ import annotations

__all__: list[str] = []
