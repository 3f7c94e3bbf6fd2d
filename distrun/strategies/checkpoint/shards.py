"""Sharded checkpoints: a folder per checkpoint, torch.distributed.checkpoint (DCP) inside.

::

    ckpt-000000100/
        __0_0.distcp, __1_0.distcp, ...   each rank's own shards, written by that rank, in parallel
        .metadata                         DCP's index: which file holds which piece of which tensor
        distrun.json                      the rest: format, step, data position, RNG, optimizer groups

**Atomic.** Every rank writes into ``.tmp-ckpt-<step>/``. DCP's coordinator writes
``.metadata`` only once every rank's file is written and fsynced; then rank 0 checks that
every file the index names is there, writes ``distrun.json`` (fsynced) and renames the folder
to ``ckpt-<step>/``, then fsyncs the parent. So a ``ckpt-<step>`` folder is complete by
construction: a job killed mid-save leaves the previous checkpoints the newest and a
``.tmp-ckpt-*`` folder, which listing ignores and the next save removes; a save that fails
on any rank (a full disk) is removed at once by every rank (``discard``).

**Resharding.** DCP's index records each tensor's global shape and every shard's offsets,
so a checkpoint loads onto any number of ranks: a sharded model takes only its own pieces
(``shard_reader.load_into``), a whole model (mirrored, one-device, ``export``) takes every piece
(``shard_reader.read_tensors``).

**No code runs on load.** DCP writes its index with ``pickle`` and reads non-tensor entries
with ``torch.load(weights_only=False)``. distrun writes tensors only (``layout.split`` puts the
rest in ``distrun.json``), reads the index with an unpickler that admits DCP's own metadata
classes and nothing else, and refuses a checkpoint that holds pickled objects.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from distrun.errors import CheckpointError
from distrun.strategies.checkpoint.files import fsync_dir
from distrun.strategies.checkpoint.write_failure import write_failed

__all__ = ["FORMAT", "SIDECAR", "folder_path", "temporary_path", "is_sharded", "prepare", "commit", "discard",
           "read_sidecar", "size_bytes", "remove", "remove_stale"]

FORMAT = "distrun.checkpoint.dcp.v1"
SIDECAR = "distrun.json"
_TMP_PREFIX = ".tmp-ckpt-"

def folder_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}"


def temporary_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"{_TMP_PREFIX}{step:09d}"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir()


def prepare(directory: str | os.PathLike[str], step: int) -> Path:
    """Rank 0, before any rank writes: remove what killed saves left, make the step's folder."""
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale(folder)
        tmp = temporary_path(folder, step)
        tmp.mkdir()
        return tmp
    except OSError as exc:
        raise write_failed(folder, step, exc) from None


def discard(directory: str | os.PathLike[str], step: int, exc: BaseException) -> CheckpointError:
    """Any rank, after a save of ``step`` failed on any rank (DCP raises on every rank once all
    have written or failed): remove what was written, and say why in one line."""
    shutil.rmtree(temporary_path(directory, step), ignore_errors=True)
    return exc if isinstance(exc, CheckpointError) else write_failed(Path(directory), step, exc)


def commit(directory: str | os.PathLike[str], step: int, sidecar: dict[str, Any]) -> Path:
    """Rank 0, once DCP's save has returned: the sidecar, then the rename that publishes it."""
    folder = Path(directory)
    tmp, final = temporary_path(folder, step), folder_path(folder, step)
    missing = _missing_files(tmp)
    if missing:
        raise CheckpointError(
            f"{folder}: the shards of step {step} written on other hosts are not here ({', '.join(missing[:3])}"
            f"{'...' if len(missing) > 3 else ''}): a sharded checkpoint needs a --checkpoint-dir every host shares")
    try:
        with open(tmp / SIDECAR, "w", encoding="utf-8") as fh:
            json.dump({"format": FORMAT, **sidecar}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)  # the folder's own entries, before it is published
        if final.exists():  # the same step saved again: out of the listing first, then replaced
            remove(final)
        os.replace(tmp, final)
        fsync_dir(folder)
    except OSError as exc:
        raise discard(folder, step, exc) from None
    return final


def read_sidecar(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(Path(path) / SIDECAR, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete sharded checkpoint (no {SIDECAR})") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}/{SIDECAR}: unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a distrun sharded checkpoint (format {FORMAT} expected)")
    return data


def remove(path: Path) -> None:
    """Delete a published checkpoint folder: renamed out of the listing first (one atomic step),
    so a kill halfway through the delete never leaves a ``ckpt-<step>`` with files missing."""
    doomed = path.with_name(f"{_TMP_PREFIX}removed-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale(directory: str | os.PathLike[str]) -> None:
    """What killed saves and deletes left (``.tmp-ckpt-*`` folders); nothing else is written there."""
    folder = Path(directory)
    for entry in folder.glob(f"{_TMP_PREFIX}*"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def size_bytes(path: str | os.PathLike[str]) -> int:
    return sum(entry.stat().st_size for entry in Path(path).iterdir() if entry.is_file())


def _missing_files(tmp: Path) -> list[str]:
    from distrun.strategies.checkpoint.shard_reader import read_index  # DCP: the saving job imported it already

    index = read_index(tmp)
    named = {info.relative_path for info in (index.storage_data or {}).values()}
    return sorted(name for name in named if not (tmp / name).is_file())
