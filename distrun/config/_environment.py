"""The cluster file's environment keys: ``requirements:``, ``wheels:`` and ``index:``.

Kept apart from the cluster file's parser (``config/cluster``) because they are one
concern, the Python packages every host's environment holds, and the parser is long
enough. Everything here is checked on the client before any connection (exit 2, one
line naming the path), so a typo in a folder name is not found on the hosts, once per
host, as a pip error::

    requirements: requirements.txt        # pip's format, relative to the cluster file
    requirements: ["clickutil==1.0", "einops>=0.7"]   # or the lines themselves
    wheels: wheels/                        # a folder of .whl files on the client, shipped to the hosts
    index: false                           # true: pip's own index; a URL: that index; false: none
    keep_environments: 5                   # on each host, the newest environments kept (by last use)

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

from distrun.errors import ConfigError

__all__ = ["EnvironmentSpec", "ENVIRONMENT_KEYS", "parse_environment"]

ENVIRONMENT_KEYS = ("requirements", "wheels", "index", "keep_environments")
#: Environments a host keeps (the cluster's and jobs' ``--requirements`` layers, by last use) when
#: a build adds one; an environment a server or a running job uses is never removed.
DEFAULT_KEEP_ENVIRONMENTS = 5

#: A requirements file is read whole on the client; a larger one is not a requirements file.
MAX_REQUIREMENTS_BYTES = 1024 * 1024
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
    return EnvironmentSpec(requirements=requirements, wheels=wheels, index=index, source=source, keep=keep)


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
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise err("requirements", "must be a requirements file (relative to the cluster file) or a list of "
                                  f"requirements. Received: {value!r}"[:200])
    path = _local(value, base_dir)
    try:
        if path.stat().st_size > MAX_REQUIREMENTS_BYTES:
            raise err("requirements", f"{path} is larger than 1 MiB; it is not a requirements file")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise err("requirements", f"cannot read {path}: {why}") from None
    lines = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    return lines, str(path)


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
