"""``python -m distrun.runtime._checkpoint_tool ls|export``: the torch side of ``distrun checkpoint``.

The CLI never imports torch (the control plane's rule), so it runs this in a short-lived
interpreter and reads one JSON line back. Listing reads no tensors: a plain file is opened
with ``mmap=True`` (its header), a sharded folder's sidecar and DCP index say the rest.
Exporting a sharded checkpoint joins every rank's pieces into whole tensors in this one
process, with no process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from distrun.strategies.checkpoint import layout, list_checkpoints, load_checkpoint, shard_reader, shards


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _row(step: int, path: Path) -> dict[str, Any]:
    if shards.is_sharded(path):
        sidecar, index = shards.read_sidecar(path), shard_reader.read_index(path)
        return {"path": str(path), "step": step, "strategy": sidecar.get("strategy"), "format": "sharded",
                "world_size": sidecar.get("num_replicas"), "mesh": _mesh(sidecar), "bytes": shards.size_bytes(path),
                "parameters": sum(entry.size.numel() for key, entry in index.state_dict_metadata.items()
                                  if key.startswith(layout.MODEL))}
    data = _load(path)
    return {"path": str(path), "step": step, "strategy": data.get("strategy"), "format": "plain",
            "world_size": data.get("num_replicas"), "mesh": _mesh(data), "bytes": path.stat().st_size,
            "parameters": sum(t.numel() for t in data.get("model", {}).values() if isinstance(t, torch.Tensor))}


def _mesh(entries: dict[str, Any]) -> dict[str, int] | None:
    """The layout that wrote it: ``{"dp": R, "tp": T, "pp": P}`` (a replica of one rank: ``{"dp": R}``)."""
    mesh = entries.get("mesh")
    if isinstance(mesh, dict):
        return {str(k): int(v) for k, v in mesh.items()}
    replicas = entries.get("num_replicas")
    return {"dp": int(replicas)} if isinstance(replicas, int) else None


def describe(folder: Path) -> list[dict[str, Any]]:
    return [_row(step, path) for step, path in list_checkpoints(folder)]


def export(source: Path, out: Path) -> dict[str, Any]:
    """The model's plain state_dict (tensors by name, nothing else) from a checkpoint file, or
    from a folder's newest: what ``torch.load(out, weights_only=True)`` reads with no distrun."""
    if source.is_dir() and not (source / shards.SIDECAR).is_file():  # a folder of checkpoints: its newest
        found = list_checkpoints(source)
        if not found:
            raise FileNotFoundError(f"{source}: no checkpoint (ckpt-<step>.pt or ckpt-<step>/) in this folder")
        source = found[-1][1]
    data = load_checkpoint(source, model_only=True) if shards.is_sharded(source) else _load(source)
    model = {name: tensor.clone() for name, tensor in data["model"].items()  # off the mmap, contiguous
             if isinstance(tensor, torch.Tensor)}
    tmp = out.with_name(out.name + ".tmp")
    torch.save(model, tmp)
    tmp.replace(out)
    return {"source": str(source), "out": str(out), "step": data.get("step"), "tensors": len(model),
            "parameters": sum(t.numel() for t in model.values())}


def main(argv: list[str]) -> int:
    try:
        if argv[0] == "ls":
            print(json.dumps({"checkpoints": describe(Path(argv[1]))}))
        elif argv[0] == "export":
            print(json.dumps(export(Path(argv[1]), Path(argv[2]))))
        else:
            raise ValueError(f"unknown command {argv[0]!r}")
    except FileNotFoundError as exc:  # distrun's own "no checkpoint here": its message says it all
        print(json.dumps({"error": str(exc)}))
        return 1
    except Exception as exc:  # noqa: BLE001 - one line back to the CLI, which maps it to CheckpointError
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
