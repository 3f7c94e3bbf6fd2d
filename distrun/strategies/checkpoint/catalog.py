"""One contract over both checkpoint formats: list them, find the newest, load one, prune.

A folder may hold plain checkpoints (``ckpt-<step>.pt``, rank 0's one file: ``files``) and
sharded ones (``ckpt-<step>/``, DCP: ``shards``), for example after a job moved from
mirrored to sharded. They are listed together by step, and ``load_checkpoint`` gives either
as the plain format's dict (whole tensors on the CPU, the optimizer in torch's index-keyed
layout), so every strategy, the evaluator and the tools read both; only a sharded model
loads a sharded checkpoint's pieces directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from distrun.errors import CheckpointError
from distrun.strategies.checkpoint import files, layout, shards
from distrun.strategies.checkpoint.rng import rng_from_json

__all__ = ["list_checkpoints", "latest_checkpoint", "newest_complete", "load_checkpoint", "read_entries", "prune"]


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint of either format, oldest first."""
    found = dict(files.list_files(directory))
    folder = Path(directory)
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith("ckpt-") and entry.name[5:].isdigit() and (entry / shards.SIDECAR).is_file():
                found[int(entry.name[5:])] = entry  # the same step in both formats: the sharded one is newer
    return sorted(found.items())


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def newest_complete(directory: str | os.PathLike[str]) -> str:
    """What a failed save leaves a resume: "the newest complete checkpoint is <path> (step N)"."""
    try:
        found = list_checkpoints(directory)
    except OSError as exc:
        return f"{directory} cannot be listed ({exc.strerror})"
    if not found:
        return f"no complete checkpoint is in {directory}"
    step, path = found[-1]
    return f"the newest complete checkpoint is {path} (step {step})"


def load_checkpoint(path: str | os.PathLike[str], *, model_only: bool = False) -> dict[str, Any]:
    """Either format as the plain format's dict (``model_only``: a sharded one's optimizer
    state is not read, and ``optimizer`` is empty)."""
    if not shards.is_sharded(path):
        return files.load_file(path)
    from distrun.strategies.checkpoint import shard_reader  # DCP, imported by a job that reads a sharded checkpoint

    sidecar = shards.read_sidecar(path)
    model, optimizer = layout.join(shard_reader.read_tensors(path, layout.MODEL if model_only else ""), sidecar)
    if model_only:
        optimizer = None
    return {**read_entries(path, sidecar), "model": model, "optimizer": layout.indexed(optimizer) if optimizer else {}}


def read_entries(path: str | os.PathLike[str], sidecar: dict[str, Any] | None = None) -> dict[str, Any]:
    """A sharded checkpoint's sidecar as the plain format has it (RNG states as tensors), with
    the JSON parts of the model's and optimizer's state kept under ``model``/``optimizer``."""
    sidecar = sidecar if sidecar is not None else shards.read_sidecar(path)
    return {**sidecar, "rng": rng_from_json(sidecar.get("rng") or {})}


def prune(directory: str | os.PathLike[str], keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints."""
    for _, old in list_checkpoints(directory)[:-keep]:
        try:
            if old.is_dir():
                shards.remove(old)
            else:
                old.unlink(missing_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{old}: cannot remove an old checkpoint: {exc.strerror}") from None
