"""Unpacking a shipped code bundle, refusing anything that could escape its folder.

Every member is checked before a single byte is written: only regular files and
folders; no absolute paths, no ``..``, no links, devices or FIFOs; a size and
count cap. The checked archive is extracted into a temporary folder and renamed
into place, so a half-unpacked bundle is never seen and two jobs unpacking the
same bundle at once do not collide. The sha256 is checked against the name the
client gave, so a bundle folder always holds exactly what its name says.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_MEMBERS = 10_000


class BundleError(ValueError):
    """The archive is corrupt, unsafe, or not what its name says."""


def check_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    if len(members) > MAX_MEMBERS:
        raise BundleError(f"{len(members)} entries, over the {MAX_MEMBERS} limit")
    total = 0
    for member in members:
        name = member.name
        path = PurePosixPath(name)
        if not name or path.is_absolute() or name.startswith(("/", "\\")) or "\\" in name or "\x00" in name:
            raise BundleError(f"absolute or odd path {name!r}")
        if ".." in path.parts:
            raise BundleError(f"path {name!r} leaves the bundle")
        if not (member.isfile() or member.isdir()):
            kind = "link" if (member.issym() or member.islnk()) else "device or special file"
            raise BundleError(f"{name!r} is a {kind}; bundles hold regular files only")
        total += member.size
        if total > MAX_UNPACKED_BYTES:
            raise BundleError(f"unpacks to over {MAX_UNPACKED_BYTES // 2**20} MiB")
    return members


def unpack(archive: Path, sha256: str, dest: Path) -> Path:
    """Unpack ``archive`` to ``dest`` (if not there yet) after checking its hash and members."""
    if dest.is_dir():
        return dest
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sha256:
        raise BundleError(f"sha256 is {digest}, not {sha256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        try:
            with tarfile.open(archive, mode="r:gz") as tar:
                members = check_members(tar)
                for member in members:
                    target = staging / member.name
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(member)
                    if source is None:
                        raise BundleError(f"{member.name!r} has no content")
                    with source, open(target, "wb") as out:
                        shutil.copyfileobj(source, out)
                    os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
        except BundleError:
            raise
        except (tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as exc:  # ValueError: a NUL in a path
            raise BundleError(f"not a readable .tar.gz: {exc}") from None
        try:
            os.rename(staging, dest)
        except OSError:
            if not dest.is_dir():  # lost a race to an identical unpack: fine; anything else is not
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
