"""``python -m distrun.runtime._checkpoint_tool ls|export``: the torch side of ``distrun checkpoint``.

The CLI never imports torch (the control plane's rule), so it runs this in a short-lived
interpreter and reads one JSON line back. Files are opened with ``mmap=True``: listing a
folder of multi-gigabyte checkpoints reads their headers, not their tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from distrun.strategies.checkpoint import list_checkpoints


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def describe(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for step, path in list_checkpoints(folder):
        data = _load(path)
        rows.append({"path": str(path), "step": step, "strategy": data.get("strategy"),
                     "world_size": data.get("num_replicas"), "bytes": path.stat().st_size,
                     "parameters": sum(t.numel() for t in data.get("model", {}).values()
                                       if isinstance(t, torch.Tensor))})
    return rows


def export(source: Path, out: Path) -> dict[str, Any]:
    """The model's plain state_dict (tensors by name, nothing else) from a checkpoint file, or
    from a folder's newest: what ``torch.load(out, weights_only=True)`` reads with no distrun."""
    if source.is_dir():
        found = list_checkpoints(source)
        if not found:
            raise FileNotFoundError(f"{source}: no checkpoint (ckpt-<step>.pt) in this folder")
        source = found[-1][1]
    data = _load(source)
    model = {name: tensor.clone() for name, tensor in data["model"].items()}  # off the mmap, contiguous
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
    except Exception as exc:  # noqa: BLE001 - one line back to the CLI, which maps it to CheckpointError
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
