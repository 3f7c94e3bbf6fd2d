"""Code bundles: the recipe and the Python files beside it, content-addressed by sha256.

Every `train --cluster` ships the code from the laptop, so the hosts never hold
model code and an edit runs on the next try. The archive is deterministic (sorted
entries, zeroed times and owners, normalised modes, gzip without a timestamp), so
the same files always give the same sha256 and a host that already has a bundle
is not sent it again.

What goes in: the recipe, every ``*.py`` file in its folder, each path the recipe's own
``include = [...]`` names (relative to it: the data it reads beside itself) and each
``--include`` path (a file, or a folder taken recursively), minus what
``.distrunignore`` in the recipe's folder names (one glob per line, matched
against the path inside the bundle and against the file name; ``#`` comments).
Caches, VCS folders and links never go in.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distrun.config import inspect_recipe
from distrun.errors import RecipeError, UsageError

__all__ = ["Bundle", "pack", "MAX_BUNDLE_BYTES", "IGNORE_FILE"]

MAX_BUNDLE_BYTES = 256 * 1024 * 1024
IGNORE_FILE = ".distrunignore"
_ALWAYS_SKIPPED = ("__pycache__", ".git", ".hg", ".svn", ".venv", "*.pyc", ".ipynb_checkpoints", ".DS_Store")


@dataclass(frozen=True)
class Bundle:
    sha256: str
    data: bytes  # the .tar.gz
    files: tuple[str, ...]  # paths inside the bundle, sorted
    recipe: str  # the recipe's path inside the bundle

    @property
    def size_bytes(self) -> int:
        return len(self.data)


def pack(recipe: Path, includes: Sequence[Path] = ()) -> Bundle:
    recipe = recipe.resolve()
    root = recipe.parent
    ignore = _ignore_patterns(root / IGNORE_FILE)
    chosen: dict[str, Path] = {}
    for path in sorted(root.glob("*.py")):
        _add(chosen, root, path, ignore)
    chosen[recipe.name] = recipe  # the recipe always goes in, whatever the ignore file says
    declared = inspect_recipe(str(recipe)).include
    for name in declared:
        if not (root / name).exists():
            raise RecipeError(f"{recipe}: include {name!r}: no such file or folder next to the recipe ({root / name})")
    # What the recipe declares goes in whatever the ignore file says (the recipe asked for it by name).
    for include, skip in [*((root / name, ()) for name in declared), *((path, ignore) for path in includes)]:
        include = include.resolve()
        if not include.exists():
            raise UsageError(f"--include {include}: no such file or folder")
        try:
            include.relative_to(root)
        except ValueError:
            raise UsageError(f"--include {include}: must be inside the recipe's folder {root}") from None
        if include.is_dir():
            for path in sorted(include.rglob("*")):
                if path.is_file() and not any(_skipped(part) for part in path.relative_to(root).parts):
                    _add(chosen, root, path, skip)
        else:
            _add(chosen, root, include, skip)
    data = _archive(chosen)
    if len(data) > MAX_BUNDLE_BYTES:
        raise UsageError(f"the code bundle is {len(data) / 2**20:.0f} MiB, over the "
                         f"{MAX_BUNDLE_BYTES // 2**20} MiB limit: list data files in {root / IGNORE_FILE}")
    return Bundle(hashlib.sha256(data).hexdigest(), data, tuple(sorted(chosen)), recipe.name)


def _skipped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in _ALWAYS_SKIPPED)


def _ignore_patterns(path: Path) -> tuple[str, ...]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return ()
    return tuple(line.strip().rstrip("/") for line in lines if line.strip() and not line.lstrip().startswith("#"))


def _add(chosen: dict[str, Path], root: Path, path: Path, ignore: tuple[str, ...]) -> None:
    if path.is_symlink() or not path.is_file():
        return  # links never go in: the host would resolve them against its own filesystem
    relative = path.relative_to(root).as_posix()
    if _skipped(path.name) or any(
            fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(path.name, pattern)
            or any(fnmatch.fnmatch(part, pattern) for part in Path(relative).parts[:-1]) for pattern in ignore):
        return
    chosen[relative] = path


def _archive(files: dict[str, Path]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            content = files[name].read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o755 if os.access(files[name], os.X_OK) else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(content))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()
