"""ShardedStrategy (``--strategy sharded``, alias ``fsdp``): FSDP2, for models too big for one device.

Mirrored keeps the whole model, its gradients and its optimizer state on every device.
Sharded keeps 1/N of each per rank: each unit's parameters are all-gathered just before
its forward and backward and freed after, and gradients are reduce-scattered, so each
rank steps the optimizer on its own shard. The data plan is mirrored's (each rank its
share of every global batch), and gradients are averaged over the ranks as DDP averages
them, so a sharded job ends with one-device's parameters to float tolerance.

``shard_within``: ``all`` shards over every rank; ``host`` is HSDP, sharding inside each
host and replicating across hosts on a 2-D mesh (gradients all-reduced across hosts), for
when the model fits a host and the network between hosts is the slow part.

**No rank but one holds the whole model.** Inside ``scope()`` rank 0 builds the recipe's model
on the CPU from the seeded generator, as every strategy does, and every other rank builds it
on the meta device (no memory). After sharding, the other ranks allocate only their shards
(``to_empty``), and rank 0's values reach them by broadcast (``set_model_state_dict`` with
``broadcast_from_rank0``), buffers too. So a model bigger than one device starts, and its
initial parameters are still one-device's.

``--precision bf16|fp16`` is FSDP's MixedPrecisionPolicy: fp32 master weights, shards gathered
and computed in the low precision, gradients reduced in fp32; no autocast on top. fp16 adds
the loss scaler every strategy uses (``step/precision.py``): it unscales each rank's gradient
shards in place and all-reduces the overflow verdict, so every rank skips the same steps.
``--compile`` compiles each unit before sharding it (``sharding/compile.py``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrun.config.job import SHARD_WITHIN
from distrun.errors import CheckpointError, ConfigError
from distrun.strategies import checkpoint as ckpt
from distrun.strategies.base import Strategy
from distrun.strategies.checkpoint import shards
from distrun.strategies.checkpoint.pending import PendingSave
from distrun.strategies.checkpoint.layout import MODEL as MODEL_PREFIX
from distrun.strategies.checkpoint.rng import rng_to_json
from distrun.strategies.checkpoint.staging import BackgroundStaging
from distrun.strategies.checkpoint.write_failure import RecordingStreams, write_failed
from distrun.strategies.sharding.allocator import fix_mmap_threshold
from distrun.strategies.sharding.apply import apply_fsdp, parameter_names, rebuild_optimizer, reshard_all
from distrun.strategies.sharding.checkpoint import load_sharded, sharded_state
from distrun.strategies.sharding.compile import compile_units
from distrun.strategies.sharding.mesh import Layout, choose_layout
from distrun.strategies.sharding.state import (
    broadcast_from_rank0,
    load_full_model_state,
    load_full_optimizer_state,
    on_cpu,
    on_meta,
    same_rng_as_rank0,
)
from distrun.strategies.sharding.units import pick_units
from distrun.strategies.step.precision import PRECISION_DTYPES, ScaledOptimizer

__all__ = ["ShardedStrategy"]

_HOST_BYTES = 64  # a host name as the shared-folder check gathers it


class ShardedStrategy(Strategy):
    name = "sharded"
    _compiles_units = True

    def __init__(self, *args: Any, reshard_after_forward: bool = True, shard_within: str = "auto",
                 offload: bool = False, hosts: int = 1, async_checkpoint: bool = False, **kwargs: Any) -> None:
        """``hosts``: how many hosts the ranks are on, in rank order (HSDP's replica count);
        ``async_checkpoint``: write checkpoints behind training (a gloo group of their own)."""
        super().__init__(*args, **kwargs)
        if shard_within not in SHARD_WITHIN:
            raise ConfigError(f"--shard-within: expected {' or '.join(SHARD_WITHIN)}. Received: {shard_within!r}")
        self._reshard = reshard_after_forward
        self._shard_within = shard_within
        self._offload = offload
        self._hosts = hosts
        self.mesh: DeviceMesh | None = None
        # DCP's background collectives must not interleave with training's on the same group.
        self._checkpoint_group = dist.new_group(backend="gloo") if async_checkpoint else None
        # ... and the shards are copied out of the model behind the next forward and backward.
        self._staging = BackgroundStaging(cuda=self.device.type == "cuda") if async_checkpoint else None
        if self.device.type == "cpu":  # gathered buffers come and go each step: keep them off the heap
            fix_mmap_threshold()

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Rank 0 builds the model on the CPU (the seeded values); the others on the meta device."""
        return torch.device("cpu") if self.is_chief else torch.device("meta")

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        initial = on_cpu(model.state_dict()) if self.is_chief else {}  # rank 0's values, for everyone
        home = torch.device("cpu") if self._offload else self.device
        if not on_meta(model):
            model = model.to(home)
        layout = self._choose_layout(sum(p.numel() for p in model.parameters()))
        self.mesh = self._make_mesh(layout.hsdp)
        units = pick_units(model, self.units_from)
        if self.is_chief:
            why = f" ({layout.why})" if layout.why else ""
            print(f"[sharded] {units.description}; {self._describe_mesh()}{why}", flush=True)
        names = parameter_names(model)
        if self._step.settings.compile:  # each block before sharding: FSDP's hooks stay eager around it
            compile_units(units.modules, self._step.settings.compile_mode)
        apply_fsdp(model, units.modules, self.mesh, param_dtype=PRECISION_DTYPES.get(self.precision),
                   reshard_after_forward=self._reshard, offload=self._offload)
        if on_meta(model):
            model.to_empty(device=home)  # only this rank's shards (and the buffers) are allocated
        broadcast_from_rank0(model, initial, self._collective_device)
        del initial
        same_rng_as_rank0(self._collective_device)
        if optimizer is None:
            return model, None
        optimizer = rebuild_optimizer(optimizer, model, names)
        self._wait_for_copies(optimizer)
        return model, optimizer

    def _wait_for_copies(self, optimizer: torch.optim.Optimizer) -> None:
        """``--async-checkpoint``: ``optimizer``'s steps wait for a save's copy still under way (the
        shards it copies must not move yet). Parameters changed outside an optimizer step (an EMA
        a custom loop keeps) are not covered: such a loop saves with ``wait=True``."""
        if self._staging is not None:
            optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _buffer_keys(self) -> set[str]:
        """The model's buffers under their checkpoint keys: a forward may change them, so a save clones them at once."""
        return {MODEL_PREFIX + name for name, _ in self.unwrap().named_buffers()}

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """``--async-checkpoint``: the step that would change the shards waits until the save in
        flight has copied them; that wait counts in the save's ``blocked_ms``."""
        assert self._staging is not None
        waited_ms = self._staging.wait_before_step()
        if self._pending_save is not None:
            self._pending_save.blocked_ms += waited_ms

    def close(self) -> None:
        super().close()
        if self._staging is not None:
            self._staging.close()

    def _choose_layout(self, parameters: int) -> Layout:
        """``--shard-within``, ``auto`` decided from the least memory any rank has (all-reduced MIN)."""
        world, hosts = self.num_replicas, self._hosts
        least = float("inf")
        if self._shard_within == "auto" and hosts > 1 and world % hosts == 0:
            if self.device.type == "cuda":
                mine = float(torch.cuda.get_device_properties(self.device).total_memory)
            else:  # a host's ranks share its RAM
                mine = psutil.virtual_memory().available / (world // hosts)
            verdict = torch.tensor([mine], dtype=torch.float64, device=self._collective_device)
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
            least = float(verdict.item())
        return choose_layout(self._shard_within, hosts=hosts, world=world, parameters=parameters,
                             rank_memory_bytes=least)

    def _make_mesh(self, hsdp: bool) -> DeviceMesh:
        device_type, world = self.device.type, self.num_replicas
        if hsdp:
            return init_device_mesh(device_type, (self._hosts, world // self._hosts),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))

    def _describe_mesh(self) -> str:
        assert self.mesh is not None
        if self.mesh.ndim == 2:
            return (f"HSDP: sharded over {self.mesh.size(1)} rank(s) in each host, replicated over "
                    f"{self.mesh.size(0)} hosts")
        return f"sharded over all {self.mesh.size()} rank(s)"

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        try:
            yield self.compute_model()
        finally:
            reshard_all(self.unwrap())

    def eval_forwards_to_match(self, forwards: int) -> int:
        """Each forward all-gathers every unit with every rank: a rank with fewer evaluation
        batches (an eval set that does not split evenly) runs the difference again."""
        return int(self.reduce("max", float(forwards))) - forwards

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """No autocast: the mixed-precision policy casts what FSDP gathers."""
        return contextlib.nullcontext()

    @property
    def _torch_optimizer(self) -> Any:
        """The optimizer that steps the shards: under fp16, the one the loss scaler stands in front of."""
        return self._optimizer.inner if isinstance(self._optimizer, ScaledOptimizer) else self._optimizer

    # -- checkpoints: DCP folders, each rank writing its own shards (checkpoint/shards.py)

    def check_checkpoint_dir(self, directory: str | Path) -> None:
        """Before training: every rank must see the folder rank 0 writes to (a sharded checkpoint
        is one folder of every rank's files); the hosts that do not are named, in one line."""
        folder = Path(directory)
        probe = folder / f".distrun-probe-{self._shared_token()}"
        cannot = None
        if self.is_chief:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe.touch()
            except OSError as exc:
                cannot = exc.strerror
        self.barrier()
        host = socket.gethostname().encode()[:_HOST_BYTES - 1]
        mine = torch.zeros(1, _HOST_BYTES, dtype=torch.uint8)
        mine[0, 0] = int(probe.exists())
        mine[0, 1:1 + len(host)] = torch.frombuffer(bytearray(host), dtype=torch.uint8)
        every = self._gather(mine, None).cpu()  # every rank's (sees it, host name): all agree on the verdict
        if self.is_chief:
            probe.unlink(missing_ok=True)
        if cannot is not None:
            raise CheckpointError(f"--checkpoint-dir {folder}: cannot write: {cannot}")
        blind = sorted({bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="replace") for row in every if not row[0]})
        if blind:
            raise CheckpointError(f"--checkpoint-dir {folder}: not shared by every host ({', '.join(blind)} cannot see "
                                  "rank 0's files); a sharded checkpoint is one folder of every rank's shards, so it "
                                  "needs storage all hosts mount")

    def _shared_token(self) -> str:
        """A name every rank agrees on and no other job uses: rank 0's pid and a random draw, broadcast."""
        token = torch.tensor([os.getpid() if self.is_chief else 0, secrets.randbits(31) if self.is_chief else 0],
                             device=self._collective_device)
        if self._distributed:
            dist.broadcast(token, src=0)
        return f"{int(token[0])}-{int(token[1])}"

    def _write_checkpoint(self, directory: Path, meta: dict[str, Any], *, keep: int, started: float,
                          wait: bool) -> Path | None:
        reshard_all(self.unwrap())  # a custom loop may save after a forward without backward
        tensors, rest = self._sharded_state()
        sidecar = {**meta, "rng": rng_to_json(meta["rng"]), **rest}
        step = self.step
        if self.is_chief:
            shards.prepare(directory, step)
        self.barrier()
        writer = FileSystemWriter(shards.temporary_path(directory, step))
        writer.fs = streams = RecordingStreams(writer.fs)  # a full disk named as one (write_failure)

        def publish() -> Path | None:
            if not self.is_chief:
                return None
            path = shards.commit(directory, step, sidecar)
            ckpt.prune(directory, keep)
            return path

        def discard(exc: BaseException) -> None:
            """Every rank sees a failed write (DCP gathers them, once every rank's write has ended)
            and removes what was written: the first rank to report the failure ends the job, and
            its folder must be gone by then (the others may be stopped before they get to it)."""
            shards.discard(directory, step, exc)

        # --async-checkpoint: copy the shards and write them behind training. Not with ``wait``
        # (the run's last save, a loop that must have it now): nothing would overlap the write,
        # and a copy first only adds to it, so it is written straight from the model.
        if self._staging is not None and not wait:
            written = self._staging.save(tensors, self._buffer_keys(), storage_writer=writer,
                                         process_group=self._checkpoint_group)
            self._pending_save = PendingSave(step, written, publish, (time.perf_counter() - started) * 1e3,
                                             discard=discard, directory=directory, recorded=lambda: streams.error)
            return None
        try:
            dcp.save(tensors, storage_writer=writer)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's own is a BaseException
            discard(exc)
            raise write_failed(directory, step, exc, streams.error) from None
        path = publish()
        self.barrier()
        if path is not None:
            self._reporter.checkpoint(step, str(path), (time.perf_counter() - started) * 1e3)
        return path

    def _sharded_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this rank's tensors for DCP, the JSON rest the chief writes beside them)."""
        return sharded_state(self.unwrap(), self._torch_optimizer)

    def _load_sharded(self, path: Path, data: dict[str, Any]) -> None:
        """Fill this rank's pieces from the DCP folder ``path`` (``data``: its sidecar)."""
        load_sharded(path, self.unwrap(), self._torch_optimizer, data)

    def _read_checkpoint(self, path: Path) -> dict[str, Any]:
        """A sharded checkpoint's entries without its tensors (they load straight into the shards)."""
        return ckpt.read_entries(path) if shards.is_sharded(path) else super()._read_checkpoint(path)

    def _load_checkpoint(self, path: Path, data: dict[str, Any]) -> None:
        if shards.is_sharded(path):
            self._load_sharded(path, data)
        else:  # a plain file, whole: each rank keeps its shards of it
            super()._load_checkpoint(path, data)

    def _load_model_state(self, state: dict[str, Any]) -> None:
        load_full_model_state(self.unwrap(), state)

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self._torch_optimizer is not None and state:
            load_full_optimizer_state(self.unwrap(), self._torch_optimizer, state)
