"""Reading sharded checkpoints (``shards``' folders) through torch.distributed.checkpoint.

Apart from ``shards`` because DCP's import costs a rank about 0.75 s (it pulls in DTensor): a job
that never reads a sharded checkpoint never imports it. What the index may hold, and why it is
read with a restricted unpickler, is ``shards``' docstring.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from distrun.errors import CheckpointError

__all__ = ["read_index", "read_tensors", "load_into", "SafeReader"]

_INDEX = ".metadata"  # DCP's index of a checkpoint folder

#: What DCP's index may name (module, attribute): its metadata classes, torch's dtypes and
#: sizes, paths. Anything else in a ``.metadata`` file is refused.
_INDEX_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *((module, name) for module in ("pathlib", "pathlib._local")  # Python 3.13 pickles paths from pathlib._local
      for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
}



class _IndexUnpickler(pickle._Unpickler):  # noqa: SLF001 - the Python unpickler: its opcodes can be overridden
    """Only DCP's metadata classes, torch's dtypes and sizes, and paths; and BUILD (setting an
    object's state) only on instances, never on a class: an index could otherwise rewrite an
    admitted class's attributes for the whole process."""

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")

    def _load_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError(f"sets the attributes of the class {self.stack[-2].__qualname__}")
        pickle._Unpickler.load_build(self)  # noqa: SLF001

    dispatch[pickle.BUILD[0]] = _load_build


def read_index(path: str | os.PathLike[str]) -> Metadata:
    """DCP's ``.metadata``, through the restricted unpickler; only tensor entries are accepted."""
    where = Path(path) / _INDEX
    try:
        with open(where, "rb") as fh:
            index = _IndexUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a sharded checkpoint (no {_INDEX})") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, ImportError, IndexError,
            KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: refused: {exc}") from None
    if not isinstance(index, Metadata):
        raise CheckpointError(f"{where}: not a DCP index")
    objects = [key for key, entry in index.state_dict_metadata.items() if not isinstance(entry, TensorStorageMetadata)]
    if objects:
        raise CheckpointError(f"{path}: holds pickled objects ({', '.join(objects[:3])}); distrun loads tensors only")
    return index


class SafeReader(FileSystemReader):
    """DCP's file reader with the restricted index reader."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = read_index(self.path)
        if index.storage_meta is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


def read_tensors(path: str | os.PathLike[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor whose key starts with ``prefix``, whole, on the CPU, in this process alone
    (no process group): for a model that is not sharded, and for the tools (``export`` reads
    the model's alone, not the optimizer's twice-as-large state)."""
    index = read_index(path)
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
               for key, entry in index.state_dict_metadata.items() if key.startswith(prefix)}
    with warnings.catch_warnings():  # DCP warns that no process group means one process: that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=SafeReader(path), no_dist=True)
    return tensors


def load_into(path: str | os.PathLike[str], targets: dict[str, Any]) -> set[str]:
    """Fill ``targets`` (tensors or DTensors, any sharding) in place from the checkpoint, every
    rank together. Keys the checkpoint lacks are left out: model keys are an error (a different
    model); optimizer keys are state that was never created. Returns the keys loaded."""
    present = set(read_index(path).state_dict_metadata)
    missing = sorted(key for key in targets if key not in present and key.startswith("model/"))
    if missing:
        raise CheckpointError(f"{path}: this model's {', '.join(m[6:] for m in missing[:3])}"
                              f"{'...' if len(missing) > 3 else ''} not in the checkpoint (a different model?)")
    wanted = {key: value for key, value in targets.items() if key in present}
    try:
        dcp.load(wanted, storage_reader=SafeReader(path))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's own is a BaseException
        raise CheckpointError(f"{path}: cannot load: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
    return set(wanted)
