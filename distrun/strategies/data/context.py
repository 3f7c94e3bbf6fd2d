"""InputContext: what ``train_data(ctx)`` needs to build its replica's input."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InputContext"]


@dataclass(frozen=True)
class InputContext:
    """TensorFlow's tf.distribute.InputContext, for PyTorch recipes.

    A recipe that returns an iterable (not a map-style Dataset) shards it itself
    with ``replica_id``/``num_replicas`` and batches it with
    ``per_replica_batch_size``.
    """

    num_replicas: int
    replica_id: int
    global_batch_size: int
    seed: int = 0

    @property
    def per_replica_batch_size(self) -> int:
        return self.global_batch_size // self.num_replicas
