"""The requirement lines of a ``requirements:`` file: pip's format, a ``pyproject.toml`` or a ``uv.lock``.

Read on the client, so a host needs nothing but pip or uv to install them, and hashed with
the rest of the environment (``client/_environment``): a changed dependency list is
another environment. The three formats, chosen by the file's name:

- a ``pyproject.toml``'s ``[project].dependencies``, plus the ``[project.optional-dependencies]``
  the cluster file's ``extras:`` names (an extra naming the project itself, as
  ``all = ["me[gpu,cli]"]`` does, is expanded, not installed);
- a ``uv.lock``'s locked packages at their exact versions (``name==version``), each with the
  environment markers under which the project needs it (a Windows-only package does not
  make a Linux host's install fail), walked from the project's own entries, which are not
  installed: the project is what distrun ships; ``extras:`` adds the project's locked extras;
- any other file: pip's requirements format, a line each (comments dropped).

A file that is not what its name says is one line naming the file and what is wrong
(ConfigError through the caller's ``err``, exit 2). ``tomllib`` is the standard library's
from Python 3.11; on 3.10 the ``tomli`` package is used where installed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrun.errors import ConfigError

__all__ = ["requirement_lines", "is_toml_source"]

Err = Callable[[str, str], ConfigError]
#: A uv.lock's marker terms per package, past which a package is taken as always needed (a
#: larger install is safer than a missing one); real locks stay far below it.
_MAX_TERMS = 32
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def is_toml_source(path: Path) -> bool:
    """Whether ``path`` is read as TOML (a ``pyproject.toml`` or a ``uv.lock``), where ``extras:`` applies."""
    return path.name == "uv.lock" or path.suffix == ".toml"


def requirement_lines(path: Path, text: str, extras: tuple[str, ...], err: Err) -> tuple[str, ...]:
    """The requirement lines of the file ``path`` whose content is ``text``."""
    if path.name == "uv.lock":
        return _uv_lock(path, _toml(path, text, err), extras, err)
    if path.suffix == ".toml":
        return _pyproject(path, _toml(path, text, err), extras, err)
    if extras:
        raise err("requirements", f"extras: only a pyproject.toml or a uv.lock has extras, not {path}")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def _toml(path: Path, text: str, err: Err) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise err("requirements", f"reading {path.name} needs Python 3.11 or the tomli package; "
                                      "or list the requirements instead") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise err("requirements", f"{path} is not valid TOML: {exc}"[:300]) from None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _strings(value: Any, path: Path, key: str, err: Err) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item.strip() and "\n" not in item
                                              for item in value):
        raise err("requirements", f"{path}: {key} must be a list of requirement strings")
    return [item.strip() for item in value]


def _pyproject(path: Path, data: dict[str, Any], extras: tuple[str, ...], err: Err) -> tuple[str, ...]:
    project = data.get("project")
    if not isinstance(project, dict):
        raise err("requirements", f"{path} has no [project] table")
    if "dependencies" in (project.get("dynamic") or []):
        raise err("requirements", f"{path}: [project].dependencies are dynamic (computed by the build backend); "
                                  "list them in a requirements file instead")
    lines = _strings(project.get("dependencies", []), path, "[project].dependencies", err)
    optional = project.get("optional-dependencies", {})
    if not isinstance(optional, dict):
        raise err("requirements", f"{path}: [project.optional-dependencies] must be a table")
    own = _canonical(str(project.get("name", "")))
    wanted, seen, out = list(extras), set(), list(lines)
    while wanted:
        extra = wanted.pop(0)
        if _canonical(extra) in seen:
            continue
        seen.add(_canonical(extra))
        found = next((key for key in optional if _canonical(key) == _canonical(extra)), None)
        if found is None:
            have = ", ".join(sorted(optional)) or "none"
            raise err("requirements", f"{path}: no optional-dependencies {extra!r} (it has: {have})")
        for line in _strings(optional[found], path, f"[project.optional-dependencies].{found}", err):
            named = _NAME.match(line)
            if own and named and _canonical(named.group(1)) == own:  # `all = ["me[gpu]"]`: the project's own extras
                wanted += [item.strip() for item in (named.group(2) or "").split(",") if item.strip()]
            else:
                out.append(line)
    return tuple(dict.fromkeys(out))


def _uv_lock(path: Path, data: dict[str, Any], extras: tuple[str, ...], err: Err) -> tuple[str, ...]:
    packages = data.get("package")
    if not isinstance(packages, list) or not all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                                 for p in packages):
        raise err("requirements", f"{path}: [[package]] must be a list of tables, each with a name")
    by_name: dict[str, list[dict[str, Any]]] = {}
    for package in packages:
        by_name.setdefault(_canonical(package["name"]), []).append(package)
    roots = [p for p in packages if _is_local_project(p)]
    if not roots:
        raise err("requirements", f"{path}: no package of the lock is the project (an editable or virtual source)")
    # Each package's marker terms: a set of conjunctions (an empty one: always needed).
    terms: dict[int, set[tuple[str, ...]]] = {}
    queue = [(root, (), tuple(extras)) for root in roots]
    visited: set[tuple[int, tuple[str, ...], tuple[str, ...]]] = set()
    while queue:  # ends: a package's terms are finite (sets of the lock's markers), at most _MAX_TERMS
        package, term, with_extras = queue.pop()
        for edge in _edges(package, with_extras, path, err):
            child = _find(by_name, edge, path, err)
            marker = edge.get("marker")
            new = tuple(sorted(set(term + ((str(marker),) if marker else ()))))
            have = terms.setdefault(id(child), set())
            if () in have or not new or len(have) >= _MAX_TERMS:
                have.clear()
                have.add(())
                new = ()
            else:
                have.add(new)
            key = (id(child), new, tuple(edge.get("extra") or ()))
            if key not in visited:
                visited.add(key)
                queue.append((child, new, key[2]))
    lines = []
    for package in packages:
        found = terms.get(id(package))
        if found is None or _is_local_project(package):
            continue
        line = _pinned(package, path, err)
        if () not in found:
            line += " ; " + _marker(sorted(found))
        lines.append(line)
    return tuple(lines)


def _marker(terms: list[tuple[str, ...]]) -> str:
    """PEP 508: the terms or'ed, each term's markers and'ed, parenthesised only where that is needed."""
    def conj(term: tuple[str, ...]) -> str:
        return term[0] if len(term) == 1 else " and ".join(f"({m})" for m in term)
    return conj(terms[0]) if len(terms) == 1 else " or ".join(f"({conj(t)})" for t in terms)


def _is_local_project(package: dict[str, Any]) -> bool:
    source = package.get("source")
    return isinstance(source, dict) and ("editable" in source or "virtual" in source)


def _edges(package: dict[str, Any], extras: tuple[str, ...], path: Path, err: Err) -> list[dict[str, Any]]:
    edges = package.get("dependencies", [])
    optional = package.get("optional-dependencies", {})
    if not isinstance(optional, dict):
        raise err("requirements", f"{path}: {package['name']}: optional-dependencies must be a table")
    for extra in extras:
        found = next((key for key in optional if _canonical(key) == _canonical(extra)), None)
        if found is None:
            if _is_local_project(package):
                have = ", ".join(sorted(optional)) or "none"
                raise err("requirements", f"{path}: {package['name']} has no extra {extra!r} (it has: {have})")
            continue  # an extra of a dependency that adds nothing on this lock
        edges = list(edges) + list(optional[found])
    if not isinstance(edges, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in edges):
        raise err("requirements", f"{path}: {package['name']}: dependencies must be a list of tables with a name")
    return edges


def _find(by_name: dict[str, list[dict[str, Any]]], edge: dict[str, Any], path: Path, err: Err) -> dict[str, Any]:
    candidates = by_name.get(_canonical(edge["name"]), [])
    if "version" in edge:
        candidates = [p for p in candidates if p.get("version") == edge["version"]] or candidates
    if not candidates:
        raise err("requirements", f"{path}: a dependency on {edge['name']!r} that the lock has no package for")
    return candidates[0]


def _pinned(package: dict[str, Any], path: Path, err: Err) -> str:
    """``name==version`` for an index's or a local wheel's package; ``name @ URL`` for a git or URL source."""
    name, version, source = package["name"], package.get("version"), package.get("source") or {}
    if isinstance(source, dict) and isinstance(source.get("git"), str):
        url, _, commit = source["git"].partition("#")
        return f"{name} @ git+{url.split('?', 1)[0]}" + (f"@{commit}" if commit else "")
    if isinstance(source, dict) and isinstance(source.get("url"), str):
        return f"{name} @ {source['url']}"
    if not isinstance(version, str) or not version.strip():
        raise err("requirements", f"{path}: package {name!r} has no version")
    return f"{name}=={version}"
