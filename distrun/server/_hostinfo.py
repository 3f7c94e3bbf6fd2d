"""Facts about the host for `status`: CPUs, memory, load, GPUs. psutil, never torch."""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil

from distrun.launch import visible_gpu_count

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
    }
