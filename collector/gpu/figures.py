"""The GPU figures the collector writes as stats of group ``gpu``: their names, units and dcgm-exporter twins.

The collector (:mod:`collector.gpu.sampler`) samples each GPU with NVML and writes every figure as a stat of the
group :data:`GPU_GROUP` named ``gpu<index>.<figure>`` (``gpu0.util``, ``gpu3.fb_used``), in a writer entry of
each rank the GPU is attributed to: per rank, the GPU(s) that rank uses; merged across the ranks sharing a GPU,
that GPU. Every sink carries them like any stat; ``/metrics`` also shows each figure as one family
``shmstat_gpu_<figure>`` with ``gpu``, ``uuid`` and ``rank`` labels (:mod:`collector.prometheus.exporter`). The
units are dcgm-exporter's, so a dashboard written for ``DCGM_FI_DEV_FB_USED`` reads ``shmstat_gpu_fb_used`` the
same way.

Device figures are the GPU's whatever rank looks at it; ``proc_*`` figures are the rank's own processes on it
(the rank and its children), present only when the rank was matched to the GPU by pid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shmstat.aggregation import Aggregation

__all__ = [
    "FIGURES",
    "GPU_GROUP",
    "THROTTLE_REASONS",
    "GpuFigure",
    "figure_of",
    "is_gpu_stat",
    "stat_name",
    "throttle_names",
]

GPU_GROUP = "gpu"
"""The group of the GPU figures."""


@dataclass(frozen=True)
class GpuFigure:
    """One figure sampled per GPU: its stat name part, unit, dcgm-exporter twin and how it is aggregated."""

    name: str
    """The part after ``gpu<index>.`` in the stat name, and after ``shmstat_gpu_`` in the Prometheus family."""
    unit: str
    dcgm: str
    """The dcgm-exporter field holding the same figure in the same unit ("" when it has none)."""
    help: str
    latest: bool = False
    """Exported as the window's latest sample (a bit mask, a running total) rather than its mean."""
    extra: str = ""
    """The ``--gpu-extra`` choice that turns this figure on (an expensive NVML call); "" for always sampled."""
    per_process: bool = False
    """A figure of the rank's own processes on the GPU, not of the whole GPU."""

    @property
    def aggregations(self) -> tuple[Aggregation, ...]:
        """What its stat keeps per window: the latest sample and the maximum for a mask or a running total, else
        mean, minimum and maximum."""
        if self.latest:
            return (Aggregation.VALUE, Aggregation.MAX)
        return (Aggregation.MEAN, Aggregation.MIN, Aggregation.MAX)

    @property
    def family(self) -> str:
        """Its Prometheus family."""
        return f"shmstat_gpu_{self.name}"


FIGURES: dict[str, GpuFigure] = {f.name: f for f in (
    GpuFigure("util", "%", "DCGM_FI_DEV_GPU_UTIL", "GPU utilisation: share of time a kernel ran (NVML)"),
    GpuFigure("mem_copy_util", "%", "DCGM_FI_DEV_MEM_COPY_UTIL", "memory utilisation: share of time memory was "
              "read or written (NVML)"),
    GpuFigure("fb_used", "MiB", "DCGM_FI_DEV_FB_USED", "framebuffer memory used, MiB"),
    GpuFigure("fb_total", "MiB", "DCGM_FI_DEV_FB_TOTAL", "framebuffer memory in all, MiB"),
    GpuFigure("power_usage", "W", "DCGM_FI_DEV_POWER_USAGE", "power drawn, W"),
    GpuFigure("temp", "C", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature, degrees C"),
    GpuFigure("sm_clock", "MHz", "DCGM_FI_DEV_SM_CLOCK", "SM clock, MHz"),
    GpuFigure("clock_throttle_reasons", "mask", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
              "clock throttle reasons, NVML's bit mask (latest sample)", latest=True),
    GpuFigure("throttled", "1", "", "1 while the clocks are held down (power cap, thermal, hardware slowdown, sync "
              "boost; not idle or application clocks): the mean is the share of samples throttled"),
    GpuFigure("total_energy", "mJ", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
              "energy used since the driver loaded, mJ (latest sample; --gpu-extra energy)", latest=True,
              extra="energy"),
    GpuFigure("pcie_tx", "KB/s", "DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "PCIe sent, KB/s (--gpu-extra pcie)",
              extra="pcie"),
    GpuFigure("pcie_rx", "KB/s", "DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "PCIe received, KB/s (--gpu-extra pcie)",
              extra="pcie"),
    GpuFigure("proc_fb_used", "MiB", "", "memory the rank's processes hold on the GPU, MiB", per_process=True),
    GpuFigure("proc_sm_util", "%", "", "SM utilisation of the rank's processes on the GPU", per_process=True),
)}
"""Every figure, by name."""

THROTTLE_REASONS: dict[int, str] = {
    0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks",
}
"""NVML's clock throttle reason bits (``nvmlClocksThrottleReason*``) by the names the collector reports."""

NOT_THROTTLING = 0x1 | 0x2 | 0x100
"""Reasons that hold the clocks down without slowing work: idle, application clocks, display clocks."""


def throttle_names(mask: int) -> list[str]:
    """The reasons set in NVML's mask, by name (an unknown bit as ``0x...``)."""
    out = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    if rest:
        out.append(hex(rest))
    return out


def stat_name(index: int, figure: str) -> str:
    """The stat name of ``figure`` for GPU ``index`` (``gpu0.util``)."""
    return f"gpu{index}.{figure}"


_STAT = re.compile(r"gpu(\d+)\.([a-z_]+)")


def figure_of(group: str, name: str) -> tuple[int, GpuFigure] | None:
    """``(gpu index, figure)`` of a stat the collector writes, None for any other stat (a rank's own stats in a
    group called ``gpu`` included)."""
    if group != GPU_GROUP:
        return None
    m = _STAT.fullmatch(name)
    if m is None:
        return None
    fig = FIGURES.get(m.group(2))
    return None if fig is None else (int(m.group(1)), fig)


def is_gpu_stat(group: str, name: str) -> bool:
    """Whether ``group/name`` is a GPU figure the collector writes."""
    return figure_of(group, name) is not None
