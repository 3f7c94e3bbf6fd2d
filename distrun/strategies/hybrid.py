"""The hybrid strategy (``--embeddings ps``): dense layers mirrored, large embeddings on ps tasks.

TensorFlow's "hybrid" of MirroredStrategy and parameter servers, and TorchRec's shape for
recommendation models: the recipe's large ``nn.Embedding`` / ``nn.EmbeddingBag`` tables
(larger than ``--ps-partition-mb``) live on the ps tasks, split by rows; everything else is
DDP, as under mirrored or multi-worker. It is composition, not a third strategy: before DDP
wraps the model, each table is swapped for a ``RemoteEmbedding`` (``ps/tables.py``) that pulls
the rows its batch looks up, so DDP never sees a table and the ps tasks never see a dense layer.

Each step, just before the recipe's optimizer steps the dense parameters (DDP all-reduced their
gradients in backward), every replica pushes its rows' gradients; each ps task applies the
mean of one push per replica once (SyncReplicasOptimizer's rule, ``--ps-sync``'s code) and
answers every replica when it has. The next step's pulls see that update, so the parameters
are one-device's wherever the recipe's optimizer changes only the rows a step looks up (SGD,
Adagrad, SparseAdam): one that would move other rows too is refused in one line naming it.

Each step a replica reports what it moved (``Reporter.bytes_moved``: the live view's line and the
summary): its rows pulled and their gradients pushed, and its dense gradients, which DDP
all-reduces. Mirrored would all-reduce every table's whole gradient instead; ``bench embeddings``
sets the two side by side. ``--clip-grad-norm`` clips one norm over the dense gradients and the
tables' (each made from every replica's rows), as one-device clips its own.

``--elastic``: a lost replica heals as under mirrored, and the ps tasks keep the tables. Each
push names the replica's membership round, and a ps task applies a round only once every replica
of that round pushed to it and every task holds its part (``ps/server.py``); a round a lost
replica can no longer complete is dropped, and the push raises a change of membership. The push
comes before the dense step, so a replica whose step is dropped has changed nothing, and the new
group redoes the whole step. A replica whose rank changes opens its ps connections again: the
chief's operations (checkpoints, the end) are the rank 0's of the round.

The whole tables never reach a replica (never a GPU): they are built on the CPU with the
model, as every strategy builds it, and dropped there. The chief's checkpoint gathers each table
from its shards, so it is the plain model's and loads under any strategy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distrun.config import DEFAULT_PS_PARTITION_MB
from distrun.errors import ConfigError
from distrun.strategies.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from distrun.strategies.parameter_server import _ps_link
from distrun.strategies.ps.channel import open_worker_channels
from distrun.strategies.ps.layout import Layout
from distrun.strategies.step.compile import plain_module
from distrun.strategies.step.precision import ScaledOptimizer
from distrun.strategies.ps.tables import RemoteEmbedding, RowClient, Tables, is_table, rowwise_refusal, table_paths
from distrun.strategies.base import Strategy

__all__ = ["HybridMirroredStrategy", "HybridMultiWorkerStrategy", "hybrid_of"]


class _EmbeddingsOnPs:
    """What the hybrid adds to a DDP strategy: the tables swapped out, pushed at each step."""

    def __init__(self, *args: Any, store: Any, num_ps: int, secret: bytes,
                 partition_bytes: int = int(DEFAULT_PS_PARTITION_MB * 2**20), wire: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        """``store``: the job's TCPStore, where ps connections are numbered; ``secret``: the job's,
        which each ps task checks (``ps/channel.py``); ``wire``: what rows cross in."""
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._store = store
        self._num_ps = num_ps
        self._secret = secret
        self._partition_bytes = partition_bytes
        self._wire = wire
        self._rows: RowClient | None = None
        self._paths: list[str] = []
        self._keys: list[str] = []  # the plain model's state_dict keys, in its order
        self._positions: dict[str, int] = {}  # table path -> its index in the optimizer's state_dict
        self._base_lr: float | None = None
        self._dense_grad_bytes = 0  # a step's dense gradients, which DDP all-reduces

    def _wrap(self, root: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        me: Strategy = self  # type: ignore[assignment]
        model = plain_module(root)  # the recipe's (--compile hands a CompileRoot around it): the checkpoint's names
        paths = table_paths(model, self._partition_bytes)
        if not paths:
            raise ConfigError(f"--embeddings ps: the recipe's model has no nn.Embedding or nn.EmbeddingBag larger "
                              f"than --ps-partition-mb {self._partition_bytes / 2**20:g}; lower it, or leave "
                              "--embeddings out")
        modules = dict(model.named_modules())
        weights = [modules[path].weight for path in paths]
        tied = [name for name, p in model.named_parameters(remove_duplicate=False)
                if any(p is w for w in weights) and name not in {f"{path}.weight" for path in paths}]
        if tied:
            raise ConfigError(f"--embeddings ps: {tied[0]} is a table's weight too (tied weights); a table on the ps "
                              "tasks cannot also be a dense layer's weight: untie them, or leave --embeddings out")
        refusal = rowwise_refusal(optimizer, weights)
        if refusal is not None:
            raise ConfigError(refusal)
        self._paths, self._keys = paths, list(model.state_dict())
        layout = Layout(Tables(model, paths), self._num_ps, self._partition_bytes, rows_of=is_table)
        if me.is_chief:
            for line in layout.describe():
                print(f"[placement] {line}", flush=True)
            print(f"[placement] DDP on every replica: the rest of the model, "
                  f"{sum(p.numel() for n, p in model.named_parameters() if not _in(n, paths))} parameters", flush=True)
        channels = open_worker_channels(self._store, self._num_ps, me.replica_id, self._secret, self._wire)
        self._rows = RowClient(layout, channels, me.device)
        self._channels_of = me.replica_id
        if me._elastic is not None and me._elastic.round is not None:
            self._follow_round(me._elastic.round)
        flat = [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
        for path, weight in zip(paths, weights):
            self._positions[path] = next((i for i, p in enumerate(flat) if p is weight), -1)
            parent_path, _, leaf = path.rpartition(".")
            parent = modules[parent_path] if parent_path else model
            setattr(parent, leaf, RemoteEmbedding(modules[path], Tables.weight_name(path), self._rows))
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.state.pop(weight, None)  # Adagrad makes its state at construction
            weight.data = torch.empty(0, dtype=weight.dtype)  # the replica's copy goes; the ps tasks hold it
        self._dense_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if isinstance(optimizer, torch.optim.Optimizer):
            self._base_lr = float(optimizer.param_groups[0]["lr"]) or None
            optimizer.register_step_pre_hook(self._before_dense_step)
        if any(p.numel() and p.requires_grad for p in model.parameters()):
            wrapped, optimizer = super()._wrap(root, optimizer)  # type: ignore[misc]
        elif me._elastic is not None:  # its rounds rebuild the replicas' DDP, and there is none
            raise ConfigError("--embeddings ps --elastic: every parameter of the recipe's model is a table on the "
                              "ps tasks, so the replicas train nothing that a new round could heal; raise "
                              "--ps-partition-mb to keep a table with DDP, or leave --elastic out")
        else:  # every table on the ps tasks, nothing else trained here (a factorisation model): no DDP
            wrapped = root.to(me.device)
        if isinstance(optimizer, torch.optim.Optimizer):
            _state_to_params(optimizer)
        scaler = me._step.scaler
        if scaler is not None and optimizer is not None:  # fp16: the rows' gradients are unscaled and checked too
            optimizer = _RowsScaledOptimizer(optimizer, list(model.parameters()), scaler, self._rows)
        return wrapped, optimizer

    #: fp16: ``_RowsScaledOptimizer`` unscales (``_wrap``), not the step's own wrapper.
    _unscale_in_step = False

    def _stepping_optimizer(self, optimizer: Any) -> torch.optim.Optimizer | None:
        return super()._stepping_optimizer(getattr(optimizer, "inner", optimizer))  # type: ignore[misc]

    def lr_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizer = getattr(self._wrapped_optimizer, "inner", self._wrapped_optimizer)
        return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []

    _wrapped_optimizer: Any = None

    _clip_max_norm: float | None = None
    _channels_of = 0  # the replica id the ps connections were opened (and proven) with

    def _before_dense_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before the dense step: ``--clip-grad-norm`` over both, then this step's rows to the ps tasks.
        Pushed first, so that a round the ps tasks drop (``--elastic``: a replica lost) leaves the
        dense parameters as they were, and the step is redone whole."""
        if self._clip_max_norm is not None:
            self._clip(optimizer, self._clip_max_norm)
        self._push(optimizer)

    def _push(self, optimizer: Any) -> None:
        """This step's rows to the ps tasks, at this replica's lr (its scheduler's)."""
        assert self._rows is not None
        factor = float(optimizer.param_groups[0]["lr"]) / self._base_lr if self._base_lr else 1.0
        with _ps_link():
            self._rows.push(factor)
        me: Strategy = self  # type: ignore[assignment]
        me._reporter.bytes_moved(self._rows.row_bytes / self._rows.pushes, float(self._dense_grad_bytes))

    def _clip_before_step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """``--clip-grad-norm`` over the dense gradients and the tables' rows together: one-device's clip,
        before the push (``_before_dense_step``)."""
        self._clip_max_norm = max_norm

    # -- --elastic: the ps tasks' rounds follow the membership

    def _follow_round(self, round_: Any) -> None:
        """Push and pull as a replica of membership round ``round_``; connections opened again where
        this replica's rank changed (a ps task proves which replica is the chief by them)."""
        assert self._rows is not None
        me: Strategy = self  # type: ignore[assignment]
        if me.replica_id != self._channels_of:
            with _ps_link():
                self._rows.close(chief=False)  # a BYE: a replica that leaves, not one lost
                self._rows.channels = open_worker_channels(self._store, self._num_ps, me.replica_id, self._secret,
                                                           self._wire)
            self._channels_of = me.replica_id
        self._rows.round_tag, self._rows.members = round_.generation + 1, round_.world_size

    def _release_model(self) -> None:
        """A recovery begins: this replica leaves its membership round on the ps tasks too."""
        super()._release_model()  # type: ignore[misc]
        if self._rows is not None:
            self._rows.touched = []
            with _ps_link():
                self._rows.abandon()

    def _rebuild_model(self, round_: Any) -> None:
        super()._rebuild_model(round_)  # type: ignore[misc]
        if self._rows is not None:
            self._follow_round(round_)

    @torch.no_grad()
    def _clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """``clip_grad_norm_``'s rule over one-device's gradients: the dense ones (DDP's mean, the same on
        every replica) and each table's whole gradient, which is the mean of every replica's row
        gradients, summed where their rows meet. Each replica gathers the others' rows of each table
        to make it (only its norm is needed), so every replica scales by the same factor, and the
        ps tasks' mean of the scaled pushes is the clipped table gradient."""
        assert self._rows is not None
        me: Strategy = self  # type: ignore[assignment]
        dense = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        rows = [(name, ids, values.grad) for name, ids, values in self._rows.touched if values.grad is not None]
        norms = [torch.linalg.vector_norm(grad, 2.0) for grad in dense]
        for name in self._rows.layout.names:
            mine = [(ids, grad) for table, ids, grad in rows if table == name]
            norm = self._table_norm(name, mine, me)
            if norm is not None:
                norms.append(norm)
        if not norms:
            return
        total = torch.linalg.vector_norm(torch.stack([norm.to(me.device) for norm in norms]), 2.0)
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_'s, to the letter
        for grad in [*dense, *(grad for _name, _ids, grad in rows)]:
            grad.mul_(factor.to(grad.device))

    def _table_norm(self, name: str, mine: list[tuple[torch.Tensor, torch.Tensor]], me: Strategy
                    ) -> torch.Tensor | None:
        """The norm of table ``name``'s gradient over the global batch: every replica's row gradients
        (``mine`` here), gathered, summed by row id and averaged over the replicas as the ps tasks
        will; None where no replica looked the table up this step."""
        dim = self._rows.layout.shapes[name][1:]  # type: ignore[union-attr]
        ids = torch.cat([ids for ids, _ in mine]) if mine else torch.zeros(0, dtype=torch.int64, device=me.device)
        grads = (torch.cat([grad for _, grad in mine]) if mine
                 else torch.zeros((0, *dim), dtype=self._rows.layout.dtypes[name], device=me.device))  # type: ignore[union-attr]
        ids, grads = me.gather(ids).to(me.device), me.gather(grads).to(me.device)  # every replica's, in replica order
        if not ids.numel():
            return None
        unique, where = torch.unique(ids, return_inverse=True)
        table = torch.zeros((unique.numel(), *grads.shape[1:]), dtype=grads.dtype, device=grads.device)
        table.index_add_(0, where, grads)
        return torch.linalg.vector_norm(table / me.num_replicas, 2.0)

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._rows is not None:
            self._rows.touched = []  # a step whose update was skipped (--on-nonfinite skip) pushed nothing
        return super().run(fn, *args, **kwargs)  # type: ignore[misc]

    def settle(self) -> None:
        """Before an evaluation, a checkpoint and the end: what this replica's steps moved so far, as a
        log (``--json``, TensorBoard, trackers): the tables' rows and row gradients, to and from the
        ps tasks, beside the dense gradients DDP all-reduced (each step's whole dense part)."""
        super().settle()  # type: ignore[misc]
        if self._rows is None:
            return
        me: Strategy = self  # type: ignore[assignment]
        dense = sum(p.numel() * p.element_size() for p in me.unwrap().parameters())
        me.log(embedding_mb=self._rows.step_bytes / 2**20, dense_grad_mb=dense * self._rows.pushes / 2**20)

    def _checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The plain model's state and the recipe optimizer's, each table gathered from its shards."""
        assert self._rows is not None
        model_state, optimizer_state = super()._checkpoint_state()  # type: ignore[misc]
        with _ps_link():
            values, states = self._rows.gather()
        for path in self._paths:
            model_state[f"{path}.weight"] = values[Tables.weight_name(path)]
        model_state = {key: model_state[key] for key in self._keys if key in model_state}
        if optimizer_state:
            state = dict(optimizer_state.get("state", {}))
            for path in self._paths:
                gathered = states.get(Tables.weight_name(path))
                if gathered and self._positions[path] >= 0:
                    state[self._positions[path]] = gathered
            optimizer_state["state"] = dict(sorted(state.items()))
        return model_state, optimizer_state

    def _load_model_state(self, state: dict[str, Any]) -> None:
        """The dense part into the model; the tables kept for the ps tasks (``_after_restore``)."""
        state = dict(state)
        self._pending_tables = {path: state.pop(f"{path}.weight") for path in self._paths if f"{path}.weight" in state}
        super()._load_model_state(state)  # type: ignore[misc]

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        """The dense parameters' state into the recipe's optimizer; the tables' kept for the ps tasks."""
        if state:
            kept = dict(state.get("state", {}))
            self._pending_table_state = {path: kept.pop(self._positions[path], None) or {} for path in self._paths}
            state = {**state, "state": kept}
        super()._load_optimizer_state(state)  # type: ignore[misc]

    def _after_restore(self) -> None:
        """The chief sends each ps task its rows of the checkpoint's tables and their optimizer state
        (the ps tasks of a ``--resume`` job answer no one before)."""
        super()._after_restore()  # type: ignore[misc]
        me: Strategy = self  # type: ignore[assignment]
        if me.is_chief and self._rows is not None:
            with _ps_link():
                self._rows.load(me.step, {Tables.weight_name(path): table for path, table in self._pending_tables.items()},
                                {Tables.weight_name(path): state for path, state in self._pending_table_state.items()})
        self._pending_tables, self._pending_table_state = {}, {}

    _pending_tables: dict[str, torch.Tensor] = {}
    _pending_table_state: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        """Leave the group together first, then end (chief) or leave (the others) the ps tasks."""
        super().close()  # type: ignore[misc]
        if self._rows is not None:
            self._rows.close(self.is_chief)  # type: ignore[attr-defined]


class _RowsScaledOptimizer(ScaledOptimizer):
    """fp16's step with the tables' rows in it: their gradients are unscaled with the dense ones, and
    the verdict (the same on every replica) covers both, so an overflow skips the dense step and
    the push on every replica alike."""

    def __init__(self, inner: Any, params: list[nn.Parameter], scaler: Any, rows: RowClient | None) -> None:
        super().__init__(inner, params, scaler)
        self._rows = rows

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise TypeError("--precision fp16: optimizer.step(closure) is not supported under loss scaling")
        touched = self._rows.touched if self._rows is not None else []
        grads = [p.grad for p in self._params if p.grad is not None]
        grads += [rows.grad for _name, _ids, rows in touched if rows.grad is not None]
        overflow = self.scaler.unscale_and_check(grads)
        if not overflow:
            self._inner.step()  # its post-hook pushes the rows
        elif self._rows is not None:
            self._rows.touched = []
        self.scaler.update(overflow)


def _state_to_params(optimizer: torch.optim.Optimizer) -> None:
    """State made when the optimizer was built (Adagrad's sums), on the CPU where the model is built,
    follows its parameter to the device the strategy moved it to."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.device != param.device:
                state[key] = value.to(param.device)


def _in(name: str, paths: list[str]) -> bool:
    return any(name.startswith(f"{path}.") for path in paths)


class HybridMirroredStrategy(_EmbeddingsOnPs, MirroredStrategy):
    """mirrored with ``--embeddings ps``."""


class HybridMultiWorkerStrategy(_EmbeddingsOnPs, MultiWorkerMirroredStrategy):
    """multi-worker with ``--embeddings ps``."""


def hybrid_of(name: str) -> type[Strategy]:
    """The hybrid form of strategy ``name`` (mirrored or multi-worker)."""
    kinds: dict[str, type[Strategy]] = {"mirrored": HybridMirroredStrategy, "multi-worker": HybridMultiWorkerStrategy}
    if name not in kinds:
        raise ConfigError(f"--embeddings ps: for --strategy mirrored or multi-worker. Received: --strategy {name}")
    return kinds[name]
