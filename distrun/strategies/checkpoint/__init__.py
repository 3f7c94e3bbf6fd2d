"""Checkpoints in two formats behind one contract (``catalog``).

``files``: the plain format, one ``ckpt-<step>.pt`` written by rank 0 and loaded with
``weights_only=True`` (every strategy but sharded writes it). ``shards``: a ``ckpt-<step>/``
folder of torch.distributed.checkpoint shards, each rank writing its own (sharded writes it).
``latest_checkpoint``/``list_checkpoints``/``load_checkpoint`` read both.
"""

from distrun.strategies.checkpoint import layout, shards
from distrun.strategies.checkpoint.catalog import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune,
    read_entries,
)
from distrun.strategies.checkpoint.files import checkpoint_path, save_checkpoint

__all__ = ["layout", "shards", "checkpoint_path", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "prune", "read_entries",
           "save_checkpoint"]
