"""ParameterServerStrategy: ps tasks hold the parameters, workers train on their own.

TensorFlow's asynchronous strategy, for the same fit-style recipe. Each worker
keeps a compute copy of the model; every step it

1. has the current dense parameters of every ps task (the reply to its last
   push brought them; the first step pulls), and, inside the forward, pulls
   only the rows of a partitioned embedding that the batch looks up;
2. computes gradients on its own shard of the data (``loss.backward()``);
3. pushes them at ``optimizer.step()``: the ps tasks apply the recipe's
   optimizer to their shards, one push at a time.

The global step is the number of updates applied (the ps task 0's count), so
``--steps N`` means N applied updates whatever the number of workers; with
``--epochs`` each worker's batch is one update, so N = epochs x batches per
epoch x workers (synchronous rounds, ``--ps-sync``, apply one update per round).

Workers share no process group, so one can die without stopping the others.
The chief (worker 0) also coordinates: it prints the placement, evaluates,
writes checkpoints in the synchronous strategies' format (parameters and
optimizer state gathered from the ps tasks) and tells the ps tasks when the job
is over. Choosing this over all-reduce: docs/parameter-server.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distrun.config import DEFAULT_PS_PARTITION_MB
from distrun.errors import PsTaskLost
from distrun.strategies.checkpoint.catalog import latest_checkpoint
from distrun.strategies.ps.channel import (Channel, Op, describe_state, lr_factor_word, open_worker_channels,
                                          receive_state)
from distrun.strategies.ps.layout import Layout, flat_specs, pack, unpack_into
from distrun.strategies.ps.tables import exchange_rows, join_row_shards, send_row_gradients
from distrun.strategies.base import ReplicaInfo, Reporter, Strategy, zero_grads

__all__ = ["ParameterServerStrategy"]


@contextlib.contextmanager
def _ps_link() -> Iterator[None]:
    """A broken connection to a ps task, as one clear error (not gloo's C++ message and stack)."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if "gloo" not in text and "Connection" not in text:
            raise
        raise PsTaskLost(f"lost a ps task: {text.splitlines()[0][:200]}") from None


class _PushOptimizer:
    """Stands in for the recipe's optimizer on a worker: ``step()`` pushes gradients.

    The recipe's own optimizer object is kept (never stepped here) for its
    hyperparameters and its ``state_dict`` layout, which checkpoints reuse. Its lr is this
    worker's: a scheduler built on it (or a step pre-hook) moves it, and each push carries it
    to the ps tasks as a factor of the recipe's lr. Its step hooks run around each push, as
    they would around a step: a push the fp16 scaler drops runs no post-hook.
    """

    def __init__(self, strategy: ParameterServerStrategy, inner: Any) -> None:
        self._strategy = strategy
        self.inner = inner
        groups = inner.param_groups if isinstance(inner, torch.optim.Optimizer) else []
        self._base_lr = groups[0]["lr"] if groups else None  # the recipe's, before any scheduler moved it

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups if self.inner is not None else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self._strategy._params, set_to_none)

    def step(self) -> None:
        inner = self.inner
        hooked = isinstance(inner, torch.optim.Optimizer)
        if hooked:
            for hook in list(inner._optimizer_step_pre_hooks.values()):
                hook(inner, (), {})
        if self._strategy._push(self._lr_factor()) and hooked:
            for hook in list(inner._optimizer_step_post_hooks.values()):
                hook(inner, (), {})

    def _lr_factor(self) -> float:
        """This worker's lr over the recipe's: what the ps tasks apply its push with."""
        if not self._base_lr:
            return 1.0
        return float(self.inner.param_groups[0]["lr"]) / float(self._base_lr)

    def state_dict(self) -> dict[str, Any]:
        return self._strategy._gather_optimizer_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._strategy._pending_optimizer_state = state


class ParameterServerStrategy(Strategy):
    name = "parameter-server"
    _unscale_in_step = False  # fp16: embedding rows' gradients are not in param.grad; _push unscales

    def __init__(self, replica: ReplicaInfo, reporter: Reporter, *, store: Any, num_ps: int, secret: bytes,
                 sync: bool = False, partition_bytes: int = int(DEFAULT_PS_PARTITION_MB * 2**20),
                 wire: torch.dtype | None = None, **kwargs: Any) -> None:
        """``wire``: the dtype pushes and pulls cross in (``--compression fp16|bf16``); the ps keeps fp32.
        ``secret``: the job's, which every ps task checks this worker proves (``ps/channel.py``)."""
        super().__init__(replica, reporter, **kwargs)
        self._wire = wire
        self._secret = secret
        self._store = store
        self._num_ps = num_ps
        self._sync = sync
        self._partition_bytes = partition_bytes
        self._channels: list[Channel] = []
        self._layout: Layout | None = None
        self._params: list[nn.Parameter] = []
        self._stale = True
        self._version = 0
        self._done = False
        self._limit = 0
        self._pushes = 0
        self._touched: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._pending_optimizer_state: dict[str, Any] | None = None
        self.staleness = 0

    # -- identity: workers are the replicas; the ps tasks are not

    @property
    def updates_per_batch(self) -> int:
        """Applied updates per global batch of data: each worker's batch is one, unless in rounds."""
        return 1 if self._sync else self.num_replicas

    @property
    def evaluates(self) -> bool:
        return self.is_chief  # the chief evaluates the whole eval set; workers only train

    @property
    def eval_shard(self) -> tuple[int, int]:
        return (0, 1)

    def set_step_budget(self, total_steps: int | None) -> None:
        self._limit = total_steps or 0

    # -- building

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        model = model.to(self.device)
        self._layout = Layout(model, self._num_ps, self._partition_bytes)
        self._params = list(model.parameters())
        if self.is_chief:
            for line in self._layout.describe():
                print(f"[placement] {line}", flush=True)
        self._channels = open_worker_channels(self._store, self._num_ps, self.replica_id, self._secret, self._wire)
        # Evaluation (and any forward outside ``run``) sees the current parameters too.
        model.register_forward_pre_hook(lambda module, args: self._pull() if self._stale else None)
        modules = dict(model.named_modules())
        for name in self._layout.sparse_names:
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            embedding = modules[owner]
            embedding.forward = self._sparse_forward(embedding, name)  # type: ignore[method-assign]
        self._dense_specs = [flat_specs([self._layout.shard_shape(r) for r in self._layout.dense(t)],
                                        [self._layout.dtypes[r.name] for r in self._layout.dense(t)])
                             for t in range(self._num_ps)]
        return model, _PushOptimizer(self, optimizer)

    # -- the step: pull, (forward, backward), push

    @torch.no_grad()
    def _pull(self) -> None:
        with _ps_link():
            self._pull_dense()
        if self._done and self._limit:
            self.step = self._limit  # finished by the others while this worker was away (evaluating, say)
        self._stale = False

    def _pull_dense(self) -> None:
        assert self._layout is not None
        for channel in self._channels:
            channel.send_header(Op.PULL)
        for task, channel in enumerate(self._channels):
            header = channel.recv_header()
            self._receive_dense(task, channel)
            if task == 0:
                self._version = header[0]
            self._done = self._done or bool(header[1])

    def _receive_dense(self, task: int, channel: Channel) -> None:
        """Task ``task``'s dense shards, straight into this worker's parameters."""
        assert self._layout is not None
        flats = [channel.recv_values((n,), dtype) for n, dtype in self._dense_specs[task]]
        targets = [ref.view(self._params[ref.index].data) for ref in self._layout.dense(task)]
        unpack_into([f.to(self.device) for f in flats], targets)

    @torch.no_grad()
    def _push(self, lr_factor: float = 1.0) -> bool:
        """Push this step's gradients, applied at ``lr_factor`` times the recipe's lr; False when
        the fp16 scaler dropped them."""
        touched = self._touched
        self._touched = []
        if self._overflowed(touched):
            self._stale = True  # no push, so no reply with parameters: the next step pulls them
            return False
        with _ps_link():
            self._send_gradients(touched, lr_factor)
            for task, channel in enumerate(self._channels):
                applied, done, staleness, *_rest = channel.recv_header()
                self._receive_dense(task, channel)  # the next step's parameters, in the same reply
                if task == 0:
                    self._version, self.staleness = applied, staleness
                self._done = self._done or bool(done)
        self._pushes += 1
        self._stale = False
        return True

    def _overflowed(self, touched: list[tuple[str, torch.Tensor, torch.Tensor]]) -> bool:
        """fp16: unscale this worker's gradients, dense and embedding rows; True means skip the push.

        The verdict is this worker's alone: asynchronous workers share no step, so one
        worker's skipped batch is a lost gradient (as a dropped push is), not a stall.
        """
        scaler = self._step.scaler
        if scaler is None:
            return False
        grads = [p.grad for p in self._params if p.grad is not None]
        grads += [rows.grad for _name, _ids, rows in touched if rows.grad is not None]
        overflow = scaler.unscale_and_check(grads)
        scaler.update(overflow)
        return overflow

    def _send_gradients(self, touched: list[tuple[str, torch.Tensor, torch.Tensor]], lr_factor: float) -> None:
        """One PUSH to every ps task: its dense shards' gradients, then its embedding rows'."""
        assert self._layout is not None
        for task, channel in enumerate(self._channels):
            grads = []
            for ref in self._layout.dense(task):
                param = self._params[ref.index]
                grads.append(ref.view(param.grad) if param.grad is not None else ref.view(torch.zeros_like(param)))
            # The reply brings the next parameters.
            channel.send_header(Op.PUSH, self._version, self._limit, lr_factor_word(lr_factor))
            channel.send_values(*[g.cpu() for g in pack(grads)])
            send_row_gradients(self._layout, channel, task, touched)

    def _sparse_forward(self, embedding: nn.Embedding, name: str) -> Any:
        """An embedding forward that pulls only the looked-up rows, and keeps them for the push."""
        def forward(ids: torch.Tensor) -> torch.Tensor:
            uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
            rows = self._pull_rows(name, uniq)
            rows.requires_grad_(torch.is_grad_enabled())
            if rows.requires_grad:
                self._touched.append((name, uniq, rows))
            padding = None
            if embedding.padding_idx is not None:
                hit = (uniq == embedding.padding_idx).nonzero()
                padding = int(hit[0, 0]) if hit.numel() else None
            return F.embedding(inverse.view(ids.shape), rows, padding, None, 2.0,
                               embedding.scale_grad_by_freq, False)
        return forward

    @torch.no_grad()
    def _pull_rows(self, name: str, uniq: torch.Tensor) -> torch.Tensor:
        with _ps_link():
            return self._exchange_rows(name, uniq)

    def _exchange_rows(self, name: str, uniq: torch.Tensor) -> torch.Tensor:
        assert self._layout is not None
        return exchange_rows(self._layout, self._channels, name, uniq).to(self.device)

    def _sync_wait_s(self, timed_s: float | None) -> float | None:
        """Asynchronous workers wait for no other worker: a worker's step time is its compute time.
        ``--ps-sync`` rounds wait for every worker's push, and that wait is not timed."""
        return None if self._sync else 0.0

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._stale:  # here, not only in the forward hook: a recipe's forward may skip the root module
            self._pull()
        self._reporter.step_started(self.step + 1)
        with self.autocast():
            result = fn(*args, **kwargs)
        self.step = self._limit if self._done and self._limit else self._version
        self._reporter.worker_progress(self._pushes, self.staleness)
        self._report_step(result)
        return result

    # -- checkpoints: gathered from (and restored to) the ps tasks, in the common format

    def _fetch_state(self) -> list[list[tuple[torch.Tensor, dict[str, Any]]]]:
        """Per ps task, each owned shard's values and optimizer state (in the layout's order)."""
        assert self._layout is not None
        replies = []
        with _ps_link():
            for task, channel in enumerate(self._channels):
                channel.send_header(Op.STATE)
                doc = channel.recv_json()
                shards = []
                for ref, shard in zip(self._layout.owned(task), doc["shards"]):
                    value = channel.recv(self._layout.shard_shape(ref), self._layout.dtypes[ref.name])
                    shards.append((value, receive_state(channel, shard["state"])))
                replies.append(shards)
        return replies

    def _gathered(self) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, Any]]]:
        """Whole parameters and per-parameter optimizer state, joined from the row shards."""
        assert self._layout is not None
        parts: dict[int, list[tuple[int, torch.Tensor, dict[str, Any]]]] = {}
        for task, shards in enumerate(self._fetch_state()):
            for ref, (value, state) in zip(self._layout.owned(task), shards):
                parts.setdefault(ref.index, []).append(((ref.shard.rows or (0, 0))[0], value, state))
        return join_row_shards(parts)

    def _checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The model (parameters from the ps tasks, buffers from the chief) and the optimizer
        state, in exactly the layout the synchronous strategies write, from one gather."""
        values, states = self._gathered()
        with torch.no_grad():
            for i, value in values.items():
                self._params[i].data.copy_(value.to(self._params[i].device))
        model_state = {k: v.detach().cpu() for k, v in self.unwrap().state_dict().items()}
        return model_state, self._optimizer_layout(states)

    def _gather_optimizer_state(self) -> dict[str, Any]:
        return self._optimizer_layout(self._gathered()[1])

    def _optimizer_layout(self, states: dict[int, dict[str, Any]]) -> dict[str, Any]:
        inner = self._optimizer.inner if self._optimizer is not None else None
        if inner is None:
            return {}
        position = self._optimizer_positions(inner)
        layout = inner.state_dict()
        layout["state"] = {position[i]: state for i, state in states.items() if i in position}
        return layout

    def _optimizer_positions(self, inner: Any) -> dict[int, int]:
        """Layout parameter index -> its index in the optimizer's state_dict."""
        by_id = {id(p): i for i, p in enumerate(self._params)}
        positions: dict[int, int] = {}
        flat = [p for group in inner.param_groups for p in group["params"]]
        for position, param in enumerate(flat):
            if id(param) in by_id:
                positions[by_id[id(param)]] = position
        return positions

    def save(self, directory: Any, *, keep: int = 3, wait: bool = False, extra: dict[str, Any] | None = None) -> Any:
        if not self.is_chief:
            return None  # the chief writes; the others keep training
        return super().save(directory, keep=keep, wait=wait, extra=extra)

    #: The chief restores alone (the workers wait on the ps tasks): no agreement among the ranks.
    _agrees_on_checkpoints = False

    def restore(self, directory: Any) -> dict[str, Any]:
        if not self.is_chief:  # the ps tasks hold every worker until the chief has loaded them
            if self.lr_schedule is not None:  # each worker goes on from the chief's schedule
                path = latest_checkpoint(directory)
                if path is not None:
                    data = self._read_checkpoint(path)
                    self.lr_schedule.load_state_dict(data.get("lr_scheduler"), int(data.get("step", 0)))
            # A custom loop's own state, on every worker (the chief's, as every strategy returns it).
            path = latest_checkpoint(directory)
            return {"extra": (self._read_checkpoint(path).get("extra") or {}) if path is not None else {}}
        return super().restore(directory)

    def lr_optimizers(self) -> list[torch.optim.Optimizer]:
        """The recipe's optimizer: never stepped here, but its lr is what each push carries."""
        inner = self._wrapped_optimizer.inner if isinstance(self._wrapped_optimizer, _PushOptimizer) else None
        return [inner] if isinstance(inner, torch.optim.Optimizer) else []

    def _after_restore(self) -> None:
        """Send the loaded parameters and optimizer state to the ps tasks that own them."""
        assert self._layout is not None
        inner = self._optimizer.inner if self._optimizer is not None else None
        saved = self._pending_optimizer_state or {}
        position = self._optimizer_positions(inner) if inner is not None else {}
        saved_state = saved.get("state", {})
        for task, channel in enumerate(self._channels):
            shards, tensors = [], []
            for ref in self._layout.owned(task):
                param = self._params[ref.index].detach().cpu()
                state = saved_state.get(position.get(ref.index, -1), {})
                # This shard's rows of every state tensor shaped like the parameter (Adam's moments).
                rows = {key: ref.view(value) if isinstance(value, torch.Tensor) and value.shape == param.shape
                        else value for key, value in state.items()}
                described, state_tensors = describe_state(rows)
                shards.append({"state": described})
                tensors += [ref.view(param).contiguous(), *state_tensors]
            with _ps_link():
                channel.send_header(Op.LOAD)
                channel.send_json({"applied": self.step, "shards": shards})
                channel.send(*tensors)
                channel.recv_header()
        self._pending_optimizer_state = None
        self._version = self.step
        self._stale = True

    # -- the end

    def close(self) -> None:
        """The chief ends the job on every ps task; any other worker just leaves."""
        op = Op.FINISH if self.is_chief else Op.BYE
        for channel in self._channels:
            try:
                channel.send_header(op)
                if op == Op.FINISH:
                    channel.recv_header()
            except RuntimeError:
                pass  # that ps task is gone already
        self._channels = []
