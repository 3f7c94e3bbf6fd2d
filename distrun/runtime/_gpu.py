"""GPU figures for the live view: utilisation and memory from NVML, else torch's own.

NVML (the ``nvidia-ml-py`` package, the ``gpu`` extra) reads what ``nvidia-smi`` shows:
the device's utilisation over the last sample period and its memory in use, so a rank
that is starved (input-bound, waiting in a collective) shows as a low percentage. Without
the package, or when NVML cannot be opened (a container without the driver's library),
utilisation is unknown and memory falls back to torch's peak allocation in this process.
The device is found by UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering cannot mix devices.
Read only when a step event is sent (throttled), so it costs nothing per step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GpuProbe"]


class GpuProbe:
    """One CUDA device's (utilisation %, memory MB); utilisation is None without NVML."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self._handle: Any = None
        self._nvml: Any = None
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no package, no driver library, an old driver: torch's figure
            self._handle = None

    def sample(self) -> tuple[float | None, float]:
        if self._handle is not None:
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                used = float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / 2**20
                return util, used
            except Exception:  # noqa: BLE001 - a transient NVML error: fall back for this sample
                pass
        import torch

        return None, torch.cuda.max_memory_allocated(self._device) / 2**20
