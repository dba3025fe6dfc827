"""The GPUs as the collector sees them: the few NVML calls it makes, behind one small interface.

:class:`GpuDevices` is that interface, one method per NVML call (a device is its NVML index). Two things
implement it: :class:`NvmlDevices`, NVML itself through ``pynvml`` (the ``nvidia-ml-py`` package, the extra
``shmstat[gpu]``; imported only here and only when a collector turns GPU telemetry on, never on the rank side),
and :class:`RecordedDevices`, a device played back from a recording (JSON), so the whole path runs where there
is no GPU (CI). :func:`open_devices` picks one: the recording named by :data:`RECORDING_ENV` if set, else NVML.

A method returns None where the device does not support the figure (NVML's ``NOT_SUPPORTED``, ``NO_PERMISSION``,
a process's memory NVML cannot see); anything else NVML raises (a GPU lost) goes up to the sampler, which counts
it and says it once.

What the calls cost, measured on an H200 (driver 580.159.04, 4 processes on the GPU): 1-6 µs each for
utilisation, memory, power, temperature, SM clock and throttle reasons; 56 µs for the process list, 1.9 ms for
per-process utilisation; 3.7 ms for total energy and 20.8 ms for PCIe throughput (these two only with
``--gpu-extra``); ``nvmlInit`` 12 ms.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Protocol

from shmstat.errors import ConfigError

__all__ = ["RECORDING_ENV", "GpuDevices", "NvmlDevices", "RecordedDevices", "driver_present", "open_devices"]

RECORDING_ENV = "SHMSTAT_GPU_RECORDING"
"""Set to the path of a recording (see :class:`RecordedDevices`): the collector samples that instead of NVML (for
tests, and for trying the GPU views on a machine without a GPU)."""


class GpuDevices(Protocol):
    """The NVML calls the GPU sampler makes; None where the device does not support a figure."""

    driver: str
    """The driver version, as NVML says it."""

    def count(self) -> int:
        """How many GPUs (``nvmlDeviceGetCount``)."""

    def uuid(self, i: int) -> str:
        """The GPU's UUID (``GPU-...``)."""

    def name(self, i: int) -> str:
        """The product name."""

    def utilization(self, i: int) -> tuple[int, int] | None:
        """(GPU %, memory %) over NVML's last sample period (``nvmlDeviceGetUtilizationRates``)."""

    def memory(self, i: int) -> tuple[int, int] | None:
        """(used, total) framebuffer bytes (``nvmlDeviceGetMemoryInfo``)."""

    def power_mw(self, i: int) -> int | None:
        """Power drawn, mW (``nvmlDeviceGetPowerUsage``)."""

    def temperature_c(self, i: int) -> int | None:
        """GPU temperature, degrees C."""

    def sm_clock_mhz(self, i: int) -> int | None:
        """SM clock, MHz."""

    def throttle_reasons(self, i: int) -> int | None:
        """The clock throttle (event) reasons bit mask."""

    def processes(self, i: int) -> list[tuple[int, int | None]]:
        """(pid, bytes of GPU memory it holds, None if NVML cannot say) of every compute process on the GPU
        (``nvmlDeviceGetComputeRunningProcesses``)."""

    def process_utilization(self, i: int) -> list[tuple[int, int]] | None:
        """(pid, SM %) of the processes NVML sampled on the GPU since the previous call
        (``nvmlDeviceGetProcessUtilization``); empty when none ran a kernel, None where it is not supported."""

    def energy_mj(self, i: int) -> int | None:
        """Energy used since the driver loaded, mJ (expensive: 3.7 ms on an H200)."""

    def pcie_kbps(self, i: int) -> tuple[int, int] | None:
        """(sent, received) PCIe KB/s (expensive: 20.8 ms on an H200)."""

    def close(self) -> None:
        """Release NVML."""


def driver_present() -> bool:
    """Whether an NVIDIA driver is loaded on this machine (so a GPU telemetry that cannot start is worth a word)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def open_devices() -> GpuDevices:
    """The GPUs to sample: the recording :data:`RECORDING_ENV` names if set, else NVML. Raises
    :class:`ConfigError` (one sentence saying why) when there is nothing to sample: ``nvidia-ml-py`` missing,
    NVML not loadable, no GPU."""
    path = os.environ.get(RECORDING_ENV)
    if path:
        return RecordedDevices(path)
    return NvmlDevices()


class NvmlDevices:
    """NVML through ``pynvml`` (``pip install 'shmstat[gpu]'``). Construct to initialise NVML (12 ms on an H200);
    raises :class:`ConfigError` when NVML cannot be used or finds no GPU."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise ConfigError("nvidia-ml-py is not installed (pip install 'shmstat[gpu]')") from None
        self._nv: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise ConfigError(f"NVML cannot start ({exc})") from None
        try:
            n = pynvml.nvmlDeviceGetCount()
            if n == 0:
                raise ConfigError("NVML finds no GPU")
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except BaseException:
            self.close()
            raise
        self._seen_us = [0] * n
        self._unsupported = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION}
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            if getattr(exc, "value", None) in self._unsupported:
                return None
            raise

    def count(self) -> int:
        """How many GPUs."""
        return len(self._handles)

    def uuid(self, i: int) -> str:
        """The GPU's UUID."""
        return _text(self._nv.nvmlDeviceGetUUID(self._handles[i]))

    def name(self, i: int) -> str:
        """The product name."""
        return _text(self._nv.nvmlDeviceGetName(self._handles[i]))

    def utilization(self, i: int) -> tuple[int, int] | None:
        """(GPU %, memory %)."""
        rates = self._call(self._nv.nvmlDeviceGetUtilizationRates, self._handles[i])
        return None if rates is None else (int(rates.gpu), int(rates.memory))

    def memory(self, i: int) -> tuple[int, int] | None:
        """(used, total) bytes."""
        info = self._call(self._nv.nvmlDeviceGetMemoryInfo, self._handles[i])
        return None if info is None else (int(info.used), int(info.total))

    def power_mw(self, i: int) -> int | None:
        """Power, mW."""
        return self._call(self._nv.nvmlDeviceGetPowerUsage, self._handles[i])

    def temperature_c(self, i: int) -> int | None:
        """Temperature, C."""
        return self._call(self._nv.nvmlDeviceGetTemperature, self._handles[i], self._nv.NVML_TEMPERATURE_GPU)

    def sm_clock_mhz(self, i: int) -> int | None:
        """SM clock, MHz."""
        return self._call(self._nv.nvmlDeviceGetClockInfo, self._handles[i], self._nv.NVML_CLOCK_SM)

    def throttle_reasons(self, i: int) -> int | None:
        """Throttle reasons mask."""
        return self._call(self._reasons, self._handles[i])

    def processes(self, i: int) -> list[tuple[int, int | None]]:
        """(pid, bytes held) of the compute processes."""
        procs = self._call(self._nv.nvmlDeviceGetComputeRunningProcesses, self._handles[i]) or []
        return [(int(p.pid), _bytes_held(p.usedGpuMemory)) for p in procs]

    def process_utilization(self, i: int) -> list[tuple[int, int]] | None:
        """(pid, SM %) sampled since the previous call."""
        try:
            samples = self._call(self._nv.nvmlDeviceGetProcessUtilization, self._handles[i], self._seen_us[i])
        except self._nv.NVMLError as exc:
            if getattr(exc, "value", None) == self._nv.NVML_ERROR_NOT_FOUND:
                return []  # no process ran a kernel since the previous call
            raise
        if samples is None:
            return None
        out = []
        for s in samples:
            self._seen_us[i] = max(self._seen_us[i], int(s.timeStamp))
            out.append((int(s.pid), int(s.smUtil)))
        return out

    def energy_mj(self, i: int) -> int | None:
        """Energy since the driver loaded, mJ."""
        return self._call(self._nv.nvmlDeviceGetTotalEnergyConsumption, self._handles[i])

    def pcie_kbps(self, i: int) -> tuple[int, int] | None:
        """(sent, received) KB/s."""
        tx = self._call(self._nv.nvmlDeviceGetPcieThroughput, self._handles[i], self._nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call(self._nv.nvmlDeviceGetPcieThroughput, self._handles[i], self._nv.NVML_PCIE_UTIL_RX_BYTES)
        return None if tx is None or rx is None else (int(tx), int(rx))

    def close(self) -> None:
        """``nvmlShutdown``."""
        with contextlib.suppress(self._nv.NVMLError):
            self._nv.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes_held(value: int | None) -> int | None:
    """A process's memory as NVML gives it: None when NVML cannot say (``NVML_VALUE_NOT_AVAILABLE``, all ones)."""
    if value is None or value < 0 or value >= (1 << 64) - 1:
        return None
    return int(value)


class RecordedDevices:
    """GPUs played back from a recording: a JSON object ``{"driver": str, "devices": [DEVICE, ...]}``, each
    DEVICE ``{"uuid", "name", "memory_total" (bytes), "frames": [FRAME, ...]}`` and each FRAME ``{"util",
    "mem_util" (%), "memory_used" (bytes), "power_mw", "temperature_c", "sm_clock_mhz", "throttle_reasons",
    "energy_mj", "pcie_tx_kbps", "pcie_rx_kbps", "processes": [[pid, bytes or null], ...],
    "process_utilization": [[pid, sm %], ...]}``; a figure absent from a frame is one the device does not support.

    A device moves to its next frame (after the last, back to the first) each time its utilisation is read: the
    sampler reads it first in every sample. Raises :class:`ConfigError` for a file it cannot read."""

    def __init__(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            self.driver = str(doc.get("driver", "recorded"))
            self._devices: list[dict[str, Any]] = list(doc["devices"])
            for d in self._devices:
                if not d["frames"]:
                    raise ValueError(f"device {d['uuid']} has no frame")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{RECORDING_ENV}={path!r} is not a GPU recording ({exc})") from None
        self.path = path
        self._frame = [-1] * len(self._devices)

    def _now(self, i: int) -> dict[str, Any]:
        frames = self._devices[i]["frames"]
        return frames[max(self._frame[i], 0) % len(frames)]

    def count(self) -> int:
        """How many devices the recording holds."""
        return len(self._devices)

    def uuid(self, i: int) -> str:
        """The recorded UUID."""
        return str(self._devices[i]["uuid"])

    def name(self, i: int) -> str:
        """The recorded product name."""
        return str(self._devices[i].get("name", "recorded GPU"))

    def utilization(self, i: int) -> tuple[int, int] | None:
        """The next frame's (GPU %, memory %)."""
        self._frame[i] += 1
        f = self._now(i)
        return None if "util" not in f else (int(f["util"]), int(f.get("mem_util", 0)))

    def memory(self, i: int) -> tuple[int, int] | None:
        """(used, total) bytes."""
        f = self._now(i)
        return None if "memory_used" not in f else (int(f["memory_used"]), int(self._devices[i]["memory_total"]))

    def power_mw(self, i: int) -> int | None:
        """Power, mW."""
        return self._now(i).get("power_mw")

    def temperature_c(self, i: int) -> int | None:
        """Temperature, C."""
        return self._now(i).get("temperature_c")

    def sm_clock_mhz(self, i: int) -> int | None:
        """SM clock, MHz."""
        return self._now(i).get("sm_clock_mhz")

    def throttle_reasons(self, i: int) -> int | None:
        """Throttle reasons mask."""
        return self._now(i).get("throttle_reasons")

    def processes(self, i: int) -> list[tuple[int, int | None]]:
        """The recorded compute processes."""
        return [(int(pid), None if used is None else int(used)) for pid, used in self._now(i).get("processes", [])]

    def process_utilization(self, i: int) -> list[tuple[int, int]] | None:
        """The recorded per-process SM % (None when the frame has none: not supported)."""
        samples = self._now(i).get("process_utilization")
        return None if samples is None else [(int(pid), int(sm)) for pid, sm in samples]

    def energy_mj(self, i: int) -> int | None:
        """Energy, mJ."""
        return self._now(i).get("energy_mj")

    def pcie_kbps(self, i: int) -> tuple[int, int] | None:
        """(sent, received) KB/s."""
        f = self._now(i)
        return None if "pcie_tx_kbps" not in f else (int(f["pcie_tx_kbps"]), int(f["pcie_rx_kbps"]))

    def close(self) -> None:
        """Nothing to release."""
