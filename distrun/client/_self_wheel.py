"""A wheel of the client's own distrun, for hosts whose python has none or another version.

Built from the files this interpreter imports distrun from, not fetched from an index:
a host then runs exactly the client's code, also an editable checkout's edits, and an
offline host needs nothing else. It is zipped here (no build backend, no subprocess:
a fraction of a second) and deterministic (sorted entries, fixed times and modes), so
its sha256 names its content; that hash goes into the environment's name, and an edit
to the client's distrun rebuilds the hosts' environments that carry it. The metadata
(version, dependencies, the ``distrun`` command) is the installed distribution's own.
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from distrun._version import __version__

__all__ = ["SelfWheel", "self_wheel", "source_digest"]

_SKIPPED_DIRS = {"__pycache__"}
_SKIPPED_SUFFIXES = (".pyc", ".pyo")
_DATE = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class SelfWheel:
    filename: str
    data: bytes
    sha256: str


def self_wheel() -> SelfWheel:
    """The client's distrun as a wheel; built once per process (its files do not change under it)."""
    return _build()


def source_digest() -> str:
    """sha256 of the version and every file the wheel would hold: names the wheel without building it
    (an `up` that finds every host ready never zips anything)."""
    digest = hashlib.sha256(__version__.encode())
    for name, data in _files():
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _files() -> tuple[tuple[str, bytes], ...]:
    package = Path(__file__).resolve().parents[1]  # distrun/, as this interpreter imports it
    files = sorted(path for path in package.rglob("*")
                   if path.is_file() and not _SKIPPED_DIRS.intersection(path.relative_to(package).parts)
                   and not path.name.endswith(_SKIPPED_SUFFIXES))
    return tuple((f"distrun/{path.relative_to(package).as_posix()}", path.read_bytes()) for path in files)


@lru_cache(maxsize=1)
def _build() -> SelfWheel:
    info = f"distrun-{__version__}.dist-info"
    entries: list[tuple[str, bytes]] = list(_files())
    entries.append((f"{info}/METADATA", _metadata().encode()))
    entries.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: distrun\nRoot-Is-Purelib: true\n"
                                     b"Tag: py3-none-any\n"))
    entry_points = _dist_text("entry_points.txt")
    if entry_points:
        entries.append((f"{info}/entry_points.txt", entry_points.encode()))
    record = "".join(f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}\n" for name, data in entries)
    entries.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            item = zipfile.ZipInfo(name, date_time=_DATE)
            item.external_attr = 0o644 << 16
            item.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(item, data)
    data = buffer.getvalue()
    return SelfWheel(f"distrun-{__version__}-py3-none-any.whl", data, hashlib.sha256(data).hexdigest())


def _metadata() -> str:
    text = _dist_text("METADATA")
    if text:
        return text
    return f"Metadata-Version: 2.1\nName: distrun\nVersion: {__version__}\n"  # run from a bare source tree


def _dist_text(name: str) -> str:
    """The installed distribution's file ``name``; a source tree's bare ``distrun.egg-info`` in the
    working folder may come first on ``sys.path``, so the first distribution that has it."""
    for dist in metadata.distributions(name="distrun"):
        if dist.version == __version__ and (text := dist.read_text(name)):
            return text
    return ""


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
