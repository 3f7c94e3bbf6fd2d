"""Facts about the host for `status`: CPUs, memory, load, GPUs. psutil, never torch.

The GPUs' utilisation and memory come from NVML (``pynvml``, the optional ``gpu`` extra),
imported on first use and opened once per server; without it the answer says why there are
none, so that a page can tell "no GPU" from "not asked"."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading
import time
from typing import Any

import psutil

from distrun.launch import visible_gpu_count
from distrun.protocol.cluster import GpuReading

_NVIDIA_SMI_TIMEOUT_S = 5.0


def gpu_names() -> tuple[str, ...]:
    """GPU model names from nvidia-smi (empty without the NVIDIA driver), limited to the visible ones."""
    count = visible_gpu_count()
    smi = shutil.which("nvidia-smi")
    if count == 0 or smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return tuple("GPU" for _ in range(count))
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return tuple(names[:count]) if names else tuple("GPU" for _ in range(count))


def host_facts() -> dict[str, object]:
    memory = psutil.virtual_memory()
    return {
        "cpu_count": os.cpu_count() or 1,
        "memory_total_bytes": int(memory.total),
        "memory_available_bytes": int(memory.available),
        "load_1m": float(os.getloadavg()[0]),
        "cpu_pct": _CPU.percent(),
    }


#: Callers of ``status`` closer together than this share one CPU reading.
_CPU_MIN_INTERVAL_S = 0.5


class _CpuUse:
    """The host's CPU use over every core since the server's last ``status`` (psutil's
    ``interval=None``: no sleep in the answer); None on the first, which has no interval yet.
    Callers closer together than :data:`_CPU_MIN_INTERVAL_S` (the CLI, two dashboards) share
    the last reading: psutil's over a few milliseconds is noise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_at: float | None = None  # monotonic
        self._last: float | None = None

    def percent(self) -> float | None:
        with self._lock:
            now = time.monotonic()
            if self._read_at is not None and now - self._read_at < _CPU_MIN_INTERVAL_S:
                return self._last
            value = float(psutil.cpu_percent(interval=None))
            self._last = value if self._read_at is not None else None
            self._read_at = now
            return self._last


_CPU = _CpuUse()


def gpu_readings() -> tuple[tuple[GpuReading, ...], str | None]:
    """Every GPU NVML sees on this host, read now, and why there are none (None when there are some)."""
    nvml, why = _nvml()
    if nvml is None:
        return (), why
    readings = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append(GpuReading(index, name.decode() if isinstance(name, bytes) else str(name),
                                       float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                                       int(memory.used), int(memory.total)))
    except Exception as exc:  # noqa: BLE001 - NVMLError and kin: say so, never fail `status`
        return tuple(readings), f"NVML failed: {exc}"
    return tuple(readings), None if readings else "NVML found none"


@functools.lru_cache(maxsize=1)
def _nvml() -> tuple[Any, str | None]:
    """pynvml, initialised once; or None and why (no package, no driver library)."""
    try:
        import pynvml
    except ImportError:
        return None, "NVML not found: no pynvml (pip install 'distrun[gpu]')"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None, f"NVML not found: {exc}"
    return pynvml, None
