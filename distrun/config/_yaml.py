"""YAML loading that remembers where each value came from.

Validation errors must name the file, the line and the key path
(``cluster.yaml:7: hosts[1].roles: ...``). PyYAML's safe constructors build
plain values and forget their marks, so this walks the composed node tree
itself and records the line of every key path it builds. Only safe scalar
types are constructed (no python/object tags), and duplicate keys are errors
rather than a silent "last one wins".
"""

from __future__ import annotations

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


def load_located(text: str, source: str) -> Located:
    """Parse one YAML document; syntax errors become ConfigError with file:line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        value = _build(loader, node, "", lines, source) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{line}: not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    finally:
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


def _build(loader: yaml.SafeLoader, node: yaml.Node, path: str, lines: dict[str, int], source: str) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # merge keys (<<) the way PyYAML does
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: {path or 'top level'}: "
                                  f"keys must be strings. Received: {key!r}")
            child = f"{path}.{key}" if path else key
            if key in result:
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: {child}: duplicate key")
            lines[child] = key_node.start_mark.line + 1
            result[key] = _build(loader, value_node, child, lines, source)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, item, f"{path}[{i}]", lines, source) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)
