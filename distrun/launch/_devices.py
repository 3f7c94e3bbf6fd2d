"""Counting GPUs without importing torch (the control plane never imports it)."""

from __future__ import annotations

import os

_NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def visible_gpu_count(environ: dict[str, str] | None = None, proc_dir: str = _NVIDIA_PROC) -> int:
    """GPUs the NVIDIA driver exposes, limited by CUDA_VISIBLE_DEVICES when it is set."""
    env = os.environ if environ is None else environ
    try:
        physical = len(os.listdir(proc_dir))
    except OSError:
        physical = 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    entries = [item.strip() for item in visible.split(",") if item.strip()]
    # CUDA stops at the first invalid entry; "-1" is the idiom for "no GPU".
    count = 0
    for item in entries:
        if item.startswith("-"):
            break
        count += 1
    return min(count, physical)
