"""`distrun bench resnet50|resnet18|mlp`: images/s and scaling efficiency, the seeds' headline table.

For each replica count (1, 2, 4, ... up to N, and N itself) a fresh
``distrun train`` of the scaling workload (``_scaling_recipe.py``: synthetic
ImageNet-shaped data made on the device, warm-up steps excluded) reports
images/s from its median step, or that its window was too short to measure
(under a second, or still warming up: its first half slower); efficiency is images/s at n over n times images/s at 1. With
``compare_ddp`` a hand-written torchrun + DDP script of the same workload runs
at N replicas in the same run, and the ratio is reported. On a cluster the rows
are 1 replica (one-device on the first worker host) and the cluster's world size
(multi-worker). This module never imports torch; the workloads do, in their own
processes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distrun.bench._runs import HERE, measurement, run_command

__all__ = ["ScalingRow", "ScalingReport", "run_scaling", "replica_counts", "SEEDS_EFFICIENCY"]

_RECIPE = HERE / "_scaling_recipe.py"
_DDP = HERE / "_scaling_ddp.py"
#: The seeds' reference: ResNet-50, batch 128 per GPU, 1 to 8 V100s at 90-95% efficiency.
SEEDS_EFFICIENCY = (0.90, 0.95)
#: Parameters of each workload (the published counts; tests/unit/test_models.py holds them).
PARAMETERS = {"resnet50": 25_557_032, "resnet18": 11_689_512}


@dataclass(frozen=True)
class ScalingRow:
    replicas: int
    images_per_s: float
    scaling_efficiency: float
    #: Why this run's figure cannot be trusted (too few seconds timed, still warming up); None: it can.
    too_short: str | None = None

    @property
    def images_per_s_per_replica(self) -> float:
        return self.images_per_s / self.replicas

    def to_dict(self) -> dict[str, float | int]:
        return {"replicas": self.replicas, "images_per_s": self.images_per_s,
                "images_per_s_per_replica": self.images_per_s_per_replica,
                "scaling_efficiency": self.scaling_efficiency, "too_short": self.too_short}


@dataclass(frozen=True)
class ScalingReport:
    model: str
    parameters: int
    device: str
    image_size: int
    batch_per_replica: int
    steps: int
    rows: tuple[ScalingRow, ...]
    ddp_images_per_s: float | None = None
    precision: str = "fp32"
    compiled: bool = False

    @property
    def note(self) -> str | None:
        """One line when a run was too short to measure (its efficiency means nothing then)."""
        short = [row for row in self.rows if row.too_short]
        if not short:
            return None
        first = short[0]
        return (f"too short to measure: at {first.replicas} replica(s) {first.too_short}; "
                f"time more steps (--steps {max(2 * self.steps, 20)}) or a bigger --batch")

    @property
    def vs_ddp(self) -> float | None:
        if self.ddp_images_per_s is None or not self.rows:
            return None
        return self.rows[-1].images_per_s / self.ddp_images_per_s

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "benchmark": "scaling", "model": self.model, "parameters": self.parameters, "device": self.device,
            "image_size": self.image_size, "batch_per_replica": self.batch_per_replica, "steps": self.steps,
            "precision": self.precision, "compile": self.compiled,
            "rows": [row.to_dict() for row in self.rows], "reference_efficiency": list(SEEDS_EFFICIENCY),
        }
        if self.note is not None:
            data["note"] = self.note
        if self.ddp_images_per_s is not None:
            data["ddp_images_per_s"] = self.ddp_images_per_s
            data["vs_ddp"] = self.vs_ddp
        return data


def replica_counts(maximum: int) -> list[int]:
    """1, 2, 4, ... below ``maximum``, then ``maximum`` itself."""
    counts, n = [], 1
    while n < maximum:
        counts.append(n)
        n *= 2
    return counts + [maximum]


def run_scaling(*, model: str, device: str, max_replicas: int, image_size: int, batch: int, steps: int,
                warmup: int, strategy: str, cluster: Path | None = None, compare_ddp: bool = False,
                precision: str | None = None, compile_model: bool = False,
                progress: Callable[[str], None] = lambda _: None) -> ScalingReport:
    """``precision`` None: bf16 on GPU, fp32 on CPU (where bf16 autocast is slower than fp32)."""
    precision = precision or ("bf16" if device == "cuda" else "fp32")
    step_flags = ["--precision", precision, *(["--compile"] if compile_model else [])]
    py = sys.executable
    env = dict(os.environ)
    workload = ["--model", model, "--image-size", str(image_size), "--batch", str(batch),
                "--steps", str(steps), "--warmup", str(warmup)]
    parameters = PARAMETERS.get(model, 0)

    def distrun(replicas: int | None, strategy_name: str) -> tuple[int, float, str | None]:
        """One `distrun train` of the workload: (replicas it ran, images/s, why too short or None)."""
        argv = [py, "-m", "distrun", "train", str(_RECIPE), "--json", "--strategy", strategy_name,
                "--device", device, *step_flags]
        if cluster is not None:
            argv += ["--cluster", str(cluster), "--no-fetch"]
        else:
            argv += ["--replicas", str(replicas)]
        _, out = run_command([*argv, "--", *workload], env)
        found = measurement(out, "scaling")
        nonlocal parameters
        parameters = int(found.get("parameters", parameters))  # type: ignore[arg-type]
        return (int(found["replicas"]), float(found["images_per_s"]),  # type: ignore[arg-type]
                found.get("too_short"))  # type: ignore[return-value]

    if cluster is not None:
        progress("1 replica (one-device on the cluster's first worker)")
        measured = [distrun(None, "one-device")]
        progress("every worker (multi-worker)")
        measured.append(distrun(None, "multi-worker"))
    else:
        measured = []
        for n in replica_counts(max_replicas):
            progress(f"{n} replica(s)")
            measured.append(distrun(n, "one-device" if n == 1 else strategy))
    base = measured[0][1]
    rows = tuple(ScalingRow(n, rate, rate / (n * base) if base else 0.0, short) for n, rate, short in measured)
    ddp = None
    if compare_ddp:
        progress(f"torchrun + DDP at {max_replicas} replica(s)")
        _, out = run_command([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={max_replicas}",
                              str(_DDP), *workload, *step_flags], {**env, "DISTRUN_BENCH_DEVICE": device})
        ddp = float(measurement(out, "scaling")["images_per_s"])  # type: ignore[arg-type]
    return ScalingReport(model, parameters, device, image_size, batch, steps, rows, ddp, precision, compile_model)
