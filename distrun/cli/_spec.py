"""From flags to a JobSpec: the recipe's defaults merged in, and how many replicas this machine
or a cluster gives a job (one per GPU, ``--tp`` x ``--pp`` ranks to a replica)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrun.config import (
    DEFAULT_CPU_REPLICAS,
    DILOCO_DEFAULTS,
    JobSpec,
    RecipeInfo,
    RecipeKind,
    StrategyName,
    inspect_recipe,
)
from distrun.errors import UsageError
from distrun.launch import visible_gpu_count

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE", "build_spec", "diloco_alone", "local_layout", "recipe_defaults", "replicas_of"]

#: Samples per step over all replicas when neither the flag nor the recipe says.
DEFAULT_GLOBAL_BATCH_SIZE = 64


def build_spec(*, recipe: Path, device: str, strategy: str, replicas: int | None, steps: int | None,
               epochs: int | None, global_batch_size: int | None, seed: int | None,
               checkpoint_dir: Path | None, gpus: int | None = None, **rest: Any) -> JobSpec:
    """Merge flags with the recipe's ``defaults`` (flags win) into a validated JobSpec.

    ``gpus``: GPUs the job may use (a cluster's); default: this machine's.
    """
    path = recipe.expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"{recipe}: recipe not found")
    info = inspect_recipe(str(path))
    name = StrategyName.parse(strategy)
    if name is StrategyName.PARAMETER_SERVER and info.kind is not RecipeKind.FIT:
        raise UsageError(f"{recipe}: --strategy parameter-server trains fit-style recipes (model, optimizer, loss, "
                         f"train_data), where the ps tasks can build the model and its optimizer; this one is a "
                         f"{info.kind.value}")
    if info.kind is RecipeKind.SCRIPT and name in (StrategyName.CENTRAL_STORAGE, StrategyName.SHARDED,
                                                   StrategyName.DILOCO):
        raise UsageError(f"{recipe}: a plain script builds its own model and loop (its own DDP or FSDP), so "
                         f"--strategy {name.value} cannot apply to it; -s mirrored (or multi-worker on a cluster) "
                         "starts its processes")
    if info.kind is RecipeKind.SCRIPT:
        step_flags = [flag for flag, used in (("--compile", rest.get("compile")),
                                              ("--precision", rest.get("precision", "fp32") != "fp32"),
                                              ("--compression", rest.get("compression", "none") != "none"),
                                              ("--clip-grad-norm", rest.get("clip_grad_norm") is not None),
                                              ("--accumulate", rest.get("accumulate", 1) != 1)) if used]
        if step_flags:
            raise UsageError(f"{recipe}: {step_flags[0]} applies to recipes distrun steps (fit-style or main(strategy)); "
                             "a plain script owns its model and loop: call torch.compile / torch.autocast / "
                             "DDP's register_comm_hook in it")
    # A custom loop gets it in strategy.options and evaluates when it says; a plain script has no options.
    if rest.get("eval_every") and (info.kind is RecipeKind.SCRIPT or (
            info.kind is RecipeKind.FIT and "eval_data" not in info.functions)):
        what = "has no eval_data(ctx)" if info.kind is RecipeKind.FIT else "is a plain script, which evaluates in its own loop"
        raise UsageError(f"{recipe}: --eval-every evaluates a fit-style recipe's eval_data, or is a custom loop's "
                         f"strategy.options.eval_every; this one {what}")
    if replicas is None and not name.distributed:
        replicas = 1
    tp, pp = rest.get("tp", 1), rest.get("pp", 1)
    split = [flag for flag, used in (("--tp", tp != 1), ("--pp", pp != 1),
                                     ("--activation-checkpointing", rest.get("activation_checkpointing", "none") != "none"))
             if used]
    if info.kind is RecipeKind.SCRIPT and split:
        raise UsageError(f"{recipe}: {split[0]} applies to recipes distrun steps (fit-style or main(strategy)); a plain "
                         "script owns its model: apply torch's parallelize_module / pipelining / checkpoint in it")
    whole = all(isinstance(v, int) and v >= 1 for v in (tp, pp))
    device, replicas = local_layout(device, replicas, visible_gpu_count() if gpus is None else gpus,
                                    ranks_per_replica=tp * pp if whole else 1)
    filled = recipe_defaults(info, steps=steps, epochs=epochs, global_batch_size=global_batch_size, seed=seed,
                             checkpoint_every=rest.pop("checkpoint_every"))
    return JobSpec.of(
        str(path),
        strategy=name,
        replicas=replicas,
        device=device,
        checkpoint_dir=str(checkpoint_dir.expanduser().resolve()) if checkpoint_dir else None,
        **filled,
        **rest,
    )


def recipe_defaults(info: RecipeInfo, *, steps: int | None, epochs: int | None, global_batch_size: int | None,
                    seed: int | None, checkpoint_every: int | None) -> dict[str, Any]:
    """The values the flags leave unset, from the recipe's ``defaults`` (flags win), else
    distrun's: ``build_spec`` uses them, and ``--print-config`` prints them."""
    defaults = dict(info.defaults)
    if steps is None and epochs is None:
        steps, epochs = defaults.get("steps"), defaults.get("epochs")
        if steps is not None:
            epochs = None
    if info.kind is RecipeKind.FIT and global_batch_size is None:  # a custom loop batches its own data
        global_batch_size = defaults.get("global_batch_size", DEFAULT_GLOBAL_BATCH_SIZE)
    return {"steps": steps, "epochs": epochs, "global_batch_size": global_batch_size,
            "seed": seed if seed is not None else defaults.get("seed", 0),
            "checkpoint_every": checkpoint_every or defaults.get("checkpoint_every")}


def local_layout(device: str, replicas: int | None, gpus: int, *, ranks_per_replica: int = 1) -> tuple[str, int]:
    """(device, replicas) from ``--device`` and ``--replicas`` on a machine with ``gpus`` GPUs:
    auto means a GPU if any; replicas default to one per GPU, else DEFAULT_CPU_REPLICAS. A
    replica of several ranks (``--tp``) takes that many GPUs, and defaults to one replica on CPU."""
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    elif device == "cuda" and not gpus:
        raise UsageError("--device cuda: no GPU found on this machine (CUDA_VISIBLE_DEVICES and the NVIDIA driver)")
    elif device not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected auto, cpu or cuda. Received: {device!r}")
    if replicas is None:
        if device != "cuda":
            replicas = DEFAULT_CPU_REPLICAS if ranks_per_replica == 1 else 1
        elif gpus < ranks_per_replica:
            raise UsageError(f"--tp x --pp = {ranks_per_replica}: a replica takes {ranks_per_replica} GPUs, and this "
                             f"machine has {gpus}")
        else:
            replicas = gpus // ranks_per_replica
    elif device == "cuda" and replicas * ranks_per_replica > gpus:
        ranks = f" x {ranks_per_replica} ranks" if ranks_per_replica > 1 else ""
        raise UsageError(f"--replicas {replicas}{ranks}: only {gpus} GPU(s) found on this machine")
    return device, replicas


def replicas_of(slots: int, per_replica: int, source: Any) -> int:
    """A cluster's replicas: its worker slots, ``--tp`` x ``--pp`` ranks to a replica."""
    if per_replica > 1 and slots % per_replica:
        raise UsageError(f"--tp x --pp = {per_replica}: {source} has {slots} worker slot(s), which do not split into "
                         f"replicas of {per_replica} ranks; give the workers a multiple of {per_replica} slots")
    return slots // per_replica if per_replica > 1 else slots


def diloco_alone(spec: JobSpec) -> tuple[JobSpec, str | None]:
    """``--strategy diloco`` with one replica is one-device (its outer step would only rescale its
    own steps): the spec it runs as, and the note that says so (None for any other job)."""
    if spec.strategy.name is not StrategyName.DILOCO or spec.strategy.replicas != 1 or spec.strategy.elastic:
        return spec, None  # --elastic: the one replica may be joined by others; it stays diloco
    plain = spec.replace(strategy=StrategyName.ONE_DEVICE, **DILOCO_DEFAULTS)
    return plain, ("note: --strategy diloco with one replica is one-device training (no other replica to "
                   "sync with): running --strategy one-device")
