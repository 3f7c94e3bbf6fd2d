"""YAML loading that remembers where each value came from.

Validation errors must name the file, the line and the key path
(``cluster.yaml:7: hosts[1].roles: ...``). PyYAML's safe constructors build
plain values and forget their marks, so this walks the composed node tree
itself and records the line of every key path it builds. Only safe scalar
types are constructed (no python/object tags), and duplicate keys are errors
rather than a silent "last one wins".

A cluster file may come from someone else, so loading is bounded whatever the
file's shape (each bound a one-line ConfigError naming file and line):

* ``MAX_FILE_BYTES``: far above any real cluster file (10,000 hosts fit in 2 MiB);
* ``MAX_DEPTH`` levels of nesting, checked on the token stream before PyYAML's
  recursive composer runs (5,000 nested brackets used to end in RecursionError);
* ``MAX_VALUES`` values built in all. Aliases stay allowed (``ssh: &lab {...}``
  then ``*lab`` is how a file shares settings), but each use of one counts its
  whole value again, so an alias bomb (nine levels of ``&a [*a, *a, ...]``, 9^8
  leaves in 700 bytes) stops at the bound instead of filling memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distrun.errors import ConfigError


@dataclass(frozen=True)
class Located:
    """A loaded document plus the 1-based line of each key path in it."""

    value: Any
    lines: dict[str, int]
    source: str

    def where(self, path: str) -> str:
        """``file:line`` for ``path``, falling back to its nearest located parent."""
        probe = path
        while True:
            if probe in self.lines:
                return f"{self.source}:{self.lines[probe]}"
            if not probe:
                return self.source
            probe = _parent(probe)

    def error(self, path: str, message: str) -> ConfigError:
        prefix = f"{path}: " if path else ""
        return ConfigError(f"{self.where(path)}: {prefix}{message}")


def _parent(path: str) -> str:
    if path.endswith("]"):
        return path[: path.rindex("[")]
    return path.rpartition(".")[0]


#: Bounds on any YAML distrun reads (see the module docstring).
MAX_FILE_BYTES = 4 * 2**20
MAX_DEPTH = 64
MAX_VALUES = 200_000

class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's base-60 numbers: ``2:4`` (an ``--elastic`` range),
    ``10:20`` (a ``--profile`` window) and ``02:00:00`` (a Slurm time) stay text, as YAML 1.2 reads
    them, instead of becoming 124, 620 and 7200."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"""^(?:[-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""", re.X), list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))

_OPENS = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
          yaml.FlowSequenceStartToken)
_CLOSES = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def load_located(text: str, source: str) -> Located:
    """Parse one YAML document; syntax errors and exceeded bounds become ConfigError with file:line."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: {size:,} bytes; a cluster file is at most {MAX_FILE_BYTES // 2**20} MiB")
    loader: yaml.SafeLoader | None = None
    try:
        loader = _Loader(text)  # its reader refuses unprintable characters here
        _check_depth(text, source)
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        budget = _Budget(source)
        value = _build(loader, node, "", lines, source, budget) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{line}: not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    return Located(value, lines, source)


def load_file(path: Path) -> Located:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return load_located(text, str(path))


def _check_depth(text: str, source: str) -> None:
    """Refuse nesting beyond MAX_DEPTH from the token stream (PyYAML's scanner is not recursive)."""
    depth = 0
    for token in yaml.scan(text, Loader=yaml.SafeLoader):
        if isinstance(token, _OPENS):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{source}:{token.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        elif isinstance(token, _CLOSES):
            depth -= 1


class _Budget:
    """Counts the values built; an alias counts its whole value at every use."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.left = MAX_VALUES

    def spend(self, node: yaml.Node) -> None:
        self.left -= 1
        if self.left < 0:
            raise ConfigError(f"{self.source}:{node.start_mark.line + 1}: expands to more than {MAX_VALUES:,} values "
                              "(aliases repeat their whole value at each use); a cluster file is far smaller")


def _build(loader: yaml.SafeLoader, node: yaml.Node, path: str, lines: dict[str, int], source: str,
           budget: _Budget) -> Any:
    budget.spend(node)
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        explicit = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
        loader.flatten_mapping(node)  # merge keys (<<) the way PyYAML does: merged entries first
        merged = len(node.value) - explicit
        result: dict[str, Any] = {}
        written: set[str] = set()  # keys the mapping itself spells (a merged key may be overridden)
        for position, (key_node, value_node) in enumerate(node.value):
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: {path or 'top level'}: "
                                  f"keys must be strings. Received: {key!r}")
            child = f"{path}.{key}" if path else key
            if position >= merged:
                if key in written:
                    raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: {child}: duplicate key")
                written.add(key)
            lines[child] = key_node.start_mark.line + 1
            result[key] = _build(loader, value_node, child, lines, source, budget)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, item, f"{path}[{i}]", lines, source, budget) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)
