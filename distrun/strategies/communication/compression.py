"""Gradient compression as DDP communication hooks: fewer bytes on the wire per step.

DDP all-reduces gradients bucket by bucket while backward runs; a communication
hook replaces that all-reduce, so compression overlaps backward exactly as the
plain one does.

* ``fp16`` / ``bf16``: each bucket is cast down, divided by the world size first (so
  the sum cannot overflow fp16's 65504), all-reduced, and cast back: half the bytes.
  torch's own ``bf16_compress_hook`` refuses gloo; this one works on gloo and NCCL.
* ``powersgd[:RANK]``: torch's PowerSGD (a rank-r approximation P Q^T of each matrix
  gradient, with error feedback and warm-started Q), after ``warmup`` steps of plain
  all-reduce. Its state goes into checkpoints (``comm``): the step count, Q and P
  memories, the generator, and every replica's error-feedback residual, gathered to
  the chief, since each replica's residual is its own.

PowerSGD keeps its state per DDP bucket, and DDP lays buckets out again after the
first step of every process (and may differ after a restart). So checkpoints hold
the state per parameter (each one's slice of the residual and of Q, in torch's own
memory order), and each bucket takes its parameters' slices when DDP first shows
it; a re-bucketing mid-run goes through the same per-parameter form. A resumed run
therefore equals an uninterrupted one bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from distrun.config._compression import Compression
from distrun.strategies.communication.bucket_queue import OrderedBucketHook
from distrun.strategies.step.precision import PRECISION_DTYPES

__all__ = ["CommCompression", "cast_compress_hook"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def cast_compress_hook(dtype: torch.dtype) -> Hook:
    """All-reduce each bucket in ``dtype`` (mean, as DDP's own), written back in the bucket's dtype."""

    def hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none, or real classes
        group = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    return hook


class CommCompression:
    """One replica's compression: registers the hook and owns PowerSGD's state.

    PowerSGD keeps its state per DDP bucket; this class can also hold it per parameter
    (``_errors``, ``_qs``), the form checkpoints use and the bridge across a re-bucketing.
    """

    def __init__(self, compression: Compression, *, warmup_steps: int, seed: int) -> None:
        self.compression = compression
        self._warmup_steps = warmup_steps
        self._seed = seed
        self._state: powersgd.PowerSGDState | None = None
        self._shapes: list[torch.Size] = []  # by parameter position
        self._position: dict[int, int] = {}  # id(parameter) -> position
        self._signatures: dict[int, tuple[int, ...]] = {}  # bucket index -> parameter positions
        self._errors: dict[int, torch.Tensor] = {}  # parameter position -> this replica's residual
        self._qs: dict[int, torch.Tensor] = {}  # parameter position -> its warm-start Q (flat)
        self._ordered: OrderedBucketHook | None = None

    def attach(self, ddp: DistributedDataParallel) -> None:
        kind = self.compression.kind
        if kind in ("fp16", "bf16"):
            ddp.register_comm_hook(None, cast_compress_hook(PRECISION_DTYPES[kind]))
        elif kind == "powersgd":
            params = list(ddp.module.parameters())
            self._position = {id(p): i for i, p in enumerate(params)}
            self._shapes = [p.shape for p in params]
            self._state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.compression.rank,
                start_powerSGD_iter=self._warmup_steps, use_error_feedback=True, warm_start=True,
                random_seed=self._seed)
            # One bucket at a time, in order: torch's hook issues its P and Q all-reduces from
            # future callbacks, and two buckets' callbacks interleaved differently on two ranks
            # deadlocked a 1.3M-parameter MLP at the first compressed step (gloo).
            state = self._state
            self._ordered = OrderedBucketHook(lambda bucket: self._powersgd_hook(state, bucket).wait(),
                                              "distrun-powersgd")
            ddp.register_comm_hook(state, self._ordered.hook)

    def close(self) -> None:
        if self._ordered is not None:
            self._ordered.close()

    def _powersgd_hook(self, state, bucket):  # type: ignore[no-untyped-def]  # as cast_compress_hook's
        index = bucket.index()
        signature = tuple(self._position[id(p)] for p in bucket.parameters())
        known = self._signatures.get(index)
        if known != signature:
            if known is not None:  # DDP re-bucketed: carry every bucket's state over, per parameter
                self._split_all()
            self._signatures[index] = signature
            self._assemble(index, signature)
        return powersgd.powerSGD_hook(state, bucket)

    # -- per bucket <-> per parameter

    def _layout(self, signature: tuple[int, ...]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """The bucket's flat layout as torch's hook uses it: (position, numel) in bucket order,
        and (position, P size, Q size) of the compressed ones in its memory order (by shape)."""
        flat = [(pos, self._shapes[pos].numel()) for pos in signature]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for pos in signature:
            shape = self._shapes[pos]
            if len(shape) == 0:
                continue
            n, m = shape[0], shape.numel() // max(shape[0], 1)
            rank = min(n, m, self.compression.rank)
            assert self._state is not None
            if powersgd._should_compress(n, m, rank, self._state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append(pos)
        low_rank = []
        for (n, m), positions in by_shape.items():
            rank = min(n, m, self.compression.rank)
            low_rank += [(pos, n * rank, m * rank) for pos in positions]
        return flat, low_rank

    def _per_parameter(self, signature: tuple[int, ...], error: torch.Tensor | None, q: torch.Tensor | None
                       ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """A bucket's residual and Q, cut into each parameter's slice (by position)."""
        flat, low_rank = self._layout(signature)
        errors = dict(zip([pos for pos, _ in flat], error.split([n for _, n in flat]))) if error is not None else {}
        qs = (dict(zip([pos for pos, _, _ in low_rank], q.split([qn for _, _, qn in low_rank])))
              if q is not None else {})
        return errors, qs

    def _split_all(self) -> None:
        state = self._state
        assert state is not None
        for index, signature in self._signatures.items():
            errors, qs = self._per_parameter(signature, state.error_dict.pop(index, None),
                                             state.q_memory_dict.pop(index, None))
            self._errors.update(errors)
            self._qs.update(qs)
            state.p_memory_dict.pop(index, None)
        self._signatures.clear()

    def _assemble(self, index: int, signature: tuple[int, ...]) -> None:
        """Give bucket ``index`` the per-parameter state its parameters have (all of it, or none)."""
        state = self._state
        assert state is not None
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.pop(index, None)
        flat, low_rank = self._layout(signature)
        device = _hook_device()
        if flat and all(pos in self._errors for pos, _ in flat):
            state.error_dict[index] = torch.cat([self._errors.pop(pos) for pos, _ in flat]).to(device)
        if low_rank and all(pos in self._qs for pos, _, _ in low_rank):
            state.q_memory_dict[index] = torch.cat([self._qs.pop(pos) for pos, _, _ in low_rank]).to(device)
            state.p_memory_dict[index] = torch.empty(sum(pn for _, pn, _ in low_rank), device=device,
                                                     dtype=state.q_memory_dict[index].dtype)

    # -- checkpoints (every replica calls state_for_checkpoint: it gathers)

    def state_for_checkpoint(self, rank: int, world_size: int) -> dict[str, Any] | None:
        """PowerSGD's state per parameter, every replica's residuals gathered to rank 0 (None
        elsewhere, and for the stateless compressions). A collective: every replica calls it."""
        state = self._state
        if state is None:
            return None
        # Per parameter: the buckets' state, and what a resume restored but no step has used yet.
        errors, qs = dict(self._errors), dict(self._qs)
        for index, signature in self._signatures.items():
            bucket_errors, bucket_qs = self._per_parameter(signature, state.error_dict.get(index),
                                                           state.q_memory_dict.get(index))
            errors.update(bucket_errors)
            qs.update(bucket_qs)
        # Every replica holds residuals for the same parameters: one gather of them all, in position order.
        positions = sorted(errors)
        replicas: list[dict[int, torch.Tensor]] = [{} for _ in range(world_size)]
        if positions:
            local = torch.cat([errors[pos].detach().reshape(-1) for pos in positions]).to(_hook_device())
            gathered = [torch.empty_like(local) for _ in range(world_size)] if rank == 0 else None
            dist.gather(local, gathered, dst=0)
            sizes = [errors[pos].numel() for pos in positions]
            replicas = [dict(zip(positions, tensor.cpu().split(sizes))) for tensor in gathered or []]
        if rank != 0:
            return None
        _name, keys, pos, has_gauss, cached = state.rng.get_state()
        return {"kind": "powersgd", "rank": self.compression.rank, "iter": state.iter,
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                "errors": [{str(k): v.clone() for k, v in e.items()} for e in replicas],
                "q": {str(k): v.detach().cpu().clone() for k, v in qs.items()}}

    def load_checkpoint_state(self, saved: dict[str, Any] | None, rank: int) -> None:
        """Take back what ``state_for_checkpoint`` wrote; buckets get it as DDP first shows them.

        A checkpoint of another compression (or none), or of another replica count, leaves
        PowerSGD to start fresh: its residuals belong to replicas that no longer exist.
        """
        state = self._state
        if state is None or not saved or saved.get("kind") != "powersgd" \
                or saved.get("rank") != self.compression.rank:
            return
        state.iter = int(saved["iter"])
        rng = saved["rng"]
        state.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                             rng["cached_gaussian"]))
        shapes_match = all(int(k) < len(self._shapes) and v.numel() == self._shapes[int(k)].numel()
                           for k, v in (saved["errors"][0] if saved["errors"] else {}).items())
        if len(saved["errors"]) == dist.get_world_size() and shapes_match:
            self._errors = {int(k): v for k, v in saved["errors"][rank].items()}
            self._qs = {int(k): v for k, v in saved["q"].items()}
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()
        self._signatures.clear()


def _hook_device() -> torch.device:
    """Where the hook's tensors live: the GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
