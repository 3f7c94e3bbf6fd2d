"""Plain checkpoints: one ``ckpt-<step>.pt`` file each, written atomically by rank 0.

The format is deliberately plain so any tool can read it::

    torch.load(path, weights_only=True) -> {
        "format": "distrun.checkpoint.v1",
        "model": state_dict of the unwrapped model (no "module." prefix, CPU tensors),
        "optimizer": optimizer.state_dict(),
        "step": global step, "epoch": int, "batch_in_epoch": int (data position),
        "rng": {"torch": ByteTensor, "python": random.getstate()},
        "strategy": str, "num_replicas": int, "global_batch_size": int | None, "seed": int,
        "layout": {"accumulate": int, "activation_checkpointing": str}, and under --tp/--pp
        "mesh": {"dp", "tp", "pp"},
    }

Nothing in it needs pickle's arbitrary-object loading, so ``weights_only=True``
loads it. Writes go to a temporary file in the same folder, are fsynced, renamed
over the final name and the folder is fsynced: a process killed mid-save leaves
the previous checkpoints intact and at most a stray temporary file, which
listing ignores and the next save removes. A save that fails (a full disk)
removes its own temporary file.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from distrun.errors import CheckpointError
from distrun.strategies.checkpoint.write_failure import RecordingFile, write_failed

__all__ = ["FORMAT", "checkpoint_path", "list_files", "save_checkpoint", "load_file", "load_bytes", "fsync_dir"]

FORMAT = "distrun.checkpoint.v1"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP_PREFIX = ".tmp-ckpt-"


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def list_files(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every complete plain checkpoint, oldest first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def save_checkpoint(directory: str | os.PathLike[str], step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically; a write that fails (a full
    disk) leaves nothing of it behind and says why in one line."""
    folder = Path(directory)
    tmp = folder / f"{_TMP_PREFIX}{step:09d}-{os.getpid()}"
    recorder = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(folder)
        final = checkpoint_path(folder, step)
        with open(tmp, "wb") as fh:
            recorder = RecordingFile(fh)
            torch.save({"format": FORMAT, **state}, recorder)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(folder)
        return final
    except Exception as exc:  # noqa: BLE001 - torch.save turns the OSError into a RuntimeError
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise write_failed(folder, step, exc, recorder.error if recorder else None) from None


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    return _loaded(path, path)


def load_bytes(data: bytearray, path: str | os.PathLike[str]) -> dict[str, Any]:
    """A plain checkpoint's bytes, received from another host (``agreed.py``); ``path``: where it
    is there."""
    return _loaded(_Buffer(data), path)


class _Buffer(io.RawIOBase):
    """A read-only file over a buffer: torch.load reads it piece by piece, where ``io.BytesIO``
    would first copy a bytearray whole (a checkpoint's size again)."""

    def __init__(self, data: bytearray) -> None:
        super().__init__()
        self._view, self._at = memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, target: Any) -> int:
        part = self._view[self._at:self._at + len(target)]
        target[:len(part)] = part
        self._at += len(part)
        return len(part)


def _loaded(source: str | os.PathLike[str] | io.RawIOBase, path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise CheckpointError(f"{path}: unreadable checkpoint: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a distrun checkpoint (format {FORMAT} expected)")
    return data


def _remove_stale_temporaries(folder: Path) -> None:
    for entry in folder.glob(f"{_TMP_PREFIX}*"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)  # what a killed sharded save left (shards.py)
            continue
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue  # another live writer's file
        entry.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (the file's own fsync does not)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
