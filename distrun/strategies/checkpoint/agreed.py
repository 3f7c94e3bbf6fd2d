"""One checkpoint for every rank: a resume or a predict without shared storage.

A cluster's ``--checkpoint-dir`` is a folder on the chief's host (docs/standalone-client.md: shared
storage is not assumed), and a plain checkpoint is one file the chief writes there. A resume
(``--resume``, a ``--max-restarts`` attempt) or a predict has every rank read "the newest
checkpoint": each on its own host, where the folder holds an older one, another run's, or none.
A rank then failed, or, worse, loaded other weights than its peers.

So the ranks agree first, in one all-gather of what each found (its step, kind and size, or that
it could not look): the checkpoint is the newest step any rank found, from the lowest rank that
holds it (the source: rank 0 unless an elastic job's chief moved to another host). The source
broadcasts its file's name. A rank whose own checkpoint is the source's file (the same name,
size, inode and mtime: shared storage) reads it without more; one whose file only has the same
name and size (a copy, or another run's step N) compares SHA-256s with the source, which hashes
its file only where some rank needs that. Every other rank receives the
source's bytes over the job's own process group, in chunks (a GPU rank's buffer stays small under
NCCL), into one buffer it reads in memory: nothing is written on its host. A sharded checkpoint
cannot be sent so (each rank wrote its shards on its own host): a rank that does not see it is
one error, the same on every rank. So is a rank that could not look in its folder.

Every rank of the default group calls it at once: ``restore`` and predict's load do (the
parameter-server chief restores alone and does not).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distrun.errors import CheckpointError
from distrun.strategies.checkpoint import files, shards

__all__ = ["agreed_checkpoint", "CHUNK_BYTES"]

#: The most bytes one broadcast carries: a received file's chunk on a rank's collective device.
CHUNK_BYTES = 64 * 2**20
_NONE, _PLAIN, _SHARDED, _FAILED = 0, 1, 2, 3
_STEP = re.compile(r"^ckpt-(\d+)(\.pt)?$")
_DIGEST_BYTES = 32


def agreed_checkpoint(find: Callable[[], Path | None], device: torch.device) -> tuple[Path | None, dict[str, Any] | None]:
    """(the checkpoint, its entries where this rank received them, else None: read the path).
    ``find``: the checkpoint this rank would read on its own (its newest, or the path it was
    given; called here, so that a folder it cannot list is everyone's one error); ``device``:
    where the default group's tensors live."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return find(), None
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, row, problem = _look(find)
    table = torch.zeros(world, len(row), dtype=torch.int64, device=device)
    table[rank] = torch.tensor(row, dtype=torch.int64, device=device)
    dist.all_reduce(table)  # each rank's row at its own index
    rows = table.cpu().tolist()
    failed = [r for r, each in enumerate(rows) if each[0] == _FAILED]
    if failed:
        raise CheckpointError(problem if rank in failed else
                              f"rank(s) {', '.join(map(str, failed))} could not look for the checkpoint (their own "
                              "errors say why)")
    found = [(each[2], -r) for r, each in enumerate(rows) if each[0] != _NONE]
    if not found:
        return None, None
    source = -max(found)[1]  # the newest step; of the ranks holding it, the lowest
    kind, size = rows[source][0], rows[source][1]
    # Kind, size and step as the source's: the same file where inode and mtime agree too; else its
    # content decides, and only then does anyone hash (every rank reads the same table).
    alike = {r for r, each in enumerate(rows) if r != source and each[:3] == rows[source][:3]}
    hashing = {r for r in alike if rows[r][3:] != rows[source][3:]}
    name, digest = _announce(mine if rank == source else None, bool(hashing), source, device)
    sees = rank == source or (rank in alike and mine is not None and mine.name == Path(name).name
                              and (rank not in hashing or _digest_is(mine, digest)))
    seen = torch.zeros(world, dtype=torch.int64, device=device)
    seen[rank] = int(sees)
    dist.all_reduce(seen)
    lacking = [r for r, flag in enumerate(seen.cpu().tolist()) if not flag]
    if lacking and kind == _SHARDED:  # on every rank alike: none goes on to load it
        raise CheckpointError(f"{name}: a sharded checkpoint rank {source} holds but rank(s) "
                              f"{', '.join(map(str, lacking))} do not see; its shards are on the hosts that wrote "
                              "them: put --checkpoint-dir on storage every host sees, or use the plain checkpoint "
                              "`distrun checkpoint export` writes")
    data = _send(mine if rank == source else None, size, source, lacking, device) if lacking else None
    if sees:
        return mine, None
    assert data is not None, "a rank that does not see the checkpoint is sent it"
    print(f"distrun: rank {rank}: {name} is not on this host; read from rank {source} over the job's process "
          f"group ({size / 1e6:,.1f} MB)", file=sys.stderr, flush=True)
    loaded = files.load_bytes(data, name)
    return Path(name), loaded


def _look(find: Callable[[], Path | None]) -> tuple[Path | None, list[int], str]:
    """(this rank's checkpoint, its row: kind, size, step, inode, mtime; what went wrong looking)."""
    try:
        mine = find()
        if mine is None:
            return None, [_NONE, 0, -1, 0, 0], ""
        match = _STEP.match(mine.name)
        step = int(match.group(1)) if match else -1  # a --checkpoint of any name: every rank's is the same
        if shards.is_sharded(mine):
            return mine, [_SHARDED, 0, step, 0, 0], ""
        stat = mine.stat()
        return mine, [_PLAIN, stat.st_size, step, stat.st_ino, stat.st_mtime_ns], ""
    except CheckpointError as exc:
        return None, [_FAILED, 0, -1, 0, 0], exc.message
    except OSError as exc:
        return None, [_FAILED, 0, -1, 0, 0], \
            f"{exc.filename or 'the checkpoint folder'}: cannot look for a checkpoint: {exc.strerror}"


def _announce(mine: Path | None, with_digest: bool, source: int, device: torch.device) -> tuple[str, bytes]:
    """The source's checkpoint name (its path there) and, where a rank must compare contents, its
    SHA-256, to every rank."""
    named = b""
    if mine is not None:
        try:
            digest = _digest(mine) if with_digest else bytes(_DIGEST_BYTES)
        except OSError:
            digest = bytes(_DIGEST_BYTES)  # unreadable now: its bytes' broadcast will say so
        named = digest + os.fsencode(mine)
    length = torch.tensor([len(named)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=source)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if mine is not None:
        buffer.copy_(torch.frombuffer(bytearray(named), dtype=torch.uint8))
    dist.broadcast(buffer, src=source)
    raw = buffer.cpu().numpy().tobytes()
    return os.fsdecode(raw[_DIGEST_BYTES:]), raw[:_DIGEST_BYTES]


def _digest_is(path: Path, digest: bytes) -> bool:
    """Whether this rank's copy has the source's content (another run's step N has its name and
    nearly its size)."""
    try:
        return _digest(path) == digest
    except OSError:
        return False


def _digest(path: Path) -> bytes:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 * 2**20), b""):
            sha.update(block)
    return sha.digest()


def _send(mine: Path | None, size: int, source: int, lacking: list[int], device: torch.device) -> bytearray | None:
    """The source's file, chunk by chunk, to the ``lacking`` ranks (a group of them and the source,
    made by every rank as new_group asks); the bytes on a lacking rank, None elsewhere."""
    members = sorted({source, *lacking})
    group = dist.new_group(ranks=members)
    rank = dist.get_rank()
    if rank not in members:
        return None
    received = bytearray(size) if rank != source else None
    try:
        with open(mine, "rb") if mine is not None else contextlib.nullcontext() as fh:
            for start in range(0, size, CHUNK_BYTES):
                count = min(CHUNK_BYTES, size - start)
                if received is not None and device.type == "cpu":  # straight into the buffer
                    chunk = torch.frombuffer(memoryview(received)[start:start + count], dtype=torch.uint8)
                else:
                    chunk = torch.empty(count, dtype=torch.uint8, device=device)
                if fh is not None:
                    chunk.copy_(torch.frombuffer(bytearray(fh.read(count)), dtype=torch.uint8))
                dist.broadcast(chunk, src=source, group=group)
                if received is not None and device.type != "cpu":
                    received[start:start + count] = chunk.cpu().numpy().tobytes()
        if device.type == "cuda":  # the last chunk is on the wire before its group goes
            torch.cuda.current_stream(device).synchronize()
    finally:
        dist.destroy_process_group(group)
    return received
