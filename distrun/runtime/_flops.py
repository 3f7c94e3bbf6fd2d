"""Peak dense FLOP/s of the GPUs distrun knows, for MFU (model FLOPs utilisation).

MFU is the model's FLOPs per second over what the devices could do at the job's precision:
dense tensor-core figures for bf16/fp16 and TF32 (no 2:4 sparsity), the CUDA cores' figure
for fp32 when torch does not let matmuls use TF32 (its default). From NVIDIA's datasheets;
an unknown device gives None, and no MFU is shown rather than a made-up one.
"""

from __future__ import annotations

import torch

__all__ = ["peak_flops"]

_TERA = 1e12
#: name fragment -> (bf16/fp16, tf32, fp32) dense TFLOP/s; the first fragment found in the name wins.
_PEAKS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100", (989.4, 494.7, 66.9)),  # SXM5
    ("H200", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's dense peak at ``precision`` (fp32, bf16, fp16); None off a known GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (half, tf32, fp32) in _PEAKS:
        if fragment in name:
            if precision in ("bf16", "fp16"):
                return half * _TERA
            uses_tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
            return (tf32 if uses_tf32 else fp32) * _TERA
    return None
