"""A replica's checkpoints: what ``save`` writes and ``restore`` reads, in the plain format or a
strategy's own (a mixin of ``Strategy``, as ``ReplicaCollectives`` is: it uses the strategy's state).

``save`` is called by every replica; the plain format's chief writes ``ckpt-<step>.pt`` and the
others wait at a barrier until it is complete. ``restore`` reads the newest checkpoint of either
format, at any world size, into the prepared model and optimizer, and puts back the step, the
data position, the random state and the loss scale. Strategies change what is written through
the hooks (``_checkpoint_state``, ``_comm_state``, ``_write_checkpoint``, ``_read_checkpoint``,
``_load_checkpoint``, ``_after_restore``), never the two calls.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from distrun.errors import CheckpointError, RecipeError
from distrun.strategies.checkpoint.agreed import agreed_checkpoint
from distrun.strategies.checkpoint.catalog import latest_checkpoint, load_checkpoint, newest_complete, prune
from distrun.strategies.checkpoint.files import save_checkpoint
from distrun.strategies.checkpoint.mismatch import describe_mismatch
from distrun.strategies.checkpoint.pending import PendingSave
from distrun.strategies.checkpoint.rng import rng_state, set_rng_state

__all__ = ["CheckpointReplica"]


class CheckpointReplica:
    """Mixed into Strategy, which supplies the model, optimizer, step, data position and reporter."""

    _optimizer: Any
    _replica: Any
    _reporter: Any
    _dataset: Any
    _step: Any
    _global_batch_size: int | None
    step: int
    epoch: int
    name: str
    restored_from: Path | None
    #: The fit loop's learning-rate schedule (``runtime/_schedule.LrSchedule``), when the recipe has
    #: one: its state is every checkpoint's ``lr_scheduler``, and ``restore`` puts it back.
    lr_schedule: Any = None
    #: Told ``(step, path)`` after ``restore`` read a checkpoint: the runtime says "resumed from ...
    #: at step N" for a custom loop, which calls ``restore`` itself (the fit loop says it on its own).
    on_restored: Callable[[int, str], None] | None = None
    #: Whether every rank of the default group restores at once, so that they can agree on rank 0's
    #: checkpoint (``agreed.py``); the parameter-server chief restores alone.
    _agrees_on_checkpoints = True
    _collective_device: torch.device
    _distributed: bool

    def _optimizer_state(self) -> dict[str, Any]:
        return self._optimizer.state_dict() if self._optimizer is not None else {}

    def _checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(model state_dict on the CPU, optimizer state_dict): what the chief's plain checkpoint stores."""
        model = self.unwrap()
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}, self._optimizer_state()

    def _load_model_state(self, state: dict[str, Any]) -> None:
        self.unwrap().load_state_dict(state)

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self._optimizer is not None and state:
            self._optimizer.load_state_dict(state)

    def _comm_state(self) -> dict[str, Any] | None:
        """Gradient communication's state for a checkpoint (``comm``); every replica calls it
        (it may gather), the chief's answer is written. None: nothing to keep."""
        return None

    def _load_comm_state(self, saved: dict[str, Any] | None) -> None:
        """Take back ``_comm_state``'s checkpoint entry (None when the checkpoint has none)."""

    def check_checkpoint_dir(self, directory: str | Path) -> None:
        """Before training: fail now rather than at the first save if ``directory`` cannot hold
        this strategy's checkpoints. Nothing to check for the chief's one file."""

    def _checkpoint_meta(self) -> dict[str, Any]:
        """Everything a checkpoint keeps besides the model and the optimizer."""
        position = self._dataset.position if self._dataset is not None else (self.epoch, 0)
        meta = {"step": self.step, "epoch": position[0], "batch_in_epoch": position[1], "rng": rng_state(),
                "strategy": self.name, "num_replicas": self.num_replicas,
                "global_batch_size": self._global_batch_size, "seed": self._replica.seed,
                # The step's layout beside the strategy (model parallel adds its mesh): what a run, or
                # --strategy auto, chose; a resume may choose again, since checkpoints reshard.
                "layout": {"accumulate": self._step.settings.accumulate,
                           "activation_checkpointing": self._step.settings.activation_checkpointing}}
        scaler = self._step.scaler_state()
        if scaler is not None:
            meta["scaler"] = scaler
        if self.lr_schedule is not None:
            meta["lr_scheduler"] = self.lr_schedule.state_dict()
        return meta

    def save(self, directory: str | Path, *, keep: int = 3, wait: bool = False,
             extra: dict[str, Any] | None = None) -> Path | None:
        """Write this step's checkpoint into ``directory`` and keep the newest ``keep``; every
        replica calls it. Returns its path on the chief (None elsewhere, and under
        ``--async-checkpoint`` while it is still being written, unless ``wait``).

        ``extra``: a custom loop's own state (a scheduler's or an early stop's ``state_dict()``),
        which ``restore`` returns as its ``extra`` entry. The chief's is kept, as JSON in either
        format (a sharded checkpoint's sidecar is JSON), so it must hold plain values: it comes
        back the same from every format, tuples as lists."""
        self._finish_checkpoint()  # a wait here is the previous save's cost, counted there
        started = time.perf_counter()
        with self._saving(directory, "saving a checkpoint"):
            kept = _plain(extra) if extra is not None else None  # refused before anything is written
            comm = self._comm_state()
            meta = self._checkpoint_meta()
            if comm is not None:
                meta["comm"] = comm
            if kept is not None:
                meta["extra"] = kept
            return self._write_checkpoint(Path(directory), meta, keep=keep, started=started, wait=wait)

    @contextlib.contextmanager
    def _saving(self, directory: str | Path, doing: str) -> Iterator[None]:
        """A save that fails says so (a failure here is not "at step N+1": ``during`` stays set
        on the way out) and names the newest checkpoint still complete, which ``--resume`` takes."""
        before, self._reporter.during = getattr(self._reporter, "during", None), doing
        try:
            yield
        except CheckpointError as exc:
            if getattr(exc, "newest_named", False):  # a save with wait=True: its write's own failure, named
                raise
            named = CheckpointError(f"{exc.message}; {newest_complete(directory)}", detail=exc.detail)
            named.newest_named = True  # type: ignore[attr-defined]
            raise named from None
        except Exception as exc:
            if self.is_membership_change(exc):  # --elastic goes on: the next failure is at a step again
                self._reporter.during = before
            raise
        self._reporter.during = before

    def _write_checkpoint(self, directory: Path, meta: dict[str, Any], *, keep: int, started: float,
                          wait: bool) -> Path | None:
        """The plain format: the chief writes ``ckpt-<step>.pt``; every replica waits until it is complete."""
        path = None
        if self.is_chief:
            model_state, optimizer_state = self._checkpoint_state()
            path = save_checkpoint(directory, self.step, {"model": model_state, "optimizer": optimizer_state,
                                                               **meta})
            prune(directory, keep)
        self.barrier()
        if path is not None:
            self._reporter.checkpoint(self.step, str(path), (time.perf_counter() - started) * 1e3)
        return path

    #: A checkpoint still being written in the background (``--async-checkpoint``).
    _pending_save: PendingSave | None = None

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written in the background is written and reported."""
        self._finish_checkpoint()

    def _finish_checkpoint(self, *, block: bool = True) -> Path | None:
        """Report a background save once it is written (waiting for it when ``block``); its path
        on the chief."""
        pending = self._pending_save
        if pending is None or (not block and not pending.done()):
            return None
        self._pending_save = None
        started = time.perf_counter()
        with self._saving(pending.directory, "writing a checkpoint in the background"):
            path = pending.wait()
        # Training waited for the write (the next save, the run's end): the save's cost too.
        pending.blocked_ms += (time.perf_counter() - started) * 1e3 if block else 0.0
        if path is not None:
            self._reporter.checkpoint(pending.step, str(path), pending.blocked_ms)
        return path

    def restore(self, directory: str | Path) -> dict[str, Any]:
        """Load the newest checkpoint in ``directory`` (either format, any world size) into the
        prepared model and optimizer. Restores step, data position and RNG too; returns the
        checkpoint's entries (a sharded one's without its tensors), among them ``extra``: what
        ``save(extra=...)`` kept (``{}`` where it kept nothing)."""
        path, received = self.agreed_checkpoint(lambda: latest_checkpoint(directory))
        if path is None:
            raise CheckpointError(f"{directory}: no checkpoint to resume from (expected ckpt-<step>.pt or ckpt-<step>/)")
        data = received if received is not None else self._read_checkpoint(path)
        saved_gbs = data.get("global_batch_size")
        if saved_gbs and self._global_batch_size and saved_gbs != self._global_batch_size:
            raise CheckpointError(
                f"{path}: written with global batch size {saved_gbs}, resumed with {self._global_batch_size}; "
                "the data position only carries over with the same global batch size"
            )
        try:
            self._load_checkpoint(path, data)
        except RuntimeError as exc:  # another model's checkpoint: say which keys and shapes differ
            mismatch = describe_mismatch(exc)
            if mismatch is None:
                raise
            raise CheckpointError(f"{path}: not a checkpoint of this model: {mismatch}") from None
        self.restored_from = path  # the live view and the summary say what was resumed
        self.step = int(data["step"])
        self.epoch = int(data.get("epoch", 0))
        if self._dataset is not None:
            self._dataset.seek(self.epoch, int(data.get("batch_in_epoch", 0)))
        set_rng_state(data.get("rng") or {}, self.device)
        self._step.load_scaler_state(data.get("scaler"))
        if self.lr_schedule is not None:  # after the optimizer's state, whose groups carry an lr too
            self.lr_schedule.load_state_dict(data.get("lr_scheduler"), self.step)
        self._load_comm_state(data.get("comm"))
        self._after_restore()
        data["extra"] = data.get("extra") or {}
        if self.on_restored is not None:
            self.on_restored(self.step, str(path))
        return data

    def agreed_checkpoint(self, find: Callable[[], Path | None]) -> tuple[Path | None, dict[str, Any] | None]:
        """One checkpoint for every rank (``find``: the one this rank would read on its own), and
        its entries where this rank's host does not hold it (None: read the path): ``agreed.py``."""
        if not self._agrees_on_checkpoints or not self._distributed:  # one process: its own
            return find(), None
        return agreed_checkpoint(find, self._collective_device)

    def _read_checkpoint(self, path: Path) -> dict[str, Any]:
        """The checkpoint as the plain format's dict: whole tensors, whichever format it is in."""
        return load_checkpoint(path)

    def _load_checkpoint(self, path: Path, data: dict[str, Any]) -> None:
        self._load_model_state(data["model"])
        self._load_optimizer_state(data.get("optimizer") or {})

    def _after_restore(self) -> None:
        """Hook: re-synchronise replicas after loading state."""


def _plain(extra: Any) -> dict[str, Any]:
    """``save(extra=...)`` as JSON gives it back: the same from the plain and the sharded format."""
    if not isinstance(extra, dict):
        raise RecipeError(f"strategy.save(extra=...) takes a dict of plain values. Received: {type(extra).__name__}")
    try:
        return json.loads(json.dumps(extra))
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"strategy.save(extra=...): {exc}; a checkpoint keeps plain values (dict, list, "
                          "str, int, float, bool, None): a tensor as .tolist(), a scheduler as its state_dict()"
                          ) from None
