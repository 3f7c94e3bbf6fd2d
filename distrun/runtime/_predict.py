"""``distrun predict``: a checkpoint's model over the recipe's ``predict_data``, on every replica.

Keras's ``model.predict`` and Lightning's ``Trainer.predict``, under any strategy. It reuses
what evaluation already does right, so predictions and evaluations split data alike:

* the checkpoint goes in through the strategy's own restore hooks, so either format (plain or
  sharded) loads at any world size, into any layout, and a checkpoint of another model is the
  same one line as ``--resume``'s (``restore`` itself is not called: it takes only the newest
  checkpoint, and positions the training data);
* each replica takes a strided share of the map-style dataset (``strategy.eval_shard``: no
  padding, no duplicates), and where a forward is a collective (sharded, ``--tp``/``--pp``) a
  replica with fewer batches runs extra forwards it throws away, as evaluation does;
* rows reach rank 0 as tensors (``torch.distributed``: one small all-gather of their shapes,
  then one gather of the rows), never pickled, and rank 0 puts each back at its index.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from distrun.config import JobSpec, PredictSpec
from distrun.errors import CheckpointError, RecipeError, TrainingError
from distrun.runtime._fit import _default_forward
from distrun.runtime._move import batch_len, to_device
from distrun.runtime._reporter import EventReporter
from distrun.strategies import InputContext, Strategy, latest_checkpoint
from distrun.strategies.checkpoint import layout, shards
from distrun.strategies.checkpoint.mismatch import describe_mismatch
from distrun.strategies.data.plan import is_map_style

__all__ = ["predict"]

#: Row dtypes that cross the gather; a code each in the shapes' all-gather.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 6  # a row's dimensions after the batch's


def predict(recipe: ModuleType, strategy: Strategy, spec: JobSpec, reporter: EventReporter, job: PredictSpec) -> int:
    """Run the prediction on this rank; rank 0 writes ``job.output``. Returns the batches this rank ran."""
    if not hasattr(recipe, "predict_data"):
        raise RecipeError(f"{spec.recipe}: distrun predict needs predict_data(ctx) in the recipe (a map-style "
                          "dataset of the samples to predict, in order)")
    step_fn = getattr(recipe, "predict_step", None) or getattr(recipe, "forward", _default_forward)
    if spec.parallel.pp > 1 and step_fn is not _default_forward:
        raise RecipeError(f"{spec.recipe}: --pp runs the model as a chain of stages fed batch[0]; a recipe "
                          "predict_step or forward cannot be split into them: drop it, or put its work in pp_chain")
    global_batch_size = spec.training.global_batch_size or 32 * strategy.num_replicas
    torch.manual_seed(spec.training.seed)  # identical initial parameters, as fit's
    reporter.during = "building the model"
    with strategy.scope():
        model = recipe.model()
        optimizer = recipe.optimizer(model.parameters()) if hasattr(recipe, "optimizer") else None
    reporter.during = "preparing the model for the strategy"
    strategy.prepare(model, optimizer)
    reporter.during = "loading the checkpoint"
    path = _load(strategy, job.checkpoint, spec.checkpoint.dir)
    reporter.during = "loading the data"
    ctx = InputContext(strategy.num_replicas, strategy.replica_id, global_batch_size, spec.training.seed)
    dataset = recipe.predict_data(ctx)
    if not is_map_style(dataset):
        raise RecipeError(f"{spec.recipe}: predict_data(ctx) must return a map-style dataset (__len__ and "
                          f"__getitem__), so that each output lands at its sample's index; got {type(dataset).__name__}")
    index, count = strategy.eval_shard
    mine = list(range(index, len(dataset), count))
    batches = DataLoader(Subset(dataset, mine), batch_size=max(1, global_batch_size // strategy.num_replicas))
    reporter.total_steps = len(batches)
    extra = strategy.eval_forwards_to_match(len(batches))
    reporter.during = None
    rows: list[torch.Tensor] = []
    keeps = strategy.updates_metrics
    with strategy.evaluating() as compute, torch.no_grad():
        compute.eval()
        last = None
        for step, batch in enumerate(batches, 1):
            reporter.step_started(step)
            batch = to_device(batch, strategy.device)
            outputs = strategy.eval_outputs(compute, step_fn, batch)
            last = batch
            if outputs is not None and keeps:
                rows.append(_rows(outputs, batch_len(batch), spec.recipe))
            reporter.step(step, 0, None, batch_len(batch))
        if extra and last is None:  # this replica's share is empty: any sample makes a forward
            last = to_device(next(iter(DataLoader(Subset(dataset, [0]), batch_size=1))), strategy.device)
        for _ in range(extra):  # only keep a collective forward in step with the other replicas
            strategy.eval_outputs(compute, step_fn, last)
    reporter.during = "gathering the outputs"
    mine_out = torch.cat(rows) if rows else None
    outputs = _gather(mine_out, index if keeps else -1, len(dataset), count, strategy.device, spec.recipe)
    if outputs is not None:
        reporter.during = "writing the outputs"
        _write(job.output, {"outputs": outputs, "checkpoint": str(path)})
    reporter.during = None
    return len(batches)


def _load(strategy: Any, checkpoint: str | None, directory: str | None) -> Path:
    """The checkpoint (``--checkpoint``, else the newest in ``directory``) loaded through the
    strategy's restore hooks, so that every format reaches every layout."""
    if checkpoint is not None:
        def find() -> Path | None:
            return Path(checkpoint) if Path(checkpoint).exists() else None
        missing = f"--checkpoint {checkpoint}: no such file or folder"
    else:
        def find() -> Path | None:
            return latest_checkpoint(directory) if directory else None
        missing = (f"{directory}: no checkpoint to predict with (expected ckpt-<step>.pt or ckpt-<step>/ on the "
                   "chief's host; or pass a checkpoint on the client with --checkpoint: it is shipped)")
    # One checkpoint for every rank: a host without it receives a plain one from the rank that has it.
    path, received = strategy.agreed_checkpoint(find)
    if path is None:
        raise CheckpointError(missing)
    if shards.is_sharded(path):
        _same_shapes(strategy, path)
    # restore's own hooks (see the module's docstring)
    data = received if received is not None else strategy._read_checkpoint(path)  # noqa: SLF001
    try:
        strategy._load_checkpoint(path, data)  # noqa: SLF001
    except RuntimeError as exc:  # another model's checkpoint: say which keys and shapes differ
        mismatch = describe_mismatch(exc)
        if mismatch is None:
            raise
        raise CheckpointError(f"{path}: not a checkpoint of this model: {mismatch}") from None
    strategy._after_restore()  # noqa: SLF001 - central-storage's compute copy, diloco's global copy
    return path


def _same_shapes(strategy: Any, path: Path) -> None:
    """A sharded checkpoint of another model, said as a plain one's is (DCP's own error names no
    key): its index's shapes against the model's whole ones. A pipeline stage holds only part of
    the model, so ``--tp``/``--pp`` give the whole model's shapes from before the split (every rank
    the same: each says it, none waits in DCP's load for one that stopped)."""
    from distrun.strategies.checkpoint.shard_reader import read_index  # DCP: only for a sharded checkpoint

    saved = {key[len(layout.MODEL):]: list(entry.size) for key, entry in read_index(path).state_dict_metadata.items()
             if key.startswith(layout.MODEL)}
    whole = getattr(strategy, "whole_shapes", None)
    model = whole() if whole is not None else {key: list(value.shape) for key, value in strategy.unwrap().state_dict().items()}
    sizes = [f"{key} (checkpoint {saved[key]}, model {shape})".replace("'", "")
             for key, shape in model.items() if key in saved and saved[key] != shape]
    parts = [f"size mismatch for {', '.join(sizes[:3])}"] if sizes else []
    for kind, keys in (("missing", [k for k in model if k not in saved]), ("unexpected", [k for k in saved if k not in model])):
        if keys:
            parts.append(f"{kind} keys: {', '.join(keys[:3])}")
    if parts:
        raise CheckpointError(f"{path}: not a checkpoint of this model: {'; '.join(parts)}")


def _rows(outputs: Any, samples: int, recipe: str) -> torch.Tensor:
    """One batch's outputs as rows: a tensor whose first dimension is the batch's."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() == 0 or outputs.shape[0] != samples:
        what = f"a tensor of shape {tuple(outputs.shape)}" if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise RecipeError(f"{recipe}: predict_step (or the forward) must return a tensor with one row per sample "
                          f"({samples} in this batch); it returned {what}")
    if outputs.dtype not in _DTYPES or outputs.dim() - 1 > _MAX_DIMS:
        raise RecipeError(f"{recipe}: predict outputs of dtype {outputs.dtype} with {outputs.dim()} dimensions "
                          f"cannot be gathered; return one of {len(_DTYPES)} plain dtypes, at most {_MAX_DIMS + 1} dims")
    return outputs.detach()


def _gather(mine: torch.Tensor | None, shard: int, total: int, replicas: int, device: torch.device,
            recipe: str) -> torch.Tensor | None:
    """Every replica's rows on rank 0, each at its sample's index (None on the other ranks).

    ``shard``: this rank's share (rows ``shard, shard + replicas, ...``), or -1 for a rank whose
    rows another rank of its replica sends."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _place([(shard, mine)], total, replicas, mine, recipe)
    meta = torch.full((4 + _MAX_DIMS,), -1, dtype=torch.int64)
    meta[0], meta[1] = shard, 0 if mine is None else mine.shape[0]
    if mine is not None:
        meta[2], meta[3] = mine.dim() - 1, _DTYPES.index(mine.dtype)
        meta[4:4 + mine.dim() - 1] = torch.tensor(mine.shape[1:], dtype=torch.int64)
    metas = [torch.empty_like(meta, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(metas, meta.to(device))
    table = [m.cpu().tolist() for m in metas]
    shaped = [m for m in table if m[2] >= 0]
    if not shaped:  # nothing to predict anywhere
        return torch.empty(0) if dist.get_rank() == 0 else None
    kinds = {(m[2], m[3], tuple(m[4:4 + m[2]])) for m in shaped}
    if len(kinds) > 1:
        raise RecipeError(f"{recipe}: predict outputs differ in shape or dtype between batches or replicas "
                          f"({sorted(kinds)}); every row must have the same")
    ndim, code, rest = kinds.pop()
    longest = max(m[1] for m in table)
    buffer = torch.zeros((longest, *rest), dtype=_DTYPES[code], device=device)
    if mine is not None and mine.shape[0]:
        buffer[: mine.shape[0]] = mine.to(device)
    if dist.get_rank() != 0:
        dist.gather(buffer, None, dst=0)
        return None
    gathered = [torch.empty_like(buffer) for _ in table]
    dist.gather(buffer, gathered, dst=0)
    parts = [(m[0], g[: m[1]].cpu()) for m, g in zip(table, gathered) if m[0] >= 0]
    return _place(parts, total, replicas, parts[0][1] if parts else None, recipe)


def _place(parts: list[tuple[int, torch.Tensor | None]], total: int, replicas: int, like: torch.Tensor | None,
           recipe: str) -> torch.Tensor:
    """Each share's rows at their samples' indices; every index filled exactly once."""
    if like is None:
        return torch.empty(0)
    out = torch.empty((total, *like.shape[1:]), dtype=like.dtype)
    filled = torch.zeros(total, dtype=torch.bool)
    for shard, rows in parts:
        if rows is None or shard < 0:
            continue
        indices = torch.arange(shard, total, replicas)
        if rows.shape[0] != indices.numel() or filled[indices].any():
            raise RecipeError(f"{recipe}: replica {shard} predicted {rows.shape[0]} rows for its "
                              f"{indices.numel()} samples (predict_data's length differs between ranks?)")
        out[indices] = rows.cpu()
        filled[indices] = True
    if not bool(filled.all()):
        raise RecipeError(f"{recipe}: {int((~filled).sum())} of predict_data's {total} samples have no output")
    return out


def _write(output: str, data: dict[str, Any]) -> None:
    """``torch.save`` to a temporary name beside the file, then renamed: never half a file."""
    partial = f"{output}.partial-{os.getpid()}"
    try:
        torch.save(data, partial)
        os.replace(partial, output)
    except OSError as exc:
        Path(partial).unlink(missing_ok=True)
        raise TrainingError(f"--output {output}: cannot write the predictions: {exc.strerror or exc}") from None
