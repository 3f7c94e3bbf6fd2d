"""The cluster file's environment keys: ``requirements:``, ``wheels:`` and ``index:``.

Kept apart from the cluster file's parser (``config/cluster``) because they are one
concern, the Python packages every host's environment holds, and the parser is long
enough. Everything here is checked on the client before any connection (exit 2, one
line naming the path), so a typo in a folder name is not found on the hosts, once per
host, as a pip error::

    requirements: requirements.txt        # pip's format, relative to the cluster file
    requirements: ["clickutil==1.0", "einops>=0.7"]   # or the lines themselves
    requirements: pyproject.toml           # [project].dependencies (or a uv.lock: its pinned packages)
    requirements: {file: pyproject.toml, extras: [gpu]}   # ... and optional-dependencies
    wheels: wheels/                        # a folder of .whl files on the client, shipped to the hosts
    index: false                           # true: pip's own index; a URL: that index; false: none
    keep_environments: 5                   # on each host, the newest environments kept (by last use)
    installer: auto                        # uv where the host has it, else pip; or uv, or pip

``index`` defaults to ``false`` when ``wheels:`` is given (an offline host's packages are
the folder's) and to ``true`` otherwise; ``index: true`` with ``wheels:`` uses both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.config._requirements import is_toml_source, requirement_lines
from distrun.errors import ConfigError

__all__ = ["EnvironmentSpec", "ENVIRONMENT_KEYS", "parse_environment"]

ENVIRONMENT_KEYS = ("requirements", "wheels", "index", "keep_environments", "installer")
#: ``installer:``: auto is uv where a host has it (on PATH, beside its python, or its python's
#: ``uv`` package), else pip; uv or pip: that one only (uv missing on a host: exit 6).
INSTALLERS = ("auto", "uv", "pip")
#: Environments a host keeps (the cluster's and jobs' ``--requirements`` layers, by last use) when
#: a build adds one; an environment a server or a running job uses is never removed.
DEFAULT_KEEP_ENVIRONMENTS = 5

#: A requirements file is read whole on the client; a larger one is not a requirements file.
MAX_REQUIREMENTS_BYTES = 1024 * 1024
#: A uv.lock holds every wheel's hash for every platform: a large project's reaches megabytes.
MAX_LOCK_BYTES = 32 * 1024 * 1024
_URL = re.compile(r"^https?://[^\s'\"\\]+$")


@dataclass(frozen=True)
class EnvironmentSpec:
    """What every host's environment holds on top of its ``python``'s own packages.

    ``requirements`` are pip requirement lines (a file's lines, comments kept: pip
    reads them); ``wheels`` an absolute folder on the client; ``index`` True (pip's
    configured index), False (``--no-index``) or an index URL.
    """

    requirements: tuple[str, ...] = ()
    wheels: str | None = None
    index: bool | str = True
    source: str | None = None  # the requirements file, when the lines came from one
    keep: int = DEFAULT_KEEP_ENVIRONMENTS  # ``keep_environments``
    installer: str = "auto"  # one of INSTALLERS

    @property
    def empty(self) -> bool:
        return not self.requirements and self.wheels is None


Err = Callable[[str, str], ConfigError]


def parse_environment(top: dict[str, Any], err: Err, base_dir: Path) -> EnvironmentSpec | None:
    """The environment keys of a cluster file's top level, or None when it has none."""
    if not any(key in top for key in ENVIRONMENT_KEYS):
        return None
    requirements, source = _requirements(top.get("requirements"), err, base_dir)
    wheels = _wheels(top["wheels"], err, base_dir) if top.get("wheels") is not None else None
    index: bool | str = wheels is None and top.get("requirements") is not None
    if top.get("index") is not None:
        index = top["index"]
        if not isinstance(index, bool) and not (isinstance(index, str) and _URL.match(index)):
            raise err("index", f"must be true, false or an http(s) index URL. Received: {index!r}"[:200])
    keep = top.get("keep_environments", DEFAULT_KEEP_ENVIRONMENTS)
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= 1000:
        raise err("keep_environments", f"must be a whole number from 1 to 1000. Received: {keep!r}"[:200])
    installer = top.get("installer", "auto")
    if installer not in INSTALLERS:
        raise err("installer", f"must be one of {', '.join(INSTALLERS)}. Received: {installer!r}"[:200])
    return EnvironmentSpec(requirements=requirements, wheels=wheels, index=index, source=source, keep=keep,
                           installer=installer)


def _requirements(value: Any, err: Err, base_dir: Path) -> tuple[tuple[str, ...], str | None]:
    if value is None:
        return (), None
    if isinstance(value, list):
        lines = []
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item.strip() or any(c in item for c in "\x00\r\n"):
                raise err(f"requirements[{i}]", f"must be one requirement on one line. Received: {item!r}"[:200])
            lines.append(item.strip())
        return tuple(lines), None
    extras: tuple[str, ...] = ()
    if isinstance(value, dict):
        unknown = sorted(set(map(str, value)) - {"file", "extras"})
        if unknown:
            raise err(f"requirements.{unknown[0]}", "unknown key (a requirements mapping has file: and extras:)")
        raw_extras = value.get("extras", [])
        if not isinstance(raw_extras, list) or not all(isinstance(x, str) and x.strip() for x in raw_extras):
            raise err("requirements.extras", f"must be a list of extra names. Received: {raw_extras!r}"[:200])
        extras, value = tuple(x.strip() for x in raw_extras), value.get("file")
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise err("requirements", "must be a requirements file, a pyproject.toml or a uv.lock (relative to the "
                                  f"cluster file), or a list of requirements. Received: {value!r}"[:200])
    path = _local(value, base_dir)
    if extras and not is_toml_source(path):
        raise err("requirements.extras", f"only a pyproject.toml or a uv.lock has extras, not {path}")
    try:
        limit = MAX_LOCK_BYTES if is_toml_source(path) else MAX_REQUIREMENTS_BYTES
        if path.stat().st_size > limit:
            raise err("requirements", f"{path} is larger than {limit // 2**20} MiB; it is not a requirements file")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise err("requirements", f"cannot read {path}: {why}") from None
    return requirement_lines(path, text, extras, err), str(path)


def _wheels(value: Any, err: Err, base_dir: Path) -> str:
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise err("wheels", f"must be a folder of wheels on this machine. Received: {value!r}"[:200])
    path = _local(value, base_dir)
    if not path.is_dir():
        raise err("wheels", f"folder {path} does not exist" if not path.exists() else f"{path} is not a folder")
    try:
        os.listdir(path)
    except OSError as exc:
        raise err("wheels", f"cannot read folder {path}: {exc.strerror or exc}") from None
    return str(path)


def _local(value: str, base_dir: Path) -> Path:
    raw = Path(os.path.expanduser(value.strip()))
    return raw if raw.is_absolute() else (base_dir / raw).resolve()
