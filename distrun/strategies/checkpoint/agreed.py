"""The chief's checkpoint, for every rank: a resume or a predict without shared storage.

A cluster's ``--checkpoint-dir`` is a folder on rank 0's host (docs/standalone-client.md: shared
storage is not assumed), and a plain checkpoint is one file rank 0 writes there. A resume
(``--resume``, a ``--max-restarts`` attempt) or a predict has every rank read "the newest
checkpoint": each on its own host, where the folder holds an older one or none. A rank then
failed, or, worse, resumed from another step than the chief's.

So the ranks agree first. Rank 0's checkpoint is the one: its path, kind and size are broadcast,
and each rank says whether it sees that same file (the same path and size). The ranks that do
not receive the file's bytes from rank 0 over the job's own process group, in chunks (a GPU
rank's buffer stays small under NCCL), and read them in memory: nothing is written on their
host. A sharded checkpoint cannot be sent so (each rank wrote its shards on its own host): a
rank that does not see it is one line, naming the ranks and the folder, on every rank alike.

Every rank of the default group calls it at once (the parameter-server chief restores alone and
does not).
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distrun.errors import CheckpointError
from distrun.strategies.checkpoint import files, shards

__all__ = ["agreed_checkpoint", "CHUNK_BYTES"]

#: The most bytes one broadcast carries: a received file's buffer on a rank's collective device.
CHUNK_BYTES = 64 * 2**20
_NONE, _PLAIN, _SHARDED = 0, 1, 2


def agreed_checkpoint(mine: Path | None, device: torch.device) -> tuple[Path | None, dict[str, Any] | None]:
    """(rank 0's checkpoint, its entries where this rank received them from rank 0, else None:
    read the path). ``mine``: the checkpoint this rank would read on its own (its newest, or the
    path it was given); ``device``: where the default group's tensors live."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine, None
    kind, size, name = _describe(mine) if dist.get_rank() == 0 else (_NONE, 0, b"")
    head = torch.tensor([kind, size, len(name)], dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    kind, size, length = (int(value) for value in head.tolist())
    if kind == _NONE:
        return None, None
    named = torch.zeros(length, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        named.copy_(torch.frombuffer(bytearray(name), dtype=torch.uint8))
    dist.broadcast(named, src=0)
    path = Path(bytes(named.cpu().tolist()).decode())
    sees = _sees(mine, path, kind, size)
    seen = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    seen[dist.get_rank()] = int(sees)
    dist.all_reduce(seen)  # each rank's flag at its own index
    lacking = [rank for rank, flag in enumerate(seen.tolist()) if not flag]
    if lacking and kind == _SHARDED:  # on every rank alike: none goes on to load it
        raise CheckpointError(f"{path}: a sharded checkpoint rank 0 sees but rank(s) "
                              f"{', '.join(map(str, lacking))} do not; its shards are on the hosts that wrote "
                              "them: put --checkpoint-dir on storage every host sees, or use the plain checkpoint "
                              "`distrun checkpoint export` writes")
    data = _send(path, size, lacking, device) if lacking else None
    if sees:  # its own copy: the same file rank 0's is (a shipped one's path differs by host)
        return mine, None
    assert data is not None, "a rank that does not see the checkpoint is sent it"
    print(f"distrun: rank {dist.get_rank()}: {path} is not on this host; read from rank 0 over the job's "
          f"process group ({size / 1e6:,.1f} MB)", file=sys.stderr, flush=True)
    return path, files.load_bytes(data, path)


def _describe(path: Path | None) -> tuple[int, int, bytes]:
    if path is None:
        return _NONE, 0, b""
    if shards.is_sharded(path):
        return _SHARDED, 0, str(path).encode()
    try:
        return _PLAIN, path.stat().st_size, str(path).encode()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint: {exc.strerror}") from None


def _sees(mine: Path | None, chiefs: Path, kind: int, size: int) -> bool:
    """Whether this rank's own checkpoint is rank 0's: the same name, kind and (plain) size."""
    if mine is None or mine.name != chiefs.name:
        return False
    try:
        if kind == _SHARDED:
            return shards.is_sharded(mine)
        return mine.is_file() and mine.stat().st_size == size
    except OSError:
        return False


def _send(path: Path, size: int, lacking: list[int], device: torch.device) -> bytes | None:
    """Rank 0's file, chunk by chunk, to the ``lacking`` ranks (a group of them and rank 0, made by
    every rank as new_group asks); the bytes on a lacking rank, None elsewhere."""
    members = [0, *lacking]
    group = dist.new_group(ranks=members)
    rank = dist.get_rank()
    if rank not in members:
        return None
    received = io.BytesIO()
    try:
        with open(path, "rb") if rank == 0 else contextlib.nullcontext() as source:
            for start in range(0, size, CHUNK_BYTES):
                count = min(CHUNK_BYTES, size - start)
                chunk = torch.empty(count, dtype=torch.uint8, device=device)
                if rank == 0:
                    chunk.copy_(torch.frombuffer(bytearray(source.read(count)), dtype=torch.uint8))
                dist.broadcast(chunk, src=0, group=group)
                if rank != 0:
                    received.write(chunk.cpu().numpy().tobytes())
    finally:
        dist.destroy_process_group(group)
    return received.getvalue() if rank != 0 else None
