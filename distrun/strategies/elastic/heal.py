"""Healing a replica from a live peer: model, optimizer state and progress, by broadcast.

After a membership round (``membership``) members may hold different states: a
survivor that finished the step in flight, one that did not, a joiner that holds only
the recipe's initial parameters. The round names a source (the highest committed
step), and this module makes every member's state the source's.

What crosses, and how:

- **A manifest, on the store**, as JSON: every tensor's name, shape and dtype, the
  optimizer's ``param_groups`` (hyperparameters a scheduler may have changed) and its
  non-tensor state, and the plain values the strategy heals (step, data position, loss
  scale). A joiner's optimizer may have no state yet (Adam makes it at the first step),
  so receivers build the state from the manifest, not from their own.
- **The tensors, over the round's group**, one broadcast per dtype: each dtype's tensors
  are flattened into one buffer, so a model of hundreds of tensors costs a handful of
  collectives, not hundreds.

No pickle: JSON on the store, and tensors over the group.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["broadcast_tensors", "heal"]

#: How often a receiver asks for the source's manifest (a heal takes far longer than this).
MANIFEST_POLL_S = 0.05


def heal(store: Any, key: str, *, source: int, rank: int, model: nn.Module, optimizer_state: dict[str, Any],
         load_optimizer_state: Callable[[dict[str, Any]], None], values: dict[str, Any],
         device: torch.device, round_ended: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Make this member's model, optimizer state and ``values`` the ``source`` rank's; the healed values.

    ``optimizer_state``: this member's ``state_dict()`` (only the source's is read).
    ``device``: where collectives run (the CPU for gloo, the GPU for NCCL).
    ``round_ended``: whether the membership record says this round is over (a member lost);
    a receiver waiting for the source's manifest stops waiting then.
    """
    live = model.state_dict(keep_vars=False)
    if rank == source:
        manifest, optimizer_tensors = _describe(live, optimizer_state, values)
        store.set(key, json.dumps(manifest))
    else:
        manifest = _wait_for_manifest(store, key, source, round_ended)
        _check_model(manifest, live)
        optimizer_tensors = [torch.empty(shape, dtype=_dtype(dtype), device=device)
                             for _, _, shape, dtype in manifest["optimizer_tensors"]]
    model_tensors = [live[name] for name, _, _ in manifest["model"]]
    broadcast_tensors(model_tensors + optimizer_tensors, source, device)
    if rank != source:
        load_optimizer_state(_optimizer_state(manifest, optimizer_tensors))
    return manifest["values"]


def _wait_for_manifest(store: Any, key: str, source: int, round_ended: Callable[[], bool]) -> dict[str, Any]:
    """The source's manifest, once it is written. A source lost before writing it would leave
    the receivers in ``store.get`` for the store's whole timeout (300 s) while the rest of the
    job had moved on to the next round; so the wait asks the store (``check``) and the record
    (``round_ended``) in turn, and a round that ended is a change of membership like a failed
    collective (a ``RuntimeError`` that ``round_over`` confirms). The store's timeout still
    bounds it, once."""
    timeout_s = store.timeout.total_seconds()
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if round_ended():
            raise RuntimeError(f"heal: rank {source}, the source, was lost before it described its state")
        if time.monotonic() > deadline:
            raise TimeoutError(f"heal: rank {source}, the source, wrote no manifest in {timeout_s:.0f} s")
        time.sleep(MANIFEST_POLL_S)
    return json.loads(store.get(key).decode())


def _describe(live: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
              values: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    described: list[list[Any]] = []
    plain: list[list[Any]] = []
    for index, entry in optimizer_state.get("state", {}).items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach())
                described.append([index, name, list(value.shape), str(value.dtype)])
            else:
                plain.append([index, name, value])
    manifest = {
        "model": [[name, list(t.shape), str(t.dtype)] for name, t in live.items()],
        "optimizer_tensors": described,
        "optimizer_values": plain,
        "param_groups": optimizer_state.get("param_groups", []),
        "values": values,
    }
    return manifest, tensors


def _check_model(manifest: dict[str, Any], live: dict[str, torch.Tensor]) -> None:
    """Every member built the same model from the same recipe; say so plainly if not."""
    theirs = {name: (shape, dtype) for name, shape, dtype in manifest["model"]}
    ours = {name: (list(t.shape), str(t.dtype)) for name, t in live.items()}
    if theirs != ours:
        different = sorted(set(theirs.items()) ^ set((k, tuple(v)) for k, v in ours.items()))[:3]
        raise RuntimeError(f"elastic heal: this member's model differs from the source's: {different}")


def _optimizer_state(manifest: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    state: dict[Any, dict[str, Any]] = {}
    for (index, name, _, _), tensor in zip(manifest["optimizer_tensors"], tensors):
        state.setdefault(_param_key(index), {})[name] = tensor
    for index, name, value in manifest["optimizer_values"]:
        state.setdefault(_param_key(index), {})[name] = value
    return {"state": state, "param_groups": manifest["param_groups"]}


def _param_key(index: Any) -> Any:
    """JSON turns the state's int keys into strings; torch's optimizers key by int."""
    return int(index) if isinstance(index, str) and index.isdigit() else index


def broadcast_tensors(tensors: list[torch.Tensor], source: int, device: torch.device) -> None:
    """One broadcast per dtype of the flattened tensors, then each tensor takes its part back.

    Every broadcast ends before any tensor is written: a heal that fails (another member lost
    in it) leaves this member's state whole and its committed step true, so the next round may
    heal from it, or heal it, again. Written per dtype as it arrived, a failure between two
    dtypes left a member half healed under its old step."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    received = []
    for dtype, group in by_dtype.items():
        wire = [t.detach().to(device, torch.uint8 if dtype == torch.bool else dtype) for t in group]
        flat = _flatten_dense_tensors(wire)
        dist.broadcast(flat, source)
        received.append((group, flat, wire))
    if device.type == "cuda":  # NCCL queues a broadcast and returns: each must be over, not queued (not run on a GPU)
        torch.cuda.synchronize(device)
    for group, flat, wire in received:
        for target, part in zip(group, _unflatten_dense_tensors(flat, wire)):
            with torch.no_grad():
                target.copy_(part.to(target.dtype))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"elastic heal: unknown dtype {name!r} in the source's manifest")
    return dtype
