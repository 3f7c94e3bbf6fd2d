"""Checkpoints: the plain file format (``files``), written atomically and loaded with
``weights_only=True``; ``latest_checkpoint``/``list_checkpoints``/``load_checkpoint`` are
the contract the strategies and the CLI use.
"""

from distrun.strategies.checkpoint.files import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["checkpoint_path", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
